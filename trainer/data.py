"""Claimed groups to training samples: exact engine tokens, multi-turn merging, masks, advantages.

Per episode, calls are taken in order. A call whose prompt ids start with everything so far (the
previous prompt + completion) extends the current sample: the tokens in between (tool output, the
next user turn, template glue) join with loss mask 0, the new completion with mask 1. Any other
call is a *break*: it starts a new sample, and is counted. Retried calls (identical prompt ids, one
after another) keep the one a later call continues, else the last; the same prompt after other
turns is a branch and kept. Calls without exact ids are retokenized only if configured, else dropped, counted
either way. Samples longer than ``max_seq_len`` are truncated and counted. Nothing is dropped
silently: every rule has a counter in ``DataStats``.

Which tokens are trained is decided by the call's *effective* sampling, which the proxy records
(``notes.sampling``, see proxy/sampling.py): ``sampled`` and ``truncated`` calls are reproduced
exactly (temperature, top-k, top-p, min-p go to the log-prob computation); ``constrained`` calls
(grammar mask) are trained under the mask the engine applied, rebuilt from the recorded grammar
(``grammar.py``: ``masks`` per token), unless the proxy marked them ``exclude`` or the mask cannot
be rebuilt (both context only, counted), with tokens the grammar forced (engine log-prob exactly
0) out of the loss; ``penalized`` and ``greedy`` calls, and calls recorded without their effective
sampling, stay in the sequence as context with mask 0.

A call with n > 1 choices: in a multi-turn episode the choice that the next call continues is the
one merged (the others are counted as unused). A single-call episode whose choices each carry a
reward (``call_rewards`` keys ``"<ordinal>:<choice>"``) is trained as a group: every rewarded
choice is a group member of its own.

Group members and their advantages (``build_batch``): rewarded episodes (or choices), plus
abandoned episodes when ``abandoned`` is ``penalize`` (reward ``abandoned_reward``), except those
abandoned for reasons that are not the agent's doing (``contract.vocabulary.BLAMELESS``: its ``abandon_cause``).
``turn_credit: episode`` gives every token of a member the member's group-relative advantage;
``discounted`` gives each turn t the return G_t = c_t + gamma * G_{t+1} (G of the last turn = its
call reward + the episode reward), normalised over all turns of the group's members (AReaL's
``turn_discount``). ``normalize_per_episode`` makes every member weigh the same in the loss however
many samples its prefix breaks into (rLLM PR #512 found split episodes getting N times the weight).

Token layout of a sample: ``input_ids[j]`` with ``loss_mask[j] = 1`` when the policy sampled it and
it is trained, ``behaviour_logprobs[j]`` the engine's (processed) log-prob of it (NaN where unknown
or masked), and per token the sampling it was drawn with (``temperatures``, ``top_k``, ``top_p``,
``min_p``), the serving policy ``versions`` and the sampling ``modes`` (index into ``MODES``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from contract.client import Call, Episode, Group
from contract.tokens import continues, extends
from contract.vocabulary import BLAMELESS, TRAINED_MODES, Abandoned
from trainer.config import ScaleRewards, TurnCredit
from trainer.loss import group_advantages

NAN = float("nan")
MODES = TRAINED_MODES
"""Sampling modes whose tokens are trained; a token's ``modes`` entry indexes this (-1: not sampled)."""
Retokenizer = Callable[[Call], tuple[list[int], list[int]] | None]
"""(prompt ids, completion ids) rebuilt from a call's messages and reply text, or None."""
Masker = Callable[[dict[str, Any] | None, Sequence[int], Sequence[int]], "torch.Tensor | str"]
"""(recorded grammar, sampled ids, request stop ids) -> the (n, words) int32 bitmask each sampled id
was drawn under, or why it cannot be rebuilt (``trainer.grammar.GrammarMasks``)."""


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
    """The member's advantage; ``advantages`` overrides it per token (per-turn credit)."""
    member: str = ""
    """The group member the sample belongs to (episode id, or ``<episode>#<choice>``)."""
    top_k: list[int] | None = None
    top_p: list[float] | None = None
    min_p: list[float] | None = None
    versions: list[int] | None = None
    """Serving policy version per token (-1 where not sampled)."""
    modes: list[int] | None = None
    """Index into ``MODES`` per token (-1 where not sampled)."""
    allowed: dict[int, torch.Tensor] = field(default_factory=dict)
    """Position -> the (words,) int32 grammar bitmask the token there was sampled under (constrained
    calls only; ``grammar.py``'s layout). Absent positions were sampled without a mask."""
    turns: list[int] | None = None
    """Turn index within the member per token (-1 where not sampled): per-turn advantages."""
    advantages: list[float] | None = None
    member_loss_tokens: int = 0
    """Loss tokens of the whole member (all its samples): the per-episode normaliser; 0 = this sample's."""

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)

    def __len__(self) -> int:
        return len(self.input_ids)


