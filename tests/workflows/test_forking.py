"""Where the runner forks a finished group (``workflows/forking.py``), on hand-built episodes."""

from __future__ import annotations

import random

from contract.client import Call, Episode
from workflows.config import RunConfig
from workflows.forking import fork_point

NOWHERE = "no rewarded episode with a sampled agent call after its first answered call"


def call(ordinal: int, logprobs: list[float], *, side: bool = False) -> Call:
    """An answered call as the proxy records it: the agent's is sampled under a policy version; a
    side call (a user simulator's, on the passthrough route) has no version and answers greedily."""
    return Call(
        ordinal=ordinal,
        choices=[{"index": 0, "token_ids": [1] * len(logprobs), "logprobs": logprobs}],
        policy_version=None if side else 1,
        notes={"side": True, "sampling": {"mode": "greedy"}} if side else {"sampling": {"mode": "sampled"}},
    )


def episode(
    name: str,
    reward: float | None,
    logprobs: list[list[float]],
    *,
    failed: int | None = None,
    side: tuple[int, ...] = (),
) -> Episode:
    """An episode whose answered calls sampled tokens with these engine log-probs (a failed call
    at ordinal ``failed`` is no answered call: a fork never replays it; calls ``side`` are side calls)."""
    calls = [call(i, lp, side=i in side) for i, lp in enumerate(logprobs)]
    if failed is not None:
        calls.insert(failed, Call(ordinal=failed, status_code=500))
        calls = [c.model_copy(update={"ordinal": i}) for i, c in enumerate(calls)]
    return Episode(id=name, status="rewarded" if reward is not None else "abandoned", reward=reward, calls=calls)


def test_failure_forks_the_lowest_rewarded_episode_before_its_last_call() -> None:
    group = [episode("good", 1.0, [[-0.1], [-0.2], [-0.3]]), episode("bad", 0.0, [[-0.1], [-0.2]], failed=1)]
    point = fork_point(group, "failure", random.Random(0))
    assert not isinstance(point, str)
    assert (point.source, point.at) == ("bad", 1)  # two answered calls: replay one, sample the last
    same = [episode("a", 1.0, [[-0.1], [-0.2]]), episode("b", 1.0, [[-0.1], [-0.2]])]
    assert "no failure" in str(fork_point(same, "failure", random.Random(0)))


def test_entropy_forks_at_the_least_certain_call_after_the_first() -> None:
    group = [
        episode("a", 1.0, [[-9.0], [-0.1, -0.3], [-0.2]]),  # call 0 is the most uncertain, but is the whole episode
        episode("b", 0.0, [[-0.1], [-0.1], [-2.0, -1.0]]),
    ]
    point = fork_point(group, "entropy", random.Random(0))
    assert not isinstance(point, str)
    assert (point.source, point.at) == ("b", 2)


def test_fork_points_are_the_agents_sampled_calls_never_a_side_call() -> None:
    """A tau2 conversation ends with the user simulator's (greedy, side) call: forking there would
    sample no agent decision, and its log-probs say nothing of the policy's certainty."""
    group = [
        episode("won", 1.0, [[-0.1], [-0.2], [-0.1], [-5.0]], side=(1, 3)),
        episode("lost", 0.0, [[-0.1], [-0.3], [-0.4], [-9.0]], side=(1, 3)),
    ]
    failure = fork_point(group, "failure", random.Random(0))
    assert not isinstance(failure, str)
    assert (failure.source, failure.at) == ("lost", 2)  # the agent's last call, not the customer's
    entropy = fork_point(group, "entropy", random.Random(0))
    assert not isinstance(entropy, str)
    assert (entropy.source, entropy.at) == ("lost", 2)
    rng = random.Random(1)
    assert {getattr(fork_point(group, "uniform", rng), "at", None) for _ in range(50)} == {2}
    customer_only = [episode("a", 1.0, [[-0.1], [-0.2]], side=(1,)), episode("b", 0.0, [[-0.1], [-0.2]], side=(1,))]
    assert fork_point(customer_only, "failure", rng) == NOWHERE


def test_uniform_points_fall_inside_every_candidate_and_no_candidate_is_a_reason() -> None:
    group = [episode("a", 1.0, [[-0.1]] * 4), episode("b", 0.5, [[-0.1]] * 2), episode("c", None, [[-0.1]] * 9)]
    rng = random.Random(3)
    seen = set()
    for _ in range(200):
        point = fork_point(group, "uniform", rng)
        assert not isinstance(point, str)
        assert point.source in ("a", "b")  # never an abandoned episode
        assert 1 <= point.at <= (3 if point.source == "a" else 1)
        seen.add((point.source, point.at))
    assert seen == {("a", 1), ("a", 2), ("a", 3), ("b", 1)}
    assert fork_point([episode("one-call", 1.0, [[-0.1]])], "uniform", rng) == NOWHERE


def test_fork_settings_are_checked_when_the_run_is_configured() -> None:
    for bad in ({"fork_share": 1.0}, {"fork_rule": "random"}, {"fork_size": 1}, {"fork_on_divergence": "retry"}):
        try:
            RunConfig(proxy_url="http://x", admin_key="k", **bad)  # type: ignore[arg-type]
        except ValueError as exc:
            assert next(iter(bad)) in str(exc)
        else:
            raise AssertionError(f"{bad} was accepted")
