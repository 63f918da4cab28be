"""Episodes to samples: merging, masks, dedupe, breaks, truncation, skips and advantages, on crafted calls."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import pytest
import torch

from contract.client import Call, Episode, Group
from contract.vocabulary import Abandoned
from trainer.config import ConfigError, TrainerConfig, load_config
from trainer.data import ChatRetokenizer, DataStats, Rules, build_batch, episode_samples
from trainer.learner import StepStats
from trainer.loop import data_rules
from trainer.loss import group_advantages
from trainer.metrics import step_metrics
from trainer.packing import collate, plan

if TYPE_CHECKING:
    from trainer.config import Shaping

EOS = 2


def sampling(temperature: float = 1.0, *, mode: str | None = None, **fields: Any) -> dict[str, Any]:
    """The effective sampling the proxy records with a call (proxy/sampling.py)."""
    record = {"temperature": temperature, "top_p": 1.0, "top_k": 0, "min_p": 0.0, **fields}
    truncated = record["top_p"] < 1.0 or record["top_k"] > 0 or record["min_p"] > 0
    record["mode"] = mode or ("greedy" if temperature <= 0 else "truncated" if truncated else "sampled")
    return record


def call(
    ordinal: int,
    prompt: list[int] | None,
    completion: list[int] | None,
    *,
    logprobs: list[float] | None = None,
    temperature: float | None = 1.0,
    status: int = 200,
    exact: bool = True,
    version: int | None = 0,
    recorded: dict[str, Any] | None = None,
    **extra: Any,
) -> Call:
    """A stored call; its effective sampling is what the proxy resolves (temperature None -> vLLM's 1.0)."""
    choices = (
        []
        if completion is None
        else [
            {
                "index": 0,
                "token_ids": completion,
                "text": extra.pop("text", ""),
                "logprobs": logprobs if logprobs is not None else [-0.1 * (i + 1) for i in range(len(completion))],
            }
        ]
    )
    request: dict[str, Any] = {"model": "policy", "messages": extra.pop("messages", [{"role": "user", "content": "x"}])}
    if temperature is not None:
        request["temperature"] = temperature
    notes = {"sampling": recorded or sampling(1.0 if temperature is None else temperature)}
    return Call(
        ordinal=ordinal,
        request=request,
        status_code=status,
        prompt_token_ids=prompt,
        choices=choices,
        exact_ids=exact,
        policy_version=version,
        notes=notes,
        **extra,
    )


SYSTEM = [1, 2, 3]
TOOL_OUTPUT = [50, 51]


def multi_turn_episode() -> Episode:
    """Two turns with a tool output in between, a retry, a rewritten context, failures and a greedy turn."""
    turn1 = SYSTEM + [10, 11, EOS]
    calls = [
        call(0, SYSTEM, [10, 11, EOS], logprobs=[-0.1, -0.2, -0.3], temperature=0.7, version=3),
        call(1, turn1 + TOOL_OUTPUT, [12, EOS]),  # first try ...
        call(2, turn1 + TOOL_OUTPUT, [13, EOS], logprobs=[-0.4, -0.5], version=4),  # ... retried: kept
        call(3, SYSTEM + [99, 98], [14, EOS], logprobs=[-0.6, -0.7], temperature=None),  # context rewritten: break
        call(4, SYSTEM + [99, 98, 14, EOS], None, status=500),  # failed upstream
        call(5, None, [16], exact=False, text="lost ids"),  # no exact ids
        call(6, SYSTEM + [99, 98, 14, EOS, 60], [15, EOS], temperature=0.0),  # greedy: context only
        call(7, [7, 7], [8], version=None),  # another model: foreign
    ]
    return Episode(id="ep-1", group_id="g-1", status="rewarded", reward=1.0, calls=calls)


def test_merges_turns_masks_tool_output_and_counts_every_rule() -> None:
    stats = DataStats()
    first, second = episode_samples(multi_turn_episode(), group_id="g-1", max_seq_len=64, stats=stats)

    assert first.input_ids == SYSTEM + [10, 11, EOS] + TOOL_OUTPUT + [13, EOS]
    assert first.loss_mask == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert first.temperatures == [1.0, 1.0, 1.0, 0.7, 0.7, 0.7, 1.0, 1.0, 1.0, 1.0]
    assert [x if not math.isnan(x) else None for x in first.behaviour_logprobs] == [
        None,
        None,
        None,
        -0.1,
        -0.2,
        -0.3,
        None,
        None,
        -0.4,
        -0.5,
    ]
    assert first.min_version == 3

    assert second.input_ids == SYSTEM + [99, 98, 14, EOS, 60, 15, EOS]
    assert second.loss_mask == [0, 0, 0, 0, 0, 1, 1, 0, 0, 0]  # the greedy reply stays as context
    assert second.temperatures[5:7] == [1.0, 1.0]  # no temperature in the request: vLLM's default 1.0

    counted = {k: v for k, v in stats.as_dict().items() if v}
    assert counted == {
        "calls": 8,
        "calls_failed": 1,
        "calls_foreign": 1,
        "calls_deduped": 1,
        "calls_dropped_inexact": 1,
        "calls_greedy": 1,
        "merged": 2,
        "breaks": 1,
        "samples_built": 2,
        "episodes_split": 1,
    }


def test_a_retry_keeps_the_answer_the_agent_acted_on_and_a_branch_is_not_a_retry() -> None:
    """Issue 30: (a) 0: P->A, 1: P+A+tool->B, 2: P->C, 3: P+C+tool->D is an agent branching from P
    again: both branches are trained, call 0 is no retry. (b) Two calls of one prompt in a row whose
    later one committed first (ordinals follow commit order): the agent acted on the one the next call
    continues, ordinal 0 here, not the last."""
    a, b, c, d = [10, EOS], [11, EOS], [12, EOS], [13, EOS]
    branched = Episode(
        id="e",
        status="rewarded",
        reward=1.0,
        calls=[
            call(0, SYSTEM, a),
            call(1, SYSTEM + a + TOOL_OUTPUT, b),
            call(2, SYSTEM, c),
            call(3, SYSTEM + c + TOOL_OUTPUT, d),
        ],
    )
    stats = DataStats()
    first, second = episode_samples(branched, group_id="g", max_seq_len=64, stats=stats)
    assert first.input_ids == SYSTEM + a + TOOL_OUTPUT + b and second.input_ids == SYSTEM + c + TOOL_OUTPUT + d
    assert (stats.calls_deduped, stats.merged, stats.breaks) == (0, 2, 1)
    retried = Episode(
        id="e",
        status="rewarded",
        reward=1.0,
        calls=[call(0, SYSTEM, a), call(1, SYSTEM, c), call(2, SYSTEM + a + TOOL_OUTPUT, b)],
    )
    stats = DataStats()
    (sample,) = episode_samples(retried, group_id="g", max_seq_len=64, stats=stats)
    assert sample.input_ids == SYSTEM + a + TOOL_OUTPUT + b  # C, never continued, is the retry left out
    assert (stats.calls_deduped, stats.merged, stats.breaks) == (1, 1, 0)


def test_shadow_mismatches_of_spliced_calls_are_counted_by_cause_and_the_calls_kept() -> None:
    """The proxy's shadow check (``notes.splice.shadow``) marks a spliced prompt that differs from the
    ordinary render outside the sampled ids; the step counts them by cause, and trains the calls."""
    a, b, c = [10, EOS], [11, EOS], [12, EOS]

    def spliced(ordinal: int, prompt: list[int], completion: list[int], mismatch: str | None) -> Call:
        made = call(ordinal, prompt, completion)
        shadow = {"checked": True, "mismatch": mismatch, "at": 1 if mismatch else None}
        assert made.notes is not None
        return made.model_copy(update={"notes": {**made.notes, "splice": {"from": ordinal - 1, "shadow": shadow}}})

    calls = [
        call(0, SYSTEM, a),
        spliced(1, SYSTEM + a + TOOL_OUTPUT, b, "prefix"),
        spliced(2, SYSTEM + a + TOOL_OUTPUT + b + TOOL_OUTPUT, c, None),
        spliced(3, SYSTEM + a + TOOL_OUTPUT + b + TOOL_OUTPUT + c + TOOL_OUTPUT, a, "tail"),
    ]
    stats = DataStats()
    (sample,) = episode_samples(
        Episode(id="e", status="rewarded", reward=1.0, calls=calls), group_id="g", max_seq_len=64, stats=stats
    )
    assert len(sample.input_ids) == 17 and stats.merged == 3
    shadow = {k: v for k, v in stats.as_dict().items() if k.startswith("splice_shadow")}
    assert shadow == {"splice_shadow_prefix": 1, "splice_shadow_closing": 0, "splice_shadow_tail": 1}


def test_truncation_keeps_masks_aligned_and_drops_samples_left_without_loss_tokens() -> None:
    stats = DataStats()
    samples = episode_samples(multi_turn_episode(), group_id="g-1", max_seq_len=5, stats=stats)
    (only,) = samples  # the second sample, cut to 5 tokens, ends before its first sampled token
    assert only.input_ids == SYSTEM + [10, 11]
    assert only.loss_mask == [0, 0, 0, 1, 1]
    assert only.behaviour_logprobs[3:] == [-0.1, -0.2]
    assert len(only.behaviour_logprobs) == len(only.temperatures) == 5
    assert (stats.samples_truncated, stats.samples_empty, stats.samples_built) == (2, 1, 1)


def test_missing_engine_logprobs_are_unknown_not_zero() -> None:
    episode = Episode(
        id="e", status="rewarded", reward=0.0, calls=[call(0, SYSTEM, [10, EOS], logprobs=[-0.1])]
    )  # one log-prob for two tokens
    stats = DataStats()
    (sample,) = episode_samples(episode, group_id="g", max_seq_len=64, stats=stats)
    assert sample.loss_mask == [0, 0, 0, 1, 1]
    assert all(math.isnan(x) for x in sample.behaviour_logprobs)
    assert stats.calls_logprobs_missing == 1


def group(gid: str, rewards: list[float | None], *, abandoned: int = 0) -> Group:
    episodes = [
        Episode(id=f"{gid}-{i}", status="rewarded", reward=r, calls=[call(0, SYSTEM + [i], [20 + i, EOS])])
        for i, r in enumerate(rewards)
    ]
    episodes += [Episode(id=f"{gid}-a{i}", status="abandoned", calls=[]) for i in range(abandoned)]
    return Group(id=gid, task_id="t", status="complete", episodes=episodes)


def untrainable_group(gid: str) -> Group:
    """Two rewarded episodes with nothing to train on: one call's ids are not exact, the other failed."""
    episodes = [
        Episode(id="e0", status="rewarded", reward=1.0, calls=[call(0, None, [5], exact=False)]),
        Episode(id="e1", status="rewarded", reward=0.0, calls=[call(0, SYSTEM, [5], status=502)]),
    ]
    return Group(id=gid, task_id="t", status="complete", episodes=episodes)


def test_batch_skips_equal_and_thin_groups_and_sets_group_advantages() -> None:
    groups = [
        group("g-signal", [1.0, 0.0, 0.0, 1.0]),
        group("g-equal", [0.5, 0.5, 0.5]),
        group("g-thin", [1.0], abandoned=2),
        group("g-signal2", [3.0, 1.0]),
    ]
    batch = build_batch(groups, max_seq_len=64, scale_rewards="group")
    assert batch.trained == ["g-signal", "g-signal2"]
    assert set(batch.skipped) == {"g-equal", "g-thin"}
    assert "equal" in batch.skipped["g-equal"] and "GRPO compares at least 2" in batch.skipped["g-thin"]
    assert (batch.skipped_equal, batch.skipped_few, batch.skipped_empty) == (1, 1, 0)
    by_episode = {s.episode_id: s.advantage for s in batch.samples}
    assert by_episode["g-signal-0"] == pytest.approx(0.8658754, abs=1e-6)
    assert by_episode["g-signal-1"] == pytest.approx(-0.8658754, abs=1e-6)
    assert by_episode["g-signal2-0"] == pytest.approx(0.7070568, abs=1e-6)
    assert batch.rewards == [1.0, 0.0, 0.0, 1.0, 3.0, 1.0]


def test_group_without_trainable_calls_is_skipped_and_counted() -> None:
    batch = build_batch([untrainable_group("g")], max_seq_len=64, scale_rewards="none")
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
    expected_prompt = list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    )
    assert prompt == expected_prompt
    assert completion[-1] == tokenizer.eos_token_id and tokenizer.decode(completion[:-1]) == "4"

    episode = Episode(id="e", status="rewarded", reward=1.0, calls=[inexact])
    stats = DataStats()
    (sample,) = episode_samples(
        episode, group_id="g", max_seq_len=256, retokenize=ChatRetokenizer(tokenizer), stats=stats
    )
    assert sample.input_ids == prompt + completion and stats.calls_retokenized == 1
    assert stats.calls_logprobs_missing == 1  # retokenized tokens have no engine log-probs


