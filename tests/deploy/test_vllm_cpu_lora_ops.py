"""deploy/vllm_cpu_lora.py's ops against vLLM's own PyTorch fallback, on every case the CPU wrapper calls.

Where a token has an adapter the two must agree to float32 rounding; a token with index -1 ("no
LoRA") must be left as it was (vLLM's Triton kernels skip it; its PyTorch fallback applies the
last slot, which the last test pins down as the difference).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

vllm_ops = pytest.importorskip("vllm.lora.ops.torch_ops")

from deploy import vllm_cpu_lora as ops  # noqa: E402

SLOTS, RANK, HIDDEN, WIDE = 4, 8, 48, 80
CASES = {
    "one adapter": [2] * 7,
    "two adapters": [0, 0, 3, 3, 3, 0, 1],
    "some without": [1, -1, 1, -1, -1, 2, 1],
    "none": [-1] * 7,
}


def weights(out_dim: int, in_dim: int, stacked: bool, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(SLOTS, out_dim, in_dim, generator=generator)
    return w.unsqueeze(1) if stacked else w  # vLLM stacks [slots, 1, out, in]; some callers pass 3-D


def expected(
    reference: Callable[..., Any],
    target: torch.Tensor,
    indices: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    *rest: Any,
) -> torch.Tensor:
    """vLLM's op on a copy, then rows without an adapter put back: what the Triton kernels compute."""
    result = target.clone()
    reference(x, w, result, indices, *rest)
    result[indices < 0] = target[indices < 0]
    return result


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_shrink_matches_vllm(case: str, stacked: bool) -> None:
    indices = torch.tensor(CASES[case])
    x, w = torch.randn(len(indices), HIDDEN), weights(RANK, HIDDEN, stacked)
    target = torch.full((len(indices), RANK), 7.0)
    want = expected(vllm_ops.bgmv_shrink, target, indices, x, w, 0.5)
    got = target.clone()
    ops.bgmv_shrink(x, w, got, indices, 0.5)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("add", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_expand_matches_vllm_including_a_wider_output(case: str, add: bool) -> None:
    indices = torch.tensor(CASES[case])
    x, w = torch.randn(len(indices), RANK), weights(WIDE - 5, RANK, True)
    target = torch.randn(len(indices), WIDE)  # the model pads its output wider than the adapter's
    want = expected(vllm_ops.bgmv_expand, target, indices, x, w, add)
    got = target.clone()
    ops.bgmv_expand(x, w, got, indices, add)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("add", [True, False])
def test_expand_of_one_token_fills_every_row_as_vllm_does(add: bool) -> None:
    indices, x, w = torch.tensor([1]), torch.randn(1, RANK), weights(WIDE, RANK, True)
    target = torch.randn(3, WIDE)
    want = target.clone()
    vllm_ops.bgmv_expand(x, w, want, indices, add)
    got = target.clone()
    ops.bgmv_expand(x, w, got, indices, add)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("add", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_expand_slice_writes_only_its_columns(case: str, add: bool) -> None:
    indices = torch.tensor(CASES[case])
    x, w = torch.randn(len(indices), RANK), weights(24, RANK, True)
    target = torch.randn(len(indices), WIDE)
    want = expected(vllm_ops.bgmv_expand_slice, target, indices, x, w, 30, 24, add)
    got = target.clone()
    ops.bgmv_expand_slice(x, w, got, indices, 30, 24, add)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got[:, :30], target[:, :30])
    torch.testing.assert_close(got[:, 54:], target[:, 54:])


def test_prefill_ops_spread_one_index_per_sequence_over_its_tokens() -> None:
    lengths, per_sequence = torch.tensor([3, 1, 4]), torch.tensor([2, -1, 0])
    indices = torch.repeat_interleave(per_sequence, lengths)
    starts = torch.tensor([0, 3, 4])
    meta = (starts, lengths, per_sequence, 3, 4, 8)
    x, a = torch.randn(8, HIDDEN), weights(RANK, HIDDEN, True)
    shrunk = torch.zeros(8, RANK)
    ops.sgmv_shrink(x, a, shrunk, *meta, 2.0)
    torch.testing.assert_close(shrunk, expected(vllm_ops.bgmv_shrink, torch.zeros(8, RANK), indices, x, a, 2.0))

    b, target = weights(WIDE, RANK, True, seed=1), torch.randn(8, WIDE)
    got = target.clone()
    ops.sgmv_expand(shrunk, b, got, *meta, True)
    torch.testing.assert_close(got, expected(vllm_ops.bgmv_expand, target, indices, shrunk, b, True))

    got = target.clone()
    ops.sgmv_expand_slice(shrunk, weights(16, RANK, True), got, *meta, 8, 16, False)
    want = expected(vllm_ops.bgmv_expand_slice, target, indices, shrunk, weights(16, RANK, True), 8, 16, False)
    torch.testing.assert_close(got, want)


def test_a_token_without_an_adapter_is_untouched_where_vllms_fallback_applies_the_last_slot() -> None:
    indices, x, w = torch.tensor([-1, 0]), torch.randn(2, RANK), weights(WIDE, RANK, True)
    target = torch.zeros(2, WIDE)
    theirs = target.clone()
    vllm_ops.bgmv_expand(x, w, theirs, indices, True)
    torch.testing.assert_close(theirs[0], x[0] @ w[SLOTS - 1, 0].T)  # the bug this module fixes
    ours = target.clone()
    ops.bgmv_expand(x, w, ours, indices, True)
    assert torch.count_nonzero(ours[0]) == 0 and torch.count_nonzero(ours[1]) > 0


def test_install_puts_the_ops_where_the_cpu_wrapper_calls_them(monkeypatch: pytest.MonkeyPatch) -> None:
    punica_cpu = pytest.importorskip("vllm.lora.punica_wrapper.punica_cpu")
    for name in ops.OPS:
        monkeypatch.setattr(punica_cpu, name, getattr(punica_cpu, name))  # restored after the test
        monkeypatch.setattr(vllm_ops, name, getattr(vllm_ops, name))
    monkeypatch.setenv(ops.OPS_ENV, "vllm")
    assert not ops.install() and punica_cpu.bgmv_shrink is vllm_ops.lora_ops.bgmv_shrink
    for name in ("add_lora_linear", "add_lora_logits"):
        monkeypatch.setattr(punica_cpu.PunicaWrapperCPU, name, getattr(punica_cpu.PunicaWrapperCPU, name))
    monkeypatch.delenv(ops.OPS_ENV)
    assert ops.install() and ops.install()  # a second install wraps nothing twice
    assert all(getattr(punica_cpu, name) is getattr(ops, name) for name in ops.OPS)
    for name in ("add_lora_linear", "add_lora_logits"):
        method = getattr(punica_cpu.PunicaWrapperCPU, name)
        assert not hasattr(method.__wrapped__, "__wrapped__")


def test_the_lora_layers_return_at_once_only_in_a_batch_mapped_without_adapters() -> None:
    calls: list[tuple[Any, ...]] = []

    def add_lora_linear(self: Any, *args: Any) -> None:
        calls.append(args)

    wrapped = ops._skip_without_adapters(add_lora_linear)
    assert wrapped(SimpleNamespace(is_prefill=True, no_lora=True), "base only") is None
    wrapped(SimpleNamespace(is_prefill=True, no_lora=False), "an adapter")
    wrapped(SimpleNamespace(is_prefill=False, no_lora=True), "no_lora not computed for a decode mapping")
    assert calls == [("an adapter",), ("no_lora not computed for a decode mapping",)]
