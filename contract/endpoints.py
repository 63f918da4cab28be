"""The calls of the control API, each declared once: its arguments, its request, how its answer is read.

Each function here takes a call's public arguments (the signature both clients show) and returns
the ``Request`` to send: method, path, body (the proxy's own wire model from ``schemas.py``, so a
renamed field is a type error here), query, whether it may be sent again (``Repeat``,
``contract/retry.py``) and how the answer is read: into the entity the proxy's route built it
from (``entities.py``). ``ProxyClient`` and ``AsyncProxyClient`` turn each into a method of the
same name (``contract/client.py``), so both clients make exactly the same requests. Nothing here
does I/O.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import httpx
from pydantic import BaseModel

from contract.entities import Claim, CreatedEpisode, CreatedGroup, Episode, Group, PolicyVersion
from contract.retry import Refused, Repeat
from contract.schemas import (
    AbandonIn,
    AckIn,
    AdmissionOut,
    AuditEntryOut,
    ClaimIn,
    DeletedOut,
    EpisodeAudit,
    EpisodeCreate,
    ForkIn,
    GroupCreate,
    PublishIn,
    PurgedOut,
    PurgeIn,
    ReleaseIn,
    RenewIn,
    RewardIn,
    StepIn,
)
from contract.vocabulary import (
    AbandonCause,
    AckStatus,
    EpisodeStatus,
    ForkRule,
    GroupStatus,
    SkipCount,
    TrainerSkip,
    TrainMode,
    TrainStatus,
)

R = TypeVar("R")
CallRewards = Mapping[int, float] | Mapping[str, float]
"""Per-call rewards keyed by call ordinal (``2`` or ``"2"``), or ``"ordinal:choice"`` for a call with n > 1;
or by the call's receipt (``x-flywheel-call-id``: ``RECEIPT_PREFIX`` and hex), with ``":choice"`` likewise."""


@dataclass(frozen=True)
class Demand:
    """What a trainer takes, sent with its claims: the proxy admits new groups from it (``proxy/admission.py``)."""

    groups_per_step: int
    mode: TrainMode


@dataclass(frozen=True)
class Request(Generic[R]):
    """One call: what to send, when it may be sent again, how to read the answer."""

    method: Literal["GET", "POST", "DELETE"]
    path: str
    repeat: Repeat
    read: Callable[[Any], R]
    body: BaseModel | None = None
    params: Mapping[str, str | int | list[str]] | None = None

    def send_args(self) -> dict[str, Any]:
        # model_construct + model_dump: the proxy validates; a bad value gets its 400, as from any client.
        body = None if self.body is None else self.body.model_dump(warnings=False)
        return {"method": self.method, "url": self.path, "json": body, "params": self.params}

    def answer(self, response: httpx.Response) -> R:
        """The reply read from a success; an error answer raises ``Refused`` for the retry rule to judge."""
        if response.status_code >= 400:
            raise Refused(response)
        return self.read(response.json() if response.content else None)


def _data(read: Callable[[Any], R]) -> Callable[[Any], list[R]]:
    return lambda reply: [read(item) for item in reply["data"]]


def _none(_: Any) -> None:
    return None


# -- groups and episodes (workflows) ---------------------------------------------------------------


def create_group(
    task_id: str,
    size: int,
    *,
    metadata: dict[str, Any] | None = None,
    episode_metadata: list[dict[str, Any]] | None = None,
) -> Request[CreatedGroup]:
    """A group of ``size`` episodes for one task; each episode's key and base URL are in ``episode_keys``."""
    body = GroupCreate.model_construct(
        task_id=task_id, size=size, metadata=metadata or {}, episode_metadata=episode_metadata
    )
    return Request("POST", "/groups", "unsent", CreatedGroup.model_validate, body)


def create_episode(task_id: str | None = None, *, metadata: dict[str, Any] | None = None) -> Request[CreatedEpisode]:
    """A lone episode (recorded, never trained on by GRPO)."""
    body = EpisodeCreate.model_construct(task_id=task_id, metadata=metadata or {})
    return Request("POST", "/episodes", "unsent", CreatedEpisode.model_validate, body)


def fork(
    episode_id: str,
    at: int,
    size: int,
    *,
    on_divergence: ForkRule = "sample",
    metadata: dict[str, Any] | None = None,
) -> Request[CreatedGroup]:
    """A fork group of a rewarded episode: ``size`` episodes that replay its first ``at`` answered
    calls, then sample; run the same agent on each episode of ``episode_keys``."""
    body = ForkIn.model_construct(at=at, size=size, on_divergence=on_divergence, metadata=metadata or {})
    return Request("POST", f"/episodes/{episode_id}/fork", "unsent", CreatedGroup.model_validate, body)


def group(group_id: str) -> Request[Group]:
    return Request("GET", f"/groups/{group_id}", "safe", Group.model_validate)


