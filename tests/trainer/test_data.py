"""Episodes to samples: merging, masks, dedupe, breaks, truncation, skips and advantages, on crafted calls."""

from __future__ import annotations

import math
from typing import Any

import pytest

from trainer.client import Call, Episode, Group
from trainer.data import ChatRetokenizer, DataStats, build_batch, episode_samples
from trainer.packing import collate, plan

EOS = 2


def call(ordinal: int, prompt: list[int] | None, completion: list[int] | None, *, logprobs: list[float] | None = None,
         temperature: float | None = 1.0, status: int = 200, exact: bool = True, version: int | None = 0,
         **extra: Any) -> Call:
    choices = [] if completion is None else [{
        "index": 0, "token_ids": completion, "text": extra.pop("text", ""),
        "logprobs": logprobs if logprobs is not None else [-0.1 * (i + 1) for i in range(len(completion))]}]
    request: dict[str, Any] = {"model": "policy", "messages": extra.pop("messages", [{"role": "user", "content": "x"}])}
    if temperature is not None:
        request["temperature"] = temperature
    return Call(ordinal=ordinal, request=request, status_code=status, prompt_token_ids=prompt, choices=choices,
                exact_ids=exact, policy_version=version, **extra)


SYSTEM = [1, 2, 3]
TOOL_OUTPUT = [50, 51]


def multi_turn_episode() -> Episode:
    """Two turns with a tool output in between, a retry, a rewritten context, failures and a greedy turn."""
    turn1 = SYSTEM + [10, 11, EOS]
    calls = [
        call(0, SYSTEM, [10, 11, EOS], logprobs=[-0.1, -0.2, -0.3], temperature=0.7, version=3),
        call(1, turn1 + TOOL_OUTPUT, [12, EOS]),                                       # first try ...
        call(2, turn1 + TOOL_OUTPUT, [13, EOS], logprobs=[-0.4, -0.5], version=4),   # ... retried: kept
        call(3, SYSTEM + [99, 98], [14, EOS], logprobs=[-0.6, -0.7], temperature=None),  # context rewritten: break
        call(4, SYSTEM + [99, 98, 14, EOS], None, status=500),                        # failed upstream
        call(5, None, [16], exact=False, text="lost ids"),                            # no exact ids
        call(6, SYSTEM + [99, 98, 14, EOS, 60], [15, EOS], temperature=0.0),           # greedy: context only
        call(7, [7, 7], [8], version=None),                                           # another model: foreign
    ]
    return Episode(id="ep-1", group_id="g-1", status="rewarded", reward=1.0, calls=calls)


def test_merges_turns_masks_tool_output_and_counts_every_rule() -> None:
    stats = DataStats()
    first, second = episode_samples(multi_turn_episode(), group_id="g-1", max_seq_len=64, stats=stats)

    assert first.input_ids == SYSTEM + [10, 11, EOS] + TOOL_OUTPUT + [13, EOS]
    assert first.loss_mask == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert first.temperatures == [1.0, 1.0, 1.0, 0.7, 0.7, 0.7, 1.0, 1.0, 1.0, 1.0]
    assert [x if not math.isnan(x) else None for x in first.behaviour_logprobs] == [
        None, None, None, -0.1, -0.2, -0.3, None, None, -0.4, -0.5]
    assert first.min_version == 3

    assert second.input_ids == SYSTEM + [99, 98, 14, EOS, 60, 15, EOS]
    assert second.loss_mask == [0, 0, 0, 0, 0, 1, 1, 0, 0, 0]  # the greedy reply stays as context
    assert second.temperatures[5:7] == [1.0, 1.0]  # no temperature in the request: vLLM's default 1.0

    assert stats.as_dict() == {
        "calls": 8, "calls_failed": 1, "calls_foreign": 1, "calls_deduped": 1, "calls_retokenized": 0,
        "calls_dropped_inexact": 1, "calls_greedy": 1, "calls_logprobs_missing": 0, "merged": 2, "breaks": 1,
        "samples": 2, "samples_truncated": 0, "samples_empty": 0}


def test_truncation_keeps_masks_aligned_and_drops_samples_left_without_loss_tokens() -> None:
    stats = DataStats()
    samples = episode_samples(multi_turn_episode(), group_id="g-1", max_seq_len=5, stats=stats)
    (only,) = samples  # the second sample, cut to 5 tokens, ends before its first sampled token
    assert only.input_ids == SYSTEM + [10, 11]
    assert only.loss_mask == [0, 0, 0, 1, 1]
    assert only.behaviour_logprobs[3:] == [-0.1, -0.2]
    assert len(only.behaviour_logprobs) == len(only.temperatures) == 5
    assert (stats.samples_truncated, stats.samples_empty, stats.samples) == (2, 1, 1)


