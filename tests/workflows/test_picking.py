"""Which task the runner draws next (``workflows/picking.py``): the order, or where groups disagree; and the
summary's signal that judges it (``workflows/results.py``)."""

from __future__ import annotations

from collections import Counter

from workflows.forking import ForkPoint
from workflows.picking import TaskPicker
from workflows.results import EpisodeResult, GroupResult, RunStats


def test_without_focus_the_draws_are_the_seeded_order_cycled() -> None:
    picker = TaskPicker(["a", "b", "c"], str, focus=0.0, seed=1)
    for task in ("a", "b", "c"):
        picker.observe(task, [1.0, 1.0])
    assert [picker.next() for _ in range(7)] == ["a", "b", "c", "a", "b", "c", "a"]
    assert picker.focused == 0


def test_focus_draws_where_groups_disagreed_and_keeps_exploring() -> None:
    tasks = [f"t{i}" for i in range(10)]
    picker = TaskPicker(tasks, str, focus=0.8, seed=7)
    for task in tasks:  # every task solved by the whole group four times over, but t3
        for _ in range(4):
            picker.observe(task, [0.0, 1.0] if task == "t3" else [1.0, 1.0, 1.0])
    draws = Counter(picker.next() for _ in range(2000))
    # No kinds: the prior is all tasks' rate, p = (4 + 1) / (40 + 2); t3's chance (4 + 2p) / 6, the
    # others' 2p / 6: t3 gets its share of the focused draws plus its share of the order.
    p = 5 / 42
    t3, other = (4 + 2 * p) / 6, 2 * p / 6
    assert abs(picker.chance("t3") - t3) < 1e-12 and abs(picker.chance("t0") - other) < 1e-12
    expected = 2000 * (0.8 * t3 / (t3 + 9 * other) + 0.2 / 10)
    assert abs(draws["t3"] - expected) < 0.15 * expected, draws
    assert all(draws[t] > 0 for t in tasks)  # the floor: every task is still drawn
    assert 0.75 < picker.focused / 2000 < 0.85


def test_a_group_with_fewer_than_two_rewards_is_no_evidence() -> None:
    picker = TaskPicker(["a"], str, focus=1.0, seed=0)
    picker.observe("a", [1.0])
    picker.observe("a", [])
    assert "a" not in picker.outcomes
    picker.observe("a", [0.0, 0.5])
    assert picker.outcomes["a"].chance == 2 / 3


def test_a_task_never_drawn_takes_its_kinds_rate() -> None:
    """Math's task set outnumbers a run's groups: the kind's record steers draws to tasks not yet seen."""
    tasks = [f"{kind}{i}" for kind in ("easy", "mid") for i in range(50)]
    picker = TaskPicker(tasks, str, focus=1.0, seed=3, kind=lambda t: t.rstrip("0123456789"))
    for i in range(10):  # ten tasks of each kind seen once: every easy group agreed, every mid one split
        picker.observe(f"easy{i}", [1.0, 1.0, 1.0])
        picker.observe(f"mid{i}", [0.0, 1.0, 1.0])
    assert picker.kinds["easy"].chance == 1 / 12 and picker.kinds["mid"].chance == 11 / 12
    assert picker.chance("easy40") == 1 / 12 and picker.chance("mid40") == 11 / 12  # never drawn: the kind's rate
    assert picker.chance("mid3") == (1 + 2 * 11 / 12) / 3  # its own group, then the kind's pseudo-groups
    draws = Counter(picker.next().rstrip("0123456789") for _ in range(2000))
    assert draws["mid"] > 8 * draws["easy"], draws
    picker.observe("elsewhere", [0.0, 1.0])  # a recalled task outside this order: its own record only
    assert picker.outcomes["elsewhere"].groups == 1 and sum(k.groups for k in picker.kinds.values()) == 20


def test_the_summarys_signal_counts_plain_groups_per_kind() -> None:
    """What ``--focus`` is judged by: the share of plain groups whose rewards differ, per kind too."""

    def group(n: int, rewards: list[float | None], kind: str | None, fork: ForkPoint | None = None) -> GroupResult:
        episodes = [
            EpisodeResult(f"e{n}-{i}", f"g{n}", "t", "rewarded" if r is not None else "abandoned", r, None, 1.0)
            for i, r in enumerate(rewards)
        ]
        return GroupResult(f"g{n}", "t", "complete", episodes, fork=fork, kind=kind)

    stats = RunStats()
    stats.groups = [
        group(1, [1.0, 0.0], "add"),
        group(2, [1.0, 1.0], "add"),
        group(3, [0.0, 0.0, 0.0], "mul"),
        group(4, [1.0, None], "mul"),  # one reward: no evidence either way
        group(5, [0.0, 1.0], None),
        group(6, [0.0, 1.0], "mul", fork=ForkPoint("e1-0", 1, "uniform")),  # a fork group is not a draw
    ]
    signal = stats.signal()
    assert (signal["groups"], signal["disagreed"], signal["share"]) == (4, 2, 0.5)
    assert signal["by_kind"] == {
        "-": {"groups": 1, "disagreed": 1},
        "add": {"groups": 2, "disagreed": 1},
        "mul": {"groups": 1, "disagreed": 0},
    }
