"""Canary rollouts in the store: which arm a new episode lands in, and the one decision of each canary.

The store decides, not a proxy's memory, so several proxy processes sharing it agree: an episode's
arm is drawn inside the transaction that creates it (from its id, against the running canary's
share), and a canary episode's reward replays every rewarded episode of that canary, in their
finish order, through ``proxy.canary.CanaryTest`` inside the reward's own transaction, under the
canary row's lock: of two concurrent rewards the second sees the first, and the first verdict
reached is written once, with its evidence, or not at all. The lock order extends the store's:
group rows, episode rows, then the canary row (a publish and a manual decision take only the
latter, after the policy version row).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import Final

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from proxy.canary import Arm, CanarySettings, CanaryTest, Decision
from proxy.errors import Conflict, InvalidRequest
from proxy.store.models import Canary, Decided, Episode
from proxy.store.records import CanaryRecord
from proxy.store.sessions import Sessions

REWARDED: Final = "rewarded"


def draw_arm(episode_id: str, share: float) -> Arm:
    """The episode's arm, a pure function of its id: a uniform draw that ignores its reward (the
    test's assumption) and that every proxy, and a retry, draws alike."""
    draw = int.from_bytes(hashlib.sha256(episode_id.encode()).digest()[:8], "big") / 2**64
    return "canary" if draw < share else "baseline"


def canary_record(row: Canary) -> CanaryRecord:
    return CanaryRecord(
        canary_version=row.canary_version,
        baseline_version=row.baseline_version,
        share=row.share,
        settings=row.settings,
        started_at=row.started_at,
        verdict=row.verdict,
        reason=row.reason,
        manual=row.manual,
        evidence=row.evidence,
        decided_at=row.decided_at,
    )


async def running(session: AsyncSession, *, lock: bool = False) -> Canary | None:
    """The canary running now (at most one), optionally locked for its decision."""
    query = select(Canary).where(Canary.verdict.is_(None)).order_by(Canary.canary_version.desc()).limit(1)
    return (await session.scalars(query.with_for_update() if lock else query)).first()


async def assign(session: AsyncSession, episodes: Sequence[Episode]) -> None:
    """Give new episodes their arm of the running canary, if one runs (before they are added)."""
    canary = await running(session)
    if canary is None:
        return
    for episode in episodes:
        episode.policy_arm = draw_arm(episode.id, canary.share)
        episode.canary_version = canary.canary_version


async def for_reward(session: AsyncSession, episode: Episode, reward: float) -> Canary | None:
    """The running canary this episode's reward is evidence for, locked; None when it is none's.
    A reward outside the test's range is refused (400, nothing written): the test's error rates
    hold only for bounded rewards, and a clamped or dropped one would change its evidence unseen."""
    if episode.canary_version is None or episode.policy_arm is None:
        return None
    query = select(Canary).where(Canary.canary_version == episode.canary_version, Canary.verdict.is_(None))
    canary = (await session.scalars(query.with_for_update())).first()
    if canary is None:
        return None
    settings = CanarySettings.model_validate(canary.settings)
    if not settings.low <= reward <= settings.high:
        raise InvalidRequest(
            f"reward {reward} is outside [{settings.low}, {settings.high}], the range of canary "
            f"v{canary.canary_version}'s test this episode is evidence for (policy.canary.low/high)",
            param="reward",
            code="reward_out_of_range",
        )
    return canary


async def replay(session: AsyncSession, canary: Canary) -> Decision:
    """The test over every rewarded episode of the canary, both arms, in their finish order."""
    rows = await session.execute(
        select(Episode.policy_arm, Episode.reward)
        .where(Episode.canary_version == canary.canary_version, Episode.status == REWARDED)
        .order_by(Episode.finished_at, Episode.id)
    )
    settings = CanarySettings.model_validate(canary.settings)
    pairs = [(arm, reward) for arm, reward in rows.all() if arm is not None and reward is not None]
    return CanaryTest.replay(pairs, settings).decide()


def record_decision(canary: Canary, verdict: Decided, decision: Decision, *, manual: bool, reason: str) -> None:
    canary.verdict, canary.reason, canary.manual = verdict, reason, manual
    canary.evidence, canary.decided_at = decision.evidence(), time.time()


async def judge(session: AsyncSession, canary: Canary) -> CanaryRecord | None:
    """Decide a running, locked canary from the store's rewards; the decision, if this reached one."""
    await session.flush()  # the reward just set is part of the evidence
    decision = await replay(session, canary)
    if decision.verdict == "continue":
        return None
    record_decision(canary, decision.verdict, decision, manual=False, reason=decision.reason)
    return canary_record(canary)


class Canaries:
    """The canaries aggregate: the running one, its evidence now, past decisions, manual decisions."""

    def __init__(self, sessions: Sessions) -> None:
        self._sessions = sessions

    async def running(self) -> tuple[CanaryRecord, Decision] | None:
        """The running canary and the test's decision on its rewards so far, or None."""
        async with self._sessions.read() as session:
            canary = await running(session)
            if canary is None:
                return None
            return canary_record(canary), await replay(session, canary)

    async def arm_of(self, episode_id: str) -> tuple[str | None, int | None] | None:
        """(policy_arm, canary_version) of an episode, None when there is no such episode."""
        async with self._sessions.read() as session:
            query = select(Episode.policy_arm, Episode.canary_version).where(Episode.id == episode_id)
            row = (await session.execute(query)).first()
        return (row[0], row[1]) if row else None

    async def decide(self, verdict: Decided) -> CanaryRecord:
        """Promote or roll back the running canary by hand (409 ``no_canary`` when none runs),
        recorded as manual with the test's evidence at that moment."""
        async with self._sessions.write() as session:
            canary = await running(session, lock=True)
            if canary is None:
                raise Conflict("no canary is running", code="no_canary")
            decision = await replay(session, canary)
            reason = f"manual {verdict} through the control API; the test said: {decision.reason}"
            record_decision(canary, verdict, decision, manual=True, reason=reason)
            return canary_record(canary)

    async def decided(self, limit: int = 20) -> list[CanaryRecord]:
        """Past decisions, newest canary first."""
        async with self._sessions.read() as session:
            rows = (
                await session.scalars(
                    select(Canary)
                    .where(Canary.verdict.is_not(None))
                    .order_by(Canary.canary_version.desc())
                    .limit(limit)
                )
            ).all()
        return [canary_record(r) for r in rows]
