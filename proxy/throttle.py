"""Failed key checks per client: after too many in a window, the client is refused with 429.

Why: the admin key opens everything (rewards, publishing, the dashboard), and the login form and
every keyed route answer whether a key is right. A client (by its address as the proxy sees it)
that presented ``limit`` wrong keys within ``window_s`` seconds gets 429 with ``Retry-After`` on
every keyed request, valid keys included (otherwise the limit itself would tell it when a guess is
right), until its oldest failure leaves the window. A request with no key at all is not a guess and
is not counted. Per process: each proxy worker keeps its own counts. Behind a reverse proxy every
client shares its address: set ``auth.failed_limit: 0`` there (off) or limit at the reverse proxy.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from proxy.errors import TooManyRequests

log = logging.getLogger("flywheel.auth")
MAX_CLIENTS = 10_000
"""Clients remembered at once; the least recently failing are forgotten first (bounded memory)."""


class FailedAuth:
    def __init__(self, limit: int, window_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.window_s = window_s
        self._clock = clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self.refused = 0
        """Requests refused with 429 so far (a client crossing the limit is logged as a warning)."""

    def _recent(self, client: str, now: float) -> deque[float] | None:
        times = self._failures.get(client)
        if times is None:
            return None
        while times and times[0] <= now - self.window_s:
            times.popleft()
        if not times:
            del self._failures[client]
            return None
        return times

    def check(self, client: str) -> None:
        """Raise ``TooManyRequests`` while ``client`` is over the limit."""
        if self.limit <= 0:
            return
        now = self._clock()
        times = self._recent(client, now)
        if times is not None and len(times) >= self.limit:
            self.refused += 1
            wait = max(1, math.ceil(times[0] + self.window_s - now))
            raise TooManyRequests(
                f"too many failed key checks from this client: retry in {wait} s",
                retry_after_s=wait,
                code="too_many_failed_auth",
            )

    def failed(self, client: str) -> None:
        """Count a wrong key presented by ``client``."""
        if self.limit <= 0:
            return
        now = self._clock()
        times = self._recent(client, now) or deque()
        times.append(now)
        self._failures[client] = times
        self._failures.move_to_end(client)
        if len(times) == self.limit:
            log.warning("client %s refused for %.0f s after %d wrong keys", client, self.window_s, self.limit)
        while len(self._failures) > MAX_CLIENTS:
            self._failures.popitem(last=False)
