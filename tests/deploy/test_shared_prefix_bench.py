"""How ``bench/shared_prefix.py`` hands its samples to TRL: the same trained tokens, micro-batches within budget."""

from __future__ import annotations

import math

from bench.shared_prefix import SHAPES, samples_for, trl_micro_batch, trl_rollout


def test_a_multi_turn_sample_keeps_its_tool_results_in_the_completion_untrained() -> None:
    for sample in samples_for(SHAPES["calc"], seed=4):
        prompt, completion, mask, logprobs = trl_rollout(sample)
        start = sample.loss_mask.index(1)
        assert prompt + completion == sample.input_ids  # nothing dropped or reordered
        assert sum(sample.loss_mask[:start]) == 0 and len(prompt) == start  # the prompt: all before the first trained
        assert mask == sample.loss_mask[start:] and 0 in mask  # tool results: inside, env mask 0
        assert sum(mask) == sum(sample.loss_mask)  # TRL trains exactly Flywheel's tokens
        assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if not m)
        assert all(not math.isnan(lp) for lp in logprobs)


def test_a_single_turn_sample_is_the_shared_prompt_then_its_completion() -> None:
    samples = samples_for(SHAPES["math"], seed=4)
    prompts = {tuple(trl_rollout(s)[0]) for s in samples}
    assert len(prompts) == SHAPES["math"].groups  # one prompt per group: system + task
    for sample in samples:
        assert all(trl_rollout(sample)[2])  # every completion token trained


def test_the_micro_batch_divides_the_step_and_its_padded_size_fits_the_budget() -> None:
    samples = samples_for(SHAPES["openhands"], seed=9)
    longest = max(len(s) for s in samples)
    k = trl_micro_batch(samples, 16384)
    assert len(samples) % k == 0 and k * longest <= 16384
    assert all(len(samples) % j or j * longest > 16384 for j in range(k + 1, len(samples) + 1))  # the most that fit
    assert trl_micro_batch(samples, 1) == 1  # over budget even alone: one sequence per micro-batch
    assert trl_micro_batch(samples, 10**9) == len(samples)
