"""Samples longer than ``max_seq_len`` split at turn boundaries into continuation samples (issue 33).

A long agent episode, built call by call, against the same episode merged whole: every trained
token lands in exactly one sample, with its mask, engine log-prob, sampling, version, mode, turn and
grammar mask, after the sequence's own tokens before it (a left-truncated window); the counters say
what was split, cut and scored without its earliest context; a turn that no window can hold whole is
truncated as before; and the split member weighs what the whole one does.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from contract.client import Call, Episode, Group
from trainer.config import ConfigError, TrainerConfig, load_config
from trainer.data import DataStats, Rules, Sample, build_batch, episode_samples
from trainer.loop import data_rules
from trainer.loss import Totals, aggregate
from trainer.packing import collate

EOS = 2
SYSTEM = [1, 3, 4, 5]
TURNS = 8
CONSTRAINED, GREEDY = 1, 5
"""The turn sampled under a grammar (its middle token forced; the last token of the first part, so
also the context the second starts with), and the greedy one (context only)."""
GRAMMAR = {"structural_tag": '{"type": "structural_tag"}'}
SPLIT_AT = 16
"""max_seq_len: the 42-token episode in three parts (turns 0-1; 2-4; 6-7, with greedy 5 as context)."""


def masker(grammar: dict[str, Any] | None, completion: Any, stops: Any) -> torch.Tensor | str:
    """One distinct bitmask row per sampled token (``trainer/grammar.py`` rebuilds real ones)."""
    if grammar != GRAMMAR:
        return "no grammar recorded"
    return torch.tensor([[1 << k, 7 + len(completion)] for k in range(len(completion))], dtype=torch.int32)


def completion(turn: int) -> list[int]:
    return [100 + 10 * turn, 101 + 10 * turn, EOS]


def logprobs(turn: int) -> list[float]:
    """Distinct per token, so a token is found again wherever it lands (0.0: forced by the grammar)."""
    return [0.0 if turn == CONSTRAINED and k == 1 else -(10 * turn + k + 1) / 100 for k in range(3)]


def agent_call(ordinal: int, prompt: list[int], *, out: list[int], lps: list[float], version: int = 0) -> Call:
    record: dict[str, Any] = {"temperature": 0.8, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "mode": "sampled"}
    if ordinal == CONSTRAINED:
        record.update(mode="constrained", constrained="train", grammar=GRAMMAR)
    if ordinal == GREEDY:
        record.update(mode="greedy", temperature=0.0)
    return Call(
        ordinal=ordinal,
        request={"model": "policy", "messages": []},
        status_code=200,
        prompt_token_ids=prompt,
        choices=[{"index": 0, "token_ids": out, "logprobs": lps, "text": ""}],
        exact_ids=True,
        policy_version=version,
        notes={"sampling": record},
    )


def long_episode(eid: str = "long", reward: float = 1.0, call_rewards: dict[str, float] | None = None) -> Episode:
    """8 turns, each answering a 2-token tool output; policy version t // 2 serves turn t. 42 tokens:
    turn t's completion spans [4 + 5t, 7 + 5t)."""
    calls, prompt = [], list(SYSTEM)
    for t in range(TURNS):
        calls.append(agent_call(t, list(prompt), out=completion(t), lps=logprobs(t), version=t // 2))
        prompt += completion(t) + [200 + t, 201 + t]
    return Episode(id=eid, status="rewarded", reward=reward, calls=calls, call_rewards=call_rewards)


def short_episode(eid: str, reward: float) -> Episode:
    return Episode(
        id=eid,
        status="rewarded",
        reward=reward,
        calls=[agent_call(0, list(SYSTEM), out=[150, 151, EOS], lps=[-0.5, -0.6, -0.7])],
    )


def build(episode: Episode, max_seq_len: int, **kwargs: Any) -> tuple[list[Sample], DataStats]:
    stats = DataStats()
    samples = episode_samples(episode, group_id="g", max_seq_len=max_seq_len, stats=stats, masker=masker, **kwargs)
    return samples, stats


def offset(part: Sample, whole: Sample) -> int:
    """Where ``part``'s window starts in ``whole``'s sequence (it is a contiguous piece of it)."""
    (found,) = [k for k in range(len(whole) - len(part) + 1) if whole.input_ids[k : k + len(part)] == part.input_ids]
    return found


PER_TOKEN_CHECKED = ("loss_mask", "behaviour_logprobs", "temperatures", "top_k", "top_p", "min_p", "versions", "modes")


def same(a: Any, b: Any) -> bool:
    return (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)) or a == b


def test_every_trained_token_lands_in_exactly_one_window_with_everything_it_carries() -> None:
    (whole,), _ = build(long_episode(), 10_000)
    parts, stats = build(long_episode(), SPLIT_AT)

    assert [len(p) for p in parts] == [12, SPLIT_AT, SPLIT_AT]  # later parts: as long as max_seq_len allows
    starts = [offset(p, whole) for p in parts]
    assert starts == [0, 11, 26]
    trained_in: dict[int, int] = {}
    for part, start in zip(parts, starts, strict=True):
        assert part.turns is not None and whole.turns is not None
        for k in range(len(part)):
            j = start + k
            if part.loss_mask[k]:
                trained_in[j] = trained_in.get(j, 0) + 1
                # scored after the sequence's own tokens before it (only the earliest cut)
                assert part.input_ids[: k + 1] == whole.input_ids[start : j + 1]
                for name in PER_TOKEN_CHECKED:
                    assert same(getattr(part, name)[k], getattr(whole, name)[j]), (name, j)
                assert part.turns[k] == whole.turns[j]
        # the grammar mask follows each of its tokens (forced ones too), shifted by the window's start
        owned = {k + start for k in part.allowed}
        assert all(torch.equal(part.allowed[j - start], whole.allowed[j]) for j in owned)
    assert sorted(trained_in) == [j for j, m in enumerate(whole.loss_mask) if m]  # all of them ...
    assert set(trained_in.values()) == {1}  # ... each once
    assert sorted(j + s for p, s in zip(parts, starts, strict=True) for j in p.allowed) == sorted(whole.allowed)

    constrained = 4 + 5 * CONSTRAINED
    assert parts[0].loss_mask[constrained : constrained + 3] == [1, 0, 1]  # the forced token stays out
    # the second part starts with the first one's last token (the constrained turn's EOS): context here,
    # with nothing of its sampling, nor its grammar mask, kept
    second = parts[1]
    assert second.versions is not None and second.modes is not None and second.turns is not None
    assert second.input_ids[0] == EOS and whole.loss_mask[11] == 1 and 11 in whole.allowed
    assert (second.loss_mask[0], second.temperatures[0], second.versions[0], second.modes[0], second.turns[0]) == (
        0,
        1.0,
        -1,
        -1,
        -1,
    )
    assert math.isnan(second.behaviour_logprobs[0]) and 0 not in second.allowed
    greedy = 4 + 5 * GREEDY - 26
    assert parts[2].loss_mask[greedy : greedy + 3] == [0, 0, 0]
    assert [p.min_version for p in parts] == [0, 1, 3]  # turns 0-1, 2-4, 6-7 (greedy turn 5 is not sampled)

    counted = {k: v for k, v in stats.as_dict().items() if v}
    assert counted == {
        "calls": TURNS,
        "calls_greedy": 1,
        "calls_constrained": 1,
        "tokens_forced": 1,
        "merged": TURNS - 1,
        "samples_built": 3,
        "samples_split": 2,
        "tokens_context_cut": 3 * 5,  # turns 2, 3, 4, 6, 7
        "episodes_split": 1,
    }


def test_a_sample_that_fits_is_not_touched() -> None:
    (whole,), _ = build(long_episode(), 10_000)
    (fits,), stats = build(long_episode(), len(whole))
    assert fits.input_ids == whole.input_ids and fits.loss_mask == whole.loss_mask
    assert (stats.samples_split, stats.tokens_context_cut, stats.samples_truncated) == (0, 0, 0)


def test_a_single_turn_longer_than_max_seq_len_is_truncated_as_before() -> None:
    prompt = list(range(10, 20))
    single = Episode(
        id="e",
        status="rewarded",
        reward=1.0,
        calls=[agent_call(0, prompt, out=[30, 31, 32, 33, EOS], lps=[-0.1, -0.2, -0.3, -0.4, -0.5])],
    )
    (cut,), stats = build(single, 12)
    (old,), old_stats = build(single, 12, long_samples="truncate")
    assert cut.input_ids == old.input_ids == prompt + [30, 31]  # the prompt's start kept, the tail cut
    assert cut.loss_mask == old.loss_mask == [0] * 10 + [1, 1]
    assert cut.behaviour_logprobs[10:] == [-0.1, -0.2]
    assert (stats.samples_truncated, stats.samples_split, stats.tokens_context_cut) == (1, 0, 0)
    assert stats.as_dict() == old_stats.as_dict()


def test_a_completion_longer_than_a_window_is_cut_and_ends_the_sample() -> None:
    """The first turn fits; the second's 9-token completion cannot follow a token of context in 8."""
    long_out = list(range(40, 48)) + [EOS]
    calls = [
        agent_call(0, [1, 3, 4], out=[10, EOS], lps=[-0.1, -0.2]),
        agent_call(1, [1, 3, 4, 10, EOS, 50], out=long_out, lps=[-0.3] * 9),
        agent_call(2, [1, 3, 4, 10, EOS, 50, *long_out, 51], out=[60, EOS], lps=[-0.4, -0.5]),
    ]
    (first, cut), stats = build(Episode(id="e", status="rewarded", reward=1.0, calls=calls), 8)
    assert first.input_ids == [1, 3, 4, 10, EOS]
    assert cut.input_ids == [50, *long_out[:7]] and cut.loss_mask == [0] + [1] * 7  # turn 2 is lost, as before
    assert (stats.samples_built, stats.samples_split, stats.samples_truncated, stats.tokens_context_cut) == (2, 1, 1, 7)


def test_truncate_keeps_the_old_cut() -> None:
    (cut,), stats = build(long_episode(), SPLIT_AT, long_samples="truncate")
    (whole,), _ = build(long_episode(), 10_000)
    assert cut.input_ids == whole.input_ids[:SPLIT_AT] and cut.loss_mask == whole.loss_mask[:SPLIT_AT]
    assert (stats.samples_truncated, stats.samples_split, stats.samples_built) == (1, 0, 1)


def member_weights(samples: list[Sample], members: int) -> dict[str, float]:
    """Each member's share of the ``grpo`` loss of a per-token loss of 1 (the learner's aggregation)."""
    micro = collate(samples)
    out = {}
    for name in sorted({s.member for s in samples}):
        rows = torch.tensor([s.member == name for s in samples], dtype=torch.float32)[:, None]
        totals = Totals(sequences=members, tokens=micro.num_loss_tokens, micro_batches=1, max_completion_length=8)
        out[name] = aggregate(rows * micro.mask, micro.mask, "grpo", totals, micro.seq_tokens).item()
    return out


def test_the_split_member_weighs_what_the_whole_one_does() -> None:
    group = Group(id="g", task_id="t", status="complete", episodes=[long_episode(), short_episode("short", 0.0)])
    split = build_batch([group], rules=Rules(max_seq_len=SPLIT_AT, scale_rewards="none"), masker=masker)
    whole = build_batch([group], rules=Rules(max_seq_len=10_000, scale_rewards="none"), masker=masker)
    assert [s.member for s in split.samples] == ["long"] * 3 + ["short"] and split.members == whole.members == 2
    long_tokens = sum(s.num_loss_tokens for s in whole.samples if s.member == "long")
    assert {s.member_loss_tokens for s in split.samples if s.member == "long"} == {long_tokens}
    assert member_weights(split.samples, 2) == pytest.approx(member_weights(whole.samples, 2))
    assert member_weights(split.samples, 2) == pytest.approx({"long": 0.5, "short": 0.5})
    assert split.stats.samples_split == 2 and split.stats.episodes_split == 1


def trained_advantages(samples: list[Sample]) -> dict[float, float]:
    """Engine log-prob (distinct per token) -> the advantage of each trained token."""
    out = {}
    for sample in samples:
        assert sample.advantages is not None
        for lp, a, m in zip(sample.behaviour_logprobs, sample.advantages, sample.loss_mask, strict=True):
            if m:
                out[lp] = a
    return out


def test_per_turn_credit_follows_its_tokens_into_their_continuation() -> None:
    rewards = {"1": 0.2, "4": 0.5, "7": 0.1}
    episodes = [long_episode("a", 1.0, rewards), long_episode("b", 0.0, {"2": 0.3})]
    group = Group(id="g", task_id="t", status="complete", episodes=episodes)
    rules = Rules(scale_rewards="group", turn_credit="discounted", turn_discount=0.9)
    split = build_batch([group], rules=dataclasses.replace(rules, max_seq_len=SPLIT_AT), masker=masker)
    whole = build_batch([group], rules=dataclasses.replace(rules, max_seq_len=10_000), masker=masker)
    assert len(split.samples) == 6 and len(whole.samples) == 2
    cut = {m: trained_advantages([s for s in split.samples if s.member == m]) for m in ("a", "b")}
    for member, advantages in cut.items():
        assert advantages == pytest.approx(trained_advantages([s for s in whole.samples if s.member == member]))
    assert len(set(cut["a"].values())) == TURNS - 1  # a return per trained turn, each its own
    assert split.advantages == pytest.approx(whole.advantages)


def test_long_samples_is_a_checked_config_field() -> None:
    assert TrainerConfig().long_samples == "split"
    assert load_config(None, ["long_samples=truncate"]).long_samples == "truncate"
    with pytest.raises(ConfigError, match="unknown long_samples 'cut'; choose one of split, truncate"):
        TrainerConfig(long_samples="cut")  # type: ignore[arg-type]


def test_the_config_reaches_the_data_rules() -> None:
    """``trainer.loop.data_rules`` hands the field to ``build_batch``, or ``truncate`` would be ignored."""
    assert data_rules(TrainerConfig(long_samples="truncate")).long_samples == "truncate"
