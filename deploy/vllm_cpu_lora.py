"""vLLM on the CPU with LoRA ops that cost a matmul, not a weight copy per token.

vLLM's CPU backend applies LoRA through its PyTorch fallback (``vllm/lora/ops/torch_ops/lora_ops.py``,
used by ``vllm/lora/punica_wrapper/punica_cpu.py``): for every token it gathers that token's
adapter matrices, ``weights[indices]`` of shape ``[tokens, out, in]``, then contracts them with an
``einsum``. A prefill of 1,600 tokens thus copies 1,600 rank-16 matrices per projection, 7 projections
per layer: measured here (1 thread, SmolLM2-135M shapes, ``python -m bench.vllm_cpu_lora --ops``)
61 ms for one such shrink where one matmul takes 1 ms. A served adapter then generates at a fraction
of the base model's speed, and on a 2-core machine that is the loop's rollout budget.

Here each op does one matmul per adapter present in the batch (``x[rows] @ W[slot].T``), the same
arithmetic as the einsum. Index -1 ("no LoRA", vLLM's convention, ``punica_base.py``) adds nothing,
as vLLM's Triton kernels skip it (``lora_shrink_op.py``); the PyTorch fallback instead indexes
``weights[-1]``, the last adapter slot, so a base-model request batched with adapter requests picked
up that slot's adapter once every slot was filled.

``python -m deploy.vllm_cpu_lora <vllm serve arguments>`` installs the ops and runs vLLM's OpenAI
server (``deploy/vllm.py`` starts CPU engines this way). On the CPU vLLM spawns its engine and
worker processes (its CPU platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn``), and a spawned
child imports the parent's main module as ``__mp_main__``: this module installs the ops then too,
so the worker that runs the model has them. The first call in a process logs ``LOG_LINE`` (the
engine tests look for it). ``FLYWHEEL_VLLM_LORA_OPS=vllm``
keeps vLLM's own ops (``bench/vllm_cpu_lora.py`` measures the two against each other).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice", "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice")
OPS_ENV = "FLYWHEEL_VLLM_LORA_OPS"
LOG_LINE = "flywheel grouped LoRA ops active"

logger = logging.getLogger("flywheel.vllm_cpu_lora")
_announced = False


def _announce() -> None:
    global _announced
    if not _announced:
        _announced = True
        logger.warning("%s (pid %d)", LOG_LINE, os.getpid())


def _lora(
    x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x[t] @ weights[indices[t]].T`` for every token t, in ``dtype``, and the rows that have an adapter
    (None: all of them). ``weights`` is ``[slots, out, in]`` or ``[slots, 1, out, in]``."""
    _announce()
    x = x.to(dtype)
    out_dim, in_dim = weights.shape[-2], weights.shape[-1]
    first, last = int(indices.min()), int(indices.max())
    if first == last and first >= 0:  # the usual batch: one adapter for every token
        return x @ weights[first].reshape(out_dim, in_dim).to(dtype).T, None
    result = x.new_zeros((x.shape[0], out_dim))
    for slot in torch.unique(indices).tolist():
        if slot < 0:
            continue
        rows = indices == slot
        result[rows] = x[rows] @ weights[slot].reshape(out_dim, in_dim).to(dtype).T
    return result, indices >= 0


def _write(target: torch.Tensor, values: torch.Tensor, rows: torch.Tensor | None, add: bool) -> None:
    """``target (+)= values`` on ``rows`` only (all rows when None); ``target`` may be a view."""
    if rows is None:
        if add:
            target += values
        else:
            target.copy_(values)
    elif add:
        target[rows] += values[rows]
    else:
        target[rows] = values[rows]


