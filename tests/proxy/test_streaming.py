"""A streamed call is recorded once, however it ends and whenever its client leaves.

``StreamRelay`` on its own (no proxy, no engine): the upstream is a list of SSE bytes and the
recorder a stand-in that keeps what it is given, so the test sees every record the relay writes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest

from proxy.capture import Wants
from proxy.metrics import Metrics
from proxy.recorder import Recorder
from proxy.recording import Recording
from proxy.settings import UpstreamSettings
from proxy.store.records import NewCall
from proxy.streaming import StreamRelay
from proxy.upstream import Replica


class KeptCalls:
    """A recorder stand-in: every call it is asked to record, in order."""

    def __init__(self) -> None:
        self.calls: list[NewCall] = []

    async def record(self, call: NewCall) -> None:
        self.calls.append(call)


def _relay(kept: KeptCalls, background: set[asyncio.Task[Any]]) -> StreamRelay:
    recording = Recording(
        recorder=cast(Recorder, kept),
        metrics=Metrics(),
        kind="chat",
        body={"model": "policy", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        episode_id="e1",
        translation=None,
        model_served="policy-base",
        version=0,
        replica=Replica(UpstreamSettings(name="r0", url="http://127.0.0.1:1")),
    )
    return StreamRelay(recording, wants=Wants(token_ids=False, logprobs=False), events=None, background=background)


async def _upstream(events: list[bytes]) -> AsyncIterator[bytes]:
    for event in events:
        yield event


async def _closed() -> None:
    pass


ERROR_EVENT = b'data: {"error": {"message": "engine died", "type": "server_error"}}\n\n'


@pytest.mark.parametrize("leave_at_last_event", [False, True])
async def test_a_failed_stream_is_recorded_once_even_if_its_client_leaves_at_the_error_event(
    leave_at_last_event: bool,
) -> None:
    kept, background = KeptCalls(), set[asyncio.Task[Any]]()
    relay = _relay(kept, background)
    stream = relay.relay(_upstream([ERROR_EVENT]), _closed)
    last = await anext(stream)  # the error event: the failure is already recorded when it is sent
    assert b"engine died" in last
    if leave_at_last_event:
        await stream.aclose()  # the client goes away while the error event is on its way
    else:
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
    await asyncio.gather(*background)
    assert [c.status_code for c in kept.calls] == [502]


async def test_a_client_leaving_mid_stream_is_recorded_as_not_delivered() -> None:
    kept, background = KeptCalls(), set[asyncio.Task[Any]]()
    relay = _relay(kept, background)
    chunk = b'data: {"id": "c", "choices": [{"index": 0, "delta": {"content": "he"}, "finish_reason": null}]}\n\n'
    stream = relay.relay(_upstream([chunk, chunk]), _closed)
    await anext(stream)
    await stream.aclose()  # before the end: nothing recorded yet, so the relay records the 499
    await asyncio.gather(*background)
    assert [c.status_code for c in kept.calls] == [499]
