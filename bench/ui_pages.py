"""Dashboard page times on a store of 100,000 episodes, against the same pages on 1,000, in one run.

Why: every list in the dashboard is a keyset page on an index (``proxy/store/browse.py``), so a
page should cost about the same on a large store as on a small one; this measures it. For each
store (SQLite in a temp dir, and PostgreSQL in a database of its own on the local server, dropped
afterwards) and each size, the store is filled with groups of 4 episodes, each episode with two
recorded chat calls (a tool call and its answer, ~150 prompt ids, ~30 sampled ids with logprobs):
groups and episodes by bulk insert of the ORM tables, the calls through ``Calls.insert``
(the recorder's writer, so the call rows are exactly what the proxy stores), then rewards, group
completion and train status by bulk update, plus trainer steps and policy versions for the overview;
on PostgreSQL then ANALYZE (the statistics autovacuum would have gathered on a store that grew).

Then each page is requested in-process (httpx on the ASGI app, admin bearer key; the upstream is a
fake that answers health checks only: no page calls a model) once to warm up and ``--repeat`` times
measured; the median is printed in ms, and the ratio 100,000 / 1,000. Pages: the overview and its
live feed, the groups and episodes tables (first page, a page 95% deep by keyset cursor, filtered
by status and by task), an episode, a group's compare page, and an export of the newest 1,000
episodes through the download route (streamed, timed once after a warm-up; ms per 1,000 episodes).

Run from the repo root: ``python -m bench.ui_pages`` (``--sizes 1000 100000``, ``--stores sqlite
postgres``). Filling 100,000 episodes takes a few minutes per store on 2 shared cores.
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
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import Double, cast, insert, select, text, update
from sqlalchemy.ext.asyncio import async_sessionmaker

from bench._procs import load_average
from proxy.app import create_app
from proxy.settings import Settings
from proxy.store.db import make_engine, migrate_async
from proxy.store.models import Episode, Group, PolicyVersion, TrainerStep
from proxy.store.records import NewCall
from proxy.store.repository import Repository

ADMIN_KEY = "bench-admin-key-0123456789abcdef"
PG_SERVER = "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
GROUP_SIZE = 4
TASKS = ["calc-add", "calc-mul", "math-gsm", "math-algebra", "tool-search"]
SYSTEM = "You are a careful calculator agent. Use the calculator tool, then submit the answer."


def _fake_upstream() -> httpx.MockTransport:
    """A fake vLLM that answers the proxy's health and model probes only (no page calls a model)."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/v1/models"):
            return httpx.Response(200, json={"object": "list", "data": [{"id": "policy-base", "object": "model"}]})
        return httpx.Response(200, json={})

    return httpx.MockTransport(handler)


def _calls(episode_id: str, rng: random.Random, at: float) -> list[NewCall]:
    """Two chat calls of one episode: a calculator tool call, then the answer after its result."""
    a, b = rng.randint(2, 999), rng.randint(2, 999)
    tool_call = {
        "id": f"call_{episode_id[:8]}",
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": f"{a} * {b}"})},
    }
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a} * {b}?"}]
    second = [*first, {"role": "assistant", "content": None, "tool_calls": [tool_call]}]
    second.append({"role": "tool", "tool_call_id": tool_call["id"], "content": str(a * b)})
    prompt = [rng.randint(3, 49_000) for _ in range(150)]
    out: list[NewCall] = []
    for ordinal, (messages, n) in enumerate(((first, 30), (second, 12))):
        ids = [rng.randint(3, 49_000) for _ in range(n)]
        logprobs = [round(-rng.expovariate(2.0), 4) for _ in range(n)]
        text_out = "" if ordinal == 0 else f"The answer is {a * b}."
        out.append(
            NewCall(
                episode_id=episode_id,
                kind="chat",
                stream=False,
                request={"model": "policy", "messages": messages, "temperature": 1.0, "logprobs": True},
                response={
                    "id": f"chatcmpl-{uuid.uuid4().hex[:16]}",
                    "choices": [
                        {
                            "index": 0,
                            "message": {
                                "role": "assistant",
                                "content": text_out or None,
                                "tool_calls": [tool_call] if ordinal == 0 else None,
                            },
                            "finish_reason": "tool_calls" if ordinal == 0 else "stop",
                        }
                    ],
                },
                status_code=200,
                error=None,
                prompt_token_ids=prompt if ordinal == 0 else prompt + out[0].choices[0]["token_ids"] + [7, 8, 9],
                choices=[
                    {
                        "index": 0,
                        "token_ids": ids,
                        "logprobs": logprobs,
                        "finish_reason": "stop",
                        "text": text_out,
                        "tool_calls": [tool_call] if ordinal == 0 else None,
                    }
                ],
                exact_ids=True,
                model_requested="policy",
                model_served="policy-v3",
                policy_version=3,
                replica="vllm-0",
                started_at=at + ordinal,
                latency_ms=80.0 + rng.random() * 40,
                ttft_ms=None,
                prompt_tokens=150,
                completion_tokens=n,
                notes={"sampling": {"mode": "sampled", "temperature": 1.0}},
            )
        )
    return out


