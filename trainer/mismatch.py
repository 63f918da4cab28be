"""The engine/trainer log-prob gap: sums and maxima per sampling mode, gaps per episode, the step's figures.

Pure bookkeeping over tensors the learner already computed (no model): ``|trainer - engine|`` of
every sampled token compared under the policy version that served it, accumulated into the step's
sums (summed over micro-batches and ranks) and maxima, and per episode for its fidelity audit
(``trainer/audit.py``). Figures of groups nothing was compared in are None ("unknown"), never 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.packing import MicroBatch
from trainer.sample import MODES

Tensor = torch.Tensor
ENGINE_GROUPS = (*MODES, "all")
"""Engine-mismatch figures per trained sampling mode, and over all of them."""


@dataclass
class EpisodeGap:
    """|trainer - engine| log-prob over an episode's compared tokens (nats)."""

    total: float = 0.0
    tokens: int = 0
    max: float = 0.0

    @property
    def mean(self) -> float | None:
        return self.total / self.tokens if self.tokens else None


def engine_gap(
    trainer: Tensor,
    engine: Tensor,
    modes: Tensor,
    served: Tensor,
    tolerance: float,
    sums: dict[str, float],
    maxes: dict[str, float],
) -> None:
    """Add |trainer - engine| of the tokens ``served`` by the scored version, per mode, to the sums."""
    known = served & ~torch.isnan(engine)  # (N,)
    diff = (trainer - engine).abs()  # (N,)
    for name, rows in ((m, known & (modes == i)) for i, m in enumerate(MODES)):
        _add(name, diff[rows], tolerance, sums, maxes)
    _add("all", diff[known], tolerance, sums, maxes)


def episode_gaps(mb: MicroBatch, trainer: Tensor, engine: Tensor, served: Tensor, gaps: dict[str, EpisodeGap]) -> None:
    """Add the compared tokens' |trainer - engine| to their episodes' gaps."""
    known = served & ~torch.isnan(engine)
    if not bool(known.any()):
        return
    diff = (trainer - engine).abs()[known]
    rows = mb.rows[known]
    for row in torch.unique(rows).tolist():
        mine = diff[rows == row]
        gap = gaps.setdefault(mb.samples[row].episode_id, EpisodeGap())
        gap.total += float(mine.sum())
        gap.tokens += int(mine.numel())
        gap.max = max(gap.max, float(mine.max()))


def _add(group: str, diff: Tensor, tolerance: float, sums: dict[str, float], maxes: dict[str, float]) -> None:
    if diff.numel() == 0:
        return
    for key, value in (
        ("sum", float(diff.sum())),
        ("n", float(diff.numel())),
        ("above", float((diff > tolerance).sum())),
    ):
        sums[f"engine_{group}_{key}"] = sums.get(f"engine_{group}_{key}", 0.0) + value
    maxes[f"engine_{group}_max"] = max(maxes.get(f"engine_{group}_max", 0.0), float(diff.max()))


def engine_figures(sums: dict[str, float], maxes: dict[str, float]) -> dict[str, float | None]:
    """The step's ``policy/engine_logp_*`` and ``policy/stale_logp_*`` figures (None: nothing compared)."""
    out: dict[str, float | None] = {}
    for group in ENGINE_GROUPS:
        n = sums.get(f"engine_{group}_n", 0.0)
        suffix = "" if group == "all" else f"_{group}"
        out[f"policy/engine_logp_diff_mean{suffix}"] = sums[f"engine_{group}_sum"] / n if n else None
        out[f"policy/engine_logp_diff_max{suffix}"] = maxes.get(f"engine_{group}_max") if n else None
        out[f"policy/engine_logp_frac_above{suffix}"] = sums[f"engine_{group}_above"] / n if n else None
        out[f"policy/engine_logp_tokens{suffix}"] = n
    stale_n = sums.get("stale_n", 0.0)
    out["policy/stale_logp_diff_mean"] = sums["stale_diff"] / stale_n if stale_n else None
    out["policy/stale_logp_tokens"] = stale_n
    return out
