"""How a run stops: SIGTERM or SIGINT ends it after the current step (a second one at once), and
waits end early once a stop is asked for. Also the test hooks that kill or slow a step at an exact
instant, so crash recovery and lease loss are tested where they matter.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

FAULT_ENV = "FLYWHEEL_TRAINER_FAULT"
"""Test hook: ``<point>:<step>`` (points: after_claim, after_checkpoint) makes the process kill -9
itself there, so crash recovery is tested at exact instants."""
SLOW_STEP_ENV = "FLYWHEEL_TRAINER_SLOW_STEP_S"
"""Test hook: seconds every step waits after its update and before its commit (a step longer than a lease)."""


class Stop:
    """Whether a stop was asked for; ``sleep`` waits that end as soon as it is."""

    def __init__(self) -> None:
        self.requested = False

    def install(self, log: Callable[[str], None]) -> None:
        """SIGTERM and SIGINT ask for a stop after the current step; a second one stops at once
        (the last checkpoint is consistent)."""

        def request_stop(signum: int, _frame: Any) -> None:
            if self.requested:
                raise SystemExit(128 + signum)
            self.requested = True
            log(f"signal {signum}: stopping after the current step (again to stop at once)")

        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)

    def sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.requested and time.monotonic() < deadline:
            time.sleep(max(0.0, min(0.2, deadline - time.monotonic())))  # the clock moves between the two reads


def fault(point: str, step: int) -> None:
    """Kill this process with SIGKILL at ``point`` of ``step`` if ``FAULT_ENV`` names it."""
    if os.environ.get(FAULT_ENV) == f"{point}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def slow_step() -> None:
    """Wait ``SLOW_STEP_ENV`` seconds (unset: not at all)."""
    if slow := float(os.environ.get(SLOW_STEP_ENV) or 0):
        time.sleep(slow)