async def fill(url: str, episodes: int, seed: int = 0) -> dict[str, float]:
    """``episodes`` episodes in groups of 4, each with two calls; returns the fill's timings."""
    rng = random.Random(seed)
    await migrate_async(url)
    engine = make_engine(url, pool_size=2)
    sessions = async_sessionmaker(engine)
    repo = Repository(url)
    t0 = time.perf_counter()
    base = time.time() - episodes  # one episode a second, ending now
    chunk = 2000
    insert_s = calls_s = 0.0
    try:
        for start in range(0, episodes, chunk):
            groups: list[dict[str, Any]] = []
            members: list[dict[str, Any]] = []
            for g in range(start // GROUP_SIZE, min(start + chunk, episodes) // GROUP_SIZE):
                gid = str(uuid.uuid4())
                at = base + g * GROUP_SIZE
                groups.append(
                    {"id": gid, "task_id": TASKS[g % len(TASKS)], "size": GROUP_SIZE, "meta": {}, "status": "open"}
                    | {"created_at": at, "train_status": "pending"}
                )
                for i in range(GROUP_SIZE):
                    members.append(
                        {"id": str(uuid.uuid4()), "group_id": gid, "group_index": i, "task_id": TASKS[g % len(TASKS)]}
                        | {"meta": {}, "status": "open", "created_at": at}
                    )
            t = time.perf_counter()
            async with sessions() as session, session.begin():  # ORM bulk inserts (attribute names)
                await session.execute(insert(Group), groups)
                await session.execute(insert(Episode), members)
            insert_s += time.perf_counter() - t
            t = time.perf_counter()
            batch = [c for m in members for c in _calls(m["id"], rng, m["created_at"])]
            outcome = await repo.calls.insert(batch)
            assert all(o is None for o in outcome), [o for o in outcome if o is not None][:3]
            calls_s += time.perf_counter() - t
        t = time.perf_counter()
        async with sessions() as conn, conn.begin():
            # Rewards: half the members succeed.
            await conn.execute(
                update(Episode).values(
                    status="rewarded", reward=cast(Episode.group_index % 2, Double), finished_at=base
                )
            )
            await conn.execute(update(Group).values(status="complete", completed_at=base, train_status="trained"))
            pending = select(Group.id).order_by(Group.created_at.desc()).limit(max(1, episodes // GROUP_SIZE // 10))
            await conn.execute(
                update(Group).where(Group.id.in_(pending.scalar_subquery())).values(train_status="pending")
            )
            await conn.execute(
                insert(TrainerStep),
                [{"step": s, "metrics": _metrics(s, rng), "created_at": base + s} for s in range(500)],
            )
            await conn.execute(
                insert(PolicyVersion),
                [
                    {"version": v, "name": f"policy-v{v}", "adapter_path": f"/adapters/v{v}", "created_at": base + v}
                    | {"meta": {}}
                    for v in range(1, 51)
                ],
            )
        if not url.startswith("sqlite"):
            # Planner statistics, as autovacuum's autoanalyze gathers them on a store that grew over
            # time (a table filled in one go is planned as if empty until then). SQLite gets none:
            # the proxy never runs ANALYZE there.
            async with engine.connect() as raw:
                await (await raw.execution_options(isolation_level="AUTOCOMMIT")).execute(text("ANALYZE"))
        update_s = time.perf_counter() - t
    finally:
        await repo.close()
        await engine.dispose()
    return {"insert_s": insert_s, "calls_s": calls_s, "update_s": update_s, "total_s": time.perf_counter() - t0}


def _metrics(step: int, rng: random.Random) -> dict[str, float]:
    return {
        "reward/mean": min(1.0, 0.2 + step / 800 + rng.random() * 0.05),
        "reward/pass_rate": min(1.0, 0.1 + step / 700),
        "loss/total": 0.5 / (1 + step / 50),
        "policy/entropy": 0.8 - step / 2000,
        "policy/clip_fraction": 0.02 * rng.random(),
        "perf/tokens_per_s": 900 + rng.random() * 100,
    }


@asynccontextmanager
async def _client(url: str) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings.model_validate(
        {
            "upstreams": [{"name": "vllm-0", "url": "http://fake-upstream"}],
            "store": {"url": url},
            "auth": {"admin_key": ADMIN_KEY},
            "episodes": {"reaper_interval_s": 3600},
            "health_interval_s": 3600,
        }
    )
    app = create_app(settings, transport=_fake_upstream())
    async with app.router.lifespan_context(app):
        headers = {"authorization": f"Bearer {ADMIN_KEY}"}
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://proxy", headers=headers, timeout=600
        ) as client:
            yield client


async def _deep_cursor(url: str, table: Any, fraction: float, at_most: int | None = None) -> str:
    """The keyset cursor ``fraction`` of the way down a table, newest first (what "Next page" links
    carry), or ``at_most`` rows down if that is less."""
    engine = make_engine(url, pool_size=1)
    try:
        async with engine.connect() as conn:
            count = (await conn.execute(select(text("count(*)")).select_from(table))).scalar_one()
            offset = min(int(count * fraction), count - 1, at_most if at_most is not None else count)
            row = (
                await conn.execute(
                    select(table.c.created_at, table.c.id)
                    .order_by(table.c.created_at.desc(), table.c.id.desc())
                    .offset(offset)
                    .limit(1)
                )
            ).one()
    finally:
        await engine.dispose()
    return f"{row.created_at!r}_{row.id}"


async def time_pages(url: str, repeat: int) -> dict[str, float]:
    """Median ms per page (export: ms per 1,000 episodes)."""
    group_cursor = await _deep_cursor(url, Group.__table__, 0.95)
    episode_cursor = await _deep_cursor(url, Episode.__table__, 0.95)
    export_since = float((await _deep_cursor(url, Episode.__table__, 1.0, at_most=999)).partition("_")[0])
    engine = make_engine(url, pool_size=1)
    async with engine.connect() as conn:
        deep_episode = episode_cursor.partition("_")[2]
        deep_group = (await conn.execute(select(Episode.group_id).where(Episode.id == deep_episode))).scalar_one()
    await engine.dispose()
    pages: dict[str, tuple[str, dict[str, Any]]] = {
        "overview": ("/ui/", {}),
        "overview feed": ("/ui/api/overview", {"since_step": -1}),
        "groups": ("/ui/groups", {}),
        "groups deep": ("/ui/groups", {"after": group_cursor}),
        "groups status": ("/ui/groups", {"train_status": "pending"}),
        "groups task": ("/ui/groups", {"task": "math-alg"}),
        "episodes": ("/ui/episodes", {}),
        "episodes deep": ("/ui/episodes", {"after": episode_cursor}),
        "episodes status": ("/ui/episodes", {"status": "rewarded"}),
        "episodes status deep": ("/ui/episodes", {"status": "rewarded", "after": episode_cursor}),
        "episodes task": ("/ui/episodes", {"task": "tool-"}),
        "episode": (f"/ui/episodes/{deep_episode}", {}),
        "compare": (f"/ui/groups/{deep_group}", {}),
        "export 1,000": ("/ui/export", {"format": "jsonl"}),
    }
    out: dict[str, float] = {}
    async with _client(url) as client:
        for name, (path, params) in pages.items():
            rows = 0
            exporting = name.startswith("export")
            if exporting:  # the newest 1,000 episodes (a whole group more where they share a time)
                params = {**params, "since": repr(export_since)}
            times = []
            for i in range(2 if exporting else repeat + 1):
                t = time.perf_counter()
                if exporting:
                    async with client.stream("GET", path, params=params) as response:
                        assert response.status_code == 200, await response.aread()
                        lines = 0
                        async for chunk in response.aiter_bytes():
                            lines += chunk.count(b"\n")
                    if i == 0:
                        rows = lines
                else:
                    response = await client.get(path, params=params)
                    assert response.status_code == 200, (name, response.status_code, response.text[:300])
                if i > 0:
                    times.append((time.perf_counter() - t) * 1000)
            value = statistics.median(times)
            out[name] = value * 1000 / max(rows, 1) if exporting else value
    return out


async def _admin(statement: str) -> None:
    """CREATE or DROP DATABASE on the local server (outside a transaction, as PostgreSQL requires)."""
    engine = make_engine(PG_SERVER, pool_size=1)
    try:
        async with engine.connect() as conn:
            await (await conn.execution_options(isolation_level="AUTOCOMMIT")).execute(text(statement))
    finally:
        await engine.dispose()


async def _pg_database() -> tuple[str, str]:
    """A database of its own on the local server, so the bench never touches the tests' rows."""
    name = f"flywheel_bench_ui_{uuid.uuid4().hex[:8]}"
    await _admin(f'CREATE DATABASE "{name}"')
    return PG_SERVER.rsplit("/", 1)[0] + "/" + name, name


async def _drop_pg(name: str) -> None:
    await _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def run_store(store: str, sizes: list[int], repeat: int, workdir: Path) -> dict[int, dict[str, float]]:
    results: dict[int, dict[str, float]] = {}
    for size in sizes:
        if store == "sqlite":
            url, name = f"sqlite+aiosqlite:///{workdir / f'ui-{size}.db'}", None
        else:
            url, name = await _pg_database()
        try:
            filled = await fill(url, size)
            print(
                f"{store} {size:>7,} episodes filled in {filled['total_s']:.0f} s "
                f"(groups+episodes {filled['insert_s']:.0f} s, calls {filled['calls_s']:.0f} s, "
                f"updates {filled['update_s']:.0f} s)",
                flush=True,
            )
            results[size] = await time_pages(url, repeat)
        finally:
            if name is not None:
                await _drop_pg(name)
    return results


def report(store: str, results: dict[int, dict[str, float]]) -> None:
    sizes = sorted(results)
    small, large = sizes[0], sizes[-1]
    header = f"{store:<22}" + "".join(f"{f'{s:,} ms':>14}" for s in sizes) + f"{'ratio':>8}"
    print(header)
    print("-" * len(header))
    for name in results[small]:
        cells = "".join(f"{results[s][name]:>14.1f}" for s in sizes)
        print(f"{name:<22}{cells}{results[large][name] / results[small][name]:>8.2f}")
    print("(export: ms per 1,000 episodes streamed; ratio: largest store / smallest)\n", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 100_000])
    parser.add_argument("--stores", nargs="+", choices=["sqlite", "postgres"], default=["sqlite", "postgres"])
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    print(f"load average before: {load_average()} (2 cores; other engineers share them)", flush=True)
    summary: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="flywheel-ui-bench-") as tmp:
        for store in args.stores:
            results = asyncio.run(run_store(store, args.sizes, args.repeat, Path(tmp)))
            report(store, results)
            summary[store] = {str(size): {k: round(v, 2) for k, v in pages.items()} for size, pages in results.items()}
    print(f"load average after: {load_average()}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