PER_TOKEN = (
    "input_ids",
    "loss_mask",
    "behaviour_logprobs",
    "temperatures",
    "top_k",
    "top_p",
    "min_p",
    "versions",
    "modes",
    "turns",
    "advantages",
)


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
    calls_penalized: int = 0
    """Calls with penalties or token biases the trainer cannot reproduce: context only."""
    calls_constrained: int = 0
    """Grammar-constrained calls trained, scored under the engine's rebuilt token mask."""
    calls_constrained_excluded: int = 0
    """Grammar-constrained calls the proxy marked ``exclude``: context only."""
    calls_constrained_unmasked: int = 0
    """Grammar-constrained calls whose mask could not be rebuilt (no grammar recorded, another backend,
    a token the grammar refuses): context only, never scored without the mask."""
    calls_sampling_unrecorded: int = 0
    """Calls stored without their effective sampling (written before the proxy recorded it): context only."""
    calls_truncated_sampling: int = 0
    """Calls sampled with top-k/top-p/min-p (reproduced in the trainer's log-probs)."""
    calls_logprobs_missing: int = 0
    """Trained calls without per-token engine log-probs: no importance correction for them."""
    tokens_forced: int = 0
    """Constrained tokens the grammar forced (engine log-prob 0): no decision, out of the loss."""
    choices_unused: int = 0
    """Choices of n > 1 calls that no later call continued (and no per-choice reward named)."""
    merged: int = 0
    """Calls appended to the previous call's sample."""
    breaks: int = 0
    """Calls whose prompt did not extend the episode so far: a new sample started."""
    samples: int = 0
    samples_truncated: int = 0
    samples_empty: int = 0
    """Samples left without a trainable token (e.g. truncated to the prompt): dropped."""
    episodes_split: int = 0
    """Members whose calls broke into more than one sample (each weighs one episode if normalised)."""
    episodes_abandoned_penalized: int = 0
    episodes_abandoned_skipped: int = 0
    choice_members: int = 0
    """Group members that are single choices of an n > 1 call with per-choice rewards."""
    call_rewards_used: int = 0
    call_rewards_ignored: int = 0
    """Per-call rewards present but unused (``turn_credit: episode``, or naming an unmerged choice)."""
    turn_returns_untrained: int = 0
    """Per-turn credit: returns of turns with no trained token (greedy, penalized, excluded, truncated
    away), left out of their group's mean and std."""

    def add(self, other: DataStats) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Rules:
    """How groups become members and advantages (the trainer config's data and credit fields)."""

    max_seq_len: int = 2048
    min_rewarded: int = 2
    scale_rewards: ScaleRewards = "group"
    turn_credit: TurnCredit = "episode"
    turn_discount: float = 1.0
    abandoned: Abandoned | None = None
    """None: each group's workflow decides (group metadata ``abandoned``), else ``skip``."""
    abandoned_reward: float = 0.0
    normalize_per_episode: bool = True


