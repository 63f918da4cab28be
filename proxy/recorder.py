"""Group commit: many concurrent calls share one transaction, and each waits for its own commit.

A request hands its finished ``NewCall`` to ``record()`` and is acknowledged to the client only
after the batch holding it has committed, so a response the client received is never lost, even
to kill -9. While one batch commits, the next accumulates: at low load a batch is one call (the
latency is one commit), at high load hundreds (the throughput of one commit each).

Outcomes are per call: the store refuses, inside the inserting transaction, a call whose episode
was rewarded or abandoned meanwhile (``EpisodeClosed``, 409) while the rest of its batch commits.

The batch loop outlives everything but its own shutdown: a failing ``on_batch`` callback (the
metrics) is logged and counted (``callback_errors``), and commits go on. Were the loop ever to end
early, ``record()`` refuses calls instead of leaving them waiting for a loop that is gone.

It writes through a ``CallWriter``: the store's ``Calls`` (``repo.calls``), or a test's stand-in.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from proxy.errors import FlywheelError, RecordingFailed, StoreUnavailable
from proxy.store.records import NewCall

log = logging.getLogger("flywheel.recorder")


class CallWriter(Protocol):
    """What the recorder needs of the store: one batch of calls in one transaction."""

    async def insert(self, calls: Sequence[NewCall]) -> list[FlywheelError | None]:
        """Per call, None (committed) or why it was refused; raises if the batch did not commit."""
        ...


def _failed(exc: Exception) -> RecordingFailed:
    """Why a batch did not commit, under the store fault's status and code (503, 507 when full)."""
    if isinstance(exc, StoreUnavailable):
        return RecordingFailed(f"the call could not be recorded: {exc.message}", fault=exc)
    return RecordingFailed(f"the call could not be recorded ({type(exc).__name__}); retry it", code="recording_failed")


class Recorder:
    def __init__(
        self, calls: CallWriter, *, batch_max: int = 512, on_batch: Callable[[int, float], None] | None = None
    ) -> None:
        self._calls = calls
        self._batch_max = batch_max
        self._pending: list[tuple[NewCall, asyncio.Future[None]]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._on_batch = on_batch
        self.callback_errors = 0
        """How many times ``on_batch`` raised (each logged; the batch had committed)."""

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="flywheel-recorder")

    async def record(self, call: NewCall) -> None:
        """Return once ``call`` is committed. Raises ``EpisodeClosed`` if its episode was finished
        before the record was written (the call is not stored), ``RecordingFailed`` if the store failed
        (507 when it is full, else 503)."""
        # Only a batch loop still running will take the call: one that has ended (or, once closing,
        # never ran) would leave it waiting for ever.
        if self._closing and (self._task is None or self._task.done()):
            raise RecordingFailed("the proxy is shutting down; the call was not recorded")
        if self._task is not None and self._task.done():
            raise RecordingFailed("the recorder has stopped; the call was not recorded")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((call, future))
        self._wake.set()
        # A client that disconnects while waiting cancels only its wait: the call is in the queue
        # and is committed anyway (the batch loop skips futures that are already done).
        await future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = self._pending[: self._batch_max]
            del self._pending[: len(batch)]
            started = loop.time()
            try:
                outcomes: list[FlywheelError | None] = await self._calls.insert([call for call, _ in batch])
            except Exception as exc:  # the store is down, full or refused: every waiter gets a clear error
                log.error("recording failed", extra={"calls": len(batch), "error": repr(exc)})
                error = _failed(exc)
                for _, future in batch:
                    if not future.done():
                        future.set_exception(error)
                continue
            for (_, future), outcome in zip(batch, outcomes, strict=True):
                if future.done():
                    continue
                if outcome is None:
                    future.set_result(None)
                else:
                    future.set_exception(outcome)
            self._report(len(batch), loop.time() - started)

    def _report(self, calls: int, seconds: float) -> None:
        """Tell ``on_batch`` about a committed batch; its failure must not stop the commits."""
        if self._on_batch is None:
            return
        try:
            self._on_batch(calls, seconds)
        except Exception:
            self.callback_errors += 1
            log.exception("the on_batch callback failed; commits go on", extra={"calls": calls})

    async def close(self) -> None:
        """Drain: every call handed in before close is committed (or failed) before this returns."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None
