"""Claimed groups to training samples: exact engine tokens, multi-turn merging, masks, advantages.

Per episode, calls are taken in order. A call whose prompt ids start with everything so far (the
previous prompt + completion) extends the current sample: the tokens in between (tool output, the
next user turn, template glue) join with loss mask 0, the new completion with mask 1. Any other
call is a *break*: it starts a new sample, and is counted. Retried calls (identical prompt ids) keep
only the last. Calls without exact ids are retokenized only if configured, else dropped, counted
either way. Greedy calls (temperature 0) stay in as context with mask 0: they were not sampled from
the policy. Samples longer than ``max_seq_len`` are truncated and counted. Nothing is dropped
silently: every rule has a counter in ``DataStats``.

Token layout of a sample: ``input_ids[j]`` with ``loss_mask[j] = 1`` when the policy sampled it,
``behaviour_logprobs[j]`` the engine's (processed) log-prob of it (NaN where unknown or masked) and
``temperatures[j]`` the temperature it was sampled at.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer.client import Call, Episode, Group
from trainer.loss import group_advantages

NAN = float("nan")
Retokenizer = Callable[[Call], tuple[list[int], list[int]] | None]
"""(prompt ids, completion ids) rebuilt from a call's messages and reply text, or None."""


@dataclass
class Sample:
    group_id: str
    episode_id: str
    input_ids: list[int]
    loss_mask: list[int]
    behaviour_logprobs: list[float]
    temperatures: list[float]
    min_version: int | None = None
    advantage: float = 0.0

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class DataStats:
    """Counters of every rule that changes or drops data (summed over a step's groups)."""

    calls: int = 0
    calls_failed: int = 0
    """Errored calls or calls without a choice: nothing to train on."""
    calls_foreign: int = 0
    """Calls to a model that is not the policy (no policy version): not the behaviour policy."""
    calls_deduped: int = 0
    """Earlier copies of retried calls (same prompt ids)."""
    calls_retokenized: int = 0
    calls_dropped_inexact: int = 0
    """Calls without exact token ids, dropped because retokenize_inexact is off (or it failed)."""
    calls_greedy: int = 0
    """Temperature-0 calls, kept as context with loss mask 0."""
    calls_logprobs_missing: int = 0
    """Sampled calls without per-token engine log-probs: no importance correction for them."""
    merged: int = 0
    """Calls appended to the previous call's sample."""
    breaks: int = 0
    """Calls whose prompt did not extend the episode so far: a new sample started."""
    samples: int = 0
    samples_truncated: int = 0
    samples_empty: int = 0
    """Samples left without a trainable token (e.g. truncated to the prompt): dropped."""

    def add(self, other: DataStats) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass
class Batch:
    samples: list[Sample]
    trained: list[str]
    """Groups that produced samples (acked ``trained`` after the step)."""
    skipped: dict[str, str]
    """Group id to the reason it is acked ``skipped``."""
    rewards: list[float]
    """Rewards of the rewarded episodes of the trained groups."""
    advantages: list[float]
    """One per rewarded episode of the trained groups."""
    skipped_equal: int = 0
    skipped_few: int = 0
    skipped_empty: int = 0
    stats: DataStats = field(default_factory=DataStats)


def _temperature(call: Call) -> float:
    value = call.request.get("temperature")
    return 1.0 if value is None else float(value)


def _exact_tokens(call: Call) -> tuple[list[int], list[int]] | None:
    choice = call.choices[0]
    ids = choice.get("token_ids")
    if not call.exact_ids or call.prompt_token_ids is None or ids is None:
        return None
    return list(call.prompt_token_ids), list(ids)


@dataclass
class _Turn:
    prompt: list[int]
    completion: list[int]
    logprobs: list[float]
    temperature: float
    trainable: bool
    version: int | None


def _turns(calls: Sequence[Call], retokenize: Retokenizer | None, stats: DataStats) -> list[_Turn]:
    """Usable calls of one episode, in order, as token turns (failed, foreign and inexact ones out)."""
    turns: list[_Turn] = []
    for call in sorted(calls, key=lambda c: c.ordinal):
        stats.calls += 1
        if call.status_code != 200 or not call.choices:
            stats.calls_failed += 1
            continue
        if call.policy_version is None:
            stats.calls_foreign += 1
            continue
        tokens = _exact_tokens(call)
        exact = tokens is not None
        if tokens is None and retokenize is not None:
            tokens = retokenize(call)
            stats.calls_retokenized += tokens is not None
        if tokens is None:
            stats.calls_dropped_inexact += 1
            continue
        prompt, completion = tokens
        temperature = _temperature(call)
        logprobs = [float(x) for x in call.choices[0].get("logprobs") or []] if exact else []
        if temperature <= 0:
            stats.calls_greedy += 1
        elif len(logprobs) != len(completion):
            stats.calls_logprobs_missing += 1
        if len(logprobs) != len(completion):
            logprobs = [NAN] * len(completion)
        turns.append(_Turn(prompt, completion, logprobs, temperature if temperature > 0 else 1.0,
                           trainable=temperature > 0, version=call.policy_version))
    # Retries: a prompt that appears again later was answered again; keep the last answer only.
    last = {tuple(t.prompt): i for i, t in enumerate(turns)}
    kept = [t for i, t in enumerate(turns) if last[tuple(t.prompt)] == i]
    stats.calls_deduped += len(turns) - len(kept)
    return kept


