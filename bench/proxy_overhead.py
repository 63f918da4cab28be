"""What the proxy costs: latency and throughput direct to an upstream vs through Flywheel, in one run.

The upstream is ``fake_upstream`` (answers at once, vLLM-shaped bodies; see bench/fake_upstream.py),
so every millisecond measured is transport plus the proxy. The proxy is the real
``python -m proxy serve`` recording into SQLite (WAL) in a temp dir, with a real admin key; each
client connection is one agent with its own episode (``POST /groups``), using the episode's
``base_url`` and ``api_key`` as an agent would. Each cell runs the same closed-loop generator
(bench/_loadgen.py: raw keep-alive sockets on uvloop, pre-built requests) first straight at the
fake upstream, then through the proxy, at concurrency 1, 64 and 256, non-streamed and streamed.
The proxy cells run once per API an agent may speak (``--apis``): chat completions, and the same
conversation as a Responses request and as an Anthropic Messages request, which the proxy
translates to chat and back (``proxy/dialects``); their cost is reported against the chat cells
of the same run.

After the run the proxy is stopped (SIGTERM drains it) and the store is read: every answer the
client got as a success must be a recorded call of its episode with status 200.

Each cell also reports the CPU of every process (from /proc) and "other" (the rest of the machine):
on a shared box req/s follows the share of the cores the proxy gets, so "CPU/req" (proxy CPU
seconds per successful answer) is the figure that carries over between runs.

Run from the repo root: ``python -m bench.proxy_overhead`` (about 5 minutes with the three APIs; ``--workers 2`` runs
two proxy processes, ``--proxy-src DIR`` another checkout for a before/after). The last line is
one JSON object. Targets (2 cores): added p50 <= 1 ms at c=1; >= 1,000 recorded req/s at c=64;
Responses and Messages at most 1.5 ms p50 over chat at c=1 and at least 70% of its req/s at c=64.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson

from bench._loadgen import CHAT_END, CellResult, StreamEnd, build_request, run_cell
from bench._procs import (
    ROOT,
    FakeUpstreamProcess,
    ProxyUnderTest,
    cpu_seconds,
    exit_on_sigterm,
    load_average,
    run_in_workdir,
)

MESSAGES = [
    {"role": "system", "content": "You are a careful coding agent. Think, then call one tool."},
    {"role": "user", "content": "The test suite fails in tests/test_parser.py; find the bug and fix it."},
]


def chat_body(model: str, *, stream: bool, max_tokens: int) -> bytes:
    return orjson.dumps(
        {"model": model, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0.7, "stream": stream}
    )


def api_request(api: str, episode_path: str, *, stream: bool, max_tokens: int) -> tuple[str, bytes]:
    """The path and body of the same conversation in ``api`` (episode_path: ``/episodes/<id>/v1``)."""
    system, user = MESSAGES[0]["content"], MESSAGES[1]["content"]
    if api == "responses":
        return episode_path + "/responses", orjson.dumps(
            {
                "model": "policy",
                "instructions": system,
                "input": user,
                "max_output_tokens": max_tokens,
                "temperature": 0.7,
                "stream": stream,
            }
        )
    if api == "messages":
        return episode_path.removesuffix("/v1") + "/v1/messages", orjson.dumps(
            {
                "model": "policy",
                "system": system,
                "messages": [{"role": "user", "content": user}],
                "max_tokens": max_tokens,
                "temperature": 0.7,
                "stream": stream,
            }
        )
    return episode_path + "/chat/completions", chat_body("policy", stream=stream, max_tokens=max_tokens)


STREAM_ENDS = {
    "chat": CHAT_END,  # the fake upstream stops on length: Responses then ends "incomplete"
    "responses": StreamEnd((b"event: response.completed\n", b"event: response.incomplete\n"), keep=4096),
    "messages": StreamEnd((b"event: message_stop\n",)),
}


def busy_cpu_seconds() -> float:
    """CPU seconds all cores spent busy since boot (for "everything else on the machine")."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@dataclass
class Cell:
    target: str  # direct | proxy
    api: str  # chat | responses | messages (what the agent speaks; direct is always chat)
    stream: bool
    concurrency: int
    result: CellResult
    cpu: dict[str, float]
    """Percent of one core per process over the cell: proxy, fake_upstream, loadgen, other."""
    proxy_cpu_s: float
    transport: str = ""
    """The proxy's ``upstream_transport`` (proxy cells; ``--transports``)."""

    @property
    def proxy_cpu_ms_per_answer(self) -> float:
        """Proxy CPU per successful answer over the whole cell: what a request costs the proxy,
        whatever share of the cores the other tenants of the machine left it."""
        answered = sum(self.result.ok_per_conn)
        return 1000 * self.proxy_cpu_s / answered if answered and self.target == "proxy" else float("nan")


