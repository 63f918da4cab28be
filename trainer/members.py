"""A group's members: which episodes (or choices) are compared, with what reward, and their samples.

Members: rewarded episodes, plus abandoned episodes when ``abandoned`` is ``penalize`` (reward
``abandoned_reward``), except those abandoned for reasons that are not the agent's doing
(``contract.vocabulary.BLAMELESS``: its ``abandon_cause``). A single-call episode whose n > 1
choices each carry a reward (``call_rewards`` keys ``"<ordinal>:<choice>"``) is trained as a group
by itself: every rewarded choice is a member of its own. Under ``turn_credit: discounted`` each
turn also carries its call's reward (``turn_rewards``, used by ``credit.py``); otherwise per-call
rewards are counted unused.
"""

from __future__ import annotations

from dataclasses import dataclass

from contract.client import Episode, Group
from contract.vocabulary import BLAMELESS, Abandoned
from trainer.config import LongSamples, ScaleRewards, Shaping, TurnCredit
from trainer.counters import DataStats
from trainer.merge import episode_samples
from trainer.retokenize import Retokenizer
from trainer.sample import Sample
from trainer.turns import Masker, Turn, member_turns


@dataclass(frozen=True)
class Rules:
    """How groups become members and advantages (the trainer config's data and credit fields)."""

    max_seq_len: int = 2048
    long_samples: LongSamples = "split"
    scale_rewards: ScaleRewards = "group"
    turn_credit: TurnCredit = "episode"
    turn_discount: float = 1.0
    shaping: Shaping = "gated"
    """``gated``: per-turn credit trains only groups whose outcomes differ (``credit.shaping_only``)."""
    abandoned: Abandoned | None = None
    """None: each group's workflow decides (group metadata ``abandoned``), else ``skip``."""
    abandoned_reward: float = 0.0
    normalize_per_episode: bool = True


@dataclass
class Member:
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


def _abandon_rule(group: Group, rules: Rules) -> Abandoned:
    if rules.abandoned is not None:
        return rules.abandoned
    chosen = (group.metadata or {}).get("abandoned")
    return "penalize" if chosen == "penalize" else "skip"


def group_members(
    group: Group,
    rules: Rules,
    *,
    retokenize: Retokenizer | None,
    masker: Masker | None,
    group_stats: DataStats,
    episodes: dict[str, DataStats],
) -> list[Member]:
    """The group's members, in episode order; each episode's counters go to ``episodes`` and ``group_stats``."""
    members: list[Member] = []
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
) -> list[Member]:
    """The episode's group members (itself, or its choices with per-choice rewards); ``stats`` its counters."""
    reward = _reward(episode, rules, abandon, stats)
    if reward is None:
        return []
    per_choice = _choice_rewards(episode) if episode.status == "rewarded" else None
    if per_choice is not None:
        return _choice_members(episode, group, rules, per_choice, retokenize, masker, stats)
    turns = member_turns(episode, retokenize=retokenize, stats=stats, masker=masker)
    samples = episode_samples(
        episode,
        group_id=group.id,
        max_seq_len=rules.max_seq_len,
        stats=stats,
        turns=turns,
        long_samples=rules.long_samples,
    )
    return [Member(episode.id, reward, samples, _turn_rewards(episode, turns, rules, stats))]


def _reward(episode: Episode, rules: Rules, abandon: Abandoned, stats: DataStats) -> float | None:
    """The reward the episode is compared by, or None when it is not a member (abandons counted)."""
    if episode.status == "rewarded" and episode.reward is not None:
        return float(episode.reward)
    if episode.status != "abandoned":
        return None
    blameless = episode.abandon_cause in BLAMELESS
    if abandon != "penalize" or blameless:
        stats.episodes_abandoned_skipped += 1
        return None
    stats.episodes_abandoned_penalized += 1
    return rules.abandoned_reward


def _choice_rewards(episode: Episode) -> dict[int, float] | None:
    """Per-choice rewards of a single-call n > 1 episode ({choice: reward}), or None."""
    usable = [c for c in episode.calls or [] if c.status_code == 200 and c.choices and c.policy_version is not None]
    if len(usable) != 1 or len(usable[0].choices) < 2:
        return None
    ordinal = usable[0].ordinal
    rewards = {c: r for (o, c), r in _call_reward_keys(episode.call_rewards).items() if o == ordinal and c is not None}
    return rewards if len(rewards) >= 2 else None


def _choice_members(
    episode: Episode,
    group: Group,
    rules: Rules,
    per_choice: dict[int, float],
    retokenize: Retokenizer | None,
    masker: Masker | None,
    stats: DataStats,
) -> list[Member]:
    """One member per rewarded choice of the episode's single n > 1 call, each with that choice merged."""
    members: list[Member] = []
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
            long_samples=rules.long_samples,
        )
        choice_stats.choices_unused = 0  # the other choices are members of their own
        if n:  # the call was counted with the first choice
            choice_stats.calls = 0
        stats.add(choice_stats)
        stats.choice_members += 1
        stats.call_rewards_used += 1
        members.append(Member(f"{episode.id}#{choice}", choice_reward, samples, [0.0] * len(turns)))
    return members


def _turn_rewards(episode: Episode, turns: list[Turn], rules: Rules, stats: DataStats) -> list[float]:
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
