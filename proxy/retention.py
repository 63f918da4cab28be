"""Retention for a proxy in front of a deployed agent: bodies and token ids purged past their TTL,
episodes deleted on request, and who asked, in the audit log.

The store does the work (``proxy/store/retention.py``: which episodes are eligible, what a purge
keeps, what a deletion does to a group); this module decides when. ``Sweeper.sweep`` runs every
``retention.interval_s`` in the proxy's lifespan (``app.py``, beside the idle-episode reaper) and
purges, batch by batch (``retention.batch`` episodes per transaction and audit entry), whatever
finished more than ``retention.bodies_ttl_s`` ago; then, on a SQLite file with incremental
auto-vacuum, it hands the freed pages back (``Retention.reclaim``). Several proxy replicas may all
sweep: a purged episode is never purged twice, and on PostgreSQL a batch skips rows another holds.

The TTL is store-wide today: there is one run. ``Sweeper.ttl_s`` is the one place it is looked up,
so that once runs are first-class a run's own TTL overrides it for that run's episodes.

An admin is named in the audit log by ``key_id``: the first 16 hex digits of the sha256 of the key
it presented (``printf %s "$KEY" | sha256sum`` finds it), never the key.
"""

from __future__ import annotations

import hashlib
import logging
import time

from proxy.settings import RetentionSettings
from proxy.store.repository import Repository
from proxy.store.retention import SWEEPER, Purged

log = logging.getLogger("flywheel.retention")


def key_id(key: str) -> str:
    """What the audit log names an admin key by: its sha256, first 16 hex digits (not reversible)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def admin_actor(key: str | None) -> str:
    return f"admin:{key_id(key)}" if key else "admin"


class Sweeper:
    """Purges what is past the TTL; one per proxy process."""

    def __init__(self, settings: RetentionSettings, repo: Repository) -> None:
        self.settings = settings
        self._repo = repo

    def ttl_s(self) -> float | None:
        """The bodies' TTL (s), None: kept forever. Store-wide; a run's own value will override it."""
        return self.settings.bodies_ttl_s

    async def purge(self, older_than_s: float, *, actor: str = SWEEPER) -> tuple[Purged, list[int]]:
        """Purge every eligible episode finished more than ``older_than_s`` ago, a batch per
        transaction; the totals and the audit entries written."""
        before = time.time() - older_than_s
        total, audits = Purged(), []
        while True:
            batch = await self._repo.retention.purge(before=before, limit=self.settings.batch, actor=actor)
            total.episodes += batch.episodes
            total.calls += batch.calls
            if batch.audit_id is not None:
                audits.append(batch.audit_id)
            if batch.episodes < self.settings.batch:
                break
        if total.episodes:
            try:
                freed = await self._repo.retention.reclaim()
            except Exception as exc:  # the purge committed; the pages wait for the next one
                log.warning("retention could not return freed pages", extra={"error": repr(exc)})
                freed = 0
            log.info(
                "retention purged bodies and token ids",
                extra={"actor": actor, "episodes": total.episodes, "calls": total.calls, "pages_freed": freed},
            )
        return total, audits

    async def sweep(self) -> None:
        """One pass of the background job: purge what is past the TTL, if one is set."""
        ttl = self.ttl_s()
        if ttl is not None:
            await self.purge(ttl)