# -- effective sampling, n > 1, credit, weighting, abandons (issue: training-signal fidelity) ------------------


GRAMMAR = {"structural_tag": '{"type": "structural_tag"}'}
"""A recorded grammar (the masker under test never compiles it)."""


def masker(grammar: dict[str, Any] | None, completion: Any, stops: Any) -> torch.Tensor | str:
    """A grammar masker seam: one distinct bitmask row per sampled token for the recorded grammar,
    else why not (trainer/grammar.py rebuilds real ones; tests/integration/test_fidelity.py checks them)."""
    if grammar != GRAMMAR:
        return "no grammar recorded"
    return torch.tensor([[1 << k, -1] for k in range(len(completion))], dtype=torch.int32)


def test_recorded_sampling_decides_what_is_trained_and_with_which_filters() -> None:
    calls = [
        call(0, SYSTEM, [10, EOS], recorded=sampling(0.7, top_k=20, top_p=0.8, min_p=0.05)),
        call(
            1,
            SYSTEM + [10, EOS, 5],
            [11, EOS],
            recorded=sampling(1.0, mode="penalized", penalties={"repetition_penalty": 1.1}),
        ),
        call(
            2,
            SYSTEM + [10, EOS, 5, 11, EOS, 6],
            [12, 13, EOS],
            logprobs=[-0.3, 0.0, -0.2],
            recorded=sampling(
                1.0, mode="constrained", constraint="tool_choice=required", constrained="train", grammar=GRAMMAR
            ),
        ),
        call(
            3,
            SYSTEM + [10, EOS, 5, 11, EOS, 6, 12, 13, EOS, 7],
            [14, EOS],
            recorded=sampling(1.0, mode="constrained", constraint="response_format=json_object", constrained="exclude"),
        ),
        call(  # constrained, but the engine could not be asked for its grammar: never scored unmasked
            4,
            SYSTEM + [10, EOS, 5, 11, EOS, 6, 12, 13, EOS, 7, 14, EOS, 8],
            [16, EOS],
            recorded=sampling(1.0, mode="constrained", constraint="tool_choice=required", constrained="train"),
        ),
    ]
    unrecorded = call(5, SYSTEM + [10, EOS, 5, 11, EOS, 6, 12, 13, EOS, 7, 14, EOS, 8, 16, EOS, 9], [15, EOS])
    unrecorded.notes = None  # stored before the proxy recorded effective sampling
    stats = DataStats()
    (sample,) = episode_samples(
        Episode(id="e", status="rewarded", reward=1.0, calls=[*calls, unrecorded]),
        group_id="g",
        max_seq_len=64,
        stats=stats,
        masker=masker,
    )
    n = len(SYSTEM)
    assert sample.loss_mask[n : n + 2] == [1, 1] and sample.top_k is not None and sample.top_p is not None
    assert (sample.top_k[n], sample.top_p[n], sample.temperatures[n]) == (20, 0.8, 0.7)
    assert sample.min_p is not None and sample.min_p[n] == 0.05
    assert sample.modes is not None and sample.modes[n] == 1  # truncated
    penalized = slice(n + 3, n + 5)
    assert sample.loss_mask[penalized] == [0, 0]
    constrained = slice(n + 6, n + 9)
    assert sample.loss_mask[constrained] == [1, 0, 1]  # the grammar forced the middle token (engine log-prob 0)
    assert sample.modes[n + 6] == 2
    # each sampled token of the constrained call carries the mask it was drawn under, and only those
    assert sorted(sample.allowed) == [n + 6, n + 7, n + 8]
    assert [int(sample.allowed[n + 6 + k][0]) for k in range(3)] == [1, 2, 4]
    assert sample.loss_mask[n + 10 : n + 12] == [0, 0]  # excluded by the deployment's policy
    assert sample.loss_mask[n + 13 : n + 15] == [0, 0]  # no grammar to rebuild: context only
    assert sample.loss_mask[-2:] == [0, 0]  # no recorded sampling: context only
    assert (
        stats.calls_truncated_sampling,
        stats.calls_penalized,
        stats.calls_constrained,
        stats.calls_constrained_excluded,
        stats.calls_constrained_unmasked,
        stats.calls_sampling_unrecorded,
        stats.tokens_forced,
    ) == (1,) * 7
    # packed, the masks follow their tokens: one row per loss token, -1 (no mask) for the others
    micro = collate([sample])
    assert micro.allowed is not None and micro.masked is not None
    assert micro.masked.tolist() == [False, False, True, True]
    assert micro.allowed[2:, 0].tolist() == [1, 4] and micro.allowed[:2].eq(-1).all()


