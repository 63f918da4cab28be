"""Credit: what is compared within a group, and the advantage each trained token gets back.

``turn_credit: episode`` gives every token of a member the member's group-relative advantage (plain
GRPO); ``discounted`` gives each turn t the return G_t = c_t + gamma * G_{t+1} (G of the last turn =
its call reward + the episode reward), normalised over all trained turns of the group's members
(AReaL's ``turn_discount``). The normalisation itself is ``loss.group_advantages``.

Per-call rewards are shaping: they are not the outcome, and they are not potential-based (Ng, Harada
& Russell 1999: only shaping of the form gamma * Phi(s') - Phi(s) provably leaves the optimal policy
unchanged), so a policy can learn to earn them instead of the outcome. Under ``shaping: gated``
(the default) they therefore refine credit only in groups whose outcomes differ (``shaping_only``):
a group that failed (or succeeded) alike is skipped, so shaping is never the only signal (issue 44:
the calc agent trained on call rewards alone, every group kept, success 0 from step 30).
"""

from __future__ import annotations

from trainer.counters import DataStats
from trainer.members import Member, Rules

EQUAL = 1e-12
"""Values closer than this are equal: no signal between them."""


def member_values(members: list[Member], rules: Rules, stats: DataStats) -> list[list[float]]:
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


def shaping_only(members: list[Member], rules: Rules) -> bool:
    """Whether the group's compared values can differ by shaping alone: per-turn credit, gated
    shaping and every member's outcome (episode, choice or penalized-abandon reward) equal. Such a
    group has no outcome signal; its returns differ only by call rewards or by the discount."""
    if rules.turn_credit == "episode" or rules.shaping != "gated":
        return False
    outcomes = [m.reward for m in members]
    return max(outcomes) - min(outcomes) <= EQUAL


def assign(member: Member, advantages: list[float], rules: Rules) -> float:
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


def _returns(member: Member, gamma: float) -> list[float]:
    """G_t = c_t + gamma * G_{t+1}; the episode reward is received at the last turn."""
    out = [0.0] * len(member.turn_rewards)
    following = 0.0
    for t in range(len(out) - 1, -1, -1):
        following = member.turn_rewards[t] + (member.reward if t == len(out) - 1 else 0.0) + gamma * following
        out[t] = following
    return out


def _trained_turns(member: Member) -> list[int]:
    """The member's turns with at least one token in the loss (greedy, penalized, excluded and
    truncated-away turns have none)."""
    turns = {t for s in member.samples for t, m in zip(s.turns or (), s.loss_mask, strict=False) if m and t >= 0}
    return sorted(turns)
