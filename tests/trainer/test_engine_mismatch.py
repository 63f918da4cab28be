"""The learner's engine-mismatch figures: per sampling mode, under the serving version, None when unknown.

The engine's log-probs are made from the trainer's own (under the version that "served" them) plus a
known offset per mode, so every figure has an exact expected value: a test of the bookkeeping, on
the real model. The agreement with real vLLM is measured in tests/integration/test_fidelity.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from tests.trainer.samples import chat_sample
from trainer.config import TrainerConfig
from trainer.data import MODES, Sample
from trainer.learner import Learner
from trainer.lora import LoraPolicy
from trainer.packing import collate

NAN = float("nan")
OFFSETS = {"sampled": 0.01, "truncated": 0.03, "constrained": 0.2}


@pytest.fixture(scope="module")
def policy(vllm_model_dir: str) -> Iterator[LoraPolicy]:
    yield LoraPolicy(TrainerConfig(model=vllm_model_dir, dtype="float32", micro_batch_tokens=512, max_seq_len=512))


def served(
    policy: LoraPolicy, sample: Sample, *, mode: str, version: int, offset: float, reference: bool = False
) -> Sample:
    """``sample`` as if ``version`` sampled it in ``mode``, the engine off by ``offset`` nats on every token."""
    n = len(sample)
    marked = dataclasses.replace(
        sample,
        modes=[MODES.index(mode) if m else -1 for m in sample.loss_mask],
        versions=[version if m else -1 for m in sample.loss_mask],
    )
    with torch.no_grad():
        mb = collate([marked])
        own = policy.logprobs(mb, reference=reference).logps.tolist()
    behaviour = [NAN] * n
    trained = [j for j in range(1, n) if marked.loss_mask[j]]
    for j, logp in zip(trained, own, strict=True):
        behaviour[j] = logp - offset
    return dataclasses.replace(marked, behaviour_logprobs=behaviour, advantage=0.0)


def learner_for(policy: LoraPolicy, **fields: object) -> Learner:
    config = TrainerConfig(model=str(policy.config.model_dir), dtype="float32", learning_rate=1e-12, **fields)
    return Learner(policy, config)  # type: ignore[arg-type]


def test_fresh_tokens_are_compared_per_mode_and_unknown_is_none(policy: LoraPolicy) -> None:
    samples = [
        served(
            policy,
            chat_sample(policy, f"Question {i}?", f"Answer {i}.", 0.0),
            mode=mode,
            version=0,
            offset=OFFSETS[mode],
        )
        for i, mode in enumerate(OFFSETS)
    ]
    learner = learner_for(policy)
    learner.weights_version = 0  # a zero adapter: the weights are the base model, version 0
    stats = learner.step(samples)
    engine = stats.engine
    for sample, offset in zip(samples, OFFSETS.values(), strict=True):  # each episode's own gap (its audit)
        gap = stats.episode_gaps[sample.episode_id]
        assert gap.mean == pytest.approx(offset, abs=1e-4) and gap.tokens == sample.num_loss_tokens
    for mode, offset in OFFSETS.items():
        assert engine[f"policy/engine_logp_diff_mean_{mode}"] == pytest.approx(offset, abs=1e-4)
        assert engine[f"policy/engine_logp_diff_max_{mode}"] == pytest.approx(offset, abs=1e-4)
    assert engine["policy/engine_logp_frac_above_constrained"] == 1.0  # 0.2 > the 0.1 default tolerance
    assert engine["policy/engine_logp_frac_above_sampled"] == 0.0
    assert engine["policy/stale_logp_diff_mean"] is None and engine["policy/stale_logp_tokens"] == 0

    unknown = [dataclasses.replace(s, behaviour_logprobs=[NAN] * len(s)) for s in samples]
    engine = learner_for(policy).step(unknown).engine
    assert engine["policy/engine_logp_diff_mean"] is None and engine["policy/engine_logp_tokens"] == 0


def test_stale_tokens_are_rescored_under_the_version_that_served_them(policy: LoraPolicy) -> None:
    learner = learner_for(policy)
    base = policy.adapter_state()
    # Version 3 served these samples; the weights have moved on since (now published as version 4).
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    learner.remember(3)
    old = [
        served(policy, chat_sample(policy, "Old question?", "Old answer.", 0.0), mode="sampled", version=3, offset=0.02)
    ]
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.add_(0.05)
    learner.remember(4)
    stats = learner.step(old)
    engine = stats.engine
    assert engine["policy/engine_logp_diff_mean"] == pytest.approx(0.02, abs=1e-4)  # under v3's adapter
    assert stats.episode_gaps["Old answer."].mean == pytest.approx(0.02, abs=1e-4)  # re-scored, not the stale gap
    assert engine["policy/stale_logp_tokens"] > 0
    assert abs(engine["policy/stale_logp_diff_mean"] - 0.02) > 1e-3  # the current weights differ: staleness
    assert learner.weights_version is None  # the step moved the weights

    skipped = learner_for(policy, engine_logp_check_samples=0)
    skipped.remember(4)
    assert skipped.step(old).engine["policy/engine_logp_diff_mean"] is None  # not re-scored: unknown, not 0
    policy.load_adapter_state(base)
