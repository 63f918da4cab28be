"""The trainer's side of the proxy's leases: kept alive while a step runs, acked, handed back, resumed.

A claim leases its groups for ``lease_s``. ``LeaseKeeper`` renews a step's leases every
``lease_s / 3`` on a thread of its own, and once more just before the step is committed: a step
whose lease was lost (another trainer claimed a group after it lapsed) must not be committed.
``Leases`` acks a committed step's groups (a lapsed lease is renewed first, which fails if anyone
claimed the group), hands back leases that will not be trained, and re-checks leases claimed
before a restart.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Mapping
from typing import Any, NamedTuple

from contract.client import ProxyClient, ProxyError
from contract.schemas import EpisodeAudit
from contract.vocabulary import AckStatus, TrainerSkip
from trainer.checkpoint import LeaseRecord


class Ack(NamedTuple):
    """What one ack says of its groups: their status and, for a skip, the typed reason and its note."""

    status: AckStatus
    reason: TrainerSkip | None
    """None for a trained ack, and for a skip from a checkpoint written before reasons were typed."""
    note: str | None


def take_step(
    lease: LeaseRecord, trained: Collection[str], notes: Mapping[str, str], reasons: Mapping[str, TrainerSkip]
) -> None:
    """What a step made of a lease's groups, kept for its ack: trained, or skipped for a typed reason
    with a note (``trainer/data.py``'s ``Batch``)."""
    lease.trained = [g for g in lease.group_ids if g in trained]
    lease.skipped = {g: notes[g] for g in lease.group_ids if g in notes}
    lease.skip_reasons = {g: reasons[g] for g in lease.group_ids if g in reasons}


def skip_trained(lease: LeaseRecord, reason: TrainerSkip, note: str) -> None:
    """A dropped step's trained groups, acked skipped for ``reason`` instead (a non-finite gradient)."""
    lease.skipped.update(dict.fromkeys(lease.trained, note))
    lease.skip_reasons.update(dict.fromkeys(lease.trained, reason))
    lease.trained = []


class LeaseKeeper:
    """Keeps a step's leases alive: renews them every ``lease_s / 3`` on a thread of its own while
    the step collects and trains, and once more, synchronously, before the step is committed.

    A renewal refused with 409 marks the lease lost for good (the proxy gave a group to another
    trainer); one that fails otherwise (the proxy restarting) is retried at the next tick, and at
    the final check it counts as lost: a step whose leases cannot be confirmed is not committed.
    """

    def __init__(
        self, client: ProxyClient, lease_s: float, log: Callable[[str], None], *, trainer_id: str | None = None
    ) -> None:
        self.client = client
        self.trainer_id = trainer_id
        self.lease_s = lease_s
        self.interval_s = lease_s / 3
        self.log = log
        self.leases: list[LeaseRecord] = []
        self.lost: dict[str, str] = {}
        """Lease id -> why it is lost."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, lease: LeaseRecord) -> None:
        with self._lock:
            self.leases.append(lease)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="flywheel-lease-keeper", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                leases = [lease for lease in self.leases if lease.lease_id not in self.lost]
            for lease in leases:
                if self._stop.is_set():
                    return
                self._renew(lease, final=False)

    def _renew(self, lease: LeaseRecord, *, final: bool) -> None:
        try:
            lease.expires_at = self.client.renew(
                lease_id=lease.lease_id, group_ids=lease.group_ids, lease_s=self.lease_s, trainer_id=self.trainer_id
            )
        except ProxyError as exc:
            if exc.status in (404, 409) or final:
                with self._lock:
                    self.lost.setdefault(lease.lease_id, f"{exc.code or exc.status}: {exc.message}")
            else:
                self.log(f"[warning] renewing lease {lease.lease_id} failed, retrying: {exc.message}")

    def confirm(self) -> dict[str, str]:
        """Renew every lease now: the check before a step is committed. Returns the lost ones (empty: all held)."""
        with self._lock:
            leases = [lease for lease in self.leases if lease.lease_id not in self.lost]
        for lease in leases:
            self._renew(lease, final=True)
        with self._lock:
            return dict(self.lost)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


class Leases:
    """Acks, releases and post-restart renewals of this trainer's leases (``log``: warnings and notes)."""

    def __init__(self, client: ProxyClient, lease_s: float, log: Callable[[str], None]) -> None:
        self.client = client
        self.lease_s = lease_s
        self.log = log

    def still_held(self, lease: LeaseRecord) -> bool:
        """Renew a lease claimed before a restart; a lost one is handed back (what is left of it) and forgotten."""
        try:
            lease.expires_at = self.client.renew(
                lease_id=lease.lease_id, group_ids=lease.group_ids, lease_s=self.lease_s
            )
            return True
        except ProxyError as exc:
            if exc.status not in (404, 409):
                raise
            self.log(
                f"lease {lease.lease_id} from before the restart is lost ({exc.message}); its groups are offered again"
            )
            self.release(lease)
            return False

    def release(self, lease: LeaseRecord) -> None:
        try:
            self.client.release(lease_id=lease.lease_id)
        except ProxyError as exc:  # the lease expires on its own
            self.log(f"[warning] releasing lease {lease.lease_id} failed: {exc.message}")

    def ack(self, lease: LeaseRecord, step: int) -> None:
        """Ack a lease's groups for ``step``: the trained ones, then the skipped ones in one ack per
        reason and note, so each group carries its own typed reason and note (not every one of its
        lease). If the proxy refuses (409: a group was lost, its update may be trained twice) each
        group is acked alone, so the others still are, and the refusal is logged."""
        skips: dict[Ack, list[str]] = {}
        for group_id, note in lease.skipped.items():
            skips.setdefault(Ack("skipped", lease.skip_reasons.get(group_id), note[:4000]), []).append(group_id)
        acks = [(Ack("trained", None, None), lease.trained)]
        acks += sorted(skips.items(), key=lambda item: (item[0].reason or "", item[0].note or ""))
        for ack, ids in acks:
            if not ids:
                continue
            try:
                self._ack_groups(lease.lease_id, ids, step, ack, lease.audits)
            except ProxyError as exc:
                if exc.status == 404:
                    raise ProxyError(
                        404,
                        f"the proxy does not know the groups of step {step} ({exc.message}); "
                        "this output_dir belongs to another store: use a fresh output_dir",
                    ) from exc
                if exc.status != 409:
                    raise  # unacked groups would be offered again: stop, a restart re-acks from the checkpoint
                self._ack_each(lease, ids, step, ack, exc)

    def _ack_each(self, lease: LeaseRecord, ids: list[str], step: int, ack: Ack, refused: ProxyError) -> None:
        """After a 409 on an ack of ``ids`` (acks are all or nothing): ack the groups still held one
        by one; the refused ones are logged."""
        status = ack.status
        if len(ids) == 1:
            self.log(f"[warning] ack of group {ids[0]} ({status}) for step {step} refused: {refused.message}")
            return
        for group_id in ids:
            try:
                self._ack_groups(lease.lease_id, [group_id], step, ack, lease.audits)
            except ProxyError as one:
                if one.status != 409:
                    raise
                self.log(f"[warning] ack of group {group_id} ({status}) for step {step} refused: {one.message}")

    def _ack_groups(
        self, lease_id: str, ids: list[str], step: int, ack: Ack, audits: dict[str, dict[str, dict[str, Any]]]
    ) -> None:
        """One ack, with the fidelity audits of its groups' episodes. A lease that lapsed since the
        step was committed (a restart, a slow disk) is renewed and the ack retried: the renewal
        succeeds only if nobody claimed the groups meanwhile."""
        mine = {e: EpisodeAudit.model_validate(a) for g in ids for e, a in audits.get(g, {}).items()} or None

        def send() -> None:
            self.client.ack(
                lease_id=lease_id,
                group_ids=ids,
                step=step,
                status=ack.status,
                reason=ack.reason,
                note=ack.note,
                audits=mine,
            )

        try:
            send()
        except ProxyError as exc:
            if exc.code != "lease_expired":
                raise
            self.client.renew(lease_id=lease_id, group_ids=ids, lease_s=self.lease_s)
            send()