def test_n_gt_1_merges_the_choice_the_next_call_continues() -> None:
    first = call(0, SYSTEM, [10, EOS])
    first.choices = [
        {"index": 0, "token_ids": [10, EOS], "logprobs": [-0.1, -0.2]},
        {"index": 1, "token_ids": [11, EOS], "logprobs": [-0.3, -0.4]},
    ]
    follow = call(1, SYSTEM + [11, EOS, 5], [12, EOS])
    stats = DataStats()
    (sample,) = episode_samples(
        Episode(id="e", status="rewarded", reward=1.0, calls=[first, follow]), group_id="g", max_seq_len=64, stats=stats
    )
    assert sample.input_ids == SYSTEM + [11, EOS, 5, 12, EOS]
    assert sample.behaviour_logprobs[3:5] == [-0.3, -0.4]
    assert (stats.merged, stats.breaks, stats.choices_unused) == (1, 0, 1)


def test_the_continued_choice_is_found_past_an_unrelated_call_and_its_sample_resumes() -> None:
    """Issue 30: call 0 (n = 2), then an unrelated call on the same prefix (a side question), then the
    agent's follow-up continuing choice 1. The unrelated call used to decide the choice (none: choice
    0) and the follow-up broke off; choice 1 is the one continued, and its sample picks up again."""
    first = call(0, SYSTEM, [10, EOS])
    first.choices = [
        {"index": 0, "token_ids": [10, EOS], "logprobs": [-0.1, -0.2]},
        {"index": 1, "token_ids": [11, EOS], "logprobs": [-0.3, -0.4]},
    ]
    aside = call(1, SYSTEM + [99], [13, EOS])
    follow = call(2, SYSTEM + [11, EOS, 5], [12, EOS])
    stats = DataStats()
    main, side = episode_samples(
        Episode(id="e", status="rewarded", reward=1.0, calls=[first, aside, follow]),
        group_id="g",
        max_seq_len=64,
        stats=stats,
    )
    assert main.input_ids == SYSTEM + [11, EOS, 5, 12, EOS] and side.input_ids == SYSTEM + [99, 13, EOS]
    assert (stats.merged, stats.breaks, stats.choices_unused) == (1, 1, 1)


