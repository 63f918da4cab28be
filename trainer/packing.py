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


COLUMNS: dict[str, tuple[str, float, torch.dtype]] = {
    # MicroBatch field: (Sample field, default where the sample leaves it unset, dtype)
    "targets": ("input_ids", 0, torch.long),
    "temperatures": ("temperatures", 1.0, torch.float32),
    "behaviour_logps": ("behaviour_logprobs", float("nan"), torch.float32),
    "advantages": ("advantages", 0.0, torch.float32),
    "top_k": ("top_k", 0, torch.long),
    "top_p": ("top_p", 1.0, torch.float32),
    "min_p": ("min_p", 0.0, torch.float32),
    "versions": ("versions", NOT_SAMPLED, torch.long),
    "modes": ("modes", 0, torch.long),
}
"""The per-token fields taken at the loss positions, in the order ``MicroBatch`` declares them."""


def _column(sample: Sample, field: str, default: float, dtype: torch.dtype) -> Tensor:
    """The sample's per-token field as one tensor as long as its ids (the default where it is unset;
    a sample without per-token advantages has its own advantage on every token)."""
    value = getattr(sample, field)
    if value is None:
        return torch.full((len(sample),), sample.advantage if field == "advantages" else default, dtype=dtype)
    return torch.tensor(value, dtype=dtype)


def collate(samples: Sequence[Sample]) -> MicroBatch:
    """One packed row of ``samples``. Tensor ops per sample, not a Python loop per token: the loop
    took 40-54 ms of a 2.36 s step of a 7B model on two 8k samples on an H100, growing with the
    tokens (a one-off phase timing, not a bench: deploy/README.md, "Measured on one GPU")."""
    lengths = [len(s) for s in samples]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    select: list[Tensor] = []
    rows: list[Tensor] = []
    cols: list[Tensor] = []
    taken: dict[str, list[Tensor]] = {name: [] for name in COLUMNS}
    seq_tokens: list[int] = []
    masked: dict[int, Tensor] = {}  # loss-token index -> its grammar bitmask
    before = 0  # loss tokens of the samples before this one
    for b, sample in enumerate(samples):
        loss = torch.tensor(sample.loss_mask, dtype=torch.bool)
        loss[:1] = False  # the first token has no position before it to predict it
        at = loss.nonzero().squeeze(1)  # (n,) the sample's loss positions j
        n = int(at.shape[0])
        for slot, j in enumerate(at.tolist() if sample.allowed else ()):
            if j in sample.allowed:
                masked[before + slot] = sample.allowed[j]
        before += n
        select.append(at + (offsets[b] - 1))
        rows.append(torch.full((n,), b, dtype=torch.long))
        cols.append(torch.arange(n))
        for name, (field, default, dtype) in COLUMNS.items():
            taken[name].append(_column(sample, field, default, dtype)[at])
        seq_tokens.append(sample.member_loss_tokens or n)
    width = max((len(c) for c in cols), default=0)
    rows_t, cols_t = _cat(rows, torch.long), _cat(cols, torch.long)
    mask = torch.zeros(len(samples), width)
    mask[rows_t, cols_t] = 1.0
    flat = {name: _cat(parts, COLUMNS[name][2]) for name, parts in taken.items()}

    def table(values: Tensor, fill: float) -> Tensor:
        out = torch.full((len(samples), width), fill)
        out[rows_t, cols_t] = values
        return out

    ids = [i for s in samples for i in s.input_ids]
    return MicroBatch(
        samples=list(samples),
        input_ids=torch.tensor([ids], dtype=torch.long),
        position_ids=_cat([torch.arange(n) for n in lengths], torch.long).unsqueeze(0),
        cu_seqlens=torch.tensor(offsets, dtype=torch.long),
        select=_cat(select, torch.long),
        targets=flat["targets"],
        temperatures=flat["temperatures"],
        rows=rows_t,
        cols=cols_t,
        mask=mask,
        behaviour_logps=table(flat["behaviour_logps"], float("nan")),
        advantages=table(flat["advantages"], 0.0),
        top_k=flat["top_k"],
        top_p=flat["top_p"],
        min_p=flat["min_p"],
        versions=flat["versions"],
        modes=flat["modes"],
        seq_tokens=torch.tensor(seq_tokens, dtype=torch.float32),
        allowed=_allowed(masked, before),
    )


def _cat(parts: list[Tensor], dtype: torch.dtype) -> Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)


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