def pending_groups() -> Request[int]:
    """Complete groups the trainer has not taken yet (at most 1000 counted)."""
    # Not leased: groups a trainer holds are being trained, not waiting (counting them kept the
    # runner from generating during a step: generation and training took turns).
    params: dict[str, str | int] = {"status": "complete", "train_status": "pending", "leased": "false", "limit": 1000}
    return Request("GET", "/groups", "safe", lambda reply: len(reply["data"]), params=params)


def groups(
    *,
    status: GroupStatus | None = None,
    task_id: str | None = None,
    train_status: TrainStatus | None = None,
    train_reason: SkipCount | None = None,
    limit: int = 100,
    offset: int = 0,
) -> Request[list[Group]]:
    """Groups, newest first (without their episodes; ``group`` has them); ``train_reason`` those never
    trained for that reason (``other``: skipped or stale without one)."""
    params: dict[str, str | int] = {"limit": limit, "offset": offset}
    if status is not None:
        params["status"] = status
    if task_id is not None:
        params["task_id"] = task_id
    if train_status is not None:
        params["train_status"] = train_status
    if train_reason is not None:
        params["train_reason"] = train_reason
    return Request("GET", "/groups", "safe", _data(Group.model_validate), params=params)


def skip_counts() -> Request[dict[str, int]]:
    """Groups never trained (``skipped`` or ``stale``), counted by ``train_reason`` in one query: a
    ``SkipCount`` key each (``other``: none stored), reasons without groups left out."""
    return Request("GET", "/groups/skips", "safe", lambda reply: {str(k): int(v) for k, v in reply.items()})


def episodes(
    *,
    status: EpisodeStatus | None = None,
    task_ids: Sequence[str] | None = None,
    min_reward: float | None = None,
    source: str | None = None,
    group_id: str | None = None,
    limit: int = 100,
    offset: int = 0,
) -> Request[list[Episode]]:
    """Episodes, newest first, without their calls (``episode`` has them); every filter given must
    hold: ``task_ids`` any of these exact task ids (at most 256), ``min_reward`` rewarded at least
    this, ``source`` the episode's ``metadata["source"]`` exactly (e.g. ``teacher:<name>``). The
    trainer's warm start selects its episodes with it (``trainer/warmstart.py``)."""
    params: dict[str, str | int | list[str]] = {"limit": limit, "offset": offset}
    if status is not None:
        params["status"] = status
    if task_ids:
        params["task_id"] = list(task_ids)
    if min_reward is not None:
        params["min_reward"] = repr(float(min_reward))  # repr round-trips the float exactly
    if source is not None:
        params["source"] = source
    if group_id is not None:
        params["group_id"] = group_id
    return Request("GET", "/episodes", "safe", _data(Episode.model_validate), params=params)


def episode(episode_id: str, *, calls: bool = True) -> Request[Episode]:
    return Request(
        "GET", f"/episodes/{episode_id}", "safe", Episode.model_validate, params={"calls": str(calls).lower()}
    )


def reward(
    episode_id: str,
    reward: float,
    *,
    call_rewards: CallRewards | None = None,
    metadata: dict[str, Any] | None = None,
) -> Request[Episode]:
    """Finish an episode with its reward; ``call_rewards`` keyed by call ordinal (or ``"ordinal:choice"``)."""
    keyed = {str(k): v for k, v in call_rewards.items()} if call_rewards else None
    body = RewardIn.model_construct(reward=reward, call_rewards=keyed, metadata=metadata)
    return Request("POST", f"/episodes/{episode_id}/reward", "safe", Episode.model_validate, body)


def await_reward(episode_id: str) -> Request[Episode]:
    """The agent is done and the reward comes late: the episode awaits it (no idle abandon, no more
    calls) until ``reward`` or ``abandon`` (or the proxy's ``late_rewards.max_wait_s``)."""
    return Request("POST", f"/episodes/{episode_id}/await_reward", "safe", Episode.model_validate)


def abandon(episode_id: str, reason: str, cause: AbandonCause = "agent") -> Request[Episode]:
    """Finish an episode without a reward (never trained on); the reason is cut to the proxy's 4000 characters."""
    body = AbandonIn.model_construct(reason=reason[:4000] or "abandoned", cause=cause)  # the proxy's limits
    return Request("POST", f"/episodes/{episode_id}/abandon", "safe", Episode.model_validate, body)


# -- policy and training (trainers) ----------------------------------------------------------------


def policy() -> Request[PolicyVersion]:
    return Request("GET", "/policy", "safe", PolicyVersion.model_validate)


def policy_versions() -> Request[list[PolicyVersion]]:
    return Request("GET", "/policy/versions", "safe", _data(PolicyVersion.model_validate))


def publish(
    *, adapter_path: str, version: int | None = None, metadata: dict[str, Any] | None = None
) -> Request[PolicyVersion]:
    body = PublishIn.model_construct(adapter_path=adapter_path, version=version, metadata=metadata or {})
    return Request("POST", "/policy/publish", "safe", PolicyVersion.model_validate, body)


