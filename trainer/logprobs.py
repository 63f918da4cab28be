"""Log-probabilities of chosen tokens without a full-vocabulary log-softmax for the whole batch.

For N selected positions with hidden states h (N, H), output embedding W (V, H), target ids y and
per-row temperature tau, this computes ``log softmax(h W^T / tau)[y]`` and the entropy of that
distribution, ``rows`` positions at a time: at most rows x V logits exist at once, in forward and
in backward (which recomputes each chunk's logits instead of keeping N x V of them for autograd).

Gradient: d logp_y / d z = onehot(y) - softmax(z), and z = h W^T / tau, so
``grad_h = g * (onehot(y) - p) W / tau`` per row. W is the frozen (tied) embedding, so no grad for W.
The matmul runs in the weights' dtype (bf16 logits, like vLLM's), the softmax in float32.
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
        lse = hidden.new_empty(n, dtype=torch.float32)  # (N,)
        for s in range(0, n, rows):
            e = min(s + rows, n)
            z = (hidden[s:e] @ weight.T).float() * inv_temp[s:e, None]  # (n, V)
            lse[s:e] = torch.logsumexp(z, dim=-1)
            logps[s:e] = z.gather(1, targets[s:e, None]).squeeze(1) - lse[s:e]
            p = torch.exp(z - lse[s:e, None])
            entropy[s:e] = lse[s:e] - (p * z).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, inv_temp, lse)
        ctx.rows = rows
        ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx: Any, grad_logps: Tensor, _grad_entropy: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, targets, inv_temp, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        n = hidden.shape[0]
        for s in range(0, n, ctx.rows):
            e = min(s + ctx.rows, n)
            z = (hidden[s:e] @ weight.T).float() * inv_temp[s:e, None]  # (n, V)
            g = torch.exp(z - lse[s:e, None]).mul_(-grad_logps[s:e, None])  # -g * p
            g.scatter_add_(1, targets[s:e, None], grad_logps[s:e, None])  # + g * onehot(y)
            g.mul_(inv_temp[s:e, None])
            grad_hidden[s:e] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
        return grad_hidden, None, None, None, None


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
