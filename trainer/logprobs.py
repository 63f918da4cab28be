"""Log-probabilities of chosen tokens without a full-vocabulary log-softmax for the whole batch.

For N selected positions with hidden states h (N, H), output embedding W (V, H), target ids y and
per-row temperature tau, this computes ``log softmax(h W^T / tau)[y]`` and the entropy of that
distribution, ``rows`` positions at a time: at most rows x V logits exist at once, in forward and
in backward (which recomputes each chunk's logits instead of keeping N x V of them for autograd).

Gradient: d logp_y / d z = onehot(y) - softmax(z), and z = h W^T / tau, so
``d logp / d h = (onehot(y) - p) W / tau``, an H-vector per row that the forward pass computes
while it holds the chunk's probabilities; backward only scales it by the incoming gradient. So
neither pass keeps N x V values, and the logits are never recomputed. W is the frozen (tied)
embedding: no grad for W. The matmuls run in the weights' dtype (bf16 logits, like vLLM's), the
softmax in float32.
"""

from __future__ import annotations

from typing import Any

import torch

Tensor = torch.Tensor


class _SelectedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, inv_temp: Tensor,
                rows: int) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        logps = hidden.new_empty(n, dtype=torch.float32)  # (N,)
        entropy = hidden.new_empty(n, dtype=torch.float32)  # (N,)
        need_grad = ctx.needs_input_grad[0]
        dlogp_dh = torch.empty_like(hidden) if need_grad else None  # (N, H)
        for s in range(0, n, rows):
            e = min(s + rows, n)
            z = (hidden[s:e] @ weight.T).float() * inv_temp[s:e, None]  # (n, V)
            lse = torch.logsumexp(z, dim=-1)  # (n,)
            logps[s:e] = z.gather(1, targets[s:e, None]).squeeze(1) - lse
            p = torch.exp(z - lse[:, None])  # (n, V)
            entropy[s:e] = lse - (p * z).sum(-1)
            if dlogp_dh is not None:
                g = p.neg_().scatter_add_(1, targets[s:e, None], torch.ones_like(lse[:, None]))  # onehot - p
                g.mul_(inv_temp[s:e, None])
                dlogp_dh[s:e] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
        ctx.save_for_backward(dlogp_dh)
        ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx: Any, grad_logps: Tensor, _grad_entropy: Tensor) -> tuple[Tensor | None, ...]:
        (dlogp_dh,) = ctx.saved_tensors
        return dlogp_dh * grad_logps[:, None].to(dlogp_dh.dtype), None, None, None, None


def selected_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: Tensor,
                      rows: int = 512) -> tuple[Tensor, Tensor]:
    """(log-probs (N,) with grad to ``hidden``, entropies (N,) without) of ``targets`` under
    ``softmax(hidden @ weight.T / temperature)``, ``rows`` positions at a time."""
    if weight.requires_grad:
        raise ValueError("selected_logprobs treats the output embedding as frozen; do not train lm_head")
    inv_temp = (1.0 / temperature.float()).to(hidden.device)
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty + hidden.sum() * 0, empty  # keeps the graph connected for an empty micro-batch
    logps, entropy = _SelectedLogProbs.apply(hidden, weight, targets, inv_temp, rows)  # type: ignore[no-untyped-call]
    return logps, entropy
