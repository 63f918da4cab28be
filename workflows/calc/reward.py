"""Task success and tool-call validity, kept apart, and the episode reward built from them.

- *success*: the submitted answer equals the gold answer. Only this is the episode reward, so a
  policy cannot gain reward by format alone (well-formed calls with the wrong numbers score 0).
- *validity*: each model call held exactly one call of a known tool whose arguments satisfy its
  schema. Reported apart (``call_validity``, ``all_valid``), never folded into the reward.
- *useful* calls (a calculator call that computes a reference step, a right submission) may earn
  per-call rewards (``call_rewards``, keyed by call ordinal), which the trainer uses only with
  per-turn credit (``turn_credit: discounted``).
"""

from __future__ import annotations

from dataclasses import dataclass

from workflows.calc.env import CalcEnv


@dataclass(frozen=True)
class Score:
    success: bool
    answer: int | None
    gold: int
    calls: int
    valid_calls: int
    useful_calls: int

    @property
    def all_valid(self) -> bool:
        return self.calls > 0 and self.valid_calls == self.calls

    @property
    def reward(self) -> float:
        return float(self.success)


def score(env: CalcEnv) -> Score:
    return Score(
        success=env.answer is not None and env.answer == env.task.answer,
        answer=env.answer,
        gold=env.task.answer,
        calls=len(env.calls),
        valid_calls=sum(c.valid for c in env.calls),
        useful_calls=sum(c.useful for c in env.calls),
    )


def call_rewards(env: CalcEnv, useful: float) -> dict[int, float] | None:
    """``useful`` for each useful call, by call ordinal (0-based, as the proxy numbers them); None if 0."""
    if useful == 0.0:
        return None
    return {ordinal: useful for ordinal, call in enumerate(env.calls) if call.useful}
