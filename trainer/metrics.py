"""A step's metrics, keyed like cleanrl's charts: ``reward/``, ``advantage/``, ``loss/``, ``policy/``,
``data/``, ``staleness/``, ``proxy/``, ``perf/``, ``signals/``; a warm-start step's are ``sft/`` and ``perf/``.

The names are read by the tests, the dashboard and the launcher's collapse guard (``deploy/guard.py``):
keep them. ``data/*`` adds every counter of ``DataStats`` under its own name.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from contract.client import Group
from trainer.counters import DataStats
from trainer.data import Batch, staleness
from trainer.learner import StepStats
from trainer.sample import Sample

STEP_METRICS: dict[str, str] = {
    "reward/mean": "Mean reward of the rewarded episodes of the step's groups.",
    "reward/std": "Population standard deviation of those rewards.",
    "reward/episodes": "Rewarded episodes in the step's groups.",
    "reward/pass_rate": "Share of those episodes rewarded at least ``pass_threshold``.",
    "advantage/mean": "Mean advantage of the trained groups' members.",
    "advantage/std": "Population standard deviation of those advantages.",
    "advantage/abs_mean": "Mean absolute advantage: how much signal the step carries.",
    "loss/total": "The step's loss, KL term included (its last optimizer iteration).",
    "loss/policy": "The clipped-surrogate (policy) term of the loss.",
    "loss/kl": "Mean per-token KL to the reference (the base model); 0 when ``beta`` is 0.",
    "policy/entropy": "Mean entropy (nats) of the policy's sampling distribution (truncated as sampled) at the "
    "trained tokens.",
    "policy/clip_fraction": "``policy/clip_low`` plus ``policy/clip_high``.",
    "policy/clip_low": "Share of trained tokens with negative advantage whose ratio fell below 1 - ``epsilon``.",
    "policy/clip_high": "Share of trained tokens with positive advantage whose ratio rose above 1 + ``epsilon_high``.",
    "policy/ratio_mean": "Mean ratio of the current to the old policy's probability over trained tokens.",
    "policy/is_weight_mean": "Mean importance weight (trainer / engine probability, truncated) over trained tokens.",
    "policy/is_capped_fraction": "Share of trained tokens whose importance weight reached the cap "
    "(``vllm_importance_sampling_cap``).",
    "policy/grad_norm": "Global gradient norm before clipping; not finite: the optimizer step was skipped.",
    "data/tokens_outside_truncation": "Sampled tokens outside the trainer's top-k/top-p/min-p set (boundary "
    "rounding), kept in it.",
    "data/tokens": "Tokens of the step's samples (context and completions), a prefix several samples share counted "
    "in each (``perf/tokens_computed``: what the passes computed).",
    "data/loss_tokens": "Tokens that carry loss (trained completion tokens).",
    "data/samples": "Samples (packed sequences) trained.",
    "data/members": "Group members (episodes or rewarded choices) behind the trained samples.",
    "data/episodes_trained": "Episodes with at least one trained sample.",
    "data/calls_trained": "Calls of those episodes.",
    "data/micro_batches": "Packed micro-batches: forward and backward passes per optimizer iteration.",
    "data/groups_trained": "Groups that produced samples.",
    "data/groups_skipped_equal": "Groups skipped because every compared reward (or return) was equal: no signal.",
    "data/groups_skipped_shaping_only": "Groups skipped with equal outcomes whose per-turn returns differ by "
    "shaping alone (``shaping: gated``).",
    "data/groups_skipped_few": "Groups skipped with fewer members than GRPO compares.",
    "data/groups_skipped_empty": "Groups skipped with nothing trainable.",
    "data/groups_skipped_late": "Late groups skipped past ``late_max_versions`` or ``late_max_age_s``.",
    "data/groups_late": "Late groups (a late reward, or older than the staleness bound or ``late_after_s``) kept "
    "for training under the bounded importance weight.",
    "staleness/mean": "Mean policy versions a trained sample's oldest call lags the current version.",
    "staleness/max": "The largest such lag.",
    "proxy/policy_version": "The proxy's current policy version when the step's groups were claimed.",
    "proxy/stale_groups": "Groups the proxy dropped as stale while this step's groups were claimed.",
    "perf/step_s": "Seconds of the learner's step (forward, backward and optimizer passes).",
    "perf/tokens_per_s": "``data/tokens`` per second of ``perf/step_s``: trained tokens, shared ones counted per "
    "sample.",
    "perf/tokens_computed": "Tokens of the step's packed micro-batches: what the forward passes computed, a prefix "
    "shared within a micro-batch once (``shared_prefix``).",
    "perf/tokens_unshared": "Tokens of the step's samples, a shared prefix counted in each (``data/tokens``).",
    "perf/shared_share": "1 - ``perf/tokens_computed`` / ``perf/tokens_unshared``: the share of the samples' "
    "tokens not computed because they shared a prefix (0: none).",
    "perf/wait_s": "Seconds spent waiting for and claiming the step's groups.",
    "sft/loss": "Warm start (``warmstart.py``): the step's mean negative log-likelihood (nats) of its trained tokens.",
    "sft/tokens_trained": "Warm start: tokens trained (the assistant's completions), what ``sft/loss`` averages over.",
    "sft/tokens": "Warm start: tokens of the step's samples (context included), a shared prefix counted in each.",
    "sft/episodes": "Warm start: selected episodes the step trained on.",
    "sft/samples_trained": "Warm start: samples (packed sequences) the step trained on.",
    "sft/samples_rerendered": "Warm start: those holding another model's (a teacher's) calls re-rendered with the "
    "student's chat template.",
    "sft/micro_batches": "Warm start: packed micro-batches (forward and backward passes) of the step.",
    "sft/grad_norm": "Warm start: global gradient norm before clipping; not finite: no update.",
    "sft/entropy": "Warm start: mean entropy (nats) of the policy at the trained tokens.",
    "sft/learning_rate": "Warm start: its AdamW learning rate (``warm_start_learning_rate``).",
    "signals/cut_fraction": "Answered choices that ended at the token limit (``finish_reason: length``); "
    "None: no choice.",
    "signals/tool_call_missing": "Choices of calls that required a tool call (``tool_choice`` required or "
    "named) but carry none; None: no such call.",
}
"""What each key that ``step_metrics`` sets by name means (``data/*`` counters and the ``perf/`` memory and
``policy/engine_logp_*`` figures are documented where they are made). ``python -m deploy.docs`` renders it
and fails when a key set here is missing or one listed here is set nowhere."""


def _stats(values: list[float]) -> tuple[float, float]:
    if not values:
        return 0.0, 0.0
    return statistics.fmean(values), statistics.pstdev(values)


def step_metrics(
    batch: Batch,
    groups: list[Group],
    stats: StepStats,
    *,
    current: int,
    stale: int,
    wait_s: float,
    pass_threshold: float,
) -> dict[str, Any]:
    """The step's metrics, keyed like cleanrl's charts (reward/, loss/, policy/, data/, perf/, proxy/)."""
    rewards = [
        float(e.reward) for g in groups for e in g.episodes or [] if e.status == "rewarded" and e.reward is not None
    ]
    reward_mean, reward_std = _stats(rewards)
    adv_mean, adv_std = _stats(batch.advantages)
    lags = staleness(batch.samples, current)
    trained = {s.episode_id for s in batch.samples}  # the report's calls per trained episode: these only
    trained_calls = sum(len(e.calls or []) for g in groups for e in g.episodes or [] if e.id in trained)
    metrics: dict[str, Any] = {
        "reward/mean": reward_mean,
        "reward/std": reward_std,
        "reward/episodes": len(rewards),
        "reward/pass_rate": sum(r >= pass_threshold for r in rewards) / len(rewards) if rewards else 0.0,
        "advantage/mean": adv_mean,
        "advantage/std": adv_std,
        "advantage/abs_mean": statistics.fmean(abs(a) for a in batch.advantages) if batch.advantages else 0.0,
        **_update_metrics(stats),
        "data/tokens_outside_truncation": stats.outside,
        "data/tokens": stats.tokens,
        "data/loss_tokens": stats.loss_tokens,
        "data/samples": len(batch.samples),
        "data/members": batch.members,
        "data/episodes_trained": len(trained),
        "data/calls_trained": trained_calls,
        "data/micro_batches": stats.micro_batches,
        "data/groups_trained": len(batch.trained),
        "data/groups_skipped_equal": batch.skipped_equal,
        "data/groups_skipped_shaping_only": batch.skipped_shaping_only,
        "data/groups_skipped_few": batch.skipped_few,
        "data/groups_skipped_empty": batch.skipped_empty,
        "data/groups_skipped_late": batch.skipped_late,
        "data/groups_late": batch.late,
        "staleness/mean": statistics.fmean(lags) if lags else 0.0,
        "staleness/max": max(lags, default=0),
        "proxy/policy_version": current,
        "proxy/stale_groups": stale,
        "perf/step_s": stats.seconds,
        "perf/tokens_per_s": stats.tokens_per_s,
        "perf/tokens_computed": stats.tokens_computed,
        "perf/tokens_unshared": stats.tokens,
        "perf/shared_share": stats.shared_share,
        "perf/wait_s": wait_s,
    }
    metrics.update({f"data/{k}": v for k, v in batch.stats.as_dict().items()})
    metrics.update(stats.engine)
    metrics.update(stats.memory)
    metrics.update(collapse_signals(groups))
    return metrics


def sft_metrics(
    stats: StepStats, counters: DataStats, samples: Sequence[Sample], *, episodes: int, learning_rate: float
) -> dict[str, Any]:
    """A warm-start step's metrics (``warmstart.py``): ``sft/`` and ``perf/``, the data counters of its
    episodes as ``sft/<counter>``, and ``phase: warm_start`` (GRPO steps carry no phase)."""
    metrics: dict[str, Any] = {
        "phase": "warm_start",
        "sft/loss": stats.loss,
        "sft/tokens_trained": stats.loss_tokens,
        "sft/tokens": stats.tokens,
        "sft/episodes": episodes,
        "sft/samples_trained": len(samples),
        "sft/samples_rerendered": sum(s.rerendered for s in samples),
        "sft/micro_batches": stats.micro_batches,
        "sft/grad_norm": stats.grad_norm,
        "sft/entropy": stats.entropy,
        "sft/learning_rate": learning_rate,
        "perf/step_s": stats.seconds,
        "perf/tokens_per_s": stats.tokens_per_s,
        "perf/tokens_computed": stats.tokens_computed,
        "perf/shared_share": stats.shared_share,
    }
    metrics.update({f"sft/{k}": v for k, v in counters.as_dict().items()})
    metrics.update(stats.memory)
    return metrics


def _update_metrics(stats: StepStats) -> dict[str, float]:
    """The optimizer step's ``loss/`` and ``policy/`` charts (the learner's statistics)."""
    return {
        "loss/total": stats.loss,
        "loss/policy": stats.policy_loss,
        "loss/kl": stats.kl,
        "policy/entropy": stats.entropy,
        "policy/clip_fraction": stats.clip_low + stats.clip_high,
        "policy/clip_low": stats.clip_low,
        "policy/clip_high": stats.clip_high,
        "policy/ratio_mean": stats.ratio,
        "policy/is_weight_mean": stats.is_weight,
        "policy/is_capped_fraction": stats.is_capped,
        "policy/grad_norm": stats.grad_norm,
    }


def collapse_signals(groups: list[Group]) -> dict[str, float | None]:
    """What a collapsing policy shows first in its own samples (issue 28: whitespace-filled tool calls
    cut at ``max_tokens``), over the answered choices of the step's groups; None: nothing to count.

    ``signals/cut_fraction``: choices that ended at the token limit (``finish_reason: length``);
    ``signals/tool_call_missing``: choices of calls that required a tool call (``tool_choice``
    required or named) and carry none, the agent's call validity as the proxy sees it.
    """
    choices = cut = required = missing = 0
    for group in groups:
        for episode in group.episodes or []:
            for call in episode.calls or []:
                if call.status_code != 200:
                    continue
                forced = call.request.get("tool_choice") == "required" or isinstance(
                    call.request.get("tool_choice"), dict
                )
                for choice in call.choices:
                    choices += 1
                    cut += choice.get("finish_reason") == "length"
                    required += forced
                    missing += forced and not choice.get("tool_calls")
    return {
        "signals/cut_fraction": cut / choices if choices else None,
        "signals/tool_call_missing": missing / required if required else None,
    }
