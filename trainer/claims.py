"""Claiming a step's groups: leases asked of the proxy until the step has ``groups_per_step`` groups
(or ``batch_wait_s`` has passed since the first), each journalled in ``pending.json`` and handed to
the step's ``LeaseKeeper`` as soon as it is held.

A claim carries a lease id chosen here and kept until a claim answers, so a claim retried after its
answer was lost gets the groups that lease already holds. Each claim states the trainer's demand
(``groups_per_step``, ``mode``) and staleness bound: sync mode takes only groups from the current
policy version, async mode groups up to ``max_staleness`` versions old. After a restart, the leases
claimed before it that are still held (``resumable``) are trained first, under the same lease.
"""

from __future__ import annotations

import time
import uuid
from typing import NamedTuple

from contract.client import Claim, Demand, Group, ProxyClient, ProxyError
from trainer.checkpoint import Checkpoints, LeaseRecord
from trainer.config import TrainerConfig
from trainer.leases import LeaseKeeper
from trainer.report import Reporter
from trainer.stopping import Stop, fault


class Collected(NamedTuple):
    """A step's groups and the leases they are held under."""

    groups: list[Group]
    leases: list[LeaseRecord]
    current: int
    """The proxy's current policy version."""
    stale: int
    """Groups the proxy dropped as stale while claiming."""


class Claims:
    def __init__(
        self, client: ProxyClient, config: TrainerConfig, checkpoints: Checkpoints, reporter: Reporter, stop: Stop
    ) -> None:
        self.client = client
        self.config = config
        self.checkpoints = checkpoints
        self.reporter = reporter
        self.stop = stop
        self.resumable: list[LeaseRecord] = []
        """Leases claimed before a restart and still held: the next step trains their groups."""

    def collect(self, keeper: LeaseKeeper, step: int) -> Collected:
        """Groups for ``step``; each lease is handed to ``keeper`` as soon as it is held."""
        if self.resumable:
            resumed, self.resumable = self.resumable, []
            refetched = self._refetch(resumed)
            if refetched:  # else (all acked before a crash cleared pending.json) claim afresh
                for lease in resumed:
                    keeper.add(lease)
                return Collected(refetched, resumed, self.client.policy().version, 0)
        cfg = self.config
        groups: list[Group] = []
        leases: list[LeaseRecord] = []
        current, stale, first_at = 0, 0, None
        lease_id = str(uuid.uuid4())  # kept until a claim answers: a retried claim gets what the lost one leased
        while len(groups) < cfg.groups_per_step and not self.stop.requested:
            claim = self._claim(lease_id, cfg.groups_per_step - len(groups))
            if claim is None:
                continue
            lease_id = str(uuid.uuid4())
            current, stale = claim.current_version, stale + claim.stale
            if claim.stale:
                self.reporter.log(
                    f"{claim.stale} groups dropped as stale: older than {cfg.staleness_bound} "
                    f"versions behind v{current} (max_staleness / mode)"
                )
            if claim.groups:
                groups += claim.groups
                leases.append(LeaseRecord(claim.lease_id, [g.id for g in claim.groups], claim.lease_expires_at))
                keeper.add(leases[-1])
                self.checkpoints.set_pending(leases)
                first_at = first_at or time.monotonic()
                fault("after_claim", step)
                continue
            if first_at is not None and time.monotonic() - first_at >= cfg.batch_wait_s:
                break
            self.reporter.status(f"step {step}: {len(groups)}/{cfg.groups_per_step} groups, waiting")
            self.stop.sleep(cfg.poll_interval_s)
        return Collected(groups, leases, current, stale)

    def _claim(self, lease_id: str, max_groups: int) -> Claim | None:
        """One claim under ``lease_id``; None after a failure of a restarting proxy or store (logged, waited out)."""
        cfg = self.config
        try:
            return self.client.claim(
                trainer_id=cfg.trainer_id,
                lease_s=cfg.lease_s,
                max_groups=max_groups,
                max_staleness=cfg.staleness_bound,
                lease_id=lease_id,
                demand=Demand(cfg.groups_per_step, cfg.mode),
            )
        except ProxyError as exc:
            if exc.status not in (0, 502, 503, 504):
                raise
            self.reporter.log(f"[warning] claim failed, retrying: {exc.message}")  # proxy or store restarting
            self.stop.sleep(max(cfg.poll_interval_s, 5.0))
            return None

    def _refetch(self, leases: list[LeaseRecord]) -> list[Group]:
        groups = []
        for lease in leases:
            for group_id in lease.group_ids:
                group = self.client.group(group_id)
                if group.train_status == "pending":
                    group.episodes = [self.client.episode(e.id) for e in group.episodes or []]
                    groups.append(group)
        self.reporter.log(f"resuming {len(groups)} groups claimed before the restart")
        return groups