def test_single_call_with_rewarded_choices_trains_each_choice_as_a_group_member() -> None:
    only = call(0, SYSTEM, [10, EOS])
    only.choices = [{"index": c, "token_ids": [10 + c, EOS], "logprobs": [-0.1, -0.1]} for c in range(3)]
    episode = Episode(
        id="e", status="rewarded", reward=0.5, calls=[only], call_rewards={"0:0": 1.0, "0:1": 0.0, "0:2": 0.5}
    )
    batch = build_batch(
        [Group(id="g", task_id="t", status="complete", episodes=[episode])],
        max_seq_len=64,
        scale_rewards="none",
    )
    assert batch.trained == ["g"] and batch.members == 3 and batch.stats.choice_members == 3
    by_member = {s.member: (s.input_ids[-2], s.advantage) for s in batch.samples}
    assert by_member == {"e#0": (10, 0.5), "e#1": (11, -0.5), "e#2": (12, 0.0)}
    assert batch.stats.calls == 1 and batch.stats.choices_unused == 0


def two_turn(eid: str, reward: float, call_rewards: dict[str, float] | None = None) -> Episode:
    return Episode(
        id=eid,
        status="rewarded",
        reward=reward,
        call_rewards=call_rewards,
        calls=[call(0, SYSTEM, [10, EOS]), call(1, SYSTEM + [10, EOS, 5], [11, EOS])],
    )


