"""A fleet on one PostgreSQL: several proxies, M synthetic agents, a trainer; measured against bench/capacity.py.

What runs: ``--proxies`` real ``python -m proxy serve`` processes recording into one fresh
PostgreSQL database (created here, dropped after: other users' data is never touched), in front of
``bench/fake_upstream.py`` (the fake upstream, so the fleet's own costs are measured, not a model's)
with ``--prompt-ids template``: each chat answer's prompt ids are the request's messages through a
toy chat template, so the context grows turn by turn and each call extends the previous prompt plus
its completion, as an agent's calls do.

The agents: ``--agents`` M episodes run at once, in groups of ``--group-size`` created through the
proxies in turn (``contract/client.py``). An episode is ``--turns`` T calls: a first user message of
``--first-words`` words, then per turn the model's canned answer (``--completion`` tokens) and an
environment message of ``--added-words`` words (one token each under the toy template); rewards are
posted when the group's episodes end, and a new group starts. A trainer-like client claims complete
groups as the trainer does (``contract.client``: delta form, rejoined) and acks them over HTTP
(``--no-trainer`` to leave them), counting the claim answers' bytes.

Measured over the window after ``--warmup-s``: calls/s, p50/p99 call latency, proxy CPU per call
(``/proc``), store growth (``pg_database_size`` and ``pg_total_relation_size('calls')`` sampled
every 2 s) and claim bytes per group. Printed next to ``bench.capacity.plan`` for the same episode
shape at the measured call rate, with the ratio measured/predicted. The call-rate ceiling is the
proxies' own (their CPU per call); on a shared machine the agents, the fake upstream and PostgreSQL
take the same cores, so the measured rate sits below it.

Run: ``python -m bench.fleet [--proxies 2 --agents 16 --seconds 60]``. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
import uvloop
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from bench._loadgen import build_request, connection, created_groups
from bench._procs import FakeUpstreamProcess, ProxyUnderTest, cpu_seconds, exit_on_sigterm, load_average
from bench.capacity import Costs, Episode, plan
from bench.fake_upstream import Template, canned_text
from bench.store_growth import pg_admin
from contract.client import AsyncProxyClient
from proxy.store.db import migrate_async

WORDS = [f"w{i:03x}" for i in range(4096)]


def first_messages(rng: random.Random, words: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(words))}]


def next_messages(rng: random.Random, completion: int, words: int) -> list[dict[str, str]]:
    """The model's answer as the agent appends it, and the environment's reply."""
    return [
        {"role": "assistant", "content": canned_text(completion)},
        {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(words))},
    ]


def episode_shape(args: argparse.Namespace) -> Episode:
    """The episode in tokens, through the fake upstream's own template (P0 and E include its tokens)."""
    rng, template = random.Random(0), Template()
    messages = first_messages(rng, args.first_words)
    first = len(template.prompt(messages))
    second = len(template.prompt(messages + next_messages(rng, args.completion, args.added_words)))
    return Episode(args.turns, first, args.completion, second - first - args.completion, args.group_size)


@dataclass
class Tally:
    measure_from: float = 0.0
    stop_at: float = 0.0
    latencies_ns: list[int] = field(default_factory=list)
    calls: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    episodes: int = 0
    groups_claimed: int = 0
    claim_bytes: int = 0
    claims: int = 0

    def in_window(self) -> bool:
        return self.measure_from <= time.monotonic() <= self.stop_at

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


