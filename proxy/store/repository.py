"""The store's composition root: one ``Repository`` per process, its aggregates as attributes.

Only ``proxy/store/`` opens transactions and commits, and every public method of an aggregate is one
transaction: it either happens whole or not at all, so no route can leave a half-written group,
episode or reward behind. ``sessions.py`` is the one way to open them (and turns store faults into
503/507). Writes that must not interleave take row locks in one fixed order on PostgreSQL, so
replicas never deadlock: group rows sorted by id, then episode rows sorted by id (rewards, abandons,
the idle sweep, the recorder's inserts; the trainer routes lock group rows only). SQLite writers
(the writer engine, and the recorder's own connection) are serialised by ``BEGIN IMMEDIATE``.
On a SQLite file the recorder's group commit and the episode check take the fast path
(``sqlite_fast``), which writes the very rows the engine path writes (``rows``).

Which module holds which aggregate:

- ``repo.episodes`` (``episodes.py``): groups and episodes, rewards, abandons, the idle sweep;
- ``repo.calls`` (``calls.py``): the recorder's group commit, and the reads of stored calls;
- ``repo.forks`` (``forks.py``): fork groups, the calls their episodes replay, divergence marks;
- ``repo.versions`` (``versions.py``): the published policy versions;
- ``repo.leases`` (``leases.py``): the trainer's claims, renewals, acks and releases;
- ``repo.steps`` (``steps.py``): the trainer's step metrics;
- ``repo.browse`` (``browse.py``): the dashboard's read-only pages and counts.
- ``repo.retention`` (``retention.py``): purges of bodies and token ids, deletions on request, the audit log.
"""

from __future__ import annotations

from proxy.store.browse import Browse
from proxy.store.calls import Calls
from proxy.store.db import CONNECT_TIMEOUT_S, sqlite_file
from proxy.store.delta import Tails
from proxy.store.episodes import Episodes
from proxy.store.forks import Forks
from proxy.store.leases import Leases
from proxy.store.retention import Retention
from proxy.store.rows import Layout
from proxy.store.sessions import Sessions
from proxy.store.steps import Steps
from proxy.store.versions import Versions


class Repository:
    """Async data access for the proxy: episodes, groups, calls, policy versions, leases, trainer steps."""

    def __init__(
        self,
        url: str,
        *,
        synchronous: str = "NORMAL",
        pool_size: int = 10,
        min_rewarded: int = 2,
        sqlite_fast_path: bool = True,
        timeout_s: float = CONNECT_TIMEOUT_S,
    ) -> None:
        self.url = url
        self._sessions = Sessions(
            url, synchronous=synchronous, pool_size=pool_size, sqlite_fast_path=sqlite_fast_path, timeout_s=timeout_s
        )
        self.sqlite = self._sessions.sqlite
        # Each open episode's last stored call, the base of its next call's deltas (``delta.py``):
        # shared, as the calls put them and a reward or abandon drops its episode's.
        tails = Tails()
        self.layout = Layout()
        """Calls stored as deltas or whole, and base reads from the store (cache misses)."""
        self.episodes = Episodes(self._sessions, tails, min_rewarded=min_rewarded)
        self.calls = Calls(self._sessions, tails, self.layout)
        self.forks = Forks(self._sessions)
        self.versions = Versions(self._sessions)
        self.leases = Leases(self._sessions)
        self.steps = Steps(self._sessions)
        self.retention = Retention(self._sessions, tails, min_rewarded=min_rewarded, sqlite_file=sqlite_file(url))
        self.browse = Browse(self._sessions.read)
        """The dashboard's read-only pages and counts (``browse.py``)."""

    async def ping(self) -> None:
        await self._sessions.ping()

    async def close(self) -> None:
        await self._sessions.close()
