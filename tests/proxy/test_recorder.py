"""The recorder's group commit on a real SQLite store: when a call is acknowledged, how calls share
transactions, what every waiter sees when a commit fails, and what closing promises.

``GatedCalls`` is the real store's ``Calls`` with a gate before each batch's insert, so a test can
hold one transaction open while more calls arrive, and make a chosen batch fail as a store would.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import pytest

from proxy.errors import FlywheelError, NotFound, RecordingFailed
from proxy.recorder import Recorder
from proxy.store.calls import Calls
from proxy.store.records import NewCall
from proxy.store.repository import Repository
from tests.support.records import chat_call


class GatedCalls:
    """The real calls store; ``gate`` holds each batch before its insert, ``fail_batches`` names the
    batches (1-based) that raise as a store that is down would."""

    def __init__(self, calls: Calls) -> None:
        self._calls = calls
        self.gate = asyncio.Event()
        self.gate.set()
        self.entered = asyncio.Event()
        self.batches: list[int] = []
        self.fail_batches: set[int] = set()

    async def insert(self, calls: Sequence[NewCall]) -> list[FlywheelError | None]:
        self.batches.append(len(calls))
        self.entered.set()
        await self.gate.wait()
        if len(self.batches) in self.fail_batches:
            raise ConnectionError("database is unreachable")
        return await self._calls.insert(calls)


@pytest.fixture
async def repo(sqlite_url: str) -> AsyncIterator[Repository]:
    repository = Repository(sqlite_url, min_rewarded=2)
    try:
        yield repository
    finally:
        await repository.close()


@pytest.fixture
def gated(repo: Repository) -> GatedCalls:
    return GatedCalls(repo.calls)


@pytest.fixture
async def episode_id(repo: Repository) -> str:
    return (await repo.episodes.create_episode(task_id="t", metadata={})).id


def call(episode_id: str, marker: int = 0) -> NewCall:
    """A plain call whose last prompt id is ``marker``: the order calls were stored in reads off it."""
    return chat_call(episode_id, prompt_token_ids=[1, 2, marker])


async def held_first_batch(gated: GatedCalls, recorder: Recorder, episode_id: str) -> asyncio.Task[None]:
    """Close the gate and hand in one call: it is taken as batch 1 and held before its insert."""
    gated.gate.clear()
    first = asyncio.create_task(recorder.record(call(episode_id, marker=-1)))
    await asyncio.wait_for(gated.entered.wait(), 5)
    return first


async def queued(recorder: Recorder, calls: list[NewCall]) -> list[asyncio.Task[None]]:
    """Hand in ``calls`` concurrently and return once all of them are waiting in the queue."""
    tasks = [asyncio.create_task(recorder.record(c)) for c in calls]
    await asyncio.sleep(0)  # each task runs up to its wait; the held batch keeps the loop from taking them
    assert recorder.queue_depth == len(calls)
    return tasks


@asynccontextmanager
async def recording(gated: GatedCalls, **options: Any) -> AsyncIterator[Recorder]:
    """A started recorder on ``gated``; on the way out the gate opens (a batch held at it must be
    able to finish) and the recorder closes."""
    recorder = Recorder(gated, **options)
    recorder.start()
    try:
        yield recorder
    finally:
        gated.gate.set()
        await recorder.close()


async def released(
    gated: GatedCalls, recorder: Recorder, episode_id: str, calls: list[NewCall]
) -> list[BaseException | None]:
    """Batch 1 (one call) held at the gate while ``calls`` queue behind it, then the gate opened:
    every call's outcome, batch 1's first (None: committed)."""
    first = await held_first_batch(gated, recorder, episode_id)
    rest = await queued(recorder, calls)
    gated.gate.set()
    return await asyncio.wait_for(asyncio.gather(first, *rest, return_exceptions=True), 5)


async def test_a_call_is_acknowledged_only_once_its_batch_has_committed(
    repo: Repository, gated: GatedCalls, episode_id: str
) -> None:
    async with recording(gated) as recorder:
        first = await held_first_batch(gated, recorder, episode_id)
        await asyncio.sleep(0.05)
        assert not first.done() and recorder.queue_depth == 0  # taken into a batch, not yet committed
        assert await repo.calls.count(episode_id) == 0
        gated.gate.set()
        await asyncio.wait_for(first, 5)
        assert await repo.calls.count(episode_id) == 1


async def test_every_acknowledged_call_is_readable_at_once_from_another_connection(
    repo: Repository, gated: GatedCalls
) -> None:
    """Each of many concurrent callers, the moment its own record() returns, finds its row stored."""
    episodes = [(await repo.episodes.create_episode(task_id="t", metadata={})).id for _ in range(24)]
    async with recording(gated) as recorder:

        async def record_then_count(episode: str) -> int:
            await recorder.record(call(episode))
            return await repo.calls.count(episode)

        counts = await asyncio.gather(*(record_then_count(e) for e in episodes))
    assert counts == [1] * len(episodes)


async def test_calls_arriving_during_a_commit_share_the_next_transaction(
    repo: Repository, gated: GatedCalls, episode_id: str
) -> None:
    reported: list[tuple[int, float]] = []
    async with recording(gated, on_batch=lambda size, seconds: reported.append((size, seconds))) as recorder:
        outcomes = await released(gated, recorder, episode_id, [call(episode_id, marker=i) for i in range(10)])
    assert outcomes == [None] * 11
    assert gated.batches == [1, 10]
    assert [size for size, _ in reported] == [1, 10] and all(seconds >= 0 for _, seconds in reported)
    stored = (await repo.episodes.get_episode(episode_id)).calls or []
    assert [c.prompt_token_ids[-1] for c in stored if c.prompt_token_ids] == [-1, *range(10)]  # arrival order


async def test_batch_max_caps_the_calls_in_one_transaction(
    repo: Repository, gated: GatedCalls, episode_id: str
) -> None:
    async with recording(gated, batch_max=4) as recorder:
        outcomes = await released(gated, recorder, episode_id, [call(episode_id, marker=i) for i in range(10)])
    assert outcomes == [None] * 11
    assert gated.batches == [1, 4, 4, 2]
    assert await repo.calls.count(episode_id) == 11


async def test_a_failed_commit_fails_every_waiter_of_its_batch_and_the_next_batch_commits(
    repo: Repository, gated: GatedCalls, episode_id: str
) -> None:
    gated.fail_batches = {2}  # batch 2: the three calls queued behind the held one
    async with recording(gated) as recorder:
        outcomes = await released(gated, recorder, episode_id, [call(episode_id, marker=i) for i in range(3)])
        assert outcomes[0] is None
        for failed in outcomes[1:]:
            assert isinstance(failed, RecordingFailed)
            assert (failed.status_code, failed.type) == (503, "service_unavailable")
            assert "ConnectionError" in failed.message  # the store's failure is named, not swallowed
        assert await repo.calls.count(episode_id) == 1
        await asyncio.wait_for(recorder.record(call(episode_id, marker=99)), 5)  # the recorder lives on
        assert await repo.calls.count(episode_id) == 2 and gated.batches == [1, 3, 1]


async def test_a_refused_call_fails_alone_and_its_batch_commits(
    repo: Repository, gated: GatedCalls, episode_id: str
) -> None:
    missing = "00000000-0000-0000-0000-000000000000"
    mixed = [call(episode_id, marker=0), call(missing), call(episode_id, marker=1)]
    async with recording(gated) as recorder:
        outcomes = await released(gated, recorder, episode_id, mixed)
    assert gated.batches == [1, 3]
    assert outcomes[0] is None and outcomes[1] is None and outcomes[3] is None
    refused = outcomes[2]
    assert isinstance(refused, NotFound) and (refused.status_code, refused.code) == (404, "episode_not_found")
    assert await repo.calls.count(episode_id) == 3 and await repo.calls.count(missing) == 0


async def test_a_caller_that_stops_waiting_still_has_its_call_committed(
    repo: Repository, gated: GatedCalls, episode_id: str
) -> None:
    """A client that disconnects cancels only its wait; the record it handed in is still written."""
    async with recording(gated) as recorder:
        first = await held_first_batch(gated, recorder, episode_id)
        [gone] = await queued(recorder, [call(episode_id, marker=1)])
        first.cancel()
        gone.cancel()
        gated.gate.set()
        await asyncio.wait_for(recorder.record(call(episode_id, marker=2)), 5)
    assert first.cancelled() and gone.cancelled()
    assert await repo.calls.count(episode_id) == 3


async def test_close_drains_every_call_handed_in_before_it(
    repo: Repository, gated: GatedCalls, episode_id: str
) -> None:
    recorder = Recorder(gated, batch_max=2)
    recorder.start()
    first = await held_first_batch(gated, recorder, episode_id)
    rest = await queued(recorder, [call(episode_id, marker=i) for i in range(5)])
    closing = asyncio.create_task(recorder.close())
    await asyncio.sleep(0.05)
    assert not closing.done()  # it waits for the held transaction and everything queued behind it
    gated.gate.set()
    await asyncio.wait_for(closing, 5)
    assert all(t.done() and t.exception() is None for t in (first, *rest))
    assert await repo.calls.count(episode_id) == 6 and gated.batches == [1, 2, 2, 1]


async def test_a_call_after_close_is_refused_not_lost(repo: Repository, gated: GatedCalls, episode_id: str) -> None:
    recorder = Recorder(gated)
    recorder.start()
    await recorder.close()
    with pytest.raises(RecordingFailed) as refused:
        await asyncio.wait_for(recorder.record(call(episode_id)), 5)
    assert (refused.value.status_code, refused.value.type) == (503, "service_unavailable")
    assert await repo.calls.count(episode_id) == 0


@pytest.mark.parametrize("yields", range(5))
async def test_a_call_racing_close_is_committed_or_refused_never_left_waiting(
    repo: Repository, gated: GatedCalls, episode_id: str, yields: int
) -> None:
    """A call handed in at any point while close() runs gets an answer: committed, or refused with
    RecordingFailed. ``yields`` moves the call across close()'s steps (the batch loop ending, then
    close() resuming)."""
    recorder = Recorder(gated)
    recorder.start()
    await asyncio.sleep(0)
    closing = asyncio.create_task(recorder.close())
    for _ in range(yields):
        await asyncio.sleep(0)
    try:
        await asyncio.wait_for(recorder.record(call(episode_id)), 5)
        committed = True
    except RecordingFailed:
        committed = False
    await closing
    assert await repo.calls.count(episode_id) == (1 if committed else 0)


async def test_a_failing_on_batch_callback_is_counted_and_commits_go_on(
    repo: Repository, gated: GatedCalls, episode_id: str
) -> None:
    """The metrics callback raising (a negative count once did) must not end the batch loop: every
    later call would wait for ever."""

    def broken(size: int, seconds: float) -> None:
        raise ValueError("Counters can only be incremented by non-negative amounts.")

    async with recording(gated, on_batch=broken) as recorder:
        for marker in range(3):
            await asyncio.wait_for(recorder.record(call(episode_id, marker=marker)), 5)
    assert await repo.calls.count(episode_id) == 3 and recorder.callback_errors == 3


async def test_a_recorder_whose_loop_has_ended_refuses_calls(
    repo: Repository, gated: GatedCalls, episode_id: str
) -> None:
    recorder = Recorder(gated)
    recorder.start()
    assert recorder._task is not None
    recorder._task.cancel()  # the loop gone for any reason: nothing would ever take a call
    await asyncio.sleep(0)
    with pytest.raises(RecordingFailed) as refused:
        await asyncio.wait_for(recorder.record(call(episode_id)), 5)
    assert (refused.value.status_code, refused.value.type) == (503, "service_unavailable")
    assert await repo.calls.count(episode_id) == 0
