"""Several processes (one per GPU) under torchrun or ``accelerate launch``: data parallelism or FSDP2.

Rank 0 is the leader: it alone talks to the proxy (claim, ack, publish, report) and writes
checkpoints and logs. Each step it broadcasts the step's samples; every rank packs them the same
way, takes its share of the micro-batches, and computes gradients normalised by the whole step's
totals, so the summed gradient is the one a single process would compute on the same batch.

``parallelism: data``: the whole model is on every rank. The LoRA gradients (and the loss
statistics) are summed across ranks, so every rank clips the same gradient and takes the same AdamW
step: the replicas stay equal without sending weights. Only the small LoRA gradients cross the wire.

``parallelism: fsdp`` (``shard_model``): FSDP2 shards every weight, the frozen base and the LoRA
adapter alike, over the ranks, one group per decoder layer and one at the root; a group's weights
are gathered for its forward and backward and its LoRA gradients reduce-scattered (summed, not
averaged: the loss is already normalised by the whole step). Each pass is a collective, so every
rank runs as many passes as the busiest (``passes``: a zero-weight pass pads the short ones). The
whole adapter and optimizer state are gathered (``gathered``) after each update, so rank 0 can
checkpoint and publish them alone, and a state is loaded by cutting each rank's shard out of the
whole one (``shard_like``), on every rank, with nothing sent.

Without torchrun's environment (``WORLD_SIZE`` unset or 1) every function here is a no-op.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from trainer.packing import MicroBatch

Tensor = torch.Tensor
Pass = tuple[MicroBatch, bool]
"""One forward/backward of a rank: the micro-batch, and whether it counts (False: a padding pass)."""


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

    def passes(self, micro: Sequence[MicroBatch], *, lockstep: bool) -> list[Pass]:
        """This rank's forward/backward passes of a step.

        Data parallel: its ``share``, every pass counted. ``lockstep`` (FSDP, where each pass is a
        collective): the micro-batches longest first, dealt round-robin, so pass i of every rank is
        the i-th group of similar sizes, and a rank left short in the last round runs the step's
        smallest micro-batch again with zero weight: every rank runs the same number of passes.
        """
        if not lockstep:
            return [(mb, True) for mb in self.share(micro)]
        ordered = sorted(micro, key=lambda m: m.num_tokens, reverse=True)
        rounds = -(-len(ordered) // self.size)
        return [
            (ordered[i], True) if i < len(ordered) else (ordered[-1], False)
            for i in range(self.rank, rounds * self.size, self.size)
        ]

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


def shard_model(root: torch.nn.Module, layers: Sequence[torch.nn.Module], device: str) -> None:
    """FSDP2 over every rank of the process group: one group per decoder layer, then ``root`` (what
    is left: the embeddings, the final norm, the output embedding), in place.

    Mixed precision: every weight computes in the dtype it is stored in (no ``param_dtype``): the
    frozen base in the config's ``dtype`` (it needs no float32 master copy, so it is stored and
    sharded as it computes), the LoRA weights in float32 as peft keeps them: the arithmetic of one
    process. Gradients are reduced in float32, summed, not averaged: ``set_gradient_divide_factor(1)``
    alone would reduce-scatter with NCCL's ``PREMUL_SUM``, which gloo refuses ("Cannot use
    ReduceOp.PREMUL_SUM with Gloo", torch 2.13 ``_fsdp_collectives._get_gradient_divide_factors``);
    forcing sum-only collectives gives a plain SUM, then a division by 1, skipped, on every backend.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device, (torch.distributed.get_world_size(),))
    precision = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=precision)
    fully_shard(root, mesh=mesh, mp_policy=precision)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def gathered(value: Any) -> Any:
    """``value`` (a state dict, nested) with every DTensor gathered whole and every tensor copied onto
    the CPU. A collective when it holds DTensors: every rank calls it on the same structure."""
    if isinstance(value, dict):
        return {k: gathered(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(gathered(v) for v in value)
    if isinstance(value, DTensor):
        return value.full_tensor().detach().cpu()
    if isinstance(value, Tensor):
        return value.detach().cpu().clone()
    return value


def shard_like(full: Tensor, param: Tensor) -> Tensor:
    """This rank's shard of ``full`` laid out as the DTensor ``param``, cut locally: every rank holds
    ``full``, so nothing is sent (``src_data_rank=None``) and any rank may load alone."""
    assert isinstance(param, DTensor)
    local = full.to(device=param.device, dtype=param.dtype)
    return distribute_tensor(local, param.device_mesh, param.placements, src_data_rank=None)


def sharded_optimizer_state(state: dict[str, Any], params: Sequence[Tensor]) -> dict[str, Any]:
    """A whole optimizer state dict (as one process saves it) with each per-parameter tensor cut to
    this rank's shard of its parameter (``params`` in the optimizer's order), ready to load."""
    shards: dict[Any, dict[str, Any]] = {}
    for index, entry in state["state"].items():
        param = params[int(index)]
        shards[index] = {
            key: (shard_like(value, param) if value.shape == param.shape else value.clone())
            if isinstance(value, Tensor)
            else value
            for key, value in entry.items()
        }
    return {**state, "state": shards}
