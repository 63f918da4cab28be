"""Claimed groups to training samples: the entry the loop calls (``build_batch``), in four steps.

1. ``members.py``: which episodes (or n > 1 choices) of a group are compared, with what reward.
2. ``turns.py``: which calls of each member are trained and how (exact engine ids, effective
   sampling, grammar masks; failed, foreign and inexact calls out; retries deduped, branches kept).
3. ``merge.py``: turns spliced into as few samples as their exact ids allow (``sample.py``: the
   token layout); samples past ``max_seq_len`` split at turn boundaries (or truncated); breaks,
   splits, truncation and empty samples counted.
4. ``credit.py``: the values compared within a group (rewards, or per-turn returns) and the
   advantage each trained token gets back; here, groups without a learning signal are skipped with
   a reason and the rest normalised together (``loss.group_advantages``). Under per-turn credit a
   group whose outcomes are all equal is skipped too when ``shaping`` is ``gated`` (the default):
   its returns differ by shaping alone (``credit.shaping_only``), which is never the only signal.

``normalize_per_episode`` makes every member weigh the same in the loss however many samples its
prefix breaks, or its length splits, into (rLLM PR #512 found split episodes getting N times the
weight): each of its samples divides by the member's loss tokens (``member_loss_tokens``). Nothing is
dropped silently: every rule has a counter in ``DataStats`` (``counters.py``), the step's ``data/*``.

A late group (``Late``: its reward came late, or it is older than the staleness bound or
``late_after_s``) is trained like any other, on its recorded log-probs under the bounded importance
weight (``loss.truncated_importance_weights``), and counted (``data/groups_late``); past
``late_max_versions`` or ``late_max_age_s`` it is skipped ``late`` (``data/groups_skipped_late``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from contract.client import Group
from contract.vocabulary import TrainerSkip
from trainer.config import ScaleRewards, TrainerConfig
from trainer.counters import DataStats
from trainer.credit import EQUAL, assign, member_values, shaping_only
from trainer.loss import group_advantages
from trainer.members import Member, Rules, group_members
from trainer.merge import episode_samples
from trainer.retokenize import ChatRetokenizer, Retokenizer
from trainer.sample import MODES, PER_TOKEN, Sample
from trainer.turns import Masker, member_turns

__all__ = [
    "MODES",
    "PER_TOKEN",
    "Batch",
    "ChatRetokenizer",
    "DataStats",
    "Late",
    "Masker",
    "Retokenizer",
    "Rules",
    "Sample",
    "build_batch",
    "episode_samples",
    "finite_mean",
    "late_rule",
    "member_turns",
    "staleness",
]

SkipKind = Literal["few", "equal", "shaping_only", "empty", "late"]
"""Why a group is skipped here: too few members, equal values (no signal), equal outcomes whose
per-turn returns differ by shaping alone (``shaping: gated``), nothing trainable, a late group past
the age limit; the ack's typed ``reason`` (``contract.vocabulary.TrainerSkip``, which adds the loop's
``nonfinite``)."""
NOTHING_TRAINABLE = "no trainable calls (see the data counters)"
MIN_MEMBERS = 2
"""GRPO compares the members of a group with each other: a group with fewer has no comparison and is
skipped. How many rewarded episodes make a group complete is the proxy's ``episodes.min_rewarded``
(one setting, applied where groups complete); a complete group can still fall below this here when
the trainer leaves members out (skipped abandons, episodes without a usable call) or is a lone
episode (the proxy completes a group of one once it is rewarded)."""
Kept = tuple[Group, list[Member], list[list[float]]]
"""A group with a learning signal: its members and the values each compares by."""


@dataclass
class Batch:
    samples: list[Sample]
    trained: list[str]
    """Groups that produced samples (acked ``trained`` after the step)."""
    skipped: dict[str, str]
    """Group id to the note it is acked ``skipped`` with (the reason in words)."""
    rewards: list[float]
    """Rewards of the members of the trained groups."""
    advantages: list[float]
    """One per member of the trained groups (its mean token advantage under per-turn credit)."""
    members: int = 0
    """Members (episodes or choices) behind ``samples``: the per-episode loss normaliser."""
    skipped_equal: int = 0
    skipped_shaping_only: int = 0
    """Groups with equal outcomes whose per-turn returns differ by shaping alone (``shaping: gated``)."""
    skipped_few: int = 0
    skipped_empty: int = 0
    skipped_late: int = 0
    """Late groups past ``late_max_versions`` or ``late_max_age_s``."""
    late: int = 0
    """Late groups within the limits, kept for training (their reward came late, or they are older than
    the staleness bound or ``late_after_s``); one may still be skipped for another reason."""
    stats: DataStats = field(default_factory=DataStats)
    episodes: dict[str, DataStats] = field(default_factory=dict)
    """The counters of each episode of the trained groups: its fidelity audit (``audit``)."""
    reasons: dict[str, TrainerSkip] = field(default_factory=dict)
    """Group id to the typed reason it is acked ``skipped`` for (what the proxy counts skips by)."""

    def skip(self, group_id: str, kind: SkipKind, note: str) -> None:
        """Ack the group ``skipped`` for ``kind`` with ``note``, counted in ``skipped_<kind>``."""
        self.skipped[group_id] = note
        self.reasons[group_id] = kind
        setattr(self, f"skipped_{kind}", getattr(self, f"skipped_{kind}") + 1)


@dataclass(frozen=True)
class Late:
    """Which groups are late and which of those are too old to train (``TrainerConfig.late_*``)."""

    current_version: int
    staleness_bound: int
    """Versions a group may lag before it is late (the trainer's ``staleness_bound``)."""
    after_s: float
    """Seconds since its oldest call after which a group is late (``late_after_s``)."""
    max_versions: int | None = None
    """Versions a late group may lag and still train (``late_max_versions``; None: any)."""
    max_age_s: float | None = None
    """Seconds since its oldest call a late group may be and still train (``late_max_age_s``; None: any)."""
    now: float = field(default_factory=time.time)
    """What ages are counted to: the calls' ``started_at`` are the proxy's epoch seconds."""

    def judge(self, group: Group) -> str | None:
        """None: not late; "": late and trained (under the importance weight like any sample); else the
        note it is skipped ``late`` with. Age and lag are those of its oldest call (a fork's replayed
        calls are context, never its age, as on the proxy's claim)."""
        calls = [c for e in group.episodes or [] for c in e.calls or []]
        versions = [
            c.policy_version for c in calls if c.policy_version is not None and not (c.notes or {}).get("replay")
        ]
        lag = self.current_version - min(versions) if versions else 0
        started = min((c.started_at for c in calls), default=group.created_at)
        age = self.now - started
        awaited = any(e.awaiting_since is not None for e in group.episodes or [])
        if not (awaited or lag > self.staleness_bound or age > self.after_s):
            return None
        if self.max_versions is not None and lag > self.max_versions:
            behind = f"{lag} versions behind v{self.current_version}"
            return f"late: oldest call {behind} (late_max_versions {self.max_versions})"
        if self.max_age_s is not None and age > self.max_age_s:
            return f"late: oldest call {age:.0f}s old (late_max_age_s {self.max_age_s:.0f})"
        return ""


def late_rule(config: TrainerConfig, current_version: int) -> Late:
    """The config's late rule at ``current_version`` (the version the step's groups were claimed at)."""
    return Late(
        current_version=current_version,
        staleness_bound=config.staleness_bound,
        after_s=config.late_after_s,
        max_versions=config.late_max_versions,
        max_age_s=config.late_max_age_s,
    )


def build_batch(
    groups: Sequence[Group],
    *,
    max_seq_len: int | None = None,
    scale_rewards: ScaleRewards | None = None,
    retokenize: Retokenizer | None = None,
    rules: Rules | None = None,
    masker: Masker | None = None,
    late: Late | None = None,
) -> Batch:
    """Samples with advantages for the groups that carry a learning signal; the rest are skipped.

    ``scale_rewards: batch`` follows TRL: the std is that of every compared value of the step,
    equal-reward groups included (they then get zero advantages and are skipped for compute), and so
    are the returns of groups skipped as shaping-only: they are values of the step like any other.
    ``late``: late groups past its limits are skipped ``late``, the others counted (None: no rule).
    """
    rules = rules or Rules()
    if max_seq_len is not None:
        rules = dataclasses.replace(rules, max_seq_len=max_seq_len)
    if scale_rewards is not None:
        rules = dataclasses.replace(rules, scale_rewards=scale_rewards)
    batch = Batch(samples=[], trained=[], skipped={}, rewards=[], advantages=[])
    kept: list[Kept] = []
    compared: list[float] = []
    for group in groups:
        verdict = late.judge(group) if late is not None else None
        if verdict:
            batch.skip(group.id, "late", verdict)
            continue
        batch.late += verdict == ""
        stats, episodes = DataStats(), dict[str, DataStats]()
        members = group_members(
            group, rules, retokenize=retokenize, masker=masker, group_stats=stats, episodes=episodes
        )
        batch.stats.add(stats)
        if len(members) < MIN_MEMBERS:
            few = f"{len(members)} rewarded episodes (or penalized abandons, or rewarded choices)"
            batch.skip(group.id, "few", f"{few}: GRPO compares at least {MIN_MEMBERS}")
            continue
        values = member_values(members, rules, batch.stats)
        flat = [v for vs in values for v in vs]
        compared += flat
        if (why := _no_signal(members, flat, rules)) is not None:
            batch.skip(group.id, *why)
            continue
        kept.append((group, members, values))
        batch.episodes.update(episodes)
    if kept:
        _credit(batch, kept, compared, rules)
    return batch


def _no_signal(members: list[Member], flat: list[float], rules: Rules) -> tuple[SkipKind, str] | None:
    """Why a group with enough members cannot be learnt from, or None when it can. Equal outcomes
    are no signal under gated shaping even where per-turn returns differ: shaping (per-call rewards,
    not potential-based) would be all the group teaches (``credit.shaping_only``)."""
    if not flat:
        return "empty", NOTHING_TRAINABLE
    if max(flat) - min(flat) <= EQUAL:
        return "equal", f"all {len(flat)} rewards equal ({flat[0]:g}): no signal"
    if shaping_only(members, rules):
        return "shaping_only", (
            f"all {len(members)} outcomes equal ({members[0].reward:g}): per-turn returns differ by shaping "
            "alone (call rewards, turn_discount), no outcome signal (shaping=always trains on them)"
        )
    if not any(m.samples for m in members):
        return "empty", NOTHING_TRAINABLE
    return None


def _credit(batch: Batch, kept: list[Kept], compared: list[float], rules: Rules) -> None:
    """Normalise the kept groups' values (``scale_rewards``) and hand the advantages to their samples."""
    pooled = [torch.tensor([v for vs in values for v in vs], dtype=torch.float64) for _, _, values in kept]
    scaled = group_advantages(pooled, rules.scale_rewards, batch_values=torch.tensor(compared, dtype=torch.float64))
    for (group, members, values), advantages in zip(kept, scaled, strict=True):
        batch.trained.append(group.id)
        flat = advantages.tolist()
        offset = 0
        for member, values_ in zip(members, values, strict=True):
            mine = flat[offset : offset + len(values_)]
            offset += len(values_)
            batch.rewards.append(member.reward)
            batch.advantages.append(assign(member, mine, rules))
            loss_tokens = sum(s.num_loss_tokens for s in member.samples)
            for sample in member.samples:
                sample.member_loss_tokens = loss_tokens if rules.normalize_per_episode else 0
                batch.samples.append(sample)
            batch.members += bool(member.samples)


def staleness(samples: Sequence[Sample], current_version: int) -> list[int]:
    """Versions each sample's oldest trainable call lags the current policy."""
    return [current_version - s.min_version for s in samples if s.min_version is not None]


def finite_mean(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else 0.0