def test_returns_of_turns_never_trained_stay_out_of_the_group_statistics() -> None:
    """Issue 30: under per-turn credit a greedy (or penalized, excluded, truncated-away) turn has no
    token in the loss; its return must not shift the group's mean and std the trained turns are
    normalised by. Here each episode's second turn is greedy: only the first turns' returns count."""

    def episode(eid: str, reward: float, first_call_reward: float) -> Episode:
        calls = [
            call(0, SYSTEM, [10, EOS]),
            call(1, SYSTEM + [10, EOS] + TOOL_OUTPUT, [11, EOS], temperature=0.0),  # greedy: context only
        ]
        return Episode(id=eid, status="rewarded", reward=reward, calls=calls, call_rewards={"0": first_call_reward})

    episodes = [episode("a", 1.0, 0.3), episode("b", 0.0, 0.0), episode("c", 0.0, 0.3)]
    rules = Rules(scale_rewards="group", turn_credit="discounted", turn_discount=1.0)
    batch = build_batch([Group(id="g", task_id="t", status="complete", episodes=episodes)], rules=rules)
    first_turn_returns = torch.tensor([1.3, 0.0, 0.3], dtype=torch.float64)  # c_0 + G_1, G_1 = the reward
    (expected,) = group_advantages([first_turn_returns], "group")
    assert batch.advantages == pytest.approx(expected.tolist())
    assert batch.stats.turn_returns_untrained == 3 and batch.stats.calls_greedy == 3


