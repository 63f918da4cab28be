"""Per-episode fidelity audit: what of an episode's calls was trained, and how closely.

The step's data counters (``trainer/counters.py``) say what the rules did to a whole step; a user
looking at one episode needs the same per episode: how many calls were deduped as retries, merged
into one sequence or broken off, kept as context only, how many tokens were trained and how many
of those were scored under the engine's grammar mask, and the engine/trainer log-prob gap on them. The trainer
sends it with the ack of the episode's group; the proxy keeps it on the episode (dashboard, export).
"""

from __future__ import annotations

from collections.abc import Sequence

from contract.client import Group
from contract.schemas import EpisodeAudit
from trainer.counters import DataStats
from trainer.data import Batch
from trainer.learner import EpisodeGap
from trainer.sample import Sample

CONTEXT_ONLY = (
    "calls_greedy",
    "calls_penalized",
    "calls_replayed",
    "calls_constrained_excluded",
    "calls_constrained_unmasked",
    "calls_sampling_unrecorded",
    "calls_dropped_inexact",
)
"""Counters of calls the agent acted on that the rules keep out of the loss (context, or dropped)."""


def audit(stats: DataStats, samples: Sequence[Sample], gap: EpisodeGap | None, step: int) -> EpisodeAudit:
    """One episode's audit: its counters, its samples' trained tokens and its engine gap (None: not compared)."""
    return EpisodeAudit(
        step=step,
        calls=stats.calls,
        calls_failed=stats.calls_failed,
        calls_deduped=stats.calls_deduped,
        calls_context_only=sum(getattr(stats, name) for name in CONTEXT_ONLY),
        calls_merged=stats.merged,
        breaks=stats.breaks,
        samples=len(samples),
        samples_truncated=stats.samples_truncated,
        tokens_trained=sum(s.num_loss_tokens for s in samples),
        tokens_under_grammar=sum(len(s.allowed) for s in samples),
        tokens_forced=stats.tokens_forced,
        gap_mean=gap.mean if gap else None,
        gap_max=gap.max if gap and gap.tokens else None,
        gap_tokens=gap.tokens if gap else 0,
    )


def group_audits(
    batch: Batch, groups: Sequence[Group], gaps: dict[str, EpisodeGap], step: int
) -> dict[str, dict[str, EpisodeAudit]]:
    """Group id -> episode id -> audit, for the groups the step trained."""
    trained = set(batch.trained)
    samples: dict[str, list[Sample]] = {}
    for sample in batch.samples:  # one pass, not one per episode
        samples.setdefault(sample.episode_id, []).append(sample)
    out: dict[str, dict[str, EpisodeAudit]] = {}
    for group in groups:
        if group.id not in trained:
            continue
        out[group.id] = {
            e.id: audit(batch.episodes[e.id], samples.get(e.id, []), gaps.get(e.id), step)
            for e in group.episodes or []
            if e.id in batch.episodes
        }
    return out
