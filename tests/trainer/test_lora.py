"""The policy on SmolLM2-135M: packed log-probs equal plain ones, and a real GRPO step moves them the right way."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.trainer.samples import chat_sample
from trainer.checkpoint import Checkpoints, CheckpointState
from trainer.config import TrainerConfig
from trainer.data import Sample
from trainer.learner import Learner
from trainer.lora import Policy
from trainer.packing import collate

NAN = float("nan")


@pytest.fixture(scope="module")
def policy(vllm_model_dir: str) -> Iterator[Policy]:
    yield Policy(TrainerConfig(model=vllm_model_dir, learning_rate=1e-3, micro_batch_tokens=512, max_seq_len=512,
                               logprob_chunk_rows=7))


def sequence_logprobs(policy: Policy, samples: list[Sample], *, reference: bool = False) -> list[float]:
    with torch.no_grad():
        mb = collate(samples)
        table = mb.table(policy.logprobs(mb, reference=reference)[0])
    return (table * mb.mask).sum(-1).tolist()


def test_packed_logprobs_match_a_plain_forward_per_sample(policy: Policy) -> None:
    samples = [chat_sample(policy, "What is 2+3?", "5", 1.0),
               chat_sample(policy, "Name a colour.", "Blue, like the sky.", -1.0, temperature=0.7)]
    mb = collate(samples)
    with torch.no_grad():
        packed = mb.table(policy.logprobs(mb)[0])
        for b, sample in enumerate(samples):
            ids = torch.tensor([sample.input_ids])
            logits = policy.model(input_ids=ids).logits[0, :-1].float()  # full vocabulary, one sample alone
            logits = logits / torch.tensor(sample.temperatures[1:])[:, None]
            plain = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None]).squeeze(1)
            wanted = plain[torch.tensor(sample.loss_mask[1:], dtype=torch.bool)]
            assert packed[b, :len(wanted)].tolist() == pytest.approx(wanted.tolist(), abs=2e-2)
            assert (packed[b, :len(wanted)] - wanted).abs().mean() < 5e-3


def test_a_real_step_raises_positive_completions_relative_to_negative(policy: Policy) -> None:
    good = chat_sample(policy, "What is 2+3?", "2 + 3 = 5", advantage=1.0)
    bad = chat_sample(policy, "What is 2+3?", "2 + 3 = 7", advantage=-1.0)
    before = sequence_logprobs(policy, [good, bad])
    for sample, logp in zip((good, bad), before, strict=True):  # engine log-probs = the trainer's: weights ~1
        sample.behaviour_logprobs = [NAN if not m else logp / sum(sample.loss_mask) for m in sample.loss_mask]
    adapter_before = {k: v.clone() for k, v in policy.adapter_state().items()}

    stats = Learner(policy, policy.config).step([good, bad])

    after = sequence_logprobs(policy, [good, bad])
    changed = [k for k, v in policy.adapter_state().items() if not torch.equal(v, adapter_before[k])]
    # B starts at zero, so the first step moves every B (A's gradient is B-weighted: zero on step one)
    assert changed == [k for k in adapter_before if "lora_B" in k] and len(changed) == 210
    assert stats.grad_norm > 0 and stats.loss_tokens == sum(good.loss_mask) + sum(bad.loss_mask)
    assert (after[0] - before[0]) - (after[1] - before[1]) > 0.05, (before, after)
    # the reference policy (adapter disabled) is still the base model, where the zero-initialised adapter started
    assert sequence_logprobs(policy, [good, bad], reference=True) == pytest.approx(before, abs=1e-3)


def test_checkpoint_round_trip_restores_the_adapter_and_optimizer(policy: Policy, tmp_path: Path) -> None:
    learner = Learner(policy, dataclasses.replace(policy.config, beta=0.1))  # with the KL term to the base model
    pair = [chat_sample(policy, "Say hi.", "Hi!", advantage=1.0), chat_sample(policy, "Say hi.", "No.", advantage=-1.0)]
    learner.step(pair)
    checkpoints = Checkpoints(tmp_path, keep=1)
    checkpoints.save(adapter=policy.adapter_state(), optimizer=learner.optimizer.state_dict(),
                     state=CheckpointState(step=7, version_base=2, leases=[]))
    saved = sequence_logprobs(policy, pair)

    assert learner.step(pair).kl > 0  # move on past the checkpoint (the adapter has moved: KL > 0) ...
    assert sequence_logprobs(policy, pair) != pytest.approx(saved, abs=1e-4)
    directory, state = checkpoints.latest() or (tmp_path, None)
    adapter, optimizer = checkpoints.load_tensors(directory)
    policy.load_adapter_state(adapter)  # ... and back
    restored = Learner(policy, policy.config)
    restored.optimizer.load_state_dict(optimizer)
    assert state is not None and (state.step, state.version_base) == (7, 2)
    assert sequence_logprobs(policy, pair) == pytest.approx(saved, abs=1e-6)
    assert int(restored.optimizer.state_dict()["state"][0]["step"]) == 1
    assert sorted(p.name for p in tmp_path.joinpath("checkpoints").iterdir()) == ["LATEST", "step-00000007"]
