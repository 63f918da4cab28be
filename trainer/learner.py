"""One optimizer step on a batch of samples: pack, forward, loss, backward, clip, AdamW.

Kept apart from the loop (no HTTP, no files) so a test or a benchmark can drive a real step on
hand-made samples. With ``num_iterations == 1`` the 'old' log-probs are the current ones detached,
taken from the same forward pass (TRL computes them in a separate no-grad pass when correcting
against vLLM's log-probs); with more iterations they are computed once, before the first update.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from trainer.config import TrainerConfig
from trainer.data import Sample
from trainer.distributed import World
from trainer.lora import Policy
from trainer.loss import Totals, grpo_loss
from trainer.packing import MicroBatch, pack

Tensor = torch.Tensor
SUMS = ("loss", "policy_loss", "kl", "entropy", "clip_low", "clip_high", "is_weight", "is_capped", "ratio", "mismatch",
        "known")
"""The statistics a step sums over micro-batches (and over ranks)."""


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
    mismatch: float = 0.0
    """Mean |trainer log-prob - engine log-prob| on tokens whose engine log-prob is known."""
    grad_norm: float = 0.0
    tokens: int = 0
    loss_tokens: int = 0
    sequences: int = 0
    micro_batches: int = 0
    seconds: float = 0.0
    sums: dict[str, float] = field(default_factory=dict, repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class Learner:
    def __init__(self, policy: Policy, config: TrainerConfig, world: World | None = None) -> None:
        self.policy = policy
        self.config = config
        self.world = world or World()
        self.optimizer = torch.optim.AdamW(list(policy.parameters()), lr=config.learning_rate,
                                           betas=(config.adam_beta1, config.adam_beta2),
                                           weight_decay=config.weight_decay)

    def _old_logps(self, micro: Sequence[MicroBatch]) -> list[Tensor | None]:
        if self.config.num_iterations == 1:
            return [None] * len(micro)
        with torch.no_grad():
            return [mb.table(self.policy.logprobs(mb)[0]) for mb in micro]

    def step(self, samples: Sequence[Sample]) -> StepStats:
        """Train on ``samples`` (advantages set): ``num_iterations`` optimizer steps, one pass each.

        Under data parallelism every rank gets all of the step's samples and works on its share of
        the micro-batches; the totals that normalise the loss are the whole step's.
        """
        if not samples:
            raise ValueError("no samples to train on")
        cfg = self.config
        started = time.perf_counter()
        micro = pack(samples, cfg.micro_batch_tokens)
        totals = Totals(sequences=len(samples), tokens=sum(mb.num_loss_tokens for mb in micro),
                        micro_batches=len(micro), max_completion_length=cfg.max_completion_length)
        mine = self.world.share(micro)
        olds = self._old_logps(mine)
        sums: dict[str, float] = {}
        for _ in range(cfg.num_iterations):
            sums = {}
            for mb, old in zip(mine, olds, strict=True):
                self._accumulate(mb, old, totals, sums)
            self.world.sum_gradients(self.policy.parameters())
            sums = self.world.sum_values(sums, SUMS, self.policy.device)
            sums["grad_norm"] = self._apply()
        stats = _summarise(sums, totals, tokens=sum(mb.num_tokens for mb in micro))
        stats.seconds = time.perf_counter() - started
        return stats

    def _accumulate(self, mb: MicroBatch, old: Tensor | None, totals: Totals, sums: dict[str, float]) -> None:
        cfg = self.config
        flat, entropy = self.policy.logprobs(mb)
        logps = mb.table(flat)  # (B, T)
        old_logps = logps.detach() if old is None else old
        ref_logps = mb.table(self.policy.logprobs(mb, reference=True)[0]) if cfg.beta > 0 else None
        behaviour = mb.behaviour_logps if cfg.vllm_importance_sampling_correction else None
        out = grpo_loss(logps, old_logps, mb.advantages, mb.mask, totals=totals, loss_type=cfg.loss_type,
                        epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_upper, beta=cfg.beta, ref_logps=ref_logps,
                        behaviour_logps=behaviour, is_cap=cfg.vllm_importance_sampling_cap,
                        is_mode=cfg.vllm_importance_sampling_mode, level=cfg.importance_sampling_level)
        out.loss.backward()  # type: ignore[no-untyped-call]
        known = ~torch.isnan(mb.behaviour_logps) & mb.mask.bool()
        for key, value in (("loss", out.loss), ("policy_loss", out.policy_loss), ("kl", out.kl),
                           ("entropy", entropy.sum()), ("clip_low", out.clipped_low), ("clip_high", out.clipped_high),
                           ("is_weight", out.is_weight_sum), ("is_capped", out.is_capped), ("ratio", out.ratio_sum),
                           ("mismatch", (old_logps.detach() - mb.behaviour_logps).abs()[known].sum()),
                           ("known", known.sum())):
            sums[key] = sums.get(key, 0.0) + float(value.detach())

    def _apply(self) -> float:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm


def _summarise(sums: dict[str, float], totals: Totals, *, tokens: int) -> StepStats:
    n = max(totals.tokens, 1)
    return StepStats(
        loss=sums["loss"], policy_loss=sums["policy_loss"], kl=sums["kl"] / n, entropy=sums["entropy"] / n,
        clip_low=sums["clip_low"] / n, clip_high=sums["clip_high"] / n, is_weight=sums["is_weight"] / n,
        is_capped=sums["is_capped"] / n, ratio=sums["ratio"] / n,
        mismatch=sums["mismatch"] / sums["known"] if sums["known"] else 0.0, grad_norm=sums["grad_norm"],
        tokens=tokens, loss_tokens=totals.tokens, sequences=totals.sequences, micro_batches=totals.micro_batches,
        sums=sums)