@dataclass
class Batch:
    samples: list[Sample]
    trained: list[str]
    """Groups that produced samples (acked ``trained`` after the step)."""
    skipped: dict[str, str]
    """Group id to the reason it is acked ``skipped``."""
    rewards: list[float]
    """Rewards of the members of the trained groups."""
    advantages: list[float]
    """One per member of the trained groups (its mean token advantage under per-turn credit)."""
    members: int = 0
    """Members (episodes or choices) behind ``samples``: the per-episode loss normaliser."""
    skipped_equal: int = 0
    skipped_few: int = 0
    skipped_empty: int = 0
    stats: DataStats = field(default_factory=DataStats)
    episodes: dict[str, DataStats] = field(default_factory=dict)
    """The counters of each episode of the trained groups: its fidelity audit (``audit``)."""


# -- calls to turns ------------------------------------------------------------------------------


@dataclass
class _Turn:
    prompt: list[int]
    completion: list[int]
    logprobs: list[float]
    sampling: dict[str, Any]
    mode: int
    """Index into MODES, or -1: context only."""
    version: int | None
    ordinal: int
    choice: int
    masks: torch.Tensor | None = None
    """(len(completion), words) grammar bitmask of a trained constrained turn."""


def _sampling(call: Call, stats: DataStats) -> tuple[dict[str, Any], int]:
    """The call's effective sampling and its trained mode (-1: context only), counted."""
    recorded = (call.notes or {}).get("sampling")
    if not isinstance(recorded, dict):
        temperature = call.request.get("temperature")
        if temperature is not None and float(temperature) <= 0:
            stats.calls_greedy += 1
        else:
            stats.calls_sampling_unrecorded += 1
        return {"temperature": 1.0}, -1
    mode = recorded.get("mode")
    if mode == "greedy":
        stats.calls_greedy += 1
        return recorded, -1
    if mode == "penalized":
        stats.calls_penalized += 1
        return recorded, -1
    if mode == "constrained":
        if recorded.get("constrained") == "exclude":
            stats.calls_constrained_excluded += 1
            return recorded, -1
        stats.calls_constrained += 1
        return recorded, MODES.index("constrained")
    if mode == "truncated":
        stats.calls_truncated_sampling += 1
        return recorded, MODES.index("truncated")
    if mode == "sampled":
        return recorded, MODES.index("sampled")
    stats.calls_sampling_unrecorded += 1
    return recorded, -1


def _choice_tokens(call: Call, index: int) -> tuple[list[int], list[float]] | None:
    choice = next((c for c in call.choices if c.get("index", 0) == index), None)
    if choice is None or not call.exact_ids or call.prompt_token_ids is None or choice.get("token_ids") is None:
        return None
    return list(choice["token_ids"]), [float(x) for x in choice.get("logprobs") or []]


def _continued(prompt: list[int], choices: list[tuple[int, list[int]]], later: Sequence[Call]) -> int | None:
    """The choice the first later call that continues one of them continues, if any. A later call
    that only shares the prompt (an unrelated call, a retry of the same prompt) decides nothing."""
    for call in later:
        ids = call.prompt_token_ids
        if ids is None or not extends(ids, prompt):
            continue
        for index, completion in choices:
            if continues(ids, prompt, completion):
                return index
    return None


def _masks(call: Call, turn: _Turn, masker: Masker | None, stats: DataStats) -> None:
    """Rebuild the grammar mask of a trained constrained turn; one that cannot be rebuilt becomes context."""
    if turn.mode != MODES.index("constrained"):
        return
    found = (
        masker(turn.sampling.get("grammar"), turn.completion, call.request.get("stop_token_ids") or [])
        if masker is not None
        else "the trainer has no grammar masker (xgrammar is not installed)"
    )
    if isinstance(found, str):
        stats.calls_constrained -= 1
        stats.calls_constrained_unmasked += 1
        turn.mode = -1
        return
    turn.masks = found


