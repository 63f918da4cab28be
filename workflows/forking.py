"""Where to fork a finished group: which rewarded episode, and how many of its answered calls to replay.

A fork (``POST /episodes/{id}/fork``, ``proxy/replay.py``) replays the source's first ``at``
answered calls and samples from call ``at`` on, so its siblings compare continuations of one state:
per-turn credit without a value model. Only the agent's own sampled calls are fork points
(``agent_sampled``): the answered calls also hold side calls (a user simulator's, recorded beside
the episode and never trained; a tau2 conversation ends with one), and forking at a side or greedy
call samples no decision of the policy. Three rules pick the state among those calls 1..n-1 (call
0 is the whole episode again: an ordinary group does that):

- ``uniform``: a rewarded episode with one at random, and one of its at random;
- ``failure``: the episode with the group's lowest reward, if below its best, forked at its last
  one: the agent's last decision before the failure is sampled again;
- ``entropy``: the one, over the group's rewarded episodes, whose sampled tokens had the
  highest mean surprisal under the engine (minus their mean log-prob: a one-sample estimate of
  the sampling distribution's entropy per token), where the policy was least sure.

Each answers a ``ForkPoint`` or why the group gives none (counted by the runner).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from contract.client import Call, Episode
from contract.vocabulary import TRAINED_MODES

ForkRuleName = Literal["uniform", "failure", "entropy"]
FORK_RULES: tuple[ForkRuleName, ...] = ("uniform", "failure", "entropy")


@dataclass(frozen=True)
class ForkPoint:
    source: str
    """The episode to fork."""
    at: int
    """Its answered calls to replay; the fork samples its call ``at`` (0-based) on."""
    rule: ForkRuleName


def answered(episode: Episode) -> list[Call]:
    """The episode's answered calls in order: what a fork replays (``proxy/store/forks.py``)."""
    return sorted((c for c in episode.calls or () if c.status_code == 200), key=lambda c: c.ordinal)


def agent_sampled(call: Call) -> bool:
    """Whether the policy sampled this call for the agent: served by a policy version (a side call
    has none), not marked side, in a trained sampling mode (not greedy or penalized)."""
    notes = call.notes or {}
    sampling = notes.get("sampling")
    mode = sampling.get("mode") if isinstance(sampling, dict) else None
    return call.policy_version is not None and not notes.get("side") and mode in TRAINED_MODES


def surprisal(call: Call) -> float | None:
    """Minus the mean engine log-prob of the call's sampled tokens (first choice); None without any."""
    logprobs = [float(x) for x in (call.choices[0].get("logprobs") or [])] if call.choices else []
    return -sum(logprobs) / len(logprobs) if logprobs else None


def fork_point(episodes: Sequence[Episode], rule: ForkRuleName, rng: random.Random) -> ForkPoint | str:
    """Where to fork this finished group under ``rule``, or why nowhere."""
    rewarded = [(e, answered(e)) for e in episodes if e.status == "rewarded" and e.reward is not None]
    candidates = [(e, calls, [k for k in range(1, len(calls)) if agent_sampled(calls[k])]) for e, calls in rewarded]
    candidates = [c for c in candidates if c[2]]
    if not candidates:
        return "no rewarded episode with a sampled agent call after its first answered call"
    if rule == "uniform":
        episode, _, points = rng.choice(candidates)
        return ForkPoint(episode.id, rng.choice(points), rule)
    if rule == "failure":
        rewards = [float(e.reward or 0.0) for e, _, _ in candidates]
        lowest = min(rewards)
        if lowest >= max(rewards):
            return "every episode earned the group's best reward: no failure to fork before"
        episode, _, points = rng.choice([c for c, r in zip(candidates, rewards, strict=True) if r == lowest])
        return ForkPoint(episode.id, points[-1], rule)
    best: tuple[float, str, int] | None = None
    for episode, calls, points in candidates:
        for k in points:
            value = surprisal(calls[k])
            if value is not None and (best is None or value > best[0]):
                best = (value, episode.id, k)
    if best is None:
        return "no sampled call with log-probs after the first"
    return ForkPoint(best[1], best[2], rule)
