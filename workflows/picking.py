"""Which task the runner draws next: the seeded order, or, with ``focus``, where groups disagree.

GRPO learns nothing from a group whose rewards are all equal: its advantages are zero and the
trainer skips it. Late in a run most tasks are solved by every member (in a 30-minute math run,
616 of 887 generated groups were skipped), so drawing tasks blindly spends most generation on
groups that cannot train. ``TaskPicker`` keeps, per task, how many of its finished groups had
unequal rewards (this run's, and those the runner reads back from the store at the start), and
estimates the chance its next group does. A task set is often larger than a run's groups (the math
default's 30-minute run drew each task about once), so a task's own record is thin: its estimate is
Laplace's rule with the prior taken from its kind (``Workflow.kind``, or all tasks when the
workflow names none), (d + 2p) / (n + 2) with p the kind's own Laplace estimate. A task never
drawn gets its kind's rate, so generation moves to the kinds whose groups disagree long before each
task has a record of its own; with p = 0.5 this is Laplace's (d + 1) / (n + 2). With ``focus`` f,
a draw follows the seeded, balanced order (``runner.task_order``) with probability 1 - f (a floor
of exploration over every task, so a task that stopped disagreeing is seen again as the policy
moves) and otherwise picks a task with probability proportional to that estimate. ``focus`` 0 is
the order alone, as before.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


PRIOR_GROUPS = 2.0
"""The weight of the kind's rate in a task's estimate, in groups (Laplace's rule uses 2)."""


@dataclass
class TaskOutcomes:
    groups: int = 0
    """Groups of the task that ended with two or more rewards."""
    disagreed: int = 0
    """Those whose rewards were not all equal: the groups that train."""

    @property
    def chance(self) -> float:
        """Laplace's estimate of the chance the next group disagrees."""
        return (self.disagreed + 1) / (self.groups + 2)

    def chance_given(self, prior: float) -> float:
        """The estimate with ``prior`` (the kind's chance) in place of Laplace's 0.5."""
        return (self.disagreed + PRIOR_GROUPS * prior) / (self.groups + PRIOR_GROUPS)


class TaskPicker(Generic[T]):
    def __init__(
        self,
        order: Sequence[T],
        task_id: Callable[[T], str],
        *,
        focus: float,
        seed: int,
        kind: Callable[[T], str | None] = lambda _: None,
    ) -> None:
        if not order:
            raise ValueError("no tasks to pick from")
        self.order = list(order)
        self.focus = focus
        self.rng = random.Random(seed + 1)
        self._ids = [task_id(t) for t in self.order]
        self._kind = {i: kind(t) for i, t in zip(self._ids, self.order, strict=True)}
        self.outcomes: dict[str, TaskOutcomes] = {}
        self.kinds: dict[str | None, TaskOutcomes] = {}
        """Outcomes pooled per kind, over the tasks of ``order`` only (a recalled task of another
        split has no known kind: it counts for itself alone)."""
        self.drawn = 0
        self.focused = 0
        """Draws made by the estimate rather than the order."""

    def next(self) -> T:
        task = self.order[self.drawn % len(self.order)]
        self.drawn += 1
        if self.focus > 0 and self.rng.random() < self.focus:
            self.focused += 1
            task = self.rng.choices(self.order, weights=[self.chance(i) for i in self._ids])[0]
        return task

    def chance(self, task_id: str) -> float:
        """The estimated chance that the task's next group disagrees (the module docstring)."""
        prior = self.kinds.get(self._kind.get(task_id), TaskOutcomes()).chance
        return self.outcomes.get(task_id, TaskOutcomes()).chance_given(prior)

    def observe(self, task_id: str, rewards: Sequence[float]) -> None:
        """A finished group of the task: whether its rewards disagreed (fewer than two: no evidence)."""
        if len(rewards) < 2:
            return
        disagreed = int(max(rewards) > min(rewards))
        pools = [self.outcomes.setdefault(task_id, TaskOutcomes())]
        if task_id in self._kind:
            pools.append(self.kinds.setdefault(self._kind[task_id], TaskOutcomes()))
        for outcomes in pools:
            outcomes.groups += 1
            outcomes.disagreed += disagreed