def _turns(
    calls: Sequence[Call],
    retokenize: Retokenizer | None,
    stats: DataStats,
    force_choice: int | None = None,
    masker: Masker | None = None,
) -> list[_Turn]:
    """Usable calls of one episode, in order, as token turns (failed, foreign and inexact ones out)."""
    ordered = sorted(calls, key=lambda c: c.ordinal)
    turns: list[_Turn] = []
    for i, call in enumerate(ordered):
        stats.calls += 1
        if call.status_code != 200 or not call.choices:
            stats.calls_failed += 1
            continue
        if call.policy_version is None:
            stats.calls_foreign += 1
            continue
        index = int(call.choices[0].get("index", 0))
        if len(call.choices) > 1:
            indexed = [(int(c.get("index", 0)), list(c.get("token_ids") or [])) for c in call.choices]
            picked = (
                force_choice
                if force_choice is not None
                else _continued(list(call.prompt_token_ids or []), indexed, ordered[i + 1 :])
            )
            index = picked if picked is not None else index
            stats.choices_unused += len(call.choices) - 1
        prompt = list(call.prompt_token_ids or [])
        tokens = _choice_tokens(call, index)
        if tokens is None and retokenize is not None:
            rebuilt = retokenize(call)
            stats.calls_retokenized += rebuilt is not None
            if rebuilt is not None:
                prompt, tokens = rebuilt[0], (rebuilt[1], [])  # no engine log-probs for rebuilt ids
        if tokens is None:
            stats.calls_dropped_inexact += 1
            continue
        completion, logprobs = tokens
        sampling, mode = _sampling(call, stats)
        if mode >= 0 and len(logprobs) != len(completion):
            stats.calls_logprobs_missing += 1
        if len(logprobs) != len(completion):
            logprobs = [NAN] * len(completion)
        turn = _Turn(prompt, completion, logprobs, sampling, mode, call.policy_version, call.ordinal, index)
        _masks(call, turn, masker, stats)
        turns.append(turn)
    kept = _without_retries(turns)
    stats.calls_deduped += len(turns) - len(kept)
    return kept


def _without_retries(turns: list[_Turn]) -> list[_Turn]:
    """One turn per run of retries: calls with the same prompt one after another are one request
    asked again (a client timeout, an SDK retry); the one a later call continues is the answer the
    agent acted on, whatever order the calls committed in; if none is continued, the last. The same
    prompt sent again after other turns is a branch (an agent restarting from an earlier state), not
    a retry: both are kept, and the second starts a sample of its own."""
    kept: list[_Turn] = []
    i = 0
    while i < len(turns):
        j = i
        while j + 1 < len(turns) and turns[j + 1].prompt == turns[i].prompt:
            j += 1
        run, later = turns[i : j + 1], turns[j + 1 :]
        acted_on = next(
            (t for t in run if any(continues(n.prompt, t.prompt, t.completion) for n in later)),
            run[-1],
        )
        kept.append(acted_on)
        i = j + 1
    return kept


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


def _append(sample: Sample, gap: list[int], turn: _Turn, turn_index: int, stats: DataStats) -> None:
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
    version = turn.version if turn.version is not None else -1
    sample.versions += [-1] * len(gap) + [version if trained else -1] * n
    sample.modes += [-1] * len(gap) + [turn.mode] * n
    sample.turns += [-1] * len(gap) + [turn_index if trained else -1] * n
    if trained:
        sample.min_version = _min(sample.min_version, turn.version)


def _truncate(sample: Sample, max_seq_len: int) -> None:
    for name in PER_TOKEN:
        value = getattr(sample, name)
        if value is not None:
            setattr(sample, name, value[:max_seq_len])
    sample.allowed = {j: row for j, row in sample.allowed.items() if j < max_seq_len}


def member_turns(
    episode: Episode,
    *,
    retokenize: Retokenizer | None = None,
    stats: DataStats | None = None,
    choice: int | None = None,
    masker: Masker | None = None,
) -> list[_Turn]:
    """The usable turns of an episode (``choice`` forces the choice of n > 1 calls)."""
    return _turns(episode.calls or [], retokenize, stats if stats is not None else DataStats(), choice, masker)