def _min(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def episode_samples(episode: Episode, *, group_id: str, max_seq_len: int,
                    retokenize: Retokenizer | None = None, stats: DataStats | None = None) -> list[Sample]:
    """Merge an episode's calls into as few samples as their exact token ids allow."""
    stats = stats if stats is not None else DataStats()
    samples: list[Sample] = []
    current: Sample | None = None
    for turn in _turns(episode.calls or [], retokenize, stats):
        if current is not None and turn.prompt[:len(current.input_ids)] == current.input_ids:
            stats.merged += 1
            gap = turn.prompt[len(current.input_ids):]
        else:
            if current is not None:
                stats.breaks += 1
            current = Sample(group_id=group_id, episode_id=episode.id, input_ids=[], loss_mask=[],
                             behaviour_logprobs=[], temperatures=[])
            samples.append(current)
            gap = turn.prompt
        current.input_ids += gap + turn.completion
        current.loss_mask += [0] * len(gap) + [int(turn.trainable)] * len(turn.completion)
        current.behaviour_logprobs += [NAN] * len(gap) + (turn.logprobs if turn.trainable else
                                                          [NAN] * len(turn.completion))
        current.temperatures += [1.0] * len(gap) + [turn.temperature] * len(turn.completion)
        if turn.trainable:
            current.min_version = _min(current.min_version, turn.version)
    out = []
    for sample in samples:
        if len(sample) > max_seq_len:
            stats.samples_truncated += 1
            for name in ("input_ids", "loss_mask", "behaviour_logprobs", "temperatures"):
                setattr(sample, name, getattr(sample, name)[:max_seq_len])
        if sample.num_loss_tokens == 0 or sample.loss_mask[0] == 1:
            stats.samples_empty += 1  # nothing sampled, or no context to predict the first token from
            continue
        out.append(sample)
    stats.samples += len(out)
    return out


def build_batch(groups: Sequence[Group], *, max_seq_len: int, min_rewarded: int, scale_rewards: str,
                retokenize: Retokenizer | None = None) -> Batch:
    """Samples with advantages for the groups that carry a learning signal; the rest are skipped."""
    batch = Batch(samples=[], trained=[], skipped={}, rewards=[], advantages=[])
    kept: list[tuple[Group, list[Episode], list[list[Sample]]]] = []
    for group in groups:
        rewarded = [e for e in group.episodes or [] if e.status == "rewarded" and e.reward is not None]
        rewards = [float(e.reward) for e in rewarded if e.reward is not None]
        if len(rewarded) < min_rewarded:
            batch.skipped[group.id] = f"{len(rewarded)} rewarded episodes < min_rewarded {min_rewarded}"
            batch.skipped_few += 1
            continue
        if max(rewards) - min(rewards) <= 1e-12:
            batch.skipped[group.id] = f"all {len(rewards)} rewards equal ({rewards[0]:g}): no signal"
            batch.skipped_equal += 1
            continue
        stats = DataStats()
        per_episode = [episode_samples(e, group_id=group.id, max_seq_len=max_seq_len, retokenize=retokenize,
                                       stats=stats) for e in rewarded]
        batch.stats.add(stats)
        if not any(per_episode):
            batch.skipped[group.id] = "no trainable calls (see the data counters)"
            batch.skipped_empty += 1
            continue
        kept.append((group, rewarded, per_episode))
    if not kept:
        return batch
    reward_tensors = [torch.tensor([float(e.reward or 0.0) for e in eps], dtype=torch.float64) for _, eps, _ in kept]
    advantages = group_advantages(reward_tensors, scale_rewards)  # type: ignore[arg-type]
    for (group, _episodes, per_episode), group_rewards, adv in zip(kept, reward_tensors, advantages, strict=True):
        batch.trained.append(group.id)
        batch.rewards += group_rewards.tolist()
        batch.advantages += adv.tolist()
        for samples, value in zip(per_episode, adv.tolist(), strict=True):
            for sample in samples:
                sample.advantage = value
                batch.samples.append(sample)
    return batch


class ChatRetokenizer:
    """Rebuild a call's token ids from its messages and reply with the chat template (opt-in).

    The completion is the rendered assistant turn minus the prompt, cut after its last end-of-turn
    token, so it ends like an engine completion that stopped on EOS.
    """

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.eos = tokenizer.eos_token_id

    def _render(self, messages: list[dict[str, Any]], tools: Any, generation_prompt: bool) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                                 tokenize=True, chat_template=self.chat_template)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def __call__(self, call: Call) -> tuple[list[int], list[int]] | None:
        messages = call.request.get("messages")
        choice = call.choices[0]
        if call.kind != "chat" or not isinstance(messages, list):
            prompt = call.request.get("prompt")
            if not isinstance(prompt, str):
                return None
            return (list(self.tokenizer.encode(prompt)),
                    list(self.tokenizer.encode(choice.get("text") or "", add_special_tokens=False)))
        tools = call.request.get("tools")
        prompt = self._render(messages, tools, True)
        reply = {"role": "assistant", "content": choice.get("text") or ""}
        if choice.get("tool_calls"):
            reply["tool_calls"] = choice["tool_calls"]
        full = self._render([*messages, reply], tools, False)
        if full[:len(prompt)] != prompt:
            return None
        completion = full[len(prompt):]
        if self.eos in completion:
            completion = completion[:len(completion) - completion[::-1].index(self.eos)]
        return (prompt, completion) if completion else None


def staleness(samples: Sequence[Sample], current_version: int) -> list[int]:
    """Versions each sample's oldest trainable call lags the current policy."""
    return [current_version - s.min_version for s in samples if s.min_version is not None]


def finite_mean(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else 0.0
