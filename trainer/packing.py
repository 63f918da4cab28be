"""Pack samples into padding-free micro-batches and lay out their loss tokens for the loss.

A micro-batch is one row of concatenated samples (``input_ids`` (1, L), positions restarting at 0
per sample, ``cu_seqlens`` the sample boundaries), filled first-fit-decreasing up to a token budget,
so no compute goes to padding. The loss needs only the tokens the policy sampled: ``select`` are
the rows of the packed hidden states that predict them (position j - 1 predicts token j), and
``rows``/``cols`` place each one in a (B, T) table, T being the most loss tokens of any sample.

Shared prefixes (``shared=True``, the trainer's ``shared_prefix``; issue 45). Samples that begin
with the same tokens (a group's members share their prompt, groups share a system prompt and tools,
a fork group shares the replayed context) are packed as a prefix tree: the row holds every distinct
prefix once. Its *segments* are the edges of the samples' radix tree (a run of tokens with one
parent segment, -1 for a root), each contiguous in the row, its positions continuing from its
parent's end; ``cu_seqlens`` are the segment bounds and ``parents`` their parents. A segment attends
to all of its ancestors' tokens and causally to its own (``trainer/lora.py``), which is exactly
what each sample's tokens see when packed whole: the same tokens at the same positions, so the same
hidden states. A sample's token j sits at one packed index; its loss token j is predicted by the
packed index of token j - 1, which several samples can select (with their own targets) where they
branch right after it, so the (B, T) loss table and everything after it are those of the samples
packed whole, and the loss and its gradient are the same function of the weights (the gradient of
a shared token sums what every branch sends it).

The planner sorts the samples by their ids, so samples sharing a prefix are neighbours, cuts the
sorted list into runs of samples that share prefixes (``MIN_SHARED_TOKENS`` or more) and the runs
into chunks whose distinct tokens fit the budget, then bins the chunks first-fit-decreasing by
those tokens. Without any shared prefix that is the plan of samples packed whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainer.sample import NOT_SAMPLED, Sample

Tensor = torch.Tensor
MIN_SHARED_TOKENS = 16
"""Samples share a prefix in the tree only when it is at least this long: each segment costs an attention
call per layer (masked where it has ancestors) and a copy of its ancestors' keys and values, which a
few shared chat-template tokens do not pay for. A guess, not a measured break-even; exactness does not
depend on it."""


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


def shared_length(a: Sequence[int], b: Sequence[int], minimum: int = MIN_SHARED_TOKENS) -> int:
    """The length of the common prefix of ``a`` and ``b``, or 0 where it is shorter than ``minimum``."""
    n = min(len(a), len(b))
    if n < minimum or a[:minimum] != b[:minimum]:
        return 0
    if a[:n] == b[:n]:
        return n
    lo, hi = (
        minimum,
        n,
    )  # a[:lo] == b[:lo], a[:hi] != b[:hi]: bisect on slices (C comparisons, no Python loop per token)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def plan_shared(samples: Sequence[Sample], budget: int) -> list[list[Sample]]:
    """Bins of samples whose distinct tokens (the packed prefix tree's) fit ``budget`` where they can.

    Sorted by ids, a sample shares its longest prefix with the one before it, so the tokens it adds
    to a chunk of sorted neighbours are its length less that prefix. Runs of neighbours sharing a
    prefix are cut into chunks in order (a new chunk where the next sample's added tokens would
    exceed the budget), and the chunks go into bins first-fit decreasing by their tokens (a chunk
    counted whole: chunks in one bin share nothing by this count, so the budget holds however
    they do). A sample longer than the budget gets a bin alone. Where no prefix is shared these are
    ``plan``'s bins, in its order."""
    order = sorted(range(len(samples)), key=lambda i: samples[i].input_ids)
    chunks: list[list[Sample]] = []
    costs: list[int] = []
    first: list[int] = []  # the chunk's earliest sample in the input order: ties keep ``plan``'s order
    for k, i in enumerate(order):
        sample = samples[i]
        shared = shared_length(samples[order[k - 1]].input_ids, sample.input_ids) if k else 0
        added = len(sample) - shared
        if shared and costs[-1] + added <= budget:
            chunks[-1].append(sample)
            costs[-1] += added
            first[-1] = min(first[-1], i)
        else:
            chunks.append([sample])
            costs.append(len(sample))
            first.append(i)
    bins: list[list[Sample]] = []
    room: list[int] = []
    for c in sorted(range(len(chunks)), key=lambda c: (-costs[c], first[c])):
        for i, free in enumerate(room):
            if costs[c] <= free:
                bins[i] += chunks[c]
                room[i] -= costs[c]
                break
        else:
            bins.append(list(chunks[c]))
            room.append(budget - costs[c])
    return bins


@dataclass
class MicroBatch:
    samples: list[Sample]
    input_ids: Tensor  # (1, L)
    position_ids: Tensor  # (1, L)
    cu_seqlens: Tensor  # (S + 1,) segment bounds: the samples', or the prefix tree's segments (``parents``)
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
    parents: list[int] | None = None  # (S,) each segment's parent segment, -1: a root; None: every sample whole

    @property
    def num_tokens(self) -> int:
        """Tokens of the packed row: what the forward computes (shared prefixes once)."""
        return int(self.input_ids.shape[1])

    @property
    def unshared_tokens(self) -> int:
        """Tokens of the samples, a shared prefix counted in every sample that holds it."""
        return sum(len(s) for s in self.samples)

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


@dataclass
class Tree:
    """The samples' prefix tree laid out in one row: segment ``g`` holds tokens ``start[g]`` to
    ``end[g]`` of sample ``owner[g]`` (every sample through it has the same ones there), at packed
    ``offsets[g]``; ``leaf[b]`` is the segment sample ``b`` ends in (-1: an empty sample)."""

    owner: list[int]
    start: list[int]
    end: list[int]
    parent: list[int]
    leaf: list[int]
    offsets: list[int]

    def path(self, b: int) -> list[int]:
        """Sample ``b``'s segments, root first."""
        out: list[int] = []
        g = self.leaf[b]
        while g >= 0:
            out.append(g)
            g = self.parent[g]
        return out[::-1]

    def index(self, b: int) -> Tensor:
        """(len,) the packed index of each of sample ``b``'s tokens."""
        return _cat(
            [torch.arange(self.offsets[g], self.offsets[g] + self.end[g] - self.start[g]) for g in self.path(b)],
            torch.long,
        )


def prefix_tree(samples: Sequence[Sample], minimum: int = MIN_SHARED_TOKENS) -> Tree | None:
    """The samples' radix tree over their ids (prefixes shorter than ``minimum`` not shared), its
    segments in depth-first order; None where no prefix is shared (each sample is its own root).

    In id order each sample shares its longest prefix with the one before it, so the previous
    sample's path (a stack of segments) is all the tree a new sample needs: pop what lies past the
    shared length, split the segment it ends inside, hang the rest of the sample under it."""
    order = sorted(range(len(samples)), key=lambda i: samples[i].input_ids)
    owner: list[int] = []
    start: list[int] = []
    end: list[int] = []
    parent: list[int] = []
    leaf = [-1] * len(samples)
    stack: list[int] = []
    for k, i in enumerate(order):
        ids = samples[i].input_ids
        shared = shared_length(samples[order[k - 1]].input_ids, ids, minimum) if k else 0
        while stack and start[stack[-1]] >= shared:
            stack.pop()
        if stack and end[stack[-1]] > shared:  # the samples part inside this segment: split it there
            x = stack[-1]
            owner.append(owner[x])
            start.append(start[x])
            end.append(shared)
            parent.append(parent[x])
            start[x], parent[x] = shared, len(owner) - 1  # x keeps its deeper part (and its children, leaves)
            stack[-1] = len(owner) - 1
        if len(ids) > shared:
            owner.append(i)
            start.append(shared)
            end.append(len(ids))
            parent.append(stack[-1] if stack else -1)
            stack.append(len(owner) - 1)
        leaf[i] = stack[-1] if stack else -1
    if all(p < 0 for p in parent) and len(owner) == len(samples):
        return None
    children: list[list[int]] = [[] for _ in owner]
    roots: list[int] = []
    for g, p in enumerate(parent):
        (children[p] if p >= 0 else roots).append(g)
    layout: list[int] = []  # depth first, a parent before its children
    pending = roots[::-1]
    while pending:
        g = pending.pop()
        layout.append(g)
        pending.extend(children[g][::-1])
    new = {g: n for n, g in enumerate(layout)}
    offsets = [0]
    for g in layout:
        offsets.append(offsets[-1] + end[g] - start[g])
    return Tree(
        owner=[owner[g] for g in layout],
        start=[start[g] for g in layout],
        end=[end[g] for g in layout],
        parent=[new[parent[g]] if parent[g] >= 0 else -1 for g in layout],
        leaf=[new[g] if g >= 0 else -1 for g in leaf],
        offsets=offsets,
    )


def collate(samples: Sequence[Sample], *, shared: bool = False) -> MicroBatch:
    """One packed row of ``samples`` (``shared``: their prefix tree, where they share prefixes).
    Tensor ops per sample, not a Python loop per token: the loop took 40-54 ms of a 2.36 s step of a
    7B model on two 8k samples on an H100, growing with the tokens (a one-off phase timing, not a
    bench: deploy/README.md, "Measured on one GPU")."""
    lengths = [len(s) for s in samples]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    tree = prefix_tree(samples) if shared else None
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
        select.append(at + (offsets[b] - 1) if tree is None else tree.index(b)[at - 1])
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

    if tree is None:
        ids = [i for s in samples for i in s.input_ids]
        positions = _cat([torch.arange(n) for n in lengths], torch.long)
        bounds = offsets
    else:
        segments = zip(tree.owner, tree.start, tree.end, strict=True)
        ids = [i for owner, s, e in segments for i in samples[owner].input_ids[s:e]]
        positions = _cat([torch.arange(s, e) for s, e in zip(tree.start, tree.end, strict=True)], torch.long)
        bounds = tree.offsets
    return MicroBatch(
        samples=list(samples),
        input_ids=torch.tensor([ids], dtype=torch.long),
        position_ids=positions.unsqueeze(0),
        cu_seqlens=torch.tensor(bounds, dtype=torch.long),
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
        parents=None if tree is None else tree.parent,
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


def pack(samples: Sequence[Sample], budget: int, *, shared: bool = False) -> list[MicroBatch]:
    """The samples' micro-batches; ``shared``: planned and packed as prefix trees (``plan_shared``)."""
    if not shared:
        return [collate(group) for group in plan(samples, budget)]
    return [collate(group, shared=True) for group in plan_shared(samples, budget)]
