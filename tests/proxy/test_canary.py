"""The canary test's statistics (``proxy/canary.py``): verdicts, their evidence, and the error rate
under continuous monitoring. Engine-free: seeded simulations with ``random.Random``."""

from __future__ import annotations

import json
import math
import random

import pytest
from pydantic import ValidationError

from proxy.canary import CanarySettings, CanaryTest, Decision


def bernoulli_run(
    p_canary: float, p_baseline: float, rng: random.Random, settings: CanarySettings, share: float = 0.5
) -> CanaryTest:
    """Rewards arrive one at a time in a random arm; the verdict is looked at after every one."""
    test = CanaryTest(settings)
    while test.verdict == "continue":
        arm = "canary" if rng.random() < share else "baseline"
        p = p_canary if arm == "canary" else p_baseline
        test.add(arm, 1.0 if rng.random() < p else 0.0)
    return test


def test_clearly_worse_canary_is_rolled_back() -> None:
    test = bernoulli_run(0.2, 0.8, random.Random(1), CanarySettings())
    decision = test.decide()
    assert decision.verdict == "rollback" and not decision.capped
    assert decision.upper < 0
    assert decision.lower <= -0.6 <= decision.upper  # the bounds hold the true difference
    assert decision.pairs < 200
    assert "upper bound" in decision.reason


def test_clearly_better_canary_is_promoted() -> None:
    test = bernoulli_run(0.9, 0.5, random.Random(2), CanarySettings())
    decision = test.decide()
    assert decision.verdict == "promote" and not decision.capped
    assert decision.lower > -decision.margin
    assert decision.pairs < 300


def test_worse_canary_with_a_small_share_is_rolled_back() -> None:
    test = bernoulli_run(0.3, 0.7, random.Random(3), CanarySettings(), share=0.1)
    decision = test.decide()
    assert decision.verdict == "rollback"
    assert decision.baseline.n > 4 * decision.canary.n  # the unpaired baseline rewards are counted, not paired
    assert decision.pairs == decision.canary.n


def test_equal_arms_are_mostly_not_rolled_back() -> None:
    rng = random.Random(4)
    settings = CanarySettings(margin=0.2)
    verdicts = [bernoulli_run(0.5, 0.5, rng, settings).verdict for _ in range(40)]
    assert verdicts.count("rollback") < len(verdicts) / 2
    assert verdicts.count("promote") > len(verdicts) / 2


def test_rollback_rate_of_equal_arms_under_continuous_monitoring() -> None:
    """200 canaries equal to their baseline, the verdict checked after every reward: rollbacks on
    evidence stay within sampling slack of alpha (2 * alpha), where a fixed-sample test peeked at
    this often would exceed it many times over."""
    rng = random.Random(5)
    settings = CanarySettings(alpha=0.05, margin=0.01, max_per_arm=250)
    runs = [bernoulli_run(0.5, 0.5, rng, settings).decide() for _ in range(200)]
    on_evidence = [d for d in runs if d.verdict == "rollback" and not d.capped]
    assert len(on_evidence) <= 2 * 0.05 * len(runs)
    assert sum(d.capped for d in runs) > len(runs) / 2  # margin 0.01 is mostly out of reach in 250 pairs


def naive_z_rolls_back(rng: random.Random, pairs: int, min_pairs: int = 20) -> bool:
    """A fixed-sample one-sided z-test at 5 % on the pair differences, peeked at after every pair."""
    total = total_sq = 0.0
    for n in range(1, pairs + 1):
        d = float(rng.random() < 0.5) - float(rng.random() < 0.5)
        total, total_sq = total + d, total_sq + d * d
        if n >= min_pairs:
            mean = total / n
            sd = math.sqrt(max(total_sq / n - mean * mean, 1e-12))
            if mean + 1.645 * sd / math.sqrt(n) < 0:
                return True
    return False


def test_the_error_rate_simulation_catches_a_peeking_test() -> None:
    """The simulation above can fail: the same 200 equal canaries, judged by a fixed-sample test
    peeked at after every pair, are rolled back far beyond 2 * alpha."""
    rng = random.Random(5)
    assert sum(naive_z_rolls_back(rng, 250) for _ in range(200)) > 2 * 0.05 * 200


def test_no_verdict_before_min_per_arm() -> None:
    settings = CanarySettings(min_per_arm=30)
    test = CanaryTest(settings)
    for _ in range(29):
        test.add("canary", 0.0)
        test.add("baseline", 1.0)
    assert test.bounds()[1] < 0  # the evidence is already there; only min_per_arm holds the verdict
    assert test.decide().verdict == "continue"
    for _ in range(100):
        test.add("baseline", 1.0)
    assert test.decide().verdict == "continue"  # one arm past the minimum is not enough
    test.add("canary", 0.0)
    decision = test.decide()
    assert decision.verdict == "rollback"
    assert decision.decided_at_pairs == 30