def test_missing_engine_logprobs_are_unknown_not_zero() -> None:
    episode = Episode(id="e", status="rewarded", reward=0.0,
                      calls=[call(0, SYSTEM, [10, EOS], logprobs=[-0.1])])  # one log-prob for two tokens
    stats = DataStats()
    (sample,) = episode_samples(episode, group_id="g", max_seq_len=64, stats=stats)
    assert sample.loss_mask == [0, 0, 0, 1, 1]
    assert all(math.isnan(x) for x in sample.behaviour_logprobs)
    assert stats.calls_logprobs_missing == 1


def group(gid: str, rewards: list[float | None], *, abandoned: int = 0) -> Group:
    episodes = [Episode(id=f"{gid}-{i}", status="rewarded", reward=r,
                        calls=[call(0, SYSTEM + [i], [20 + i, EOS])]) for i, r in enumerate(rewards)]
    episodes += [Episode(id=f"{gid}-a{i}", status="abandoned", calls=[]) for i in range(abandoned)]
    return Group(id=gid, task_id="t", status="complete", episodes=episodes)


def test_batch_skips_equal_and_thin_groups_and_sets_group_advantages() -> None:
    groups = [group("g-signal", [1.0, 0.0, 0.0, 1.0]), group("g-equal", [0.5, 0.5, 0.5]),
              group("g-thin", [1.0], abandoned=2), group("g-signal2", [3.0, 1.0])]
    batch = build_batch(groups, max_seq_len=64, min_rewarded=2, scale_rewards="group")
    assert batch.trained == ["g-signal", "g-signal2"]
    assert set(batch.skipped) == {"g-equal", "g-thin"}
    assert "equal" in batch.skipped["g-equal"] and "min_rewarded" in batch.skipped["g-thin"]
    assert (batch.skipped_equal, batch.skipped_few, batch.skipped_empty) == (1, 1, 0)
    by_episode = {s.episode_id: s.advantage for s in batch.samples}
    assert by_episode["g-signal-0"] == pytest.approx(0.8658754, abs=1e-6)
    assert by_episode["g-signal-1"] == pytest.approx(-0.8658754, abs=1e-6)
    assert by_episode["g-signal2-0"] == pytest.approx(0.7070568, abs=1e-6)
    assert batch.rewards == [1.0, 0.0, 0.0, 1.0, 3.0, 1.0]


def test_group_without_trainable_calls_is_skipped_and_counted() -> None:
    empty = Group(id="g", task_id="t", status="complete", episodes=[
        Episode(id="e0", status="rewarded", reward=1.0, calls=[call(0, None, [5], exact=False)]),
        Episode(id="e1", status="rewarded", reward=0.0, calls=[call(0, SYSTEM, [5], status=502)])])
    batch = build_batch([empty], max_seq_len=64, min_rewarded=2, scale_rewards="none")
    assert batch.samples == [] and batch.skipped_empty == 1 and batch.stats.calls_dropped_inexact == 1
    assert batch.stats.calls_failed == 1


def test_packing_places_loss_tokens_of_each_sample() -> None:
    stats = DataStats()
    first, second = episode_samples(multi_turn_episode(), group_id="g-1", max_seq_len=64, stats=stats)
    assert [len(b) for b in plan([first, second, first], budget=20)] == [2, 1]
    mb = collate([first, second])
    assert mb.input_ids.shape == (1, 20) and mb.cu_seqlens.tolist() == [0, 10, 20]
    assert mb.position_ids[0, 10:].tolist() == list(range(10))
    # position j-1 predicts token j: first's loss tokens at 3,4,5,8,9 -> rows 2,3,4,7,8; second's 5,6 -> 14,15
    assert mb.select.tolist() == [2, 3, 4, 7, 8, 14, 15]
    assert mb.targets.tolist() == [10, 11, EOS, 13, EOS, 14, EOS]
    assert mb.mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert mb.behaviour_logps[0].tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5])


def test_retokenizer_rebuilds_prompt_and_completion_with_the_chat_template(vllm_model_dir: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vllm_model_dir)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    inexact = call(0, None, None, exact=False, messages=messages)
    inexact.choices = [{"index": 0, "text": "4", "token_ids": None, "logprobs": []}]
    prompt, completion = ChatRetokenizer(tokenizer)(inexact) or ([], [])
    expected_prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                         tokenize=True)["input_ids"])
    assert prompt == expected_prompt
    assert completion[-1] == tokenizer.eos_token_id and tokenizer.decode(completion[:-1]) == "4"

    episode = Episode(id="e", status="rewarded", reward=1.0, calls=[inexact])
    stats = DataStats()
    (sample,) = episode_samples(episode, group_id="g", max_seq_len=256, retokenize=ChatRetokenizer(tokenizer),
                                stats=stats)
    assert sample.input_ids == prompt + completion and stats.calls_retokenized == 1
    assert stats.calls_logprobs_missing == 1  # retokenized tokens have no engine log-probs
