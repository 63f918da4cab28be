"""Turns to samples: an episode's turns spliced into as few token sequences as their exact ids allow.

A turn whose prompt ids start with everything a sample holds so far (its earlier prompts and
completions) extends that sample: the tokens in between (tool output, the next user turn, template
glue) join with loss mask 0, the new completion with mask 1 where trained. Any other turn is a
*break*: it starts a new sample, and is counted. A turn that returns to an earlier branch extends
that branch's sample. Samples longer than ``max_seq_len`` are truncated, samples left without a
trainable token dropped, both counted. Tokens a grammar forced (engine log-prob exactly 0) are out
of the loss: no decision was made there.
"""

from __future__ import annotations

from contract.client import Episode
from contract.tokens import extends
from trainer.counters import DataStats
from trainer.retokenize import Retokenizer
from trainer.sample import MODES, NAN, NOT_SAMPLED, PER_TOKEN, Sample
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
) -> list[Sample]:
    """Merge an episode's calls into as few samples as their exact token ids allow."""
    stats = stats if stats is not None else DataStats()
    member = episode.id if choice is None else f"{episode.id}#{choice}"
    if turns is None:
        turns = member_turns(episode, retokenize=retokenize, stats=stats, choice=choice, masker=masker)
    samples: list[Sample] = []
    for index, turn in enumerate(turns):
        # The newest sample this prompt extends: the last one, or an earlier branch the agent went
        # back to (an unrelated call, or another branch, came in between).
        current = next((x for x in reversed(samples) if extends(turn.prompt, x.input_ids)), None)
        if current is not None:
            stats.merged += 1
            gap = turn.prompt[len(current.input_ids) :]
        else:
            if samples:
                stats.breaks += 1
            current = _new_sample(group_id, episode.id, member)
            samples.append(current)
            gap = turn.prompt
        _append(current, gap, turn, index, stats)
    return _trimmed(samples, max_seq_len, stats)


def _trimmed(samples: list[Sample], max_seq_len: int, stats: DataStats) -> list[Sample]:
    """Samples cut to ``max_seq_len``, without those left with nothing to train (both counted)."""
    out = []
    for sample in samples:
        if len(sample) > max_seq_len:
            stats.samples_truncated += 1
            _truncate(sample, max_seq_len)
        if sample.num_loss_tokens == 0 or sample.loss_mask[0] == 1:
            stats.samples_empty += 1  # nothing sampled, or no context to predict the first token from
            continue
        out.append(sample)
    stats.samples += len(out)
    if len(out) > 1:
        stats.episodes_split += 1
    return out


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


def _truncate(sample: Sample, max_seq_len: int) -> None:
    for name in PER_TOKEN:
        value = getattr(sample, name)
        if value is not None:
            setattr(sample, name, value[:max_seq_len])
    sample.allowed = {j: row for j, row in sample.allowed.items() if j < max_seq_len}
