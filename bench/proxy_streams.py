"""Hold 10,000 concurrent streaming calls open through the proxy, and see that none fails.

Each client connection is one agent with its own episode (``POST /groups``, 1,000 episodes per
group) and streams one chat completion through the real ``python -m proxy serve`` recording into
SQLite. The upstream is ``fake_upstream`` in slow-stream mode: the first events at once, then one
token event every ``--interval`` seconds for ``--hold`` seconds, then the end. Clients connect at
``--rate`` per second, so with ``hold`` longer than the ramp every stream is open at the peak.

File descriptors: the hard limit here is 20,000 per process and the proxy needs one per client
connection plus one per upstream connection (20,000 at 10,000 streams), so the proxy runs with
``--workers 2`` (two processes sharing the listening socket); this generator holds 10,000 sockets
and the fake upstream 10,000, each in its own process.

A stream counts as open from its response headers to its last byte; it succeeded if it ended
with ``data: [DONE]``. After the run the proxy is stopped (SIGTERM drains it) and the store is
read: every successful stream must be one recorded call with status 200.

Run from the repo root: ``python -m bench.proxy_streams`` (about 2 minutes: a 40 s ramp at 250
connections/s, 45 s with all 10,000 open, then the ends). The last line is one JSON object. On
this shared 2-core box a faster ramp or more events per second made stream set-up lag the ramp
(500/s with an event per second: all 10,000 succeeded, but at most 8,505 were open at once).
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast
from urllib.parse import urlsplit

import httptools
import orjson

from bench._loadgen import DONE_TAIL, build_request
from bench._procs import (
    FakeUpstreamProcess,
    ProxyUnderTest,
    cpu_seconds,
    exit_on_sigterm,
    load_average,
    open_fds,
    rss_mb,
    run_in_workdir,
)

GROUP_SIZE = 1000


@dataclass
class Sample:
    t: float
    open: int
    proxy_rss_mb: int
    proxy_fds: list[int]
    """Open descriptors per proxy process (parent and workers), largest first."""


@dataclass
class Tally:
    started: int = 0
    connected: int = 0
    """TCP connections to the proxy with a request sent and no end yet (streaming or waiting for headers)."""
    connected_peak: int = 0
    open: int = 0
    """Streams past their response headers and not ended: what "open streams" means here."""
    peak: int = 0
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    first_event_ms: list[float] = field(default_factory=list)
    events: int = 0

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


class StreamClient(asyncio.Protocol):
    """One connection, one streamed request; reports to the shared tally."""

    def __init__(self, tally: Tally, request: bytes, finished: asyncio.Future[None]) -> None:
        self.tally = tally
        self.request = request
        self.finished = finished
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.sent = 0.0
        self.status = 0
        self.is_open = False
        self.first = False
        self.tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no asyncio.Transport subclass
        self.sent = time.perf_counter()
        self.transport.write(self.request)
        self.tally.connected += 1
        self.tally.connected_peak = max(self.tally.connected_peak, self.tally.connected)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._end("bad_http")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.status == 200:
            self.is_open = True
            self.tally.open += 1
            self.tally.peak = max(self.tally.peak, self.tally.open)

    def on_body(self, body: bytes) -> None:
        if not self.first:
            self.first = True
            self.tally.first_event_ms.append((time.perf_counter() - self.sent) * 1000)
        self.tally.events += body.count(b"\n\n")
        self.tail = (self.tail + body)[-64:]

    def on_message_complete(self) -> None:
        if self.status != 200:
            self._end(f"http_{self.status}")
        elif not self.tail.endswith(DONE_TAIL):
            self._end("stream_error_event")
        else:
            self._end(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self._end("connection_lost")

    def _end(self, error: str | None) -> None:
        if self.finished.done():
            return
        if self.is_open:
            self.tally.open -= 1
        if self.sent:
            self.tally.connected -= 1
        if error is None:
            self.tally.ok += 1
        else:
            self.tally.error(error)
        self.finished.set_result(None)
        if self.transport is not None:
            self.transport.close()


async def one_stream(host: str, port: int, request: bytes, tally: Tally, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[None] = loop.create_future()
    tally.started += 1
    try:
        transport, _ = await asyncio.wait_for(
            loop.create_connection(lambda: StreamClient(tally, request, finished), host, port), 30.0
        )
    except (OSError, TimeoutError) as exc:
        tally.error(f"connect_{type(exc).__name__}")
        return
    try:
        await asyncio.wait_for(finished, timeout_s)
    except TimeoutError:
        tally.error("timeout")
        transport.close()


def recorded_ok(db_path: Path) -> int:
    with sqlite3.connect(db_path) as db:
        return int(db.execute("SELECT count(*) FROM calls WHERE status_code = 200 AND stream = 1").fetchone()[0])


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, object]:
    upstream = FakeUpstreamProcess.start(interval_s=args.interval)
    proxy = ProxyUnderTest.start(upstream.url, workdir, workers=args.workers)
    tally = Tally()
    samples: list[Sample] = []
    try:
        episodes = []
        for i in range(0, args.streams, GROUP_SIZE):
            episodes += proxy.create_group(min(GROUP_SIZE, args.streams - i), task_id="bench-proxy-streams")
        px = urlsplit(proxy.url)
        body = orjson.dumps(
            {
                "model": "policy",
                "stream": True,
                "max_tokens": 1000,
                "messages": [{"role": "user", "content": "Keep talking."}],
                "fake_upstream": {"duration_s": args.hold},
            }
        )
        requests = [
            build_request(
                px.hostname or "",
                px.port or 0,
                urlsplit(ep["base_url"]).path + "/chat/completions",
                body,
                {"authorization": f"Bearer {ep['api_key']}"},
            )
            for ep in episodes
        ]
        cpu0 = {"proxy": cpu_seconds(proxy.proc.pid), "fake_upstream": cpu_seconds(upstream.proc.pid)}
        t0 = time.monotonic()
        timeout_s = args.hold + args.streams / args.rate + 120
        tasks: list[asyncio.Task[None]] = []
        step = max(1, args.rate // 100)  # launch in slices every 10 ms
        for i in range(0, len(requests), step):
            for request in requests[i : i + step]:
                tasks.append(
                    asyncio.create_task(one_stream(px.hostname or "", px.port or 0, request, tally, timeout_s))
                )
            await asyncio.sleep(max(0.0, t0 + (i + step) / args.rate - time.monotonic()))
        ramp_s = time.monotonic() - t0
        print(f"  {len(tasks)} streams started in {ramp_s:.1f}s; open now: {tally.open}", flush=True)

        async def sample() -> None:
            while True:
                fds = open_fds(proxy.proc.pid)
                now = Sample(
                    round(time.monotonic() - t0, 1),
                    tally.open,
                    round(rss_mb(proxy.proc.pid)),
                    sorted(fds.values(), reverse=True),
                )
                samples.append(now)
                print(
                    f"  t={now.t}s connected={tally.connected} open={tally.open} peak={tally.peak} ok={tally.ok} "
                    f"errors={sum(tally.errors.values())} events={tally.events} "
                    f"proxy_cpu={cpu_seconds(proxy.proc.pid) - cpu0['proxy']:.1f}s "
                    f"proxy_rss={now.proxy_rss_mb}MB proxy_fds={now.proxy_fds}",
                    flush=True,
                )
                await asyncio.sleep(2.0)

        sampler = asyncio.create_task(sample())
        await asyncio.gather(*tasks)
        sampler.cancel()
        seconds = time.monotonic() - t0
        cpu = {
            "proxy": cpu_seconds(proxy.proc.pid) - cpu0["proxy"],
            "fake_upstream": cpu_seconds(upstream.proc.pid) - cpu0["fake_upstream"],
        }
    finally:
        interrupted = proxy.interrupted()
        proxy.stop()
        upstream.stop()
    recorded = recorded_ok(proxy.db_path)
    peak_rss = max((s.proxy_rss_mb for s in samples), default=0)
    peak_fds = max((max(s.proxy_fds) for s in samples if s.proxy_fds), default=0)
    errors = sum(tally.errors.values())
    print(
        f"\nstreams: {args.streams} started, peak open {tally.peak} (peak connected {tally.connected_peak}), "
        f"{tally.ok} ended with [DONE], "
        f"{errors} errors {tally.errors or ''}"
    )
    print(
        f"first event after: p50 {percentile(tally.first_event_ms, 0.5):.1f} ms, "
        f"p99 {percentile(tally.first_event_ms, 0.99):.1f} ms; {tally.events} events relayed"
    )
    print(
        f"proxy ({args.workers} workers): peak RSS {peak_rss} MB, peak fds in one worker {peak_fds}, "
        f"CPU {cpu['proxy']:.1f} s; fake_upstream CPU {cpu['fake_upstream']:.1f} s; wall {seconds:.1f} s"
    )
    if interrupted:
        print(f"WARNING: {interrupted}; these figures are not valid")
    print(
        f"store check: {recorded} streamed calls recorded with status 200 for {tally.ok} successful streams "
        f"({'OK' if recorded == tally.ok else 'MISMATCH'})"
    )
    return {
        "streams": args.streams,
        "connections_open_peak": tally.peak,
        "connected_peak": tally.connected_peak,
        "ok": tally.ok,
        "errors": errors,
        "error_kinds": tally.errors,
        "recorded": recorded,
        "recorded_missing": max(0, tally.ok - recorded),
        "seconds": round(seconds, 1),
        "ramp_seconds": round(ramp_s, 1),
        "hold_seconds": args.hold,
        "event_interval_s": args.interval,
        "events_relayed": tally.events,
        "first_event_p50_ms": round(percentile(tally.first_event_ms, 0.5), 1),
        "first_event_p99_ms": round(percentile(tally.first_event_ms, 0.99), 1),
        "proxy_workers": args.workers,
        "proxy_interrupted": interrupted,
        "proxy_rss_mb_peak": peak_rss,
        "proxy_fds_peak_per_worker": peak_fds,
        "proxy_cpu_s": round(cpu["proxy"], 1),
        "fake_upstream_cpu_s": round(cpu["fake_upstream"], 1),
        "load_avg_after": load_average(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=10_000)
    parser.add_argument("--rate", type=int, default=250, help="new connections per second")
    parser.add_argument(
        "--hold", type=float, default=45.0, help="seconds all streams are open together (each lasts ramp + hold)"
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=2.0,
        help="seconds between token events per stream (10,000 streams: 5,000 events/s)",
    )
    parser.add_argument("--workers", type=int, default=2, help="proxy worker processes")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (store, proxy log)")
    args = parser.parse_args()
    exit_on_sigterm()
    args.hold += args.streams / args.rate  # every stream is still open when the last one starts
    run_in_workdir(
        "flywheel-bench-streams-",
        lambda workdir: run(args, workdir),
        keep=lambda summary: bool(args.keep or summary["errors"] or summary["proxy_interrupted"]),
    )


if __name__ == "__main__":
    main()
