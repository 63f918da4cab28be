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

Several ranks. The leader decides each step's re-scoring (``StalePlan``: the version the weights
were published as and which samples to re-score under which older version) and every rank follows
it, remembering the served adapter as the leader did. Under FSDP every forward is a collective, so
every rank runs the re-scoring passes too (the leader's figures are kept), runs as many training
passes as the others (``World.passes``), and gathers the whole adapter and AdamW state after the
update (``optimizer_state``), which the leader checkpoints.

Objectives. ``step(objective="grpo")`` is the GRPO family (``loss.grpo_loss``); ``"sft"`` is the warm
start's supervised step (``loss.sft_loss``, ``trainer/warmstart.py``): the same packing (prefix
sharing included), forward (gradient checkpointing included), clipping and AdamW, one pass per step,
no old or reference log-probs, no importance weights, no engine comparison (its samples are scored
without the sampling they were drawn with, so a gap to the engine would mean nothing).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from trainer import memory
from trainer.config import TrainerConfig
from trainer.distributed import Pass, World, gathered, sharded_optimizer_state
from trainer.lora import LoraPolicy
from trainer.loss import Totals, grpo_loss, sft_loss
from trainer.mismatch import ENGINE_GROUPS, engine_figures, engine_gap, episode_gaps
from trainer.mismatch import EpisodeGap as EpisodeGap  # re-exported: the audit and its tests import it from here
from trainer.packing import MicroBatch, pack
from trainer.sample import Sample

Tensor = torch.Tensor
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
Objective = Literal["grpo", "sft"]
"""What a step minimises: the GRPO family's loss, or the warm start's negative log-likelihood."""
"""Adapter states kept in memory for re-scoring stale samples (versions further back are rare)."""


