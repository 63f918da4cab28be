"""Pack samples into padding-free micro-batches and lay out their loss tokens for the loss.

A micro-batch is one row of concatenated samples (``input_ids`` (1, L), positions restarting at 0
per sample, ``cu_seqlens`` the sample boundaries), filled first-fit-decreasing up to a token budget,
so no compute goes to padding. The loss needs only the tokens the policy sampled: ``select`` are
the rows of the packed hidden states that predict them (position j - 1 predicts token j), and
``rows``/``cols`` place each one in a (B, T) table, T being the most loss tokens of any sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainer.sample import NOT_SAMPLED, Sample

Tensor = torch.Tensor


def plan(samples: Sequence[Sample], budget: int) -> list[list[Sample]]:
    """First-fit decreasing bins of at most ``budget`` tokens (a longer sample gets a bin alone)."""
    bins: list[list[Sample]] = []
    room: list[int] = []
    for sample in sorted(samples, key=len, reverse=True):
        for i, free in enumerate(room):
            if len(sample) <= free:
                bins[i].append(sample)
                room[i] -= len(sample)
                break
        else:
            bins.append([sample])
            room.append(budget - len(sample))
    return bins


@dataclass
class MicroBatch:
    samples: list[Sample]
    input_ids: Tensor  # (1, L)
    position_ids: Tensor  # (1, L)
    cu_seqlens: Tensor  # (S + 1,)
    select: Tensor  # (N,) packed positions whose next token is a loss token
    targets: Tensor  # (N,) those tokens
    temperatures: Tensor  # (N,)
    rows: Tensor  # (N,) sample index in the (B, T) loss table
    cols: Tensor  # (N,) slot in that row
    mask: Tensor  # (B, T) float, 1 on loss tokens
    behaviour_logps: Tensor  # (B, T) engine log-probs, NaN where unknown
    advantages: Tensor  # (B, T) per loss token (a sample's own advantage unless per-turn credit set them)
    top_k: Tensor  # (N,) int64, 0 = off
    top_p: Tensor  # (N,) 1.0 = off
    min_p: Tensor  # (N,) 0.0 = off
    versions: Tensor  # (N,) int64 serving policy version, NOT_SAMPLED where none
    modes: Tensor  # (N,) int64 index into trainer.sample.MODES
    seq_tokens: Tensor  # (B,) loss tokens the per-sequence mean divides by (the member's, per-episode)
    allowed: Tensor | None = None  # (N, words) int32 grammar bitmask per loss token (-1: no mask); None: none masked

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_loss_tokens(self) -> int:
        return int(self.select.shape[0])

    @property
    def truncated(self) -> bool:
        """Any token sampled with top-k, top-p or min-p (the log-prob pass then applies them)."""
        return bool(((self.top_k > 0) | (self.top_p < 1.0) | (self.min_p > 0.0)).any())

    @property
    def masked(self) -> Tensor | None:
        """(N,) bool: loss tokens sampled under a grammar mask (None: none)."""
        return None if self.allowed is None else (self.allowed != -1).any(dim=1)

    def table(self, flat: Tensor) -> Tensor:
        """Scatter per-selected-token values (N,) into the (B, T) loss table (0 elsewhere)."""
        out = flat.new_zeros(self.mask.shape)
        return out.index_put((self.rows, self.cols), flat)


def _per_token(sample: Sample, name: str, default: float) -> list[float]:
    value = getattr(sample, name)
    return [default] * len(sample) if value is None else list(value)


def collate(samples: Sequence[Sample]) -> MicroBatch:
    ids: list[int] = []
    positions: list[int] = []
    bounds = [0]
    select: list[int] = []
    flat: dict[str, list[float]] = {
        k: [] for k in ("targets", "temps", "behaviour", "advantages", "top_k", "top_p", "min_p", "versions", "modes")
    }
    rows: list[int] = []
    cols: list[int] = []
    seq_tokens: list[int] = []
    masked: dict[int, Tensor] = {}  # loss-token index -> its grammar bitmask
    for b, sample in enumerate(samples):
        offset = len(ids)
        ids += sample.input_ids
        positions += range(len(sample))
        bounds.append(len(ids))
        columns = _columns(sample)
        slot = 0
        for j in range(1, len(sample)):
            if sample.loss_mask[j]:
                if j in sample.allowed:
                    masked[len(select)] = sample.allowed[j]
                select.append(offset + j - 1)
                for key, values in columns.items():
                    flat[key].append(values[j])
                rows.append(b)
                cols.append(slot)
                slot += 1
        seq_tokens.append(sample.member_loss_tokens or slot)
    width = max((sum(s.loss_mask[1:]) for s in samples), default=0)
    mask = torch.zeros(len(samples), width)
    rows_t, cols_t = torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)
    mask[rows_t, cols_t] = 1.0

    def table(values: list[float], fill: float) -> Tensor:
        out = torch.full((len(samples), width), fill)
        out[rows_t, cols_t] = torch.tensor(values, dtype=torch.float32)
        return out

    def longs(values: list[float]) -> Tensor:
        return torch.tensor([int(v) for v in values], dtype=torch.long)

    return MicroBatch(
        samples=list(samples),
        input_ids=torch.tensor([ids], dtype=torch.long),
        position_ids=torch.tensor([positions], dtype=torch.long),
        cu_seqlens=torch.tensor(bounds, dtype=torch.long),
        select=torch.tensor(select, dtype=torch.long),
        targets=longs(flat["targets"]),
        temperatures=torch.tensor(flat["temps"], dtype=torch.float32),
        rows=rows_t,
        cols=cols_t,
        mask=mask,
        behaviour_logps=table(flat["behaviour"], float("nan")),
        advantages=table(flat["advantages"], 0.0),
        top_k=longs(flat["top_k"]),
        top_p=torch.tensor(flat["top_p"], dtype=torch.float32),
        min_p=torch.tensor(flat["min_p"], dtype=torch.float32),
        versions=longs(flat["versions"]),
        modes=longs(flat["modes"]),
        seq_tokens=torch.tensor(seq_tokens, dtype=torch.float32),
        allowed=_allowed(masked, len(select)),
    )


def _columns(sample: Sample) -> dict[str, Sequence[float]]:
    """The sample's per-token fields, each as long as its ids (defaults where a field is unset)."""
    return {
        "targets": sample.input_ids,
        "temps": sample.temperatures,
        "behaviour": sample.behaviour_logprobs,
        "advantages": _per_token(sample, "advantages", sample.advantage),
        "top_k": _per_token(sample, "top_k", 0),
        "top_p": _per_token(sample, "top_p", 1.0),
        "min_p": _per_token(sample, "min_p", 0.0),
        "versions": _per_token(sample, "versions", NOT_SAMPLED),
        "modes": _per_token(sample, "modes", 0),
    }


def _allowed(masked: dict[int, Tensor], loss_tokens: int) -> Tensor | None:
    """(loss_tokens, words) grammar bitmasks, -1 (every bit set: nothing masked) where a token was
    sampled without one; None when no token of the micro-batch was."""
    if not masked:
        return None
    words = next(iter(masked.values())).shape[0]
    allowed = torch.full((loss_tokens, words), -1, dtype=torch.int32)
    allowed[torch.tensor(list(masked), dtype=torch.long)] = torch.stack(list(masked.values()))
    return allowed


def pack(samples: Sequence[Sample], budget: int) -> list[MicroBatch]:
    return [collate(group) for group in plan(samples, budget)]
