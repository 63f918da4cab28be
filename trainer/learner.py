"""One optimizer step on a batch of samples: pack, forward, loss, backward, clip, AdamW.

Kept apart from the loop (no HTTP, no files) so a test or a benchmark can drive a real step on
hand-made samples. With ``num_iterations == 1`` the 'old' log-probs are the current ones detached,
taken from the same forward pass (TRL computes them in a separate no-grad pass when correcting
against vLLM's log-probs); with more iterations they are computed once, before the first update.

Engine mismatch. Every step compares the trainer's log-prob of each sampled token under the policy
version that *served* it with vLLM's recorded (processed) log-prob, per sampling mode
(``policy/engine_logp_*``). Tokens of the version the current weights were published as are
compared on the training pass itself; tokens of older versions are re-scored (no grad) under that
version's adapter, kept in memory since it was published, on up to ``engine_logp_check_samples``
samples. This separates numeric mismatch (it should be ~0 in float32) from staleness, which is
reported apart (``policy/stale_logp_diff_mean``: current weights vs the engine on older tokens).
When nothing could be compared the figures are None ("unknown"), never 0.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from trainer.config import TrainerConfig
from trainer.distributed import World
from trainer.lora import LoraPolicy
from trainer.loss import Totals, grpo_loss
from trainer.packing import MicroBatch, pack
from trainer.sample import MODES, Sample

Tensor = torch.Tensor
ENGINE_GROUPS = (*MODES, "all")
"""Engine-mismatch figures per trained sampling mode, and over all of them."""
SUMS = (
    "loss",
    "policy_loss",
    "kl",
    "entropy",
    "clip_low",
    "clip_high",
    "is_weight",
    "is_capped",
    "ratio",
    "outside",
    "stale_diff",
    "stale_n",
    *(f"engine_{g}_{k}" for g in ENGINE_GROUPS for k in ("sum", "n", "above")),
)
"""The statistics a step sums over micro-batches (and over ranks)."""
MAXES = tuple(f"engine_{g}_max" for g in ENGINE_GROUPS)
KEEP_SNAPSHOTS = 4
"""Adapter states kept in memory for re-scoring stale samples (versions further back are rare)."""


@dataclass
class EpisodeGap:
    """|trainer - engine| log-prob over an episode's compared tokens (nats)."""

    total: float = 0.0
    tokens: int = 0
    max: float = 0.0

    @property
    def mean(self) -> float | None:
        return self.total / self.tokens if self.tokens else None