def episode_samples(
    episode: Episode,
    *,
    group_id: str,
    max_seq_len: int,
    retokenize: Retokenizer | None = None,
    stats: DataStats | None = None,
    choice: int | None = None,
    turns: list[_Turn] | None = None,
    masker: Masker | None = None,
) -> list[Sample]:
    """Merge an episode's calls into as few samples as their exact token ids allow."""
    stats = stats if stats is not None else DataStats()
    member = episode.id if choice is None else f"{episode.id}#{choice}"
    if turns is None:
        turns = _turns(episode.calls or [], retokenize, stats, choice, masker)
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


# -- groups to members and advantages -------------------------------------------------------------


@dataclass
class _Member:
    key: str
    reward: float
    samples: list[Sample]
    turn_rewards: list[float]
    """Per-call reward of each turn (0 where none), in turn order."""


def _call_reward_keys(raw: dict[str, float] | None) -> dict[tuple[int, int | None], float]:
    """``{"3": r}`` -> (3, None): r; ``{"3:1": r}`` -> (3, 1): r (call ordinal, choice index)."""
    out: dict[tuple[int, int | None], float] = {}
    for key, value in (raw or {}).items():
        ordinal, _, choice = key.partition(":")
        out[(int(ordinal), int(choice) if choice else None)] = float(value)
    return out


def _choice_members(episode: Episode) -> dict[int, float] | None:
    """Per-choice rewards of a single-call n > 1 episode ({choice: reward}), or None."""
    usable = [c for c in episode.calls or [] if c.status_code == 200 and c.choices and c.policy_version is not None]
    if len(usable) != 1 or len(usable[0].choices) < 2:
        return None
    ordinal = usable[0].ordinal
    rewards = {c: r for (o, c), r in _call_reward_keys(episode.call_rewards).items() if o == ordinal and c is not None}
    return rewards if len(rewards) >= 2 else None


def _abandon_rule(group: Group, rules: Rules) -> Abandoned:
    if rules.abandoned is not None:
        return rules.abandoned
    chosen = (group.metadata or {}).get("abandoned")
    return "penalize" if chosen == "penalize" else "skip"


def _members(
    group: Group,
    rules: Rules,
    retokenize: Retokenizer | None,
    masker: Masker | None,
    group_stats: DataStats,
    episodes: dict[str, DataStats],
) -> list[_Member]:
    members: list[_Member] = []
    abandon = _abandon_rule(group, rules)
    for episode in group.episodes or []:
        stats = episodes.setdefault(episode.id, DataStats())
        members += _episode_members(episode, group, rules, abandon, retokenize, masker, stats)
        group_stats.add(stats)
    return members


def _episode_members(
    episode: Episode,
    group: Group,
    rules: Rules,
    abandon: Abandoned,
    retokenize: Retokenizer | None,
    masker: Masker | None,
    stats: DataStats,
) -> list[_Member]:
    """The episode's group members (itself, or its choices with per-choice rewards); ``stats`` its counters."""
    members: list[_Member] = []
    if episode.status == "rewarded" and episode.reward is not None:
        reward = float(episode.reward)
    elif episode.status == "abandoned":
        blameless = episode.abandon_cause in BLAMELESS
        if abandon != "penalize" or blameless:
            stats.episodes_abandoned_skipped += 1
            return members
        stats.episodes_abandoned_penalized += 1
        reward = rules.abandoned_reward
    else:
        return members
    per_choice = _choice_members(episode) if episode.status == "rewarded" else None
    if per_choice is not None:
        for n, (choice, choice_reward) in enumerate(sorted(per_choice.items())):
            choice_stats = DataStats()
            turns = member_turns(episode, retokenize=retokenize, stats=choice_stats, choice=choice, masker=masker)
            samples = episode_samples(
                episode,
                group_id=group.id,
                max_seq_len=rules.max_seq_len,
                stats=choice_stats,
                choice=choice,
                turns=turns,
            )
            choice_stats.choices_unused = 0  # the other choices are members of their own
            if n:  # the call was counted with the first choice
                choice_stats.calls = 0
            stats.add(choice_stats)
            stats.choice_members += 1
            stats.call_rewards_used += 1
            members.append(_Member(f"{episode.id}#{choice}", choice_reward, samples, [0.0] * len(turns)))
        return members
    turns = member_turns(episode, retokenize=retokenize, stats=stats, masker=masker)
    samples = episode_samples(episode, group_id=group.id, max_seq_len=rules.max_seq_len, stats=stats, turns=turns)
    members.append(_Member(episode.id, reward, samples, _turn_rewards(episode, turns, rules, stats)))
    return members