def bgmv_shrink(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    scaling: float = 1.0,
) -> None:
    values, rows = _lora(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    _write(output_tensor[:, : values.shape[1]], scaling * values, rows, add=False)


def bgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    add_inputs: bool = True,
) -> None:
    values, rows = _lora(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    width = min(values.shape[1], output_tensor.shape[1])  # adapter and model may pad differently
    if values.shape[0] == 1 and output_tensor.shape[0] != 1:  # one token's result for every row (as vLLM)
        if rows is None or bool(rows[0]):
            _write(output_tensor[:, :width], values[:, :width].expand(output_tensor.shape[0], width), None, add_inputs)
        return
    limit = output_tensor.shape[0]
    _write(output_tensor[:, :width], values[:limit, :width], None if rows is None else rows[:limit], add_inputs)


def bgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
) -> None:
    values, rows = _lora(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    _write(output_tensor[:, slice_offset : slice_offset + slice_size], values, rows, add_inputs)


def _per_token(lora_indices_tensor: torch.Tensor, seq_len_tensor: torch.Tensor) -> torch.Tensor:
    """Prefill metadata gives one adapter index per sequence; the bgmv ops take one per token."""
    return torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)


def sgmv_shrink(
    inputs: torch.Tensor,
    lora_a_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    b_seq_start_loc: torch.Tensor,
    seq_len_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    batches: int,
    max_seq_length: int,
    token_nums: int,
    scaling: float,
) -> None:
    bgmv_shrink(inputs, lora_a_weights, output_tensor, _per_token(lora_indices_tensor, seq_len_tensor), scaling)


def sgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    b_seq_start_loc: torch.Tensor,
    seq_len_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    batches: int,
    max_seq_length: int,
    token_nums: int,
    add_inputs: bool = False,
) -> None:
    bgmv_expand(inputs, lora_b_weights, output_tensor, _per_token(lora_indices_tensor, seq_len_tensor), add_inputs)


def sgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    b_seq_start_loc: torch.Tensor,
    seq_len_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    batches: int,
    max_seq_length: int,
    token_nums: int,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = False,
) -> None:
    indices = _per_token(lora_indices_tensor, seq_len_tensor)
    bgmv_expand_slice(inputs, lora_b_weights, output_tensor, indices, slice_offset, slice_size, add_inputs)


def _skip_without_adapters(method: Callable[..., None]) -> Callable[..., None]:
    """``method`` of vLLM's CPU LoRA wrapper, returning at once when no token of the batch has an adapter.

    vLLM's V1 runner maps every batch as a prefill (``lora_model_runner_mixin.py``), for which the
    wrapper computes ``no_lora`` (``compute_meta``: every token's index is -1), and its prefill ops
    then do nothing; but each LoRA layer still allocates its shrink buffers and walks its slices in
    Python first: four layers of 30 for every token generated. Without that, a base-model request
    decodes about 1.1x faster (SmolLM2-135M, float32, one stream, 2-core Xeon, engines with and without
    it interleaved: median 12.1 against 11.0 tok/s). A batch not mapped as a prefill (``no_lora`` not
    computed) takes the full path.
    """

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        if self.is_prefill and self.no_lora:
            return None
        return method(self, *args, **kwargs)

    return wrapper


def install() -> bool:
    """Put these ops where vLLM's CPU LoRA wrapper looks them up, and let its linear and logits LoRA
    return early in a batch without adapters; False (nothing done) when ``FLYWHEEL_VLLM_LORA_OPS=vllm``
    asks for vLLM's own."""
    if os.environ.get(OPS_ENV, "flywheel") == "vllm":
        return False
    import vllm.lora.ops.torch_ops as torch_ops
    import vllm.lora.punica_wrapper.punica_cpu as punica_cpu

    this = sys.modules[__name__]
    for name in OPS:
        setattr(torch_ops, name, getattr(this, name))
        setattr(punica_cpu, name, getattr(this, name))
    wrapper = punica_cpu.PunicaWrapperCPU
    for name in ("add_lora_linear", "add_lora_logits"):
        if not hasattr(getattr(wrapper, name), "__wrapped__"):
            setattr(wrapper, name, _skip_without_adapters(getattr(wrapper, name)))
    return True


def main() -> None:
    install()
    from vllm.entrypoints.launchers.api_server.entry import main as serve

    serve()  # type: ignore[no-untyped-call]  # vLLM leaves its entry point unannotated


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__":  # an engine or worker process vLLM spawned from main()
    install()
