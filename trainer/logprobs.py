"""Log-probabilities of chosen tokens under vLLM's sampling distribution, without N x V logits.

For N selected positions with hidden states h (N, H), output embedding W (V, H), target ids y,
per-row temperature tau and optional per-row top-k / top-p / min-p, this computes log p_K(y), the
log-probability of y under the distribution vLLM sampled from, and that distribution's entropy,
``rows`` positions at a time: at most a few rows x V buffers exist at once.

What vLLM does (vLLM v1 sampler, ``vllm/v1/sample/sampler.py`` ``Sampler.sample``, with
``--logprobs-mode processed_logprobs``), and so what this module reproduces, in this order:

0. Under a grammar (``tool_choice`` required or named, JSON formats, structural tags), the logit of
   every token the grammar forbids at that position is -inf (vLLM applies xgrammar's bitmask to
   the logits before the sampler, ``vllm/v1/structured_output``), so everything below runs on the
   allowed tokens only. The bitmask of each such row comes from ``trainer/grammar.py``.
1. Logits in float32, divided by the temperature. A temperature below 1e-5 is greedy: vLLM then
   divides by 1.0 and its request parameters reset top-k/top-p/min-p to off
   (``vllm/sampling_params.py``); we do the same, so such a row gets the plain log-softmax.
2. min-p (``vllm/v1/sample/logits_processor/builtin.py``, ``MinPLogitsProcessor``, an
   argmax-invariant logits processor run right after temperature): probs = softmax of the
   tempered logits over the whole vocabulary; tokens with ``probs < max(probs) * min_p`` are set
   to -inf. 0 means off.
3. top-k then top-p (``vllm/v1/sample/ops/topk_topp_sampler.py``, ``apply_top_k_top_p_pytorch``
   and ``apply_top_k_only``; the CPU engine has no Triton CPU backend so takes these PyTorch
   paths), on the min-p-masked logits. top-k: the k-th largest logit is the threshold and logits
   strictly below it are masked, so ties with the k-th value are all kept. ``top_k`` 0 or -1 means
   off, and so does any k >= V (the input batch stores V). top-p: the logits are sorted ascending,
   softmax-ed (after the top-k mask) and cumulatively summed in float32; a token is masked when
   the cumulative sum up to and including it is ``<= 1 - top_p``, and the largest token is always
   kept. So the kept set is the smallest set of top tokens whose mass reaches ``top_p``, the
   boundary token included; within a run of tied logits the sort order decides. 1.0 means off.
4. The recorded processed logprobs are ``log_softmax`` (float32) of those masked logits:
   ``log p_K(y) = z_y - logsumexp_K z``.

Only rows with a filter on leave the fast path (temperature only, no mask); only top-p rows sort,
top-k alone uses ``topk``, min-p is a threshold. The trainer's logits differ from the engine's by
rounding, so a token near a boundary can be kept by one and not the other: a target outside the
kept set computed here is added to it (its log-prob stays finite) and flagged in ``outside``.

Gradient: with K fixed (non-differentiable), d log p_K(y) / d z = onehot(y) - p_K with p_K the
softmax restricted to K (0 outside), and z = h W^T / tau, so ``d logp / d h = (onehot(y) - p_K) W
/ tau``, an H-vector per row that the forward pass computes while it holds the chunk's
probabilities; backward only scales it. Neither pass keeps N x V values and logits are never
recomputed. W is the frozen (tied) embedding: no grad for W. The matmuls run in the weights' dtype,
the softmax and filters in float32 as in vLLM.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from trainer.grammar import unpack

Tensor = torch.Tensor
GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: temperatures below it are greedy


@dataclass(frozen=True)
class Truncation:
    """Per-row sampling filters applied after temperature, as vLLM applies them."""

    top_k: Tensor  # (N,) int64; <= 0 means off
    top_p: Tensor  # (N,) float32; >= 1.0 means off
    min_p: Tensor  # (N,) float32; <= 0.0 means off


class LogProbs(NamedTuple):
    logps: Tensor  # (N,) float32, differentiable w.r.t. hidden
    entropy: Tensor  # (N,) float32, entropy of the (truncated) sampling distribution, no grad
    outside: Tensor  # (N,) bool: the target fell outside the kept set computed here; it was added to it


def _top_k_on(top_k: Tensor, vocab: int) -> Tensor:
    return (top_k > 0) & (top_k < vocab)


def _truncate_(z: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> None:
    """Mask ``z`` (m, V) float32 tempered logits to -inf outside vLLM's kept set, in place:
    min-p, then top-k, then top-p, each only on the rows that use it."""
    vocab = z.shape[1]
    neg_inf = float("-inf")
    use_k, use_p = _top_k_on(top_k, vocab), top_p < 1.0
    rows = (min_p > 0).nonzero().squeeze(1)
    if rows.numel():
        zr = z[rows]  # (r, V)
        probs = zr.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * min_p[rows, None]  # (r, 1)
        z[rows] = zr.masked_fill_(probs < threshold, neg_inf)
    rows = (use_k & ~use_p).nonzero().squeeze(1)  # top-k without top-p: no sort
    if rows.numel():
        zr = z[rows]  # (r, V)
        k = top_k[rows]
        kth = zr.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])  # (r, 1)
        z[rows] = zr.masked_fill_(zr < kth, neg_inf)
    rows = use_p.nonzero().squeeze(1)
    if rows.numel():
        zr = z[rows]  # (r, V)
        srt, idx = zr.sort(dim=-1, descending=False)  # (r, V) ascending
        k = torch.where(use_k[rows], top_k[rows], vocab)
        kth = srt.gather(1, (vocab - k)[:, None])  # (r, 1)
        srt.masked_fill_(srt < kth, neg_inf)
        cum = srt.softmax(dim=-1).cumsum_(dim=-1)  # (r, V)
        drop = cum <= 1 - top_p[rows, None]
        drop[:, -1] = False  # the most likely token always stays
        srt.masked_fill_(drop, neg_inf)
        z[rows] = zr.scatter_(1, idx, srt)


def _chunks(n: int, rows: int, active: Tensor | None) -> Iterator[tuple[slice | Tensor, bool]]:
    """(row selector, truncated?) per chunk: contiguous slices when no row is filtered, else the
    unfiltered rows and then the filtered ones, so filtered and unfiltered rows never share a chunk."""
    if active is None:
        for s in range(0, n, rows):
            yield slice(s, min(s + rows, n)), False
        return
    for group, truncated in (((~active).nonzero().squeeze(1), False), (active.nonzero().squeeze(1), True)):
        for s in range(0, group.numel(), rows):
            yield group[s : s + rows], truncated


class _SelectedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        inv_temp: Tensor,
        rows: int,
        active: Tensor | None,
        top_k: Tensor | None,
        top_p: Tensor | None,
        min_p: Tensor | None,
        allowed: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        n = hidden.shape[0]
        logps = hidden.new_empty(n, dtype=torch.float32)  # (N,)
        entropy = hidden.new_empty(n, dtype=torch.float32)  # (N,)
        outside = torch.zeros(n, dtype=torch.bool, device=hidden.device)  # (N,)
        need_grad = ctx.needs_input_grad[0]
        dlogp_dh = torch.empty_like(hidden) if need_grad else None  # (N, H)
        for sel, truncated in _chunks(n, rows, active):
            z = (hidden[sel] @ weight.T).float() * inv_temp[sel, None]  # (n, V)
            y = targets[sel, None]  # (n, 1)
            if truncated:
                assert top_k is not None and top_p is not None and min_p is not None
                z_y = z.gather(1, y)  # (n, 1)
                if allowed is not None:  # the grammar's mask first, as vLLM applies it before sampling
                    z.masked_fill_(~unpack(allowed[sel], z.shape[1]), float("-inf"))
                _truncate_(z, top_k[sel], top_p[sel], min_p[sel])
                outside[sel] = z.gather(1, y).squeeze(1) == float("-inf")
                z.scatter_(1, y, z_y)  # the target is always in the kept set
            lse = torch.logsumexp(z, dim=-1)  # (n,)
            logp = z.sub_(lse[:, None])  # (n, V) log p_K, in place
            logps[sel] = logp.gather(1, y).squeeze(1)
            p = logp.exp()  # (n, V), 0 outside the kept set
            if truncated:
                logp.clamp_(min=torch.finfo(logp.dtype).min)  # -inf -> finite: p * logp is 0 there, not nan
            entropy[sel] = -(p * logp).sum(-1)  # not lse - sum(p z): that cancels to ~1e-5 in float32
            if dlogp_dh is not None:
                g = p.neg_().scatter_add_(1, y, torch.ones_like(lse[:, None]))  # onehot - p
                g.mul_(inv_temp[sel, None])
                dlogp_dh[sel] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
        ctx.save_for_backward(dlogp_dh)
        ctx.mark_non_differentiable(entropy, outside)
        return logps, entropy, outside

    @staticmethod
    def backward(
        ctx: Any, grad_logps: Tensor, _grad_entropy: Tensor, _grad_outside: Tensor
    ) -> tuple[Tensor | None, ...]:
        (dlogp_dh,) = ctx.saved_tensors
        return (dlogp_dh * grad_logps[:, None].to(dlogp_dh.dtype),) + (None,) * 9


def selected_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: Tensor,
    rows: int = 512,
    truncation: Truncation | None = None,
    allowed: Tensor | None = None,
) -> LogProbs:
    """Log-probs (N,) with grad to ``hidden``, entropies (N,) and ``outside`` flags (N,) of ``targets``
    under vLLM's sampling distribution: ``softmax(hidden @ weight.T / temperature)`` restricted to the
    tokens a grammar allows (``allowed``: (N, words) int32 bitmask rows, -1 = no mask; None = no row
    masked) and that min-p, top-k and top-p keep (``truncation``; None = all off), ``rows`` positions
    at a time."""
    if weight.requires_grad:
        raise ValueError("selected_logprobs treats the output embedding as frozen; do not train lm_head")
    n, device, vocab = hidden.shape[0], hidden.device, weight.shape[0]
    temperature = temperature.to(device=device, dtype=torch.float32)
    greedy = temperature < GREEDY_EPS  # never trained, but a 0 must not become inf: vLLM uses 1.0
    inv_temp = 1.0 / torch.where(greedy, 1.0, temperature)  # (N,)
    targets = targets.to(device)
    active = top_k = top_p = min_p = None
    if truncation is None and allowed is not None:  # a mask alone: the filters are off on every row
        truncation = Truncation(top_k=torch.zeros(n, dtype=torch.int64), top_p=torch.ones(n), min_p=torch.zeros(n))
    if truncation is not None:
        top_k = truncation.top_k.to(device=device, dtype=torch.int64)
        top_p = truncation.top_p.to(device=device, dtype=torch.float32)
        min_p = truncation.min_p.to(device=device, dtype=torch.float32)
        if not top_k.shape == top_p.shape == min_p.shape == (n,):
            raise ValueError(f"truncation tensors must have shape ({n},): {top_k.shape}, {top_p.shape}, {min_p.shape}")
        active = (_top_k_on(top_k, vocab) | (top_p < 1.0) | (min_p > 0)) & ~greedy  # (N,)
        if allowed is not None:
            allowed = allowed.to(device)
            if allowed.shape[0] != n:
                raise ValueError(f"allowed must have {n} rows, got {tuple(allowed.shape)}")
            active |= (allowed != -1).any(dim=1)
        if not bool(active.any()):
            active = None  # the fast path, exactly as without truncation
    if n == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        # keeps the graph connected for an empty micro-batch
        return LogProbs(empty + hidden.sum() * 0, empty, torch.zeros(0, dtype=torch.bool, device=device))
    logps, entropy, outside = _SelectedLogProbs.apply(  # type: ignore[no-untyped-call]
        hidden, weight, targets, inv_temp, rows, active, top_k, top_p, min_p, allowed
    )
    return LogProbs(logps, entropy, outside)