def _turn_rewards(episode: Episode, turns: list[_Turn], rules: Rules, stats: DataStats) -> list[float]:
    """Each turn's call reward (by ordinal, or by ordinal and the merged choice); the rest counted unused."""
    rewards = _call_reward_keys(episode.call_rewards)
    if not rewards:
        return [0.0] * len(turns)
    if rules.turn_credit == "episode":
        stats.call_rewards_ignored += len(rewards)
        return [0.0] * len(turns)
    out = []
    for turn in turns:
        value = rewards.pop((turn.ordinal, turn.choice), None)
        if value is None:
            value = rewards.pop((turn.ordinal, None), 0.0)
        out.append(value)
    stats.call_rewards_used += len(_call_reward_keys(episode.call_rewards)) - len(rewards)
    stats.call_rewards_ignored += len(rewards)
    return out


def _returns(member: _Member, gamma: float) -> list[float]:
    """G_t = c_t + gamma * G_{t+1}; the episode reward is received at the last turn."""
    out = [0.0] * len(member.turn_rewards)
    following = 0.0
    for t in range(len(out) - 1, -1, -1):
        following = member.turn_rewards[t] + (member.reward if t == len(out) - 1 else 0.0) + gamma * following
        out[t] = following
    return out


def _trained_turns(member: _Member) -> list[int]:
    """The member's turns with at least one token in the loss (greedy, penalized, excluded and
    truncated-away turns have none)."""
    turns = {t for s in member.samples for t, m in zip(s.turns or (), s.loss_mask, strict=False) if m and t >= 0}
    return sorted(turns)


def _values(members: list[_Member], rules: Rules, stats: DataStats) -> list[list[float]]:
    """What is compared within a group: one reward per member, or one return per trained turn. The
    returns of turns that are never trained do not enter the group's mean and std (counted); a
    member without turns (an abandon before any call) compares by its reward."""
    if rules.turn_credit == "episode":
        return [[m.reward] for m in members]
    values = []
    for member in members:
        returns = _returns(member, rules.turn_discount)
        if not returns:
            values.append([member.reward])
            continue
        trained = _trained_turns(member)
        stats.turn_returns_untrained += len(returns) - len(trained)
        values.append([returns[t] for t in trained])
    return values


def _assign(member: _Member, advantages: list[float], rules: Rules) -> float:
    """Set per-token advantages on the member's samples; return the member's mean token advantage.
    Under per-turn credit ``advantages`` holds one value per trained turn (``_trained_turns``)."""
    total, count = 0.0, 0
    by_turn = dict(zip(_trained_turns(member), advantages, strict=False))
    for sample in member.samples:
        if rules.turn_credit == "episode":
            sample.advantage = advantages[0]
            total += advantages[0] * sample.num_loss_tokens
        else:
            assert sample.turns is not None
            sample.advantages = [by_turn.get(t, 0.0) for t in sample.turns]
            total += sum(a for a, m in zip(sample.advantages, sample.loss_mask, strict=True) if m)
        count += sample.num_loss_tokens
    return total / count if count else 0.0