def claim(
    *,
    trainer_id: str,
    max_groups: int,
    lease_s: float,
    max_staleness: int | None,
    lease_id: str | None = None,
    demand: Demand | None = None,
) -> Request[Claim]:
    """Lease up to ``max_groups`` complete groups under ``lease_id`` (default a fresh one): retried
    with that id, a claim whose answer was lost returns the same groups. ``demand`` tells the
    proxy's admission control what the trainer takes per step (``proxy/admission.py``)."""
    body = ClaimIn.model_construct(
        trainer_id=trainer_id,
        max_groups=max_groups,
        lease_s=lease_s,
        max_staleness=max_staleness,
        lease_id=lease_id or str(uuid.uuid4()),
        groups_per_step=demand.groups_per_step if demand else None,
        mode=demand.mode if demand else None,
        calls="delta",
    )
    return Request("POST", "/trainer/claim", "safe", Claim.read, body)


def renew(*, lease_id: str, group_ids: list[str], lease_s: float, trainer_id: str | None = None) -> Request[float]:
    """Extend a lease on ``group_ids`` by ``lease_s`` from now; returns the new expiry. A 409
    ``lease_lost`` means one of the groups was claimed again: the step must be dropped."""
    body = RenewIn.model_construct(lease_id=lease_id, group_ids=group_ids, lease_s=lease_s, trainer_id=trainer_id)
    return Request("POST", "/trainer/renew", "safe", lambda reply: float(reply["lease_expires_at"]), body)


def release(*, lease_id: str, group_ids: list[str] | None = None) -> Request[int]:
    """Hand a lease's untrained groups back now instead of when it expires."""
    body = ReleaseIn.model_construct(lease_id=lease_id, group_ids=group_ids)
    return Request("POST", "/trainer/release", "safe", lambda reply: int(reply["released"]), body)


def ack(
    *,
    lease_id: str,
    group_ids: list[str],
    step: int,
    status: AckStatus,
    note: str | None = None,
    audits: dict[str, EpisodeAudit] | None = None,
    reason: TrainerSkip | None = None,
) -> Request[list[Group]]:
    """Ack leased groups for ``step``; ``audits``: the fidelity audit of each of their episodes;
    ``reason``: why a ``skipped`` ack's groups are skipped (``note``: the same in words)."""
    body = AckIn.model_construct(
        lease_id=lease_id, group_ids=group_ids, step=step, status=status, reason=reason, note=note, audits=audits
    )
    return Request("POST", "/trainer/ack", "safe", _data(Group.model_validate), body)


def admission() -> Request[AdmissionOut]:
    """The admission picture (``proxy/admission.py``): limit, backlog, refusals, the trainers' demand,
    and every group in the store by outcome."""
    return Request("GET", "/trainer/admission", "safe", AdmissionOut.model_validate)


def report_step(step: int, metrics: dict[str, Any]) -> Request[None]:
    return Request("POST", "/trainer/steps", "safe", _none, StepIn.model_construct(step=step, metrics=metrics))


def steps(since_step: int = -1) -> Request[list[dict[str, Any]]]:
    return Request(
        "GET", "/trainer/steps", "safe", lambda reply: list(reply["data"]), params={"since_step": since_step}
    )


# -- retention (operators) ---------------------------------------------------------------------------


def delete_episode(episode_id: str) -> Request[DeletedOut]:
    """Delete an episode from every table, with its calls and the episodes forked from it; an audit
    entry records it. 404 for an unknown id, 409 ``group_leased`` while its group is leased. Sent
    again only if it cannot have left: a repeat of one that was done answers 404."""
    return Request("DELETE", f"/episodes/{episode_id}", "unsent", DeletedOut.model_validate)


def delete_user(user: str) -> Request[DeletedOut]:
    """Delete every episode whose metadata names ``user`` (the proxy's ``retention.user_key``), and
    their forks; an audit entry records it (a repeat deletes nothing more)."""
    return Request("DELETE", "/episodes", "safe", DeletedOut.model_validate, params={"user": user})


def purge(older_than_s: float | None = None) -> Request[PurgedOut]:
    """Purge now the bodies and token ids of finished episodes whose groups are done with, finished
    longer ago than ``older_than_s`` (default the proxy's ``retention.bodies_ttl_s``)."""
    body = PurgeIn.model_construct(older_than_s=older_than_s)
    return Request("POST", "/retention/purge", "safe", PurgedOut.model_validate, body)


def audit_log(*, limit: int = 100, before_id: int | None = None) -> Request[list[AuditEntryOut]]:
    """The audit log of purges and deletions, newest first (``before_id`` pages on)."""
    params: dict[str, str | int] = {"limit": limit}
    if before_id is not None:
        params["before_id"] = before_id
    return Request("GET", "/retention/audit", "safe", _data(AuditEntryOut.model_validate), params=params)
