"""A group's rewards from the judge, alone or mixed with the workflow's verifier, posted or abandoned.

``reward = verifier`` (the workflow's own check, per episode: the runner's default path),
``judge`` (the judge's score), or ``mix``: ``(1 - w) * verifier + w * judge``. Both lie in [0, 1]
for the built-in workflows, so the mix does too. When the judge gives up, every episode it was to
score is abandoned with an ``infrastructure: judge`` reason: the failure is not the agent's, so the
trainer never penalizes it, and no reward is made up (not even the verifier's alone in ``mix``:
a group rewarded half one way and half another would not compare).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from contract.client import AsyncProxyClient, ProxyError
from workflows.base import INFRASTRUCTURE
from workflows.judge.judge import Judge, JudgeFailed

RewardMode = Literal["verifier", "judge", "mix"]
REWARD_MODES: tuple[str, ...] = get_args(RewardMode)
JUDGE_FAILED = INFRASTRUCTURE + "judge: "
"""Prefix of the abandon reason of episodes the judge could not score."""


def combine(mode: RewardMode, *, verifier: float | None, judge: float | None, weight: float) -> float:
    """The episode's reward under ``mode``; ``weight`` is the judge's share in ``mix``."""
    if mode == "verifier" or (mode == "mix" and weight == 0.0):
        if verifier is None:
            raise ValueError(f"reward {mode!r} needs the workflow's verifier reward")
        return verifier
    if judge is None:
        raise ValueError(f"reward {mode!r} needs a judge score")
    if mode == "judge" or weight == 1.0:
        return judge
    if verifier is None:
        raise ValueError("reward 'mix' needs the workflow's verifier reward")
    return (1.0 - weight) * verifier + weight * judge


@dataclass(frozen=True)
class JudgedGroup:
    """A group's episodes as the judge left them, and the judge requests it took."""

    episodes: list[Settled]
    attempts: int


@dataclass(frozen=True)
class Settled:
    """How one judged episode ended: rewarded, abandoned (the judge gave up), or error (the proxy refused)."""

    episode_id: str
    status: Literal["rewarded", "abandoned", "error"]
    reward: float | None
    error: str | None
    metadata: dict[str, Any] = field(default_factory=dict)


async def reward_group(
    client: AsyncProxyClient,
    judge: Judge,
    *,
    group_id: str,
    task: str,
    episode_ids: Sequence[str],
    mode: RewardMode,
    weight: float = 0.5,
    verifier: Mapping[str, float | None] | None = None,
    metadata: Mapping[str, Mapping[str, Any]] | None = None,
) -> JudgedGroup:
    """Judge the finished ``episode_ids`` of a group, then post each one's reward or abandon all of them.

    ``verifier`` holds the workflow's reward per episode (needed by ``mix``), ``metadata`` what the
    workflow stored beside it; the reward's metadata adds ``reward_mode``, ``judge_weight``,
    ``verifier_reward`` and ``judge`` (``Judgement.audit``: score, reason, model, latency, prompt, answer)."""
    if mode == "verifier":
        raise ValueError("reward_group is for the judge's modes; 'verifier' rewards each episode as it ends")
    verifier = verifier or {}
    metadata = metadata or {}
    try:
        judgement = await judge.judge(client, group_id=group_id, task=task, episode_ids=episode_ids)
    except JudgeFailed as exc:
        return JudgedGroup([await abandon(client, e, JUDGE_FAILED + str(exc)) for e in episode_ids], exc.attempts)
    settled = []
    for episode_id in episode_ids:
        verdict = judgement.verdicts[episode_id]
        reward = combine(mode, verifier=verifier.get(episode_id), judge=verdict.score, weight=weight)
        stored = {
            **metadata.get(episode_id, {}),
            "reward_mode": mode,
            "judge_weight": weight if mode == "mix" else 1.0,
            "verifier_reward": verifier.get(episode_id),
            "judge": judgement.audit(episode_id),
        }
        try:
            await client.reward(episode_id, reward, metadata=stored)
        except ProxyError as exc:
            settled.append(Settled(episode_id, "error", None, f"could not post the judged reward: {exc}", stored))
        else:
            settled.append(Settled(episode_id, "rewarded", reward, None, stored))
    return JudgedGroup(settled, judgement.attempts)


async def abandon(client: AsyncProxyClient, episode_id: str, reason: str) -> Settled:
    """Abandon one episode the judge could not score (cause ``infrastructure``: not the agent's doing);
    a refusal by the proxy is an ``error``, not an exception."""
    try:
        await client.abandon(episode_id, reason, cause="infrastructure")
    except ProxyError as exc:
        return Settled(episode_id, "error", None, f"{reason}; could not abandon the episode: {exc}")
    return Settled(episode_id, "abandoned", None, reason)
