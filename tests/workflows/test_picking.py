"""Which task the runner draws next (``workflows/picking.py``): the order, or where groups disagree."""

from __future__ import annotations

from collections import Counter

from workflows.picking import TaskPicker


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
    # t3's chance is 5/6, the others' 1/6: t3 gets 5/14 of the focused draws plus its share of the order.
    expected = 2000 * (0.8 * 5 / 14 + 0.2 / 10)
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
