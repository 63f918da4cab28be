"""A soak: N minutes of mixed traffic through one proxy; are its memory and descriptors flat?

What runs: the real ``python -m proxy serve`` (one worker) recording into SQLite in a temp dir, in
front of ``bench/fake_upstream.py`` (the fake upstream: it answers at once, so what grows or
leaks is the proxy's; ``--prompt-ids template``, so an episode's prompts grow turn by turn as an
agent's do). ``--agents`` episodes run at once, in groups of ``--group-size``; each episode opens
its own keep-alive connection (connection churn is part of the load), makes ``--turns`` calls with
``--think-s`` between them, each of a kind drawn at random: chat, streamed chat, a tool call (the
request forces a calculator tool, the answer calls it, the next turn sends the tool's result),
Responses (half streamed), Anthropic Messages (half streamed). Then the episode is rewarded (with
per-call rewards now and then) or, one time in twenty, abandoned. A trainer claims complete groups
every second, acks them (trained, or skipped one time in ten) and posts a step's metrics.

Every ``--interval-s`` it prints the proxy's RSS (MB, its whole process tree), open file
descriptors, p50/p99 call latency over the interval, calls/s, errors, and the store's size (the
database and its WAL); also its anonymous resident memory (``RssAnon``: the heap, where a leak
grows; RSS also moves when a loaded machine evicts and re-reads code pages). At the end the
verdict: least-squares slopes over the second half of the run of anonymous memory and RSS (MB per
10 minutes) and descriptors (per 10 minutes), flat if anonymous memory is within
``--rss-limit-mb`` and descriptors within ``--fd-limit``; and the store's call count against the
calls answered.

Run: ``python -m bench.soak [--minutes 30]`` (a benchmark, not a test; nothing is asserted). The
last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sqlite3
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson
import uvloop

from bench._loadgen import CHAT_END, StreamEnd, build_request, connection, created_groups
from bench._procs import FakeUpstreamProcess, ProxyUnderTest, exit_on_sigterm, load_average, open_fds, rss_mb, tree
from bench.fake_upstream import canned_text
from contract.client import AsyncProxyClient
from contract.vocabulary import AckStatus

KINDS = ("chat", "chat_stream", "tool", "responses", "messages")
RESPONSES_END = StreamEnd((b"event: response.completed\n", b"event: response.incomplete\n"), keep=4096)
MESSAGES_END = StreamEnd((b"event: message_stop\n",))
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
WORDS = [f"w{i:03x}" for i in range(4096)]


@dataclass
class Tally:
    """What the clients saw; ``latencies_ns`` and ``interval_calls`` are per reporting interval."""

    stop_at: float
    latencies_ns: list[int] = field(default_factory=list)
    interval_calls: int = 0
    calls: int = 0
    kinds: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    episodes: Counter[str] = field(default_factory=Counter)
    groups_acked: Counter[str] = field(default_factory=Counter)
    claims: int = 0


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def call_request(kind: str, messages: list[dict[str, Any]], rng: random.Random) -> tuple[str, bytes, StreamEnd | None]:
    """The path suffix, body and stream end (None: not streamed) of one call of ``kind``."""
    if kind in ("chat", "chat_stream", "tool"):
        body: dict[str, Any] = {"model": "policy", "messages": messages, "max_tokens": 16, "temperature": 1.0}
        if kind == "chat_stream":
            body["stream"] = True
        if kind == "tool":
            body |= {"tools": TOOLS, "tool_choice": "required"}
        return "/chat/completions", orjson.dumps(body), CHAT_END if kind == "chat_stream" else None
    stream = rng.random() < 0.5
    user = _words(rng, 20)
    if kind == "responses":
        body = {"model": "policy", "instructions": "Be brief.", "input": user, "max_output_tokens": 16}
        return "/responses", orjson.dumps(body | {"stream": stream}), RESPONSES_END if stream else None
    body = {"model": "policy", "system": "Be brief.", "messages": [{"role": "user", "content": user}], "max_tokens": 16}
    return "/messages", orjson.dumps(body | {"stream": stream}), MESSAGES_END if stream else None


def next_turn(kind: str, messages: list[dict[str, Any]], rng: random.Random, turn: int) -> list[dict[str, Any]]:
    """The conversation after a call: the answer as the agent appends it, then the environment's
    reply (a tool result after a tool call). Responses and Messages calls stand alone."""
    if kind == "tool":
        call = {"id": f"call-{turn}", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}
        return [
            *messages,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call-{turn}", "content": str(rng.randrange(1000))},
        ]
    if kind in ("chat", "chat_stream"):
        return [
            *messages,
            {"role": "assistant", "content": canned_text(16)},
            {"role": "user", "content": _words(rng, 30)},
        ]
    return messages


async def run_episode(key: Any, args: argparse.Namespace, rng: random.Random, tally: Tally) -> bool:
    """One episode on its own connection; False if a call failed or the run ended."""
    url = urlsplit(key.base_url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    messages: list[dict[str, Any]] = [{"role": "user", "content": _words(rng, 80)}]
    headers = {"authorization": f"Bearer {key.api_key}", "x-api-key": key.api_key, "anthropic-version": "2023-06-01"}
    async with connection(host, port) as conn:
        for turn in range(args.turns):
            if time.monotonic() > tally.stop_at:
                return False
            kind = rng.choice(KINDS)
            suffix, body, end = call_request(kind, messages, rng)
            path = url.path.removesuffix("/v1") + "/v1/messages" if suffix == "/messages" else url.path + suffix
            request = build_request(host, port, path, body, headers)
            try:
                answer = await asyncio.wait_for(conn.ask(request, stream=end is not None, end=end or CHAT_END), 60.0)
            except (TimeoutError, ConnectionError) as exc:
                tally.errors[f"{kind}:{type(exc).__name__}"] += 1
                return False
            if not answer.ok:
                tally.errors[f"{kind}:http_{answer.status}"] += 1
                return False
            tally.latencies_ns.append(answer.total_ns)
            tally.interval_calls += 1
            tally.calls += 1
            tally.kinds[kind] += 1
            messages = next_turn(kind, messages, rng, turn)
            await asyncio.sleep(args.think_s * rng.uniform(0.5, 1.5))
        return True


async def group_runner(client: AsyncProxyClient, args: argparse.Namespace, seed: int, tally: Tally) -> None:
    rng = random.Random(seed)
    async for group in created_groups(
        client, f"soak-{seed}", args.group_size, until=tally.stop_at, on_error=lambda kind: tally.errors.update([kind])
    ):
        seeds = [rng.randrange(2**31) for _ in group.episode_keys]
        done = await asyncio.gather(
            *(run_episode(k, args, random.Random(s), tally) for k, s in zip(group.episode_keys, seeds, strict=True))
        )
        for key, ok in zip(group.episode_keys, done, strict=True):
            try:
                if ok and rng.random() >= 0.05:
                    per_call = {"0": 0.5} if rng.random() < 0.3 else None
                    await client.reward(key.id, rng.random(), call_rewards=per_call)
                    tally.episodes["rewarded"] += 1
                else:
                    await client.abandon(
                        key.id, "soak: abandoned on purpose" if ok else "soak: a call failed or the run ended"
                    )
                    tally.episodes["abandoned"] += 1
            except Exception as exc:  # noqa: BLE001 - counted and reported
                tally.errors[f"finish:{type(exc).__name__}"] += 1


async def trainer(client: AsyncProxyClient, tally: Tally) -> None:
    """Claim complete groups every second and ack them at once (a trainer with an infinitely fast GPU)."""
    step, rng = 0, random.Random(7)
    while time.monotonic() < tally.stop_at:
        await asyncio.sleep(1.0)
        try:
            claim = await client.claim(trainer_id="soak", max_groups=16, lease_s=120.0, max_staleness=None)
            if not claim.groups:
                continue
            step += 1
            tally.claims += 1
            status: AckStatus = "skipped" if rng.random() < 0.1 else "trained"
            await client.ack(lease_id=claim.lease_id, group_ids=[g.id for g in claim.groups], step=step, status=status)
            tally.groups_acked[status] += len(claim.groups)
            await client.report_step(step, {"loss/policy": rng.random(), "reward/mean": rng.random()})
        except Exception as exc:  # noqa: BLE001 - counted and reported
            tally.errors[f"trainer:{type(exc).__name__}"] += 1


def anon_mb(pid: int) -> float:
    """Anonymous resident memory (``RssAnon``) of a process tree: the heap, where a leak grows.
    RSS also counts file-backed pages (code, mapped libraries) that a loaded machine evicts and
    reads back, which moves RSS without any leak."""
    total = 0
    for p in tree(pid):
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("RssAnon:"):
                total += int(line.split()[1])
    return total / 1024


def store_mb(db: Path) -> float:
    return sum(p.stat().st_size for p in db.parent.glob(db.name + "*")) / 2**20


def percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def sampler(proxy: ProxyUnderTest, args: argparse.Namespace, tally: Tally, start: float) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    print(
        f"{'min':>6} {'RSS MB':>8} {'anon MB':>8} {'fds':>5} {'p50 ms':>8} {'p99 ms':>8} {'calls/s':>8} "
        f"{'errors':>6} {'store MB':>9}"
    )
    last, errors_before = start, 0
    while True:
        remaining = tally.stop_at - time.monotonic()
        await asyncio.sleep(min(args.interval_s, max(remaining, 0.0)))
        now = time.monotonic()
        ms = sorted(ns / 1e6 for ns in tally.latencies_ns)
        errors = sum(tally.errors.values())
        row = {
            "minutes": (now - start) / 60,
            "rss_mb": rss_mb(proxy.proc.pid),
            "anon_mb": anon_mb(proxy.proc.pid),
            "fds": sum(open_fds(proxy.proc.pid).values()),
            "p50_ms": statistics.median(ms) if ms else float("nan"),
            "p99_ms": percentile(ms, 0.99),
            "calls_per_s": tally.interval_calls / (now - last),
            "errors": errors - errors_before,
            "store_mb": store_mb(proxy.db_path),
        }
        rows.append(row)
        tally.latencies_ns, tally.interval_calls, last, errors_before = [], 0, now, errors
        print(
            f"{row['minutes']:6.1f} {row['rss_mb']:8.1f} {row['anon_mb']:8.1f} {row['fds']:5d} "
            f"{row['p50_ms']:8.2f} {row['p99_ms']:8.2f} {row['calls_per_s']:8.1f} {row['errors']:6d} "
            f"{row['store_mb']:9.1f}",
            flush=True,
        )
        if now >= tally.stop_at:
            return rows


def slope_per_10_min(rows: list[dict[str, Any]], key: str) -> float:
    """Least-squares slope of ``key`` against time, per 10 minutes."""
    xs, ys = [r["minutes"] for r in rows], [r[key] for r in rows]
    if len(xs) < 2:
        return float("nan")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return 10 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else float("nan")


def verdict(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    half = [r for r in rows if r["minutes"] >= rows[-1]["minutes"] / 2]
    rss, anon, fds = (slope_per_10_min(half, k) for k in ("rss_mb", "anon_mb", "fds"))
    flat = abs(anon) <= args.rss_limit_mb and abs(fds) <= args.fd_limit
    return {
        "second_half_from_min": half[0]["minutes"] if half else float("nan"),
        "rss_slope_mb_per_10min": rss,
        "anon_slope_mb_per_10min": anon,
        "fd_slope_per_10min": fds,
        "rss_mb_second_half": [min(r["rss_mb"] for r in half), max(r["rss_mb"] for r in half)] if half else [],
        "anon_mb_second_half": [min(r["anon_mb"] for r in half), max(r["anon_mb"] for r in half)] if half else [],
        "fds_second_half": [min(r["fds"] for r in half), max(r["fds"] for r in half)] if half else [],
        "flat": flat,
    }


def stored_calls(db: Path) -> dict[str, int]:
    with sqlite3.connect(db) as conn:
        ok = conn.execute("SELECT count(*) FROM calls WHERE status_code = 200").fetchone()[0]
        total = conn.execute("SELECT count(*) FROM calls").fetchone()[0]
    return {"stored_ok": int(ok), "stored_total": int(total)}


async def drive(args: argparse.Namespace, proxy: ProxyUnderTest) -> dict[str, Any]:
    start = time.monotonic()
    tally = Tally(stop_at=start + 60 * args.minutes)
    client = AsyncProxyClient(proxy.url, proxy.admin_key)
    try:
        runners = [group_runner(client, args, seed, tally) for seed in range(args.agents // args.group_size)]
        rows, *_ = await asyncio.gather(sampler(proxy, args, tally, start), trainer(client, tally), *runners)
    finally:
        await client.aclose()
    return {"rows": rows, "tally": tally}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--interval-s", type=float, default=60.0, help="seconds between report rows")
    parser.add_argument("--agents", type=int, default=8, help="episodes running at once")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--turns", type=int, default=6, help="calls per episode")
    parser.add_argument("--think-s", type=float, default=0.1, help="an agent's mean pause between its calls")
    parser.add_argument(
        "--rss-limit-mb", type=float, default=5.0, help="flat: |anonymous memory slope| at most this, MB per 10 min"
    )
    parser.add_argument("--fd-limit", type=float, default=10.0, help="flat: |descriptor slope| at most this per 10 min")
    args = parser.parse_args()
    if args.agents < args.group_size:
        parser.error("--agents must be at least --group-size")
    exit_on_sigterm()
    upstream = FakeUpstreamProcess.start(tokens=16, prompt_ids="template")
    try:
        with tempfile.TemporaryDirectory(prefix="flywheel-soak-") as tmp:
            proxy = ProxyUnderTest.start(upstream.url, Path(tmp))
            try:
                print(f"soak: {args.minutes:g} min, {args.agents} agents, load {load_average()}", flush=True)
                result = uvloop.run(drive(args, proxy))
            finally:
                interrupted = proxy.interrupted()
                proxy.stop()
            if interrupted:
                raise RuntimeError(interrupted)
            store = stored_calls(proxy.db_path)
    finally:
        upstream.stop()
    tally: Tally = result["tally"]
    rows: list[dict[str, Any]] = result["rows"]
    summary = {
        "minutes": args.minutes,
        "agents": args.agents,
        "calls_answered": tally.calls,
        **store,
        "calls_by_kind": dict(tally.kinds),
        "episodes": dict(tally.episodes),
        "groups_acked": dict(tally.groups_acked),
        "claims": tally.claims,
        "errors": dict(tally.errors),
        "store_mb": rows[-1]["store_mb"],
        "verdict": verdict(args, rows),
        "rows": rows,
    }
    v = summary["verdict"]
    print(
        f"calls answered {tally.calls}, stored ok {store['stored_ok']} (all {store['stored_total']}); "
        f"episodes {dict(tally.episodes)}; groups acked {dict(tally.groups_acked)}; errors {dict(tally.errors) or 0}"
    )
    print(
        f"second half (from minute {v['second_half_from_min']:.1f}): anonymous memory "
        f"{v['anon_slope_mb_per_10min']:+.2f} MB per 10 min (range {v['anon_mb_second_half']}), RSS "
        f"{v['rss_slope_mb_per_10min']:+.2f} MB per 10 min (range {v['rss_mb_second_half']}), descriptors "
        f"{v['fd_slope_per_10min']:+.2f} per 10 min "
        f"(range {v['fds_second_half']}): {'FLAT' if v['flat'] else 'GROWING'}"
    )
    print(json.dumps(summary, default=str))


if __name__ == "__main__":
    main()