async def measure(
    cell: Coroutine[Any, Any, CellResult], pids: dict[str, int]
) -> tuple[CellResult, dict[str, float], float]:
    """Run ``cell`` (a ``run_cell`` not yet awaited), accounting the CPU that ``pids``, this load
    generator and the rest of the machine used meanwhile; also returns the proxy's CPU seconds."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    own, busy = os.times(), busy_cpu_seconds()
    t0 = time.monotonic()
    result = await cell
    wall = time.monotonic() - t0
    used = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    after = os.times()
    used["loadgen"] = after.user + after.system - own.user - own.system
    used["other"] = max(0.0, busy_cpu_seconds() - busy - sum(used.values()))
    return result, {name: 100 * seconds / wall for name, seconds in used.items()}, used.get("proxy", 0.0)


def recorded_ok(db_path: Path) -> dict[str, int]:
    """Recorded calls with status 200, per episode."""
    with sqlite3.connect(db_path) as db:
        rows = db.execute("SELECT episode_id, count(*) FROM calls WHERE status_code = 200 GROUP BY episode_id")
        return dict(rows.fetchall())


async def _direct_cell(
    args: argparse.Namespace, upstream: FakeUpstreamProcess, request: bytes, stream: bool, concurrency: int
) -> Cell:
    """The same chat request straight at the fake upstream: the baseline each proxy cell adds to."""
    up = urlsplit(upstream.url)
    result, cpu, _ = await measure(
        run_cell(
            up.hostname or "",
            up.port or 0,
            [request] * concurrency,
            stream=stream,
            warmup_s=args.warmup,
            measure_s=args.seconds,
        ),
        pids={"fake_upstream": upstream.proc.pid},
    )
    _progress("direct", "chat", stream, concurrency, result)
    return Cell("direct", "chat", stream, concurrency, result, cpu, 0.0)


async def _proxy_cell(
    args: argparse.Namespace,
    upstream: FakeUpstreamProcess,
    proxy: ProxyUnderTest,
    episodes: list[dict[str, str]],
    api: str,
    stream: bool,
    concurrency: int,
    transport: str,
) -> Cell:
    """One agent per connection, each on its own episode, speaking ``api`` through ``proxy``."""
    px = urlsplit(proxy.url)
    requests = [
        build_request(
            px.hostname or "",
            px.port or 0,
            *api_request(api, urlsplit(ep["base_url"]).path, stream=stream, max_tokens=args.tokens),
            {"authorization": f"Bearer {ep['api_key']}"},
        )
        for ep in episodes[:concurrency]
    ]
    result, cpu, proxy_cpu_s = await measure(
        run_cell(
            px.hostname or "",
            px.port or 0,
            requests,
            stream=stream,
            warmup_s=args.warmup,
            measure_s=args.seconds,
            end=STREAM_ENDS[api],
        ),
        pids={"proxy": proxy.proc.pid, "fake_upstream": upstream.proc.pid},
    )
    _progress(f"proxy[{transport}]", api, stream, concurrency, result)
    return Cell("proxy", api, stream, concurrency, result, cpu, proxy_cpu_s, transport)


def _progress(target: str, api: str, stream: bool, concurrency: int, result: CellResult) -> None:
    print(
        f"  {target} {api} {'stream' if stream else 'plain'} c={concurrency}: "
        f"{result.rps:.0f} req/s, p50 {result.percentile_ms(0.5):.2f} ms, errors {result.errors}",
        flush=True,
    )


def print_table(cells: list[Cell]) -> None:
    header = (
        f"{'target':<13} {'api':<9} {'mode':<7} {'conc':>5} {'ok':>7} {'err':>5} {'req/s':>8} {'p50 ms':>8} "
        f"{'p90 ms':>8} {'p99 ms':>8} {'CPU/req':>9}   cpu% proxy/upstream/loadgen/other"
    )
    print(header)
    print("-" * len(header))
    for cell in cells:
        r = cell.result
        cpu = "/".join(f"{cell.cpu.get(k, 0):.0f}" for k in ("proxy", "fake_upstream", "loadgen", "other"))
        proxy_cpu = f"{cell.proxy_cpu_ms_per_answer:.2f}ms" if cell.target == "proxy" else "-"
        mode = "stream" if cell.stream else "plain"
        target = cell.target + (f"[{cell.transport}]" if cell.transport else "")
        print(
            f"{target:<13} {cell.api:<9} {mode:<7} {cell.concurrency:>5} {r.ok:>7} {r.errors:>5}"
            f" {r.rps:>8.0f} {r.percentile_ms(0.5):>8.2f} {r.percentile_ms(0.9):>8.2f} "
            f"{r.percentile_ms(0.99):>8.2f} {proxy_cpu:>9}   {cpu}"
        )
        if r.error_kinds:
            print(f"{'':>22}errors: {r.error_kinds}")


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, object]:
    upstream = FakeUpstreamProcess.start(tokens=args.tokens)
    proxies: dict[str, ProxyUnderTest] = {}
    try:
        for transport in args.transports:  # one proxy per transport, on the same upstream
            (workdir / transport).mkdir()
            proxies[transport] = ProxyUnderTest.start(
                upstream.url,
                workdir / transport,
                workers=args.workers,
                source=args.proxy_src,
                extra_env={"FLYWHEEL_UPSTREAM_TRANSPORT": transport},
            )
        most = max(args.concurrency)
        episodes = {t: p.create_group(most, task_id="bench-proxy-overhead") for t, p in proxies.items()}
        up = urlsplit(upstream.url)
        expected: dict[str, int] = {}
        cells: list[Cell] = []
        load_before = load_average()
        for stream in (False, True):
            direct_req = build_request(
                up.hostname or "",
                up.port or 0,
                "/v1/chat/completions",
                chat_body("policy-base", stream=stream, max_tokens=args.tokens),
            )
            for concurrency in args.concurrency:
                cells.append(await _direct_cell(args, upstream, direct_req, stream, concurrency))
                for api in args.apis:
                    for transport, proxy in proxies.items():  # alternated: each transport sees the same load
                        measured = await _proxy_cell(
                            args, upstream, proxy, episodes[transport], api, stream, concurrency, transport
                        )
                        cells.append(measured)
                        for ep, ok in zip(episodes[transport], measured.result.ok_per_conn, strict=False):
                            expected[ep["id"]] = expected.get(ep["id"], 0) + ok
        load_after = load_average()
    finally:
        interrupted = "; ".join(filter(None, (p.interrupted() for p in proxies.values())))
        for proxy in proxies.values():
            proxy.stop()  # SIGTERM: drains the recorder
        upstream.stop()
    stored: dict[str, int] = {}
    for proxy in proxies.values():
        stored.update(recorded_ok(proxy.db_path))
    missing = sum(max(0, n - stored.get(eid, 0)) for eid, n in expected.items())

    print()
    print_table(cells)
    first = args.transports[0]

    def cell(target: str, stream: bool, concurrency: int, api: str = "chat", transport: str = first) -> CellResult:
        return next(
            c.result
            for c in cells
            if c.target == target
            and c.api == api
            and c.stream == stream
            and c.concurrency == concurrency
            and (target == "direct" or c.transport == transport)
        )

    summary: dict[str, object] = {}
    for stream, suffix in ((False, ""), (True, "_stream")):
        if 1 in args.concurrency:
            added = cell("proxy", stream, 1).percentile_ms(0.5) - cell("direct", stream, 1).percentile_ms(0.5)
            summary[f"c1_added_p50_ms{suffix}"] = round(added, 3)
            summary[f"c1_p50_ms_direct{suffix}"] = round(cell("direct", stream, 1).percentile_ms(0.5), 3)
            summary[f"c1_p50_ms_proxy{suffix}"] = round(cell("proxy", stream, 1).percentile_ms(0.5), 3)
        for concurrency in args.concurrency:
            if concurrency == 1:
                continue
            summary[f"c{concurrency}_rps_direct{suffix}"] = round(cell("direct", stream, concurrency).rps)
            summary[f"c{concurrency}_rps_proxy{suffix}"] = round(cell("proxy", stream, concurrency).rps)
            summary[f"c{concurrency}_p50_ms_proxy{suffix}"] = round(
                cell("proxy", stream, concurrency).percentile_ms(0.5), 2
            )
            summary[f"c{concurrency}_errors{suffix}"] = cell("proxy", stream, concurrency).errors
        for concurrency in args.concurrency:
            for transport in args.transports:
                spent = next(
                    c
                    for c in cells
                    if c.target == "proxy"
                    and c.api == "chat"
                    and c.stream == stream
                    and c.concurrency == concurrency
                    and c.transport == transport
                ).proxy_cpu_ms_per_answer
                key = f"c{concurrency}_proxy_cpu_ms_per_req{suffix}"
                summary[key if transport == first else f"{transport}_{key}"] = round(spent, 3)
            for transport in args.transports[1:]:  # the baseline against the first, same run, same load
                base, other = cell("proxy", stream, concurrency), cell("proxy", stream, concurrency, "chat", transport)
                summary[f"{transport}_c{concurrency}_rps{suffix}"] = round(other.rps)
                summary[f"{transport}_c{concurrency}_p50_ms{suffix}"] = round(other.percentile_ms(0.5), 3)
                summary[f"{first}_vs_{transport}_c{concurrency}_rps{suffix}"] = (
                    round(base.rps / other.rps, 3) if other.rps else float("nan")
                )
        for api in args.apis:  # each API against chat through the same proxy in the same run
            if api == "chat":
                continue
            if 1 in args.concurrency:
                over = cell("proxy", stream, 1, api).percentile_ms(0.5) - cell("proxy", stream, 1).percentile_ms(0.5)
                summary[f"{api}_c1_p50_ms_over_chat{suffix}"] = round(over, 3)
            for concurrency in args.concurrency:
                if concurrency == 1:
                    continue
                chat_rps = cell("proxy", stream, concurrency).rps
                ratio = cell("proxy", stream, concurrency, api).rps / chat_rps if chat_rps else float("nan")
                summary[f"{api}_c{concurrency}_rps{suffix}"] = round(cell("proxy", stream, concurrency, api).rps)
                summary[f"{api}_c{concurrency}_rps_vs_chat{suffix}"] = round(ratio, 3)
                summary[f"{api}_c{concurrency}_errors{suffix}"] = cell("proxy", stream, concurrency, api).errors
    summary.update(
        {
            "errors_total": sum(c.result.errors for c in cells),
            "proxied_ok_total": sum(expected.values()),
            "recorded_ok_total": sum(stored.values()),
            "recorded_missing": missing,
            "proxy_workers": args.workers,
            "transports": args.transports,
            "proxy_source": str(args.proxy_src),
            "proxy_interrupted": interrupted,
            "completion_tokens": args.tokens,
            "seconds_per_cell": args.seconds,
            "load_avg_before": load_before,
            "load_avg_after": load_after,
            "other_cpu_pct_mean": round(sum(c.cpu["other"] for c in cells) / len(cells)),
        }
    )
    if interrupted:
        print(f"\nWARNING: {interrupted}; these figures are not valid")
    print(
        f"\nstore check: {summary['proxied_ok_total']} successful proxied answers, "
        f"{summary['recorded_ok_total']} recorded with status 200, {missing} missing "
        f"({'OK' if missing == 0 else 'FAILED'})"
    )
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="measuring window per cell")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each window")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64, 256])
    parser.add_argument(
        "--apis",
        type=lambda s: s.split(","),
        default=["chat", "responses", "messages"],
        help="what the agents speak through the proxy (chat always runs: the others compare to it)",
    )
    parser.add_argument(
        "--transports",
        type=lambda s: s.split(","),
        default=["lean"],
        help="the proxy's upstream_transport per proxy, alternated cell by cell (lean,httpx: the hand-written "
        "transport against httpx's own; the first is the one the summary's plain keys describe)",
    )
    parser.add_argument("--tokens", type=int, default=16, help="completion tokens per answer (fake_upstream)")
    parser.add_argument("--workers", type=int, default=1, help="proxy worker processes")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (store, proxy log)")
    parser.add_argument(
        "--proxy-src",
        type=Path,
        default=ROOT,
        help="checkout whose proxy/ and migrations/ run (e.g. an older commit, for before/after)",
    )
    args = parser.parse_args()
    if "chat" not in args.apis:
        args.apis.insert(0, "chat")
    exit_on_sigterm()
    run_in_workdir(
        "flywheel-bench-",
        lambda workdir: run(args, workdir),
        keep=lambda summary: bool(args.keep or summary["errors_total"] or summary["recorded_missing"]),
    )


if __name__ == "__main__":
    main()
