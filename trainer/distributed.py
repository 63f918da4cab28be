"""Data parallelism over several processes (one per GPU), started by torchrun or ``accelerate launch``.

Rank 0 is the leader: it alone talks to the proxy (claim, ack, publish, report) and writes
checkpoints and logs. Each step it broadcasts the step's samples; every rank packs them the same
way, takes its share of the micro-batches, and computes gradients normalised by the whole step's
totals. The LoRA gradients (and the loss statistics) are then summed across ranks, so every rank
clips the same gradient and takes the same AdamW step: the replicas stay equal without sending
weights, and the update equals the one a single process would take on the same batch. Only the
small LoRA gradients cross the wire; the frozen base model is replicated, not sharded.

Without torchrun's environment (``WORLD_SIZE`` unset or 1) every function here is a no-op.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from trainer.packing import MicroBatch

Tensor = torch.Tensor


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    # -- work split ------------------------------------------------------------------------------

    def share(self, micro: Sequence[MicroBatch]) -> list[MicroBatch]:
        """This rank's micro-batches: longest first to the least-loaded rank (the same on every rank)."""
        if not self.distributed:
            return list(micro)
        load = [0] * self.size
        mine: list[MicroBatch] = []
        for mb in sorted(micro, key=lambda m: m.num_tokens, reverse=True):
            rank = min(range(self.size), key=lambda r: (load[r], r))
            load[rank] += mb.num_tokens
            if rank == self.rank:
                mine.append(mb)
        return mine

    # -- collectives -----------------------------------------------------------------------------

    def sum_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sum every parameter's gradient over ranks, in one flat all-reduce (a rank with no work sends zeros)."""
        if not self.distributed:
            return
        params = list(params)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat)
        offset = 0
        for p, g in zip(params, grads, strict=True):
            g.copy_(flat[offset : offset + p.numel()].view_as(p))
            p.grad = g
            offset += p.numel()

    def sum_values(self, values: dict[str, float], keys: Sequence[str], device: torch.device | str) -> dict[str, float]:
        """``values`` summed over ranks for ``keys`` (missing keys count as 0 on that rank)."""
        if not self.distributed:
            return {key: values.get(key, 0.0) for key in keys}
        tensor = torch.tensor([values.get(key, 0.0) for key in keys], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(tensor)
        return dict(zip(keys, tensor.tolist(), strict=True))

    def max_values(self, values: dict[str, float], keys: Sequence[str], device: torch.device | str) -> dict[str, float]:
        """``values`` maximised over ranks for ``keys`` (missing keys count as 0: the maxima here are >= 0)."""
        if not self.distributed:
            return {key: values.get(key, 0.0) for key in keys}
        tensor = torch.tensor([values.get(key, 0.0) for key in keys], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
        return dict(zip(keys, tensor.tolist(), strict=True))

    def broadcast(self, obj: Any) -> Any:
        """The leader's ``obj`` on every rank (pickled; a step's samples or a checkpoint's small LoRA state)."""
        if not self.distributed:
            return obj
        box = [obj if self.leader else None]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        """Leave the process group on a normal exit, every rank together: a rank that tears gloo
        down while its peer still has a collective in flight can abort the process at exit
        ("terminate called without an active exception", pytorch/pytorch#190489; seen here once in
        six two-rank runs of the CLI test, from the leader after its last step)."""
        if self.distributed and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def to_cpu(value: Any) -> Any:
    """A state dict with every tensor on the CPU (so another rank does not unpickle it onto this GPU)."""
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(to_cpu(v) for v in value)
    return value.cpu() if hasattr(value, "cpu") else value


def init_world(timeout_s: float) -> World:
    """Join the process group torchrun (or accelerate) describes in the environment, if any.

    NCCL on GPUs, gloo on the CPU. The timeout bounds how long followers wait at a collective, and
    they wait there while the leader waits for rewarded groups: keep it above the longest expected
    wait for a step's groups.
    """
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)  # "cuda" now names this rank's GPU (LoraPolicy moves the model there)
    torch.distributed.init_process_group(backend="nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    return World(rank=rank, size=size, local_rank=local_rank)