@pytest.mark.parametrize("reward", [1.5, -0.1, math.nan, math.inf])
def test_reward_outside_the_range_is_refused(reward: float) -> None:
    test = CanaryTest()
    with pytest.raises(ValueError, match=r"outside the canary test's range \[0.0, 1.0\]"):
        test.add("canary", reward)
    assert test.decide().canary.n == 0


def test_unknown_arm_and_other_ranges() -> None:
    test = CanaryTest(CanarySettings(low=-1.0, high=1.0))
    test.add("canary", -0.5)
    with pytest.raises(ValueError, match="arm must be"):
        test.add("control", 0.5)
    with pytest.raises(ValueError, match="outside"):
        test.add("baseline", -1.5)
    assert test.decide().canary.mean == -0.5


def test_settings_are_checked() -> None:
    with pytest.raises(ValidationError, match="low < high"):
        CanarySettings(low=1.0, high=1.0)
    with pytest.raises(ValidationError, match="margin"):
        CanarySettings(margin=1.0)
    with pytest.raises(ValidationError, match="max_per_arm"):
        CanarySettings(min_per_arm=50, max_per_arm=10)
    with pytest.raises(ValidationError):
        CanarySettings(alpha=0.0)


def test_replay_and_interleaving_give_the_same_decision() -> None:
    rng = random.Random(6)
    rewards = [("canary" if rng.random() < 0.3 else "baseline", rng.betavariate(2, 3)) for _ in range(3000)]
    live = CanaryTest()
    for arm, reward in rewards:
        live.add(arm, reward)
    assert CanaryTest.replay(rewards).decide() == live.decide()
    # Arms grouped instead of interleaved: the same pairs, so the same bounds and verdict.
    grouped = [r for r in rewards if r[0] == "baseline"] + [r for r in rewards if r[0] == "canary"]
    assert CanaryTest.replay(grouped).decide().evidence() == live.decide().evidence()
    # A different order within an arm is a different sequence of pairs.
    reordered = [r for r in rewards if r[0] == "canary"][::-1] + [r for r in rewards if r[0] == "baseline"]
    assert CanaryTest.replay(reordered).decide().evidence() != live.decide().evidence()


def test_evidence_round_trips_through_json() -> None:
    test = bernoulli_run(0.3, 0.7, random.Random(7), CanarySettings())
    decision = test.decide()
    evidence = decision.evidence()
    assert json.loads(json.dumps(evidence)) == evidence
    assert Decision.model_validate(json.loads(json.dumps(evidence))) == decision
    assert evidence["verdict"] == "rollback"
    assert set(evidence) >= {"canary", "baseline", "lower", "upper", "alpha", "margin", "reason", "pairs"}
    assert evidence["canary"]["n"] == test.decide().canary.n
    empty = CanaryTest().decide().evidence()
    assert json.loads(json.dumps(empty)) == empty and empty["canary"]["mean"] is None
    assert (empty["lower"], empty["upper"]) == (-1.0, 1.0)


@pytest.mark.parametrize("at_cap", ["rollback", "promote"])
def test_max_per_arm_decides_without_evidence(at_cap: str) -> None:
    settings = CanarySettings.model_validate({"margin": 0.01, "min_per_arm": 5, "max_per_arm": 60, "at_cap": at_cap})
    rng = random.Random(8)
    test = CanaryTest(settings)
    for _ in range(59):
        test.add("canary", rng.random())
        test.add("baseline", rng.random())
    assert test.decide().verdict == "continue"
    test.add("canary", 0.5)
    test.add("baseline", 0.5)
    decision = test.decide()
    assert decision.verdict == at_cap and decision.capped
    assert decision.decided_at_pairs == 60
    assert decision.lower < -0.01 and decision.upper > 0  # neither bound crossed
    assert "max_per_arm=60" in decision.reason


def test_verdict_sticks_while_evidence_updates() -> None:
    test = bernoulli_run(0.1, 0.9, random.Random(9), CanarySettings())
    first = test.decide()
    assert first.verdict == "rollback"
    for _ in range(200):
        test.add("canary", 1.0)
        test.add("baseline", 0.0)
    later = test.decide()
    assert later.verdict == "rollback" and later.decided_at_pairs == first.decided_at_pairs
    assert later.canary.n == first.canary.n + 200
    assert later.upper <= first.upper  # the running intersection never widens


def test_bounds_cover_the_true_difference_of_continuous_rewards() -> None:
    """Beta(4, 2) canary (mean 2/3) against Beta(2, 2) baseline (mean 1/2): the bounds bracket 1/6."""
    rng = random.Random(10)
    test = CanaryTest(CanarySettings(max_per_arm=100_000))
    for _ in range(2000):
        test.add("canary", rng.betavariate(4, 2))
        test.add("baseline", rng.betavariate(2, 2))
        lower, upper = test.bounds()
        assert lower <= 1 / 6 <= upper
    lower, upper = test.bounds()
    assert upper - lower < 0.15
    assert test.verdict == "promote"
