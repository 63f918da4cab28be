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

from trainer.data import Sample

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
    advantages: Tensor  # (B,)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_loss_tokens(self) -> int:
        return int(self.select.shape[0])

    def table(self, flat: Tensor) -> Tensor:
        """Scatter per-selected-token values (N,) into the (B, T) loss table (0 elsewhere)."""
        out = flat.new_zeros(self.mask.shape)
        return out.index_put((self.rows, self.cols), flat)


def collate(samples: Sequence[Sample]) -> MicroBatch:
    ids: list[int] = []
    positions: list[int] = []
    bounds = [0]
    select: list[int] = []
    targets: list[int] = []
    temps: list[float] = []
    rows: list[int] = []
    cols: list[int] = []
    behaviour: list[float] = []
    for b, sample in enumerate(samples):
        offset = len(ids)
        ids += sample.input_ids
        positions += range(len(sample))
        bounds.append(len(ids))
        slot = 0
        for j in range(1, len(sample)):
            if sample.loss_mask[j]:
                select.append(offset + j - 1)
                targets.append(sample.input_ids[j])
                temps.append(sample.temperatures[j])
                behaviour.append(sample.behaviour_logprobs[j])
                rows.append(b)
                cols.append(slot)
                slot += 1
    width = max((sum(s.loss_mask[1:]) for s in samples), default=0)
    mask = torch.zeros(len(samples), width)
    behaviour_table = torch.full((len(samples), width), float("nan"))
    rows_t, cols_t = torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)
    mask[rows_t, cols_t] = 1.0
    behaviour_table[rows_t, cols_t] = torch.tensor(behaviour, dtype=torch.float32)
    return MicroBatch(
        samples=list(samples), input_ids=torch.tensor([ids], dtype=torch.long),
        position_ids=torch.tensor([positions], dtype=torch.long), cu_seqlens=torch.tensor(bounds, dtype=torch.long),
        select=torch.tensor(select, dtype=torch.long), targets=torch.tensor(targets, dtype=torch.long),
        temperatures=torch.tensor(temps, dtype=torch.float32), rows=rows_t, cols=cols_t, mask=mask,
        behaviour_logps=behaviour_table,
        advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32))


def pack(samples: Sequence[Sample], budget: int) -> list[MicroBatch]:
    return [collate(group) for group in plan(samples, budget)]