def test_discounted_turn_credit_gives_each_turn_its_return() -> None:
    rules = Rules(scale_rewards="none", turn_credit="discounted", turn_discount=0.5)
    groups = [
        Group(id="g", task_id="t", status="complete", episodes=[two_turn("a", 1.0, {"0": 0.5}), two_turn("b", 0.0)])
    ]
    batch = build_batch(groups, rules=rules)
    # returns: a = [0.5 + 0.5 * 1.0, 1.0] = [1.0, 1.0]; b = [0.0, 0.0]; pooled mean 0.5
    by_member = {s.member: s for s in batch.samples}
    a, b = by_member["a"], by_member["b"]
    assert a.advantages is not None and b.advantages is not None
    assert [x for x, m in zip(a.advantages, a.loss_mask, strict=True) if m] == [0.5, 0.5, 0.5, 0.5]
    assert [x for x, m in zip(b.advantages, b.loss_mask, strict=True) if m] == [-0.5] * 4
    assert batch.stats.call_rewards_used == 1
    episode_credit = build_batch(groups, rules=Rules(scale_rewards="none"))
    assert episode_credit.stats.call_rewards_ignored == 1  # counted, not silently dropped
    assert {s.member: s.advantage for s in episode_credit.samples} == {"a": 0.5, "b": -0.5}


def shaped(gid: str, episodes: list[tuple[str, float, dict[str, float] | None]]) -> Group:
    """A group of two-turn episodes: (id, episode reward, call rewards) each."""
    return Group(id=gid, task_id="t", status="complete", episodes=[two_turn(e, r, c) for e, r, c in episodes])


def trained_turn_advantages(batch: Any, member: str) -> list[float]:
    """The advantage of each trained token of the member's samples, in order."""
    return [a for s in batch.samples if s.member == member for a, m in zip(s.advantages, s.loss_mask, strict=True) if m]


FAILED_ALIKE = [("a", 0.0, {"0": 0.3, "1": 0.3}), ("b", 0.0, {"0": 0.3}), ("c", 0.0, None), ("d", 0.0, None)]
"""Issue 44's calc groups: every episode failed (reward 0), some earned per-call rewards on the way."""