@dataclass
class StepStats:
    loss: float = 0.0
    policy_loss: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0
    clip_low: float = 0.0
    clip_high: float = 0.0
    is_weight: float = 0.0
    is_capped: float = 0.0
    ratio: float = 0.0
    grad_norm: float = 0.0
    tokens: int = 0
    loss_tokens: int = 0
    sequences: int = 0
    micro_batches: int = 0
    seconds: float = 0.0
    engine: dict[str, float | None] = field(default_factory=dict)
    """``policy/engine_logp_*`` figures (None: unknown) and the staleness gap."""
    outside: int = 0
    """Sampled tokens outside the trainer's top-k/top-p/min-p set (boundary rounding), kept in it."""
    sums: dict[str, float] = field(default_factory=dict, repr=False)
    episode_gaps: dict[str, EpisodeGap] = field(default_factory=dict, repr=False)
    """Engine mismatch per episode (the tokens compared above): the episode's fidelity audit."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def finite(self) -> bool:
        """False when the gradient was NaN or infinite: the optimizer step was skipped."""
        return math.isfinite(self.grad_norm)


class Learner:
    def __init__(self, policy: LoraPolicy, config: TrainerConfig, world: World | None = None) -> None:
        self.policy = policy
        self.config = config
        self.world = world or World()
        self.optimizer = torch.optim.AdamW(
            list(policy.parameters()),
            lr=config.learning_rate,
            betas=(config.adam_beta1, config.adam_beta2),
            weight_decay=config.weight_decay,
        )
        self.snapshots: OrderedDict[int, dict[str, Tensor]] = OrderedDict()
        """Adapter states by the policy version they were published as (the newest is the weights')."""
        self.weights_version: int | None = None
        """The version the current weights were published as; None once a step changed them unpublished."""
        self._gaps: dict[str, EpisodeGap] = {}
        """The running step's engine mismatch per episode."""

    def remember(self, version: int, state: dict[str, Tensor] | None = None) -> None:
        """The current weights are now served as ``version`` (just published, or resumed from it)."""
        self.snapshots[version] = _copy(state if state is not None else self.policy.adapter_state())
        self.snapshots.move_to_end(version)
        while len(self.snapshots) > KEEP_SNAPSHOTS:
            self.snapshots.popitem(last=False)
        self.weights_version = version

    def _old_logps(self, micro: Sequence[MicroBatch]) -> list[Tensor | None]:
        if self.config.num_iterations == 1:
            return [None] * len(micro)
        with torch.no_grad():
            return [mb.table(self.policy.logprobs(mb).logps) for mb in micro]

    def step(self, samples: Sequence[Sample], *, sequences: int | None = None) -> StepStats:
        """Train on ``samples`` (advantages set): ``num_iterations`` optimizer steps, one pass each.

        ``sequences``: what per-sequence losses average over; by default the distinct group members
        of the samples under ``normalize_per_episode``, else the samples. Under data parallelism
        every rank gets all of the step's samples and works on its share of the micro-batches; the
        totals that normalise the loss are the whole step's.
        """
        if not samples:
            raise ValueError("no samples to train on")
        cfg = self.config
        started = time.perf_counter()
        micro = pack(samples, cfg.micro_batch_tokens)
        if sequences is None:  # every rank derives it from the samples alone (followers get no Batch)
            sequences = (
                len({s.member or str(i) for i, s in enumerate(samples)}) if cfg.normalize_per_episode else len(samples)
            )
        totals = Totals(
            sequences=sequences,
            tokens=sum(mb.num_loss_tokens for mb in micro),
            micro_batches=len(micro),
            max_completion_length=cfg.max_completion_length,
        )
        mine = self.world.share(micro)
        sums: dict[str, float] = {}
        maxes: dict[str, float] = {}
        self._gaps = {}
        if self.world.leader:
            self._check_stale(samples, sums, maxes)
        olds = self._old_logps(mine)
        first: dict[str, float] = {}
        reduced: dict[str, float] = {}
        for iteration in range(cfg.num_iterations):
            step_sums = dict(sums) if iteration == 0 else {}
            for mb, old in zip(mine, olds, strict=True):
                self._accumulate(mb, old, totals, step_sums, maxes if iteration == 0 else {})
            self.world.sum_gradients(self.policy.parameters())
            reduced = self.world.sum_values(step_sums, SUMS, self.policy.device)
            reduced["grad_norm"] = self._apply()
            if iteration == 0:
                first = reduced
        maxes = self.world.max_values(maxes, MAXES, self.policy.device)
        stats = _summarise(
            reduced,
            first,
            maxes,
            totals,
            tokens=sum(mb.num_tokens for mb in micro),
            tolerance=cfg.engine_logp_tolerance,
        )
        stats.seconds = time.perf_counter() - started
        stats.episode_gaps = self._gaps  # this rank's share under data parallelism (the leader's is reported)
        if stats.finite:
            self.weights_version = None  # the weights moved: no served version holds them until published
        return stats

    def _accumulate(
        self, mb: MicroBatch, old: Tensor | None, totals: Totals, sums: dict[str, float], maxes: dict[str, float]
    ) -> None:
        cfg = self.config
        out = self.policy.logprobs(mb)
        logps = mb.table(out.logps)  # (B, T)
        old_logps = logps.detach() if old is None else old
        ref_logps = mb.table(self.policy.logprobs(mb, reference=True).logps) if cfg.beta > 0 else None
        behaviour = mb.behaviour_logps if cfg.vllm_importance_sampling_correction else None
        loss = grpo_loss(
            logps,
            old_logps,
            mb.advantages,
            mb.mask,
            totals=totals,
            loss_type=cfg.loss_type,
            epsilon=cfg.epsilon,
            epsilon_high=cfg.epsilon_upper,
            beta=cfg.beta,
            ref_logps=ref_logps,
            behaviour_logps=behaviour,
            is_cap=cfg.vllm_importance_sampling_cap,
            is_mode=cfg.vllm_importance_sampling_mode,
            level=cfg.importance_sampling_level,
            seq_tokens=mb.seq_tokens,
        )
        loss.loss.backward()  # type: ignore[no-untyped-call]
        for key, value in (
            ("loss", loss.loss),
            ("policy_loss", loss.policy_loss),
            ("kl", loss.kl),
            ("entropy", out.entropy.sum()),
            ("clip_low", loss.clipped_low),
            ("clip_high", loss.clipped_high),
            ("is_weight", loss.is_weight_sum),
            ("is_capped", loss.is_capped),
            ("ratio", loss.ratio_sum),
            ("outside", out.outside.sum()),
        ):
            sums[key] = sums.get(key, 0.0) + float(value.detach())
        if old is not None:
            return  # a second iteration's weights are no served version
        trainer = out.logps.detach()  # (N,)
        engine = mb.behaviour_logps[mb.rows, mb.cols]  # (N,)
        fresh = mb.versions == self.weights_version if self.weights_version is not None else None
        if fresh is not None:
            _engine_gap(trainer, engine, mb.modes, fresh, cfg.engine_logp_tolerance, sums, maxes)
            _episode_gaps(mb, trainer, engine, fresh, self._gaps)
        stale = (mb.versions >= 0) & ~torch.isnan(engine)
        if fresh is not None:
            stale &= ~fresh
        sums["stale_diff"] = sums.get("stale_diff", 0.0) + float((trainer - engine).abs()[stale].sum())
        sums["stale_n"] = sums.get("stale_n", 0.0) + float(stale.sum())

    @torch.no_grad()
    def _check_stale(self, samples: Sequence[Sample], sums: dict[str, float], maxes: dict[str, float]) -> None:
        """Re-score tokens of older versions under the adapter that served them (a bounded sample)."""
        limit = self.config.engine_logp_check_samples
        by_version: dict[int, list[Sample]] = {}
        for sample in samples:
            for version in sorted({v for v in sample.versions or () if v >= 0 and v != self.weights_version}):
                if version == 0 or version in self.snapshots:
                    chosen = by_version.setdefault(version, [])
                    if len(chosen) < limit:
                        chosen.append(sample)
        if not by_version:
            return
        current = _copy(self.policy.adapter_state())  # on the CPU the state shares the parameters' storage
        try:
            for version, chosen in sorted(by_version.items()):
                if version != 0:
                    self.policy.load_adapter_state(self.snapshots[version])
                for mb in pack(chosen, self.config.micro_batch_tokens):
                    out = self.policy.logprobs(mb, reference=version == 0)
                    engine = mb.behaviour_logps[mb.rows, mb.cols]
                    served = mb.versions == version
                    _engine_gap(out.logps, engine, mb.modes, served, self.config.engine_logp_tolerance, sums, maxes)
                    _episode_gaps(mb, out.logps, engine, served, self._gaps)
        finally:
            self.policy.load_adapter_state(current)

    def _apply(self) -> float:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm


def _copy(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A state that later in-place updates of the parameters (AdamW, a swap) cannot change."""
    return {k: v.clone() for k, v in state.items()}


def _engine_gap(
    trainer: Tensor,
    engine: Tensor,
    modes: Tensor,
    served: Tensor,
    tolerance: float,
    sums: dict[str, float],
    maxes: dict[str, float],
) -> None:
    """Add |trainer - engine| of the tokens ``served`` by the scored version, per mode, to the sums."""
    known = served & ~torch.isnan(engine)  # (N,)
    diff = (trainer - engine).abs()  # (N,)
    for name, rows in ((m, known & (modes == i)) for i, m in enumerate(MODES)):
        _add(name, diff[rows], tolerance, sums, maxes)
    _add("all", diff[known], tolerance, sums, maxes)


def _episode_gaps(mb: MicroBatch, trainer: Tensor, engine: Tensor, served: Tensor, gaps: dict[str, EpisodeGap]) -> None:
    """Add the compared tokens' |trainer - engine| to their episodes' gaps."""
    known = served & ~torch.isnan(engine)
    if not bool(known.any()):
        return
    diff = (trainer - engine).abs()[known]
    rows = mb.rows[known]
    for row in torch.unique(rows).tolist():
        mine = diff[rows == row]
        gap = gaps.setdefault(mb.samples[row].episode_id, EpisodeGap())
        gap.total += float(mine.sum())
        gap.tokens += int(mine.numel())
        gap.max = max(gap.max, float(mine.max()))


def _add(group: str, diff: Tensor, tolerance: float, sums: dict[str, float], maxes: dict[str, float]) -> None:
    if diff.numel() == 0:
        return
    for key, value in (
        ("sum", float(diff.sum())),
        ("n", float(diff.numel())),
        ("above", float((diff > tolerance).sum())),
    ):
        sums[f"engine_{group}_{key}"] = sums.get(f"engine_{group}_{key}", 0.0) + value
    maxes[f"engine_{group}_max"] = max(maxes.get(f"engine_{group}_max", 0.0), float(diff.max()))


def _engine_figures(sums: dict[str, float], maxes: dict[str, float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for group in ENGINE_GROUPS:
        n = sums.get(f"engine_{group}_n", 0.0)
        suffix = "" if group == "all" else f"_{group}"
        out[f"policy/engine_logp_diff_mean{suffix}"] = sums[f"engine_{group}_sum"] / n if n else None
        out[f"policy/engine_logp_diff_max{suffix}"] = maxes.get(f"engine_{group}_max") if n else None
        out[f"policy/engine_logp_frac_above{suffix}"] = sums[f"engine_{group}_above"] / n if n else None
        out[f"policy/engine_logp_tokens{suffix}"] = n
    stale_n = sums.get("stale_n", 0.0)
    out["policy/stale_logp_diff_mean"] = sums["stale_diff"] / stale_n if stale_n else None
    out["policy/stale_logp_tokens"] = stale_n
    return out


def _summarise(
    sums: dict[str, float],
    first: dict[str, float],
    maxes: dict[str, float],
    totals: Totals,
    *,
    tokens: int,
    tolerance: float,
) -> StepStats:
    """Loss figures from the last iteration; engine figures from the first (the served weights)."""
    n = max(totals.tokens, 1)
    return StepStats(
        loss=sums["loss"],
        policy_loss=sums["policy_loss"],
        kl=sums["kl"] / n,
        entropy=sums["entropy"] / n,
        clip_low=sums["clip_low"] / n,
        clip_high=sums["clip_high"] / n,
        is_weight=sums["is_weight"] / n,
        is_capped=sums["is_capped"] / n,
        ratio=sums["ratio"] / n,
        grad_norm=sums["grad_norm"],
        tokens=tokens,
        loss_tokens=totals.tokens,
        sequences=totals.sequences,
        micro_batches=totals.micro_batches,
        engine=_engine_figures(first, maxes),
        outside=int(first["outside"]),
        sums=sums,
    )
