"""The GRPO family of losses as pure tensor functions (no model, no I/O), as TRL's GRPOTrainer defines them.

Shapes: B sequences, T token positions (padded; ``mask`` is 1 on tokens the policy sampled).
Log-probs are per token. One step's sequences may be split into micro-batches: the aggregation
normalisers (``Totals``) are those of the whole step, so summing the micro-batch losses gives the
loss of the full batch, whatever the packing.

    advantages       A_i = (R_i - mean(R_group)) / (std + 1e-4)   std of the group or the batch; none: no division
    ratio            r = exp(logp - old_logp)                     per token, or exp(mean log-ratio) per sequence (GSPO)
    clipped_ratio    clip(r, 1 - epsilon, 1 + epsilon_high)
    per_token_loss   -min(r * A, clipped_ratio * A) * w + beta * per_token_kl
    w                min(exp(old_logp - engine_logp), cap)        truncated importance sampling (or 0 above cap)
    per_token_kl     exp(ref - logp) - (ref - logp) - 1           k3 estimator, http://joschu.net/blog/kl-approx.html

The warm start's supervised loss (``sft_loss``) lives here too: the mean negative log-likelihood of
the trained tokens, over the same packed tables, normalised by the same ``Totals``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainer.config import CorrectionMode, ImportanceLevel, LossType, ScaleRewards

Tensor = torch.Tensor
EPS_STD = 1e-4
"""Added to the reward std before dividing (TRL's constant)."""


def group_advantages(
    rewards: Sequence[Tensor], scale: ScaleRewards, *, batch_values: Tensor | None = None
) -> list[Tensor]:
    """Per-group advantages: reward minus the group mean, scaled by a std (unbiased, as torch.std).

    ``batch`` divides by the std of ``batch_values``: every reward of the step, equal-reward groups
    included, as TRL does (default: the concatenated ``rewards``).
    """
    centred = [r - r.mean() for r in rewards]  # (G_i,) each
    if scale == "none":
        return centred
    if scale == "batch":
        std = (batch_values if batch_values is not None else torch.cat(list(rewards))).std()
        return [c / (std + EPS_STD) for c in centred]
    return [c / (r.std() + EPS_STD) for c, r in zip(centred, rewards, strict=True)]


def per_token_kl(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """k3 estimate of KL(pi || ref) per token: exp(ref - logp) - (ref - logp) - 1 >= 0.  # (B, T)"""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def importance_ratio(logps: Tensor, old_logps: Tensor, mask: Tensor, level: ImportanceLevel) -> Tensor:
    """pi_theta / pi_old per token, or GSPO's exp(mean log-ratio) per sequence broadcast to its tokens."""
    log_ratio = logps - old_logps  # (B, T)
    if level == "sequence":
        log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
    return torch.exp(log_ratio).expand_as(logps)  # (B, T)


def truncated_importance_weights(
    old_logps: Tensor, behaviour_logps: Tensor, mask: Tensor, *, cap: float, mode: CorrectionMode
) -> tuple[Tensor, Tensor]:
    """Weights pi_old / pi_engine correcting for sampling by the engine (a stale or numerically
    different policy). NaN engine log-probs (unknown) give weight 1. Returns (weights (B, T),
    capped (B, T) bool: where the cap truncated or masked)."""
    diff = torch.nan_to_num((old_logps - behaviour_logps) * mask, nan=0.0)  # (B, T)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True).expand_as(old_logps)  # (B, T): one weight per sequence
    weights = torch.exp(diff)
    capped = (weights > cap) & mask.bool()
    if mode.endswith("truncate"):
        return weights.clamp(max=cap), capped
    return torch.where(weights > cap, torch.zeros_like(weights), weights), capped


@dataclass(frozen=True)
class Totals:
    """Normalisers of a whole step (all micro-batches)."""

    sequences: int
    """Sequences the per-sequence losses average over: group members (episodes) under per-episode
    normalisation, else samples."""
    tokens: int
    micro_batches: int
    max_completion_length: int


def aggregate(
    per_token_loss: Tensor, mask: Tensor, loss_type: LossType, totals: Totals, seq_tokens: Tensor | None = None
) -> Tensor:
    """Reduce per-token losses to this micro-batch's share of the step loss.

    ``seq_tokens`` (B,): what each row's token sum divides by under ``grpo``. Per-episode
    normalisation passes the loss tokens of the row's whole episode, so an episode split into k
    samples contributes one per-episode mean, not k per-sample means (default: the row's own tokens).
    """
    masked = per_token_loss * mask  # (B, T)
    if loss_type == "grpo":
        denominator = mask.sum(-1) if seq_tokens is None else seq_tokens.to(mask.dtype)  # (B,)
        per_sequence = masked.sum(-1) / denominator.clamp(min=1)  # (B,)
        return per_sequence.sum() / totals.sequences
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1) / totals.micro_batches
    if loss_type == "dr_grpo":
        return masked.sum() / (totals.sequences * totals.max_completion_length)
    if loss_type == "dapo":
        return masked.sum() / max(totals.tokens, 1)
    raise ValueError(f"unknown loss_type {loss_type!r}")


def sft_loss(logps: Tensor, mask: Tensor, *, totals: Totals) -> Tensor:
    """Supervised fine-tuning (the warm start, ``trainer/warmstart.py``): this micro-batch's share of
    the step's mean negative log-likelihood of its trained tokens, -sum(mask * logp) / totals.tokens.

    logps (B, T) with grad, the policy's plain log-probs (temperature 1, no filter, no grammar mask:
    the warm start's samples carry none); mask (B, T), 1 on the assistant tokens trained. The
    normaliser is the trained tokens of the whole step, DAPO's token-level mean (``aggregate``'s
    ``dapo``; Yu et al. 2025): every trained token weighs the same whatever the length of its
    sequence, and the micro-batches' shares sum to the step's mean whatever the packing. It is the
    cross-entropy TRL's SFTTrainer minimises with ``completion_only_loss`` (mean over the completion
    tokens of the batch, Hugging Face's ``ForCausalLMLoss``), taken over the whole step. Its gradient is
    GRPO's with every advantage 1, ratio 1 and no clipping or importance weight.
    """
    mask = mask.to(logps.dtype)
    return -(logps * mask).sum() / max(totals.tokens, 1)


@dataclass
class LossOut:
    loss: Tensor
    """Scalar with gradient: this micro-batch's share of the step loss."""
    policy_loss: Tensor
    kl: Tensor
    """Summed masked per-token KL (divide by tokens for the mean); 0 when beta is 0."""
    clipped_low: Tensor
    clipped_high: Tensor
    """Counts of tokens where the lower / upper clip bound was active (the gradient is cut)."""
    is_capped: Tensor
    is_weight_sum: Tensor
    ratio_sum: Tensor


def grpo_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    totals: Totals,
    loss_type: LossType,
    epsilon: float,
    epsilon_high: float,
    beta: float = 0.0,
    ref_logps: Tensor | None = None,
    behaviour_logps: Tensor | None = None,
    is_cap: float = 3.0,
    is_mode: CorrectionMode = "token_truncate",
    level: ImportanceLevel = "token",
    seq_tokens: Tensor | None = None,
) -> LossOut:
    """Clipped surrogate with optional KL and truncated importance weights.

    logps (B, T) with grad; old_logps (B, T) detached (the policy before this step's updates);
    advantages (B,) per sequence or (B, T) per token (per-turn credit); mask (B, T) float;
    behaviour_logps (B, T) the engine's, NaN where unknown; seq_tokens (B,) see ``aggregate``.
    """
    mask = mask.to(logps.dtype)
    ratio = importance_ratio(logps, old_logps, mask, level)  # (B, T)
    clipped_ratio = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)  # (B, T)
    adv = advantages.to(logps.dtype)
    adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv  # (B, 1) or (B, T)
    per_token_loss = -torch.min(ratio * adv, clipped_ratio * adv)  # (B, T)
    if behaviour_logps is not None:
        weights, capped = truncated_importance_weights(
            old_logps.detach(), behaviour_logps, mask, cap=is_cap, mode=is_mode
        )
        per_token_loss = per_token_loss * weights
    else:
        weights, capped = torch.ones_like(logps), torch.zeros_like(mask, dtype=torch.bool)
    policy_part = aggregate(per_token_loss, mask, loss_type, totals, seq_tokens)
    kl_sum = torch.zeros((), dtype=logps.dtype)
    loss = policy_part
    if beta > 0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs ref_logps (the reference policy's log-probs)")
        kl = per_token_kl(logps, ref_logps)  # (B, T)
        loss = aggregate(per_token_loss + beta * kl, mask, loss_type, totals, seq_tokens)
        kl_sum = (kl * mask).sum().detach()
    with torch.no_grad():
        on = mask.bool()
        low = (ratio < 1 - epsilon) & (adv < 0) & on
        high = (ratio > 1 + epsilon_high) & (adv > 0) & on
        return LossOut(
            loss=loss,
            policy_loss=policy_part.detach(),
            kl=kl_sum,
            clipped_low=low.sum(),
            clipped_high=high.sum(),
            is_capped=capped.sum(),
            is_weight_sum=(weights * mask).sum(),
            ratio_sum=(ratio * mask).sum(),
        )