@pytest.mark.parametrize(
    ("episodes", "discount"),
    [
        (FAILED_ALIKE, 1.0),
        ([("a", 1.0, None), ("b", 1.0, None)], 0.5),  # no call rewards: the discount alone spreads the returns
    ],
)
def test_equal_outcomes_are_no_signal_under_gated_shaping(
    episodes: list[tuple[str, float, dict[str, float] | None]], discount: float
) -> None:
    """Issue 44: per-call rewards kept the calc agent's groups unequal after every episode failed, so
    it trained on shaping alone and collapsed. Under ``shaping: gated`` (default) a group whose
    outcomes are all equal is skipped, counted and explained however its returns differ; ``always``
    trains on it as before; under ``episode`` credit it is an equal-reward skip either way."""
    group_ = shaped("g", episodes)
    rules = Rules(scale_rewards="group", turn_credit="discounted", turn_discount=discount)
    gated = build_batch([group_], rules=rules)
    assert gated.trained == [] and gated.samples == [] and gated.advantages == []
    assert (gated.skipped_shaping_only, gated.skipped_equal, gated.skipped_few, gated.skipped_empty) == (1, 0, 0, 0)
    reason = gated.skipped["g"]
    assert reason.startswith(f"all {len(episodes)} outcomes equal") and "shaping alone" in reason
    assert "shaping=always" in reason  # the setting that would train it
    always = build_batch([group_], rules=dataclasses.replace(rules, shaping="always"))
    assert always.trained == ["g"] and always.skipped_shaping_only == 0 and not always.skipped
    assert any(a != 0 for e, *_ in episodes for a in trained_turn_advantages(always, e))
    for shaping in ("gated", "always"):
        episode_credit = build_batch([group_], rules=Rules(scale_rewards="group", shaping=shaping))
        assert (episode_credit.skipped_equal, episode_credit.skipped_shaping_only) == (1, 0)


@pytest.mark.parametrize("shaping", ["gated", "always"])
def test_call_rewards_still_shape_turn_credit_where_outcomes_differ(shaping: Shaping) -> None:
    """Gating keeps shaping where there is an outcome signal: the group trains under either setting,
    with the same per-turn advantages, and a call reward lifts its turn above the same turn of a
    member with the same outcome and none."""
    group_ = shaped("g", [("a", 1.0, {"0": 0.3}), ("b", 0.0, {"0": 0.3}), ("c", 0.0, None)])
    batch = build_batch([group_], rules=Rules(scale_rewards="none", turn_credit="discounted", shaping=shaping))
    assert batch.trained == ["g"] and batch.skipped_shaping_only == 0 and batch.stats.call_rewards_used == 2
    # returns: a = [1.3, 1.0], b = [0.3, 0.0], c = [0.0, 0.0]; pooled mean 2.6 / 6
    mean = 2.6 / 6
    expected = {"a": [1.3, 1.0], "b": [0.3, 0.0], "c": [0.0, 0.0]}
    for member, returns in expected.items():
        assert trained_turn_advantages(batch, member) == pytest.approx([r - mean for r in returns for _ in range(2)])
    b, c = trained_turn_advantages(batch, "b"), trained_turn_advantages(batch, "c")
    assert b[0] > c[0] and b[2] == pytest.approx(c[2])  # the call reward shapes turn 0 only


def test_shaping_only_skips_reach_the_step_metrics() -> None:
    groups = [shaped("g-failed", FAILED_ALIKE), shaped("g-signal", [("a", 1.0, {"0": 0.3}), ("b", 0.0, None)])]
    batch = build_batch(groups, rules=Rules(scale_rewards="group", turn_credit="discounted"))
    assert batch.trained == ["g-signal"] and set(batch.skipped) == {"g-failed"}
    metrics = step_metrics(batch, groups, StepStats(), current=0, stale=0, wait_s=0.0, pass_threshold=1.0)
    assert metrics["data/groups_skipped_shaping_only"] == 1
    assert (metrics["data/groups_trained"], metrics["data/groups_skipped_equal"]) == (1, 0)


def test_shaping_is_a_checked_config_field_that_reaches_the_data_rules() -> None:
    assert TrainerConfig().shaping == "gated" and Rules().shaping == "gated"
    assert load_config(None, ["shaping=always"]).shaping == "always"
    assert data_rules(TrainerConfig(shaping="always")).shaping == "always"
    with pytest.raises(ConfigError, match="unknown shaping 'never'; choose one of gated, always"):
        TrainerConfig(shaping="never")  # type: ignore[arg-type]


