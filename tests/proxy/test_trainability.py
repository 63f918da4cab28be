"""contract/trainability.py: why a call trains nothing, and an episode's reason when none of its calls
trains; the rule the export's loss mask and the trainer follow."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from contract.trainability import FIX, Untrained, untrainable, untrained


@dataclass
class FakeCall:
    """A call's facts as the rule reads them (the contract's Call and the store's record both have them)."""

    status_code: int = 200
    notes: dict[str, Any] | None = field(default_factory=lambda: {"sampling": {"mode": "sampled"}})
    policy_version: int | None = 3
    exact_ids: bool = True
    prompt_token_ids: list[int] | None = field(default_factory=lambda: [1, 2, 3])


def mode(name: str, **extra: Any) -> dict[str, Any]:
    return {"sampling": {"mode": name, **extra}}


@pytest.mark.parametrize(
    ("call", "why"),
    [
        (FakeCall(), None),
        (FakeCall(notes=mode("truncated")), None),
        (FakeCall(notes=mode("constrained", constrained="train", grammar={"json": {}})), None),
        (FakeCall(status_code=499), "not_answered"),
        (FakeCall(status_code=400, notes={"refused": True}), "not_answered"),
        (FakeCall(notes={**mode("sampled"), "purged": True}), "purged"),
        (FakeCall(notes={**mode("sampled"), "replay": {"source_episode_id": "e"}}), "replayed"),
        (FakeCall(notes=mode("greedy")), "greedy"),
        (FakeCall(notes=mode("penalized")), "penalized"),
        (FakeCall(notes=mode("constrained", constrained="exclude", grammar={"json": {}})), "constrained_context"),
        (FakeCall(notes=mode("constrained", constrained="train", grammar=None)), "constrained_context"),
        (FakeCall(notes=None), "unsampled"),
        (FakeCall(policy_version=None), "no_policy_version"),
        (FakeCall(exact_ids=False), "no_exact_ids"),
        (FakeCall(prompt_token_ids=None), "no_exact_ids"),
    ],
)
def test_why_one_call_trains_nothing(call: FakeCall, why: Untrained | None) -> None:
    assert untrained(call) == why


def test_one_trained_call_makes_the_episode_trainable() -> None:
    assert untrainable([FakeCall(notes=mode("greedy")), FakeCall(), FakeCall(status_code=500)]) is None


def test_an_episode_with_no_calls_yet_says_nothing() -> None:
    assert untrainable([]) is None


def test_an_untrainable_episode_is_named_by_the_reason_most_calls_share() -> None:
    calls = [FakeCall(notes=mode("greedy")), FakeCall(notes=mode("greedy")), FakeCall(status_code=499)]
    assert untrainable(calls) == "greedy"
    tie = [FakeCall(status_code=499), FakeCall(notes=mode("penalized"))]
    assert untrainable(tie) == "not_answered"  # a tie: the earlier reason in the rule's order


def test_every_reason_has_its_fix() -> None:
    from typing import get_args

    assert set(FIX) == set(get_args(Untrained))
    assert all(text and not text.endswith(".") for text in FIX.values())  # the page adds the full stop