@dataclass(frozen=True)
class StalePlan:
    """The leader's re-scoring plan of a step, which every rank follows."""

    weights_version: int | None
    """The version the weights were published as (None: a step moved them since)."""
    samples: dict[int, list[int]]
    """Older version -> indices of the step's samples re-scored under its adapter (0: the base model)."""


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
    """Tokens of the step's samples, a prefix shared by several samples counted in each (what is trained on)."""
    tokens_computed: int = 0
    """Tokens of the packed rows: what the forward passes computed (a shared prefix once per micro-batch)."""
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
    memory: dict[str, float] = field(default_factory=dict)
    """The process's memory after the step (``memory.figures``: ``perf/rss_gb``, CUDA peaks)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def shared_share(self) -> float:
        """Share of the samples' tokens not computed because a micro-batch shared them (0: none)."""
        return 1.0 - self.tokens_computed / self.tokens if self.tokens > 0 else 0.0

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
        self._optimizer_state = gathered(self.optimizer.state_dict())
        """Under FSDP: the whole AdamW state as of the last update or load (empty before the first step)."""
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

    def optimizer_state(self) -> dict[str, Any]:
        """The AdamW state as one process holds it (whole moment estimates: gathered after each update
        under FSDP), what a checkpoint saves."""
        return self._optimizer_state if self.policy.sharded else self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Load a whole AdamW state (a checkpoint's); under FSDP each rank keeps its parameters' shards."""
        if self.policy.sharded:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            self.optimizer.load_state_dict(sharded_optimizer_state(state, params))
            self._optimizer_state = gathered(state)
        else:
            self.optimizer.load_state_dict(state)

    def _old_logps(self, passes: Sequence[Pass]) -> list[Tensor | None]:
        if self.config.num_iterations == 1:
            return [None] * len(passes)
        with torch.no_grad():
            return [mb.table(self.policy.logprobs(mb).logps) for mb, _ in passes]

    def step(
        self, samples: Sequence[Sample], *, sequences: int | None = None, objective: Objective = "grpo"
    ) -> StepStats:
        """Train on ``samples`` (advantages set): ``num_iterations`` optimizer steps, one pass each
        (``objective="sft"``: one supervised step, ``loss.sft_loss``; advantages unused).

        ``sequences``: what per-sequence losses average over; by default the distinct group members
        of the samples under ``normalize_per_episode``, else the samples. Under data parallelism or
        FSDP every rank gets all of the step's samples and works on its share of the micro-batches;
        the totals that normalise the loss are the whole step's.
        """
        if not samples:
            raise ValueError("no samples to train on")
        cfg = self.config
        started = time.perf_counter()
        micro = pack(samples, cfg.micro_batch_tokens, shared=cfg.shared_prefix)
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
        passes = self.world.passes(micro, lockstep=self.policy.sharded)
        sums: dict[str, float] = {}
        maxes: dict[str, float] = {}
        self._gaps = {}
        sft = objective == "sft"
        plan = self._plan(samples) if not sft else StalePlan(self.weights_version, {})
        self._check_stale(samples, self._follow(self.world.broadcast(plan)), sums, maxes)
        olds = self._old_logps(passes) if not sft else [None] * len(passes)
        first: dict[str, float] = {}
        reduced: dict[str, float] = {}
        for iteration in range(1 if sft else cfg.num_iterations):
            step_sums = dict(sums) if iteration == 0 else {}
            for (mb, counted), old in zip(passes, olds, strict=True):
                if sft:
                    self._supervised(mb, totals, step_sums, counted=counted)
                    continue
                self._accumulate(mb, old, totals, step_sums, maxes if iteration == 0 else {}, counted=counted)
            if not self.policy.sharded:  # FSDP has reduce-scattered (summed) them already
                self.world.sum_gradients(self.policy.parameters())
            reduced = self.world.sum_values(step_sums, SUMS, self.policy.device)
            reduced["grad_norm"] = self._apply()
            if iteration == 0:
                first = reduced
        maxes = self.world.max_values(maxes, MAXES, self.policy.device)
        self._gather()
        stats = _summarise(
            reduced,
            first,
            maxes,
            totals,
            tokens=sum(mb.unshared_tokens for mb in micro),
            computed=sum(mb.num_tokens for mb in micro),
            tolerance=cfg.engine_logp_tolerance,
        )
        stats.seconds = time.perf_counter() - started
        stats.episode_gaps = self._gaps  # this rank's share under data parallelism (the leader's is reported)
        if stats.finite:
            self.weights_version = None  # the weights moved: no served version holds them until published
        del micro
        memory.release()  # the step's activations and chunks go back to the OS (memory.py says why)
        stats.memory = memory.figures()
        return stats

    def _gather(self) -> None:
        """Under FSDP: the whole adapter and AdamW state onto every rank's CPU (a collective), for the
        leader's checkpoint and publish and every rank's snapshots."""
        if self.policy.sharded:
            self.policy.gather()
            self._optimizer_state = gathered(self.optimizer.state_dict())

    def _accumulate(
        self,
        mb: MicroBatch,
        old: Tensor | None,
        totals: Totals,
        sums: dict[str, float],
        maxes: dict[str, float],
        *,
        counted: bool = True,
    ) -> None:
        """One forward/backward, its statistics added to ``sums``; a pass that is not ``counted`` (FSDP's
        padding) backpropagates zero, so its collectives run and its gradients add nothing."""
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
        (loss.loss if counted else loss.loss * 0.0).backward()  # type: ignore[no-untyped-call]
        if not counted:
            return
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
            engine_gap(trainer, engine, mb.modes, fresh, cfg.engine_logp_tolerance, sums, maxes)
            episode_gaps(mb, trainer, engine, fresh, self._gaps)
        stale = (mb.versions >= 0) & ~torch.isnan(engine)
        if fresh is not None:
            stale &= ~fresh
        sums["stale_diff"] = sums.get("stale_diff", 0.0) + float((trainer - engine).abs()[stale].sum())
        sums["stale_n"] = sums.get("stale_n", 0.0) + float(stale.sum())

    def _supervised(self, mb: MicroBatch, totals: Totals, sums: dict[str, float], *, counted: bool = True) -> None:
        """One forward/backward of the warm start's loss (``loss.sft_loss``), its statistics added to ``sums``."""
        out = self.policy.logprobs(mb)
        loss = sft_loss(mb.table(out.logps), mb.mask, totals=totals)
        (loss if counted else loss * 0.0).backward()  # type: ignore[no-untyped-call]
        if not counted:
            return
        entropy, outside = out.entropy.sum(), out.outside.sum()
        for key, value in (("loss", loss), ("policy_loss", loss), ("entropy", entropy), ("outside", outside)):
            sums[key] = sums.get(key, 0.0) + float(value.detach())

    def _plan(self, samples: Sequence[Sample]) -> StalePlan | None:
        """The leader's plan: up to ``engine_logp_check_samples`` samples per older version whose
        adapter is kept (or the base model, version 0). Followers: None, they receive the leader's."""
        if not self.world.leader:
            return None
        limit = self.config.engine_logp_check_samples
        chosen: dict[int, list[int]] = {}
        for index, sample in enumerate(samples):
            for version in sorted({v for v in sample.versions or () if v >= 0 and v != self.weights_version}):
                if version == 0 or version in self.snapshots:
                    picked = chosen.setdefault(version, [])
                    if len(picked) < limit:
                        picked.append(index)
        return StalePlan(self.weights_version, chosen)

    def _follow(self, plan: StalePlan) -> StalePlan:
        """A follower takes the leader's served version: its weights are the leader's, so a version it
        has not seen yet is the current adapter (remembered, for later re-scoring under FSDP)."""
        if not self.world.leader:
            if plan.weights_version is not None and plan.weights_version not in self.snapshots:
                self.remember(plan.weights_version)
            self.weights_version = plan.weights_version
        return plan

    @torch.no_grad()
    def _check_stale(
        self, samples: Sequence[Sample], plan: StalePlan, sums: dict[str, float], maxes: dict[str, float]
    ) -> None:
        """Re-score tokens of older versions under the adapter that served them (the plan's samples).

        The leader alone without FSDP; under FSDP every rank runs the same passes (each is a
        collective) and only the leader's figures are kept."""
        if not plan.samples or not (self.world.leader or self.policy.sharded):
            return
        if not self.world.leader:
            sums, maxes = {}, {}
        gaps = self._gaps if self.world.leader else {}
        missing = [v for v in plan.samples if v != 0 and v not in self.snapshots]
        if missing:
            raise RuntimeError(f"rank {self.world.rank} holds no adapter of versions {missing} the leader re-scores")
        current = _copy(self.policy.adapter_state())  # on the CPU the state shares the parameters' storage
        try:
            for version, indices in sorted(plan.samples.items()):
                if version != 0:
                    self.policy.load_adapter_state(self.snapshots[version])
                batch = [samples[i] for i in indices]
                for mb in pack(batch, self.config.micro_batch_tokens, shared=self.config.shared_prefix):
                    out = self.policy.logprobs(mb, reference=version == 0)
                    engine = mb.behaviour_logps[mb.rows, mb.cols]
                    served = mb.versions == version
                    engine_gap(out.logps, engine, mb.modes, served, self.config.engine_logp_tolerance, sums, maxes)
                    episode_gaps(mb, out.logps, engine, served, gaps)
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


def _summarise(
    sums: dict[str, float],
    first: dict[str, float],
    maxes: dict[str, float],
    totals: Totals,
    *,
    tokens: int,
    computed: int,
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
        tokens_computed=computed,
        loss_tokens=totals.tokens,
        sequences=totals.sequences,
        micro_batches=totals.micro_batches,
        engine=engine_figures(first, maxes),
        outside=int(first["outside"]),
        sums=sums,
    )
