"""Admission control for ``POST /groups``: no group is created that could only be trained stale.

A trainer trains ``groups_per_step`` groups per policy version and drops a group whose oldest call
is more than ``max_staleness`` versions behind the current one. A group created now is sampled on
the current version; the trainer reaches it after every group ahead of it, i.e. after ``backlog /
groups_per_step`` more versions. So at most ``(max_staleness + 1) * groups_per_step`` groups can be
ahead of the trainer (its own leased, untrained groups included) before new ones can only go stale
(in ``sync`` mode, staleness 0: one step's worth, and none while a step trains). Groups acked since
the trainer's last claim count as ahead too until this proxy publishes (or the trainer claims
again, which it does after publishing): a group created between an ack and its publish would be
sampled on the version that publish makes old. The limit is that
times ``admission.slack``, or ``admission.max_backlog_groups`` when set; the backlog is counted in
the store (open groups and complete, untrained ones: ``Episodes.count_backlog``; a group whose
unfinished episodes all await a late reward is not counted: nothing more is generated for it).

A refused group gets 429 ``backlog_full`` with ``Retry-After``: about the time the trainer needs to
take the excess (its measured time per step, scaled by how far over the limit the backlog is),
between 1 s and ``max_retry_after_s``. A 429 rather than a wait inside the request: no connection is
held open, and every client (the bundled runner, a user's own script) sees the same plain rule.

The trainer states its demand with each claim (``groups_per_step``, ``max_staleness``, ``mode``);
this process keeps it in memory per ``trainer_id`` and sums the limits of the trainers seen within
``trainer_timeout_s`` (a claim or a renewal counts as seen). Open admission: when disabled, before
any trainer has claimed through this process, after every trainer has gone quiet, and for a trainer
that claims with no staleness bound (nothing it would be offered can go stale). Several proxy
replicas: each enforces the demand of the trainers that claim through it; set
``max_backlog_groups`` to give every replica the same limit (the backlog is shared through the store).

Creations are checked and inserted under one lock per process, so concurrent creations cannot
overshoot the limit on one replica; across replicas the overshoot is at most one group per replica.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from contract.vocabulary import TrainMode
from proxy.errors import BacklogFull
from proxy.settings import AdmissionSettings
from proxy.store.repository import Repository


@dataclass
class Demand:
    """What one trainer takes: ``groups_per_step`` groups per version, none older than ``max_staleness``."""

    groups_per_step: int
    max_staleness: int | None
    mode: TrainMode | None
    seen: float
    """Last claim or renewal (monotonic s)."""
    step_s: float | None = None
    """Smoothed time between the first leases of two steps (an ack in between): the time per step (s)."""
    last_lease: float | None = None
    """When the current step leased its first groups (monotonic s)."""
    acked: bool = False
    """A step was acked since ``last_lease``: the next leasing claim starts a new step."""


@dataclass(frozen=True)
class State:
    """The admission picture at one moment (``GET /trainer/admission``)."""

    enabled: bool
    limit: int | None
    """None: admission is open."""
    backlog: int
    settling: int
    trainers: dict[str, Demand]
    refused: int


class Admission:
    def __init__(
        self, settings: AdmissionSettings, repo: Repository, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self.repo = repo
        self.clock = clock
        self.trainers: dict[str, Demand] = {}
        self.refused = 0
        """Groups refused by this process since it started (also ``flywheel_admission_refused_total``)."""
        self.settling = 0
        """Groups acked since the last claim or publish: their update is not published yet."""
        self._lock = asyncio.Lock()

    # -- the trainer's side ----------------------------------------------------------------------

    def claimed(
        self,
        trainer_id: str,
        *,
        groups_per_step: int,
        max_staleness: int | None,
        mode: TrainMode | None,
        leased: int,
    ) -> None:
        """Record a trainer's demand from its claim; claims that leased groups time its steps."""
        now = self.clock()
        self.settling = 0  # a trainer claims after it published the step it acked
        demand = self.trainers.get(trainer_id)
        if demand is None:
            demand = self.trainers[trainer_id] = Demand(groups_per_step, max_staleness, mode, now)
        demand.groups_per_step, demand.max_staleness, demand.mode, demand.seen = (
            groups_per_step,
            max_staleness,
            mode,
            now,
        )
        if leased and (demand.last_lease is None or demand.acked):  # a step's first lease: steps are timed apart
            if demand.last_lease is not None:
                interval = now - demand.last_lease
                demand.step_s = interval if demand.step_s is None else 0.7 * demand.step_s + 0.3 * interval
            demand.last_lease, demand.acked = now, False

    def acked(self, groups: int) -> None:
        """A step's groups are acked: until its version is published they still hold their places."""
        self.settling += groups
        for demand in self.trainers.values():  # acks carry no trainer id: any trainer's next lease may start a step
            demand.acked = True

    def published(self) -> None:
        self.settling = 0

    def renewed(self, trainer_id: str) -> None:
        """A renewal shows the trainer is alive (mid-step) though it claims nothing."""
        if (demand := self.trainers.get(trainer_id)) is not None:
            demand.seen = self.clock()

    # -- the workflows' side ---------------------------------------------------------------------

    def _live(self) -> dict[str, Demand]:
        """The trainers seen (claim or renewal) within ``trainer_timeout_s``."""
        cutoff = self.clock() - self.settings.trainer_timeout_s
        return {name: d for name, d in self.trainers.items() if d.seen >= cutoff}

    def limit(self) -> int | None:
        """Groups admitted ahead of the trainers; None: open (module docstring)."""
        if not self.settings.enabled:
            return None
        if self.settings.max_backlog_groups is not None:
            return self.settings.max_backlog_groups
        live = self._live().values()
        if not live or any(d.max_staleness is None for d in live):
            return None
        total = sum(((d.max_staleness or 0) + 1) * d.groups_per_step for d in live)
        return max(1, math.floor(total * self.settings.slack))

    def retry_after(self, over: int) -> int:
        """Seconds until the trainers have likely taken ``over`` groups (at least 1, at most the cap)."""
        per_s = sum(d.groups_per_step / d.step_s for d in self._live().values() if d.step_s)
        guess = over / per_s if per_s else float(self.settings.retry_after_s)
        return int(min(max(math.ceil(guess), 1), self.settings.max_retry_after_s))

    @asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """Hold while a group is created; raises ``BacklogFull`` instead when the backlog is full."""
        limit = self.limit()
        if limit is None:
            yield
            return
        async with self._lock:
            backlog = await self.repo.episodes.count_backlog() + self.settling
            if backlog >= limit:
                self.refused += 1
                over = backlog - limit + 1
                raise BacklogFull(
                    f"{backlog} groups are already ahead of the trainer (limit {limit}: what it can train "
                    "within its staleness bound); a new group now would only go stale. Retry after the "
                    "Retry-After seconds",
                    retry_after_s=self.retry_after(over),
                    code="backlog_full",
                )
            yield

    async def state(self) -> State:
        return State(
            enabled=self.settings.enabled,
            limit=self.limit(),
            backlog=await self.repo.episodes.count_backlog(),
            settling=self.settling,
            trainers=self._live(),
            refused=self.refused,
        )