async def run_episode(key: Any, args: argparse.Namespace, seed: int, tally: Tally) -> bool:
    """One agent's episode, T calls on one keep-alive connection; False if a call failed or time ran out."""
    url = urlsplit(key.base_url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    rng = random.Random(seed)
    messages: list[dict[str, str]] = first_messages(rng, args.first_words)
    async with connection(host, port) as conn:
        for _ in range(args.turns):
            if time.monotonic() > tally.stop_at:
                return False
            body = orjson.dumps(
                {"model": "policy", "messages": messages, "max_tokens": args.completion, "temperature": 1.0}
            )
            request = build_request(
                host, port, f"{url.path}/chat/completions", body, {"authorization": f"Bearer {key.api_key}"}
            )
            try:
                answer = await asyncio.wait_for(conn.ask(request, stream=False), 60.0)
            except (TimeoutError, ConnectionError) as exc:
                tally.error(type(exc).__name__)
                return False
            if not answer.ok:
                tally.error(f"http_{answer.status}")
                return False
            if tally.in_window():
                tally.calls += 1
                tally.latencies_ns.append(answer.total_ns)
            messages = messages + next_messages(rng, args.completion, args.added_words)
        return True


async def group_runner(client: AsyncProxyClient, args: argparse.Namespace, runner: int, tally: Tally) -> None:
    """Groups one after another: create, run its episodes at once, reward them (abandon the unfinished)."""
    rng = random.Random(runner)
    async for group in created_groups(
        client, f"fleet-{runner}", args.group_size, until=tally.stop_at, on_error=tally.error
    ):
        done = await asyncio.gather(*(run_episode(k, args, rng.randrange(2**31), tally) for k in group.episode_keys))
        for key, ok in zip(group.episode_keys, done, strict=True):
            if ok:
                await client.reward(key.id, rng.random())
                tally.episodes += tally.in_window()
            else:
                await client.abandon(key.id, "fleet bench: stopped or failed")


class CountingTransport(httpx.AsyncHTTPTransport):
    """Counts the body bytes of ``/trainer/claim`` answers (what a trainer downloads)."""

    def __init__(self, tally: Tally) -> None:
        super().__init__()
        self.tally = tally

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        if request.url.path == "/trainer/claim":
            body = await response.aread()
            if self.tally.in_window():
                self.tally.claim_bytes += len(body)
            return httpx.Response(response.status_code, headers=response.headers, content=body)
        return response


async def trainer(url: str, admin_key: str, tally: Tally) -> None:
    """Claim complete groups and ack them trained at once (a trainer with an infinitely fast GPU)."""
    async with AsyncProxyClient(url, admin_key, transport=CountingTransport(tally)) as client:
        step = 0
        while time.monotonic() < tally.stop_at:
            claim = await client.claim(trainer_id="fleet", max_groups=4, lease_s=120.0, max_staleness=None)
            if not claim.groups:
                await asyncio.sleep(0.5)
                continue
            if tally.in_window():
                tally.groups_claimed += len(claim.groups)
                tally.claims += 1
            step += 1
            await client.ack(
                lease_id=claim.lease_id, group_ids=[g.id for g in claim.groups], step=step, status="trained"
            )


async def store_sizes(engine: AsyncEngine) -> tuple[int, int]:
    async with engine.connect() as conn:
        row = (
            await conn.execute(text("SELECT pg_database_size(current_database()), pg_total_relation_size('calls')"))
        ).one()
    return int(row[0]), int(row[1])


async def drive(args: argparse.Namespace, proxies: list[ProxyUnderTest], store_url: str) -> dict[str, Any]:
    tally = Tally()
    start = time.monotonic()
    tally.measure_from, tally.stop_at = start + args.warmup_s, start + args.warmup_s + args.seconds
    clients = [AsyncProxyClient(p.url, p.admin_key) for p in proxies]
    engine = create_async_engine(store_url)
    samples: list[tuple[float, int, int]] = []
    cpu: dict[str, list[float]] = {}

    async def sampler() -> None:
        marked = False
        while time.monotonic() < tally.stop_at:
            now = time.monotonic()
            if now >= tally.measure_from and not marked:
                cpu["from"] = [cpu_seconds(p.proc.pid) for p in proxies]
                marked = True
            if now >= tally.measure_from:
                samples.append((now, *await store_sizes(engine)))
            await asyncio.sleep(2.0)
        cpu["to"] = [cpu_seconds(p.proc.pid) for p in proxies]
        samples.append((time.monotonic(), *await store_sizes(engine)))

    runners = args.agents // args.group_size
    tasks = [group_runner(clients[i % len(clients)], args, i, tally) for i in range(runners)]
    if args.trainer:
        tasks.append(trainer(proxies[0].url, proxies[0].admin_key, tally))
    try:
        await asyncio.gather(sampler(), *tasks)
    finally:
        for client in clients:
            await client.aclose()
        await engine.dispose()
    window = samples[-1][0] - samples[0][0]
    ms = sorted(ns / 1e6 for ns in tally.latencies_ns)
    cpu_s = sum(cpu["to"]) - sum(cpu["from"])
    return {
        "seconds": window,
        "calls": tally.calls,
        "calls_per_s": tally.calls / args.seconds,
        "episodes": tally.episodes,
        "p50_ms": statistics.median(ms) if ms else float("nan"),
        "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))] if ms else float("nan"),
        "errors": tally.errors,
        "proxy_cpu_ms_per_call": 1000 * cpu_s / tally.calls if tally.calls else float("nan"),
        "db_mb_per_s": (samples[-1][1] - samples[0][1]) / window / 1e6,
        "calls_mb_per_s": (samples[-1][2] - samples[0][2]) / window / 1e6,
        "db_bytes": samples[-1][1],
        "groups_claimed": tally.groups_claimed,
        "claims": tally.claims,
        "claim_bytes_per_group": tally.claim_bytes / tally.groups_claimed if tally.groups_claimed else float("nan"),
    }


def report(args: argparse.Namespace, ep: Episode, m: dict[str, Any]) -> dict[str, Any]:
    costs = Costs()
    p = plan(ep, m["calls_per_s"], costs)
    ceiling = args.proxies * 1000 / p.proxy_cpu_ms_per_call
    rows = [
        ("calls/s (vs the proxies' CPU ceiling)", m["calls_per_s"], ceiling, ""),
        ("proxy CPU ms per call", m["proxy_cpu_ms_per_call"], p.proxy_cpu_ms_per_call, ""),
        ("store MB/s, table calls", m["calls_mb_per_s"], p.store_mb_per_s, ""),
        ("store MB/s, whole database", m["db_mb_per_s"], p.store_mb_per_s, "(model: calls only)"),
        ("claim KB per group", m["claim_bytes_per_group"] / 1e3, p.claim_bytes_per_group / 1e3, ""),
    ]
    print(
        f"episode: T={ep.turns} P0={ep.first_prompt} A={ep.completion} E={ep.added} C={ep.context} tokens, "
        f"G={ep.group_size}; {args.proxies} proxies, {args.agents} agents, {m['seconds']:.0f} s measured, "
        f"load {load_average()}"
    )
    print(
        f"calls {m['calls']}  episodes {m['episodes']}  p50 {m['p50_ms']:.1f} ms  p99 {m['p99_ms']:.1f} ms  "
        f"errors {m['errors'] or 0}  groups claimed {m['groups_claimed']} in {m['claims']} claims"
    )
    print(f"{'quantity':40} {'measured':>10} {'model':>10} {'ratio':>7}")
    out = {}
    for name, measured, model, note in rows:
        ratio = measured / model if model else float("nan")
        print(f"{name:40} {measured:10.3f} {model:10.3f} {ratio:7.2f} {note}")
        out[name] = {"measured": measured, "model": model, "ratio": ratio}
    return {"episode": asdict(ep), "measured": m, "model": asdict(p), "rows": out}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    name = f"flywheel_fleet_{uuid.uuid4().hex[:10]}"
    await pg_admin(args.pg_url, f'CREATE DATABASE "{name}"')
    store_url = args.pg_url.rsplit("/", 1)[0] + "/" + name
    upstream: FakeUpstreamProcess | None = None
    proxies: list[ProxyUnderTest] = []
    try:
        await migrate_async(store_url)  # once, before the proxies start (each would otherwise race to)
        upstream = FakeUpstreamProcess.start(tokens=args.completion, prompt_ids="template")
        with tempfile.TemporaryDirectory(prefix="flywheel-fleet-") as tmp:
            for i in range(args.proxies):
                work = Path(tmp) / f"proxy-{i}"
                work.mkdir()
                proxies.append(
                    await asyncio.to_thread(
                        ProxyUnderTest.start, upstream.url, work, extra_env={"FLYWHEEL_STORE__URL": store_url}
                    )
                )
            try:
                measured = await drive(args, proxies, store_url)
            finally:
                stopped = [why for p in proxies if (why := p.interrupted())]
                for p in proxies:
                    p.stop()
                proxies = []
            if stopped:
                raise RuntimeError("; ".join(stopped))
    finally:
        for p in proxies:
            p.stop()
        if upstream is not None:
            upstream.stop()
        await pg_admin(args.pg_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return report(args, episode_shape(args), measured)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--proxies", type=int, default=2)
    parser.add_argument("--agents", type=int, default=16, help="M: episodes running at once")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--turns", type=int, default=10, help="T: calls per episode")
    parser.add_argument("--first-words", type=int, default=500, help="the first user message (one token a word)")
    parser.add_argument("--added-words", type=int, default=300, help="the environment's words per turn")
    parser.add_argument("--completion", type=int, default=100, help="tokens the fake upstream samples per call")
    parser.add_argument("--seconds", type=float, default=60.0, help="the measured window")
    parser.add_argument("--warmup-s", type=float, default=10.0)
    parser.add_argument("--no-trainer", dest="trainer", action="store_false")
    parser.add_argument("--pg-url", default="postgresql+asyncpg://postgres@127.0.0.1:5432/test")
    args = parser.parse_args()
    if args.agents < args.group_size:
        parser.error("--agents must be at least --group-size")
    exit_on_sigterm()
    print(json.dumps(uvloop.run(run(args)), default=str))


if __name__ == "__main__":
    main()
