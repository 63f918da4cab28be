"""Turns to samples: an episode's turns spliced into as few token sequences as their exact ids allow.

A turn whose prompt ids start with everything a sample holds so far (its earlier prompts and
completions) extends that sample: the tokens in between (tool output, the next user turn, template
glue) join with loss mask 0, the new completion with mask 1 where trained. Any other turn is a
*break*: it starts a new sample, and is counted. A turn that returns to an earlier branch extends
that branch's sample. Samples left without a trainable token are dropped, counted. Tokens a grammar
forced (engine log-prob exactly 0) are out of the loss: no decision was made there.

Samples longer than ``max_seq_len`` are split at turn boundaries (``long_samples: split``). The
first part holds the whole turns that end within ``max_seq_len``; each later part is a window of
the sequence, ``max_seq_len`` tokens ending where its last whole turn ends: the turns after the
previous part as merged, preceded by as much of the sequence as fits, as context (loss mask 0, no
log-prob, sampling, version, mode or turn, no grammar mask): every trained token is trained in
exactly one part, which also holds the whole turn it belongs to. Its per-token fields and grammar
mask move with it (positions shift by the window's start).

Why a contiguous window (the most recent context): every trained token is then scored after
exactly the tokens it was generated from, less the earliest ones, at the same distances (rotary
attention sees the same relative positions). Restarting each part from the episode's first prompt
would keep the task in view, but splices two distant pieces into a sequence the engine never saw,
at distances it never used. Either way the trainer's log-prob of such a token is not the engine's:
the window is kept as long as ``max_seq_len`` allows, the tokens are counted
(``tokens_context_cut``), the truncated importance weight treats the difference as any other
engine/trainer mismatch, and the engine-gap check reports it.

A turn that no part can hold whole has no boundary to split at, and is cut at ``max_seq_len`` as
before (``samples_truncated``): the sample's first turn when its prompt and completion exceed
``max_seq_len`` (cut at its end, as before: a single-call episode trains exactly as it did), or a
later completion that does not fit after one token of context. The sample ends there, as a
truncated one did. ``long_samples: truncate`` cuts every long sample at ``max_seq_len``.
Continuations stay samples of their member: ``normalize_per_episode`` weighs the member once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from contract.client import Episode
from contract.tokens import extends
from trainer.config import LongSamples
from trainer.counters import DataStats
from trainer.retokenize import Retokenizer
from trainer.sample import CONTEXT, MODES, NAN, NOT_SAMPLED, PER_TOKEN, Sample
from trainer.turns import Masker, Turn, member_turns


def episode_samples(
    episode: Episode,
    *,
    group_id: str,
    max_seq_len: int,
    retokenize: Retokenizer | None = None,
    stats: DataStats | None = None,
    choice: int | None = None,
    turns: list[Turn] | None = None,
    masker: Masker | None = None,
    long_samples: LongSamples = "split",
) -> list[Sample]:
    """Merge an episode's calls into as few samples as their exact token ids allow, each at most
    ``max_seq_len`` tokens (longer ones split or truncated, ``long_samples``)."""
    stats = stats if stats is not None else DataStats()
    member = episode.id if choice is None else f"{episode.id}#{choice}"
    if turns is None:
        turns = member_turns(episode, retokenize=retokenize, stats=stats, choice=choice, masker=masker)
    samples: list[Sample] = []
    ends: list[list[int]] = []  # per sample: where each of its turns ends (its turn boundaries)
    for index, turn in enumerate(turns):
        # The newest sample this prompt extends: the last one, or an earlier branch the agent went
        # back to (an unrelated call, or another branch, came in between).
        at = next((i for i in reversed(range(len(samples))) if extends(turn.prompt, samples[i].input_ids)), None)
        if at is not None:
            stats.merged += 1
            gap = turn.prompt[len(samples[at].input_ids) :]
        else:
            if samples:
                stats.breaks += 1
            samples.append(_new_sample(group_id, episode.id, member))
            ends.append([])
            at = len(samples) - 1
            gap = turn.prompt
        _append(samples[at], gap, turn, index, stats)
        ends[at].append(len(samples[at]))
    return _trimmed(samples, ends, max_seq_len, long_samples, stats)


def _trimmed(
    samples: list[Sample], ends: list[list[int]], max_seq_len: int, long_samples: LongSamples, stats: DataStats
) -> list[Sample]:
    """Samples at most ``max_seq_len`` long, without those left with nothing to train (all counted)."""
    out = []
    for sample, turn_ends in zip(samples, ends, strict=True):
        parts = [sample]
        if len(sample) > max_seq_len and long_samples == "split":
            parts = _split(sample, turn_ends, max_seq_len, stats)
        elif len(sample) > max_seq_len:
            stats.samples_truncated += 1
            _truncate(sample, max_seq_len)
        for part in parts:
            if part.num_loss_tokens == 0 or part.loss_mask[0] == 1:
                stats.samples_empty += 1  # nothing sampled, or no context to predict the first token from
                continue
            out.append(part)
    stats.samples_built += len(out)
    if len(out) > 1:
        stats.episodes_split += 1
    return out


def _split(sample: Sample, ends: list[int], max_seq_len: int, stats: DataStats) -> list[Sample]:
    """A sample longer than ``max_seq_len`` as parts cut at its turn ``ends`` (the module docstring).

    Part one is the sequence up to the last turn end within ``max_seq_len``. A later part starts
    with the first trained token ``first`` after the previous part and ends at the last turn end
    ``end`` whose window ``[end - max_seq_len, end)`` still holds the token before ``first``.
    """
    end = max((e for e in ends if e <= max_seq_len), default=None)
    if end is None:  # the first turn alone is longer than max_seq_len: cut at its end, as before
        stats.samples_truncated += 1
        return [_window(sample, 0, 0, max_seq_len)]
    parts = [_window(sample, 0, 0, end)]
    while (first := next((j for j in range(end, len(sample)) if sample.loss_mask[j]), None)) is not None:
        reach = first - 1 + max_seq_len  # the furthest end of a window that holds first - 1
        done, end = end, max((e for e in ends if first < e <= reach), default=reach)
        start = end - max_seq_len
        parts.append(_window(sample, start, max(start, done), end))
        stats.samples_split += 1
        stats.tokens_context_cut += parts[-1].num_loss_tokens if start > 0 else 0
        if end not in ends:  # a completion longer than the window: cut, and the sample ends as it did
            stats.samples_truncated += 1
            break
    return parts


def _window(sample: Sample, start: int, own: int, end: int) -> Sample:
    """Tokens ``[start, end)`` of ``sample`` as a sample: ``[own, end)`` as merged, the tokens before
    ``own`` (another part's) context only; grammar masks follow their tokens."""
    fields: dict[str, Any] = {}  # name -> its per-token list
    for name in PER_TOKEN:
        value = getattr(sample, name)
        if value is not None:
            context = value[start:own] if name == "input_ids" else [CONTEXT[name]] * (own - start)
            fields[name] = context + value[own:end]
    allowed = {j - start: row for j, row in sample.allowed.items() if own <= j < end}
    part = dataclasses.replace(sample, **fields, allowed=allowed)
    versions, modes = part.versions or [], part.modes or []
    trained = [v for v, m in zip(versions, modes, strict=True) if m != NOT_SAMPLED and v != NOT_SAMPLED]
    part.min_version = min(trained, default=None)
    return part


def _min(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def _new_sample(group_id: str, episode_id: str, member: str) -> Sample:
    return Sample(
        group_id=group_id,
        episode_id=episode_id,
        member=member,
        input_ids=[],
        loss_mask=[],
        behaviour_logprobs=[],
        temperatures=[],
        top_k=[],
        top_p=[],
        min_p=[],
        versions=[],
        modes=[],
        turns=[],
    )


def _append(sample: Sample, gap: list[int], turn: Turn, turn_index: int, stats: DataStats) -> None:
    """Add the context ``gap`` (mask 0) and the turn's completion (mask 1 where trained)."""
    assert sample.top_k is not None and sample.top_p is not None and sample.min_p is not None
    assert sample.versions is not None and sample.modes is not None and sample.turns is not None
    s = turn.sampling
    n = len(turn.completion)
    trained = turn.mode >= 0
    mask = [int(trained)] * n
    if trained and MODES[turn.mode] == "constrained":
        forced = [lp == 0.0 for lp in turn.logprobs]  # the grammar left one token: no decision was made
        stats.tokens_forced += sum(forced)
        mask = [0 if f else 1 for f in forced]
    sample.input_ids += gap + turn.completion
    sample.loss_mask += [0] * len(gap) + mask
    sample.behaviour_logprobs += [NAN] * len(gap) + (turn.logprobs if trained else [NAN] * n)
    temperature = float(s.get("temperature", 1.0)) if trained else 1.0
    sample.temperatures += [1.0] * len(gap) + [temperature] * n
    sample.top_k += [0] * len(gap) + [int(s.get("top_k", 0)) if trained else 0] * n
    sample.top_p += [1.0] * len(gap) + [float(s.get("top_p", 1.0)) if trained else 1.0] * n
    sample.min_p += [0.0] * len(gap) + [float(s.get("min_p", 0.0)) if trained else 0.0] * n
    if trained and turn.masks is not None:
        start = len(sample.input_ids) - n
        sample.allowed.update((start + k, turn.masks[k]) for k in range(n))
    version = turn.version if turn.version is not None else NOT_SAMPLED
    sample.versions += [NOT_SAMPLED] * len(gap) + [version if trained else NOT_SAMPLED] * n
    sample.modes += [NOT_SAMPLED] * len(gap) + [turn.mode] * n
    sample.turns += [NOT_SAMPLED] * len(gap) + [turn_index if trained else NOT_SAMPLED] * n
    if trained:
        sample.min_version = _min(sample.min_version, turn.version)
    sample.rerendered |= turn.rerendered


def _truncate(sample: Sample, max_seq_len: int) -> None:
    for name in PER_TOKEN:
        value = getattr(sample, name)
        if value is not None:
            setattr(sample, name, value[:max_seq_len])
    sample.allowed = {j: row for j, row in sample.allowed.items() if j < max_seq_len}