def build_batch(
    groups: Sequence[Group],
    *,
    max_seq_len: int | None = None,
    min_rewarded: int | None = None,
    scale_rewards: ScaleRewards | None = None,
    retokenize: Retokenizer | None = None,
    rules: Rules | None = None,
    masker: Masker | None = None,
) -> Batch:
    """Samples with advantages for the groups that carry a learning signal; the rest are skipped.

    ``scale_rewards: batch`` follows TRL: the std is that of every compared value of the step,
    equal-reward groups included (they then get zero advantages and are skipped for compute).
    """
    rules = rules or Rules()
    if max_seq_len is not None:
        rules = dataclasses.replace(rules, max_seq_len=max_seq_len)
    if min_rewarded is not None:
        rules = dataclasses.replace(rules, min_rewarded=min_rewarded)
    if scale_rewards is not None:
        rules = dataclasses.replace(rules, scale_rewards=scale_rewards)
    batch = Batch(samples=[], trained=[], skipped={}, rewards=[], advantages=[])
    kept: list[tuple[Group, list[_Member], list[list[float]]]] = []
    compared: list[float] = []
    for group in groups:
        stats, episodes = DataStats(), dict[str, DataStats]()
        members = _members(group, rules, retokenize, masker, stats, episodes)
        batch.stats.add(stats)
        if len(members) < rules.min_rewarded:
            batch.skipped[group.id] = (
                f"{len(members)} rewarded episodes (or penalized abandons, or rewarded "
                f"choices) < min_rewarded {rules.min_rewarded}"
            )
            batch.skipped_few += 1
            continue
        values = _values(members, rules, batch.stats)
        flat = [v for vs in values for v in vs]
        if not flat:
            batch.skipped[group.id] = "no trainable calls (see the data counters)"
            batch.skipped_empty += 1
            continue
        compared += flat
        if max(flat) - min(flat) <= 1e-12:
            batch.skipped[group.id] = f"all {len(flat)} rewards equal ({flat[0]:g}): no signal"
            batch.skipped_equal += 1
            continue
        if not any(m.samples for m in members):
            batch.skipped[group.id] = "no trainable calls (see the data counters)"
            batch.skipped_empty += 1
            continue
        kept.append((group, members, values))
        batch.episodes.update(episodes)
    if not kept:
        return batch
    pooled = [torch.tensor([v for vs in values for v in vs], dtype=torch.float64) for _, _, values in kept]
    scaled = group_advantages(pooled, rules.scale_rewards, batch_values=torch.tensor(compared, dtype=torch.float64))
    for (group, members, values), advantages in zip(kept, scaled, strict=True):
        batch.trained.append(group.id)
        flat = advantages.tolist()
        offset = 0
        for member, member_values in zip(members, values, strict=True):
            mine = flat[offset : offset + len(member_values)]
            offset += len(member_values)
            batch.rewards.append(member.reward)
            batch.advantages.append(_assign(member, mine, rules))
            loss_tokens = sum(s.num_loss_tokens for s in member.samples)
            for sample in member.samples:
                sample.member_loss_tokens = loss_tokens if rules.normalize_per_episode else 0
                batch.samples.append(sample)
            batch.members += bool(member.samples)
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
        ids = self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=generation_prompt,
            tokenize=True,
            chat_template=self.chat_template,
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def __call__(self, call: Call) -> tuple[list[int], list[int]] | None:
        messages = call.request.get("messages")
        choice = call.choices[0]
        if call.kind != "chat" or not isinstance(messages, list):
            prompt = call.request.get("prompt")
            if not isinstance(prompt, str):
                return None
            return (
                list(self.tokenizer.encode(prompt)),
                list(self.tokenizer.encode(choice.get("text") or "", add_special_tokens=False)),
            )
        tools = call.request.get("tools")
        prompt = self._render(messages, tools, True)
        reply = {"role": "assistant", "content": choice.get("text") or ""}
        if choice.get("tool_calls"):
            reply["tool_calls"] = choice["tool_calls"]
        full = self._render([*messages, reply], tools, False)
        if full[: len(prompt)] != prompt:
            return None
        completion = full[len(prompt) :]
        if self.eos in completion:
            completion = completion[: len(completion) - completion[::-1].index(self.eos)]
        return (prompt, completion) if completion else None


def staleness(samples: Sequence[Sample], current_version: int) -> list[int]:
    """Versions each sample's oldest trainable call lags the current policy."""
    return [current_version - s.min_version for s in samples if s.min_version is not None]


def finite_mean(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else 0.0