def test_split_episode_is_normalised_as_one_member() -> None:
    broken = Episode(
        id="split",
        status="rewarded",
        reward=1.0,
        calls=[call(0, SYSTEM, [10, EOS]), call(1, SYSTEM + [99], [11, 12, EOS])],
    )  # re-rendered history: a break
    whole = Episode(id="whole", status="rewarded", reward=0.0, calls=[call(0, SYSTEM, [13, EOS])])
    group_ = Group(id="g", task_id="t", status="complete", episodes=[broken, whole])
    batch = build_batch([group_], rules=Rules(scale_rewards="none"))
    assert len(batch.samples) == 3 and batch.members == 2 and batch.stats.episodes_split == 1
    assert {s.member_loss_tokens for s in batch.samples if s.member == "split"} == {5}
    off = build_batch([group_], rules=Rules(scale_rewards="none", normalize_per_episode=False))
    assert {s.member_loss_tokens for s in off.samples} == {0}


@pytest.mark.parametrize(("rule", "trained"), [("penalize", True), ("skip", False)])
def test_abandoned_episodes_are_penalized_or_skipped_by_choice(rule: Abandoned, trained: bool) -> None:
    crashed = Episode(
        id="crashed",
        status="abandoned",
        abandon_reason="agent crashed: context overflow",
        abandon_cause="agent",
        calls=[call(0, SYSTEM, [14, EOS])],
    )
    # The cause decides, never the words: a reaped episode whose reason reads like an agent's failure
    # is still not penalized.
    reaped = Episode(
        id="reaped", status="abandoned", abandon_reason="agent gave no answer", abandon_cause="deadline", calls=[]
    )
    ok = [Episode(id=f"ok{i}", status="rewarded", reward=1.0, calls=[call(0, SYSTEM, [10 + i, EOS])]) for i in range(2)]
    group_ = Group(id="g", task_id="t", status="complete", episodes=[*ok, crashed, reaped])
    batch = build_batch([group_], rules=Rules(scale_rewards="none", abandoned=rule))
    if trained:
        assert batch.trained == ["g"] and batch.rewards == [1.0, 1.0, 0.0]
        assert {s.member: s.advantage for s in batch.samples}["crashed"] == pytest.approx(-2 / 3)
        assert (batch.stats.episodes_abandoned_penalized, batch.stats.episodes_abandoned_skipped) == (1, 1)
    else:
        assert batch.skipped_equal == 1 and batch.stats.episodes_abandoned_skipped == 2
    workflow_choice = Group(
        id="g", task_id="t", status="complete", metadata={"abandoned": rule}, episodes=[*ok, crashed, reaped]
    )
    assert build_batch([workflow_choice], rules=Rules(scale_rewards="none")).trained == (["g"] if trained else [])


def test_batch_scaling_takes_the_std_over_every_reward_like_trl() -> None:
    groups = [group("g-signal", [1.0, 0.0]), group("g-equal", [1.0, 1.0])]
    batch = build_batch(groups, max_seq_len=64, scale_rewards="batch")
    std = torch.tensor([1.0, 0.0, 1.0, 1.0]).std().item()  # the equal group's rewards are in the std
    assert batch.trained == ["g-signal"]
    assert {s.episode_id: s.advantage for s in batch.samples}["g-signal-0"] == pytest.approx(0.5 / (std + 1e-4))


def test_a_member_none_of_whose_calls_trains_is_counted_untrainable() -> None:
    """Issue 47: an agent that sends temperature 0 (or whose calls all fail) is recorded for nothing;
    the step says how many members were like that, beside the per-call counters that say why."""
    greedy = Episode(
        id="greedy",
        status="rewarded",
        reward=1.0,
        calls=[call(0, SYSTEM, [10, EOS], temperature=0.0), call(1, SYSTEM + [10, EOS, 5], [11, EOS], temperature=0.0)],
    )
    failed = Episode(id="failed", status="rewarded", reward=0.0, calls=[call(0, SYSTEM, None, status=500)])
    episodes = [greedy, failed, two_turn("sampled", 0.0), two_turn("sampled-2", 1.0)]
    batch = build_batch([Group(id="g", task_id="t", status="complete", episodes=episodes)])
    assert batch.stats.episodes_untrainable == 2
    assert batch.stats.calls_greedy == 2 and batch.stats.calls_failed == 1
