"""Store bytes per call and per episode, before (JSON layout) and after (compact layout, deltas), in one run.

Workloads (token ids drawn at random from a 150k vocabulary, message text ~4 characters a token):

- **math**: one call, a 150-token prompt and a 300-token answer.
- **agent**: multi-turn episodes of T turns (T in ``--turns``); each turn the model writes 150
  tokens (a tool call) and the tool answers ~450, so the context grows by ~600 tokens a turn: the
  50-turn episode ends near 30k tokens. Each call's prompt ids extend the previous prompt and
  completion, and its messages extend the previous list, as an agent's do.
- **messages** (T in ``--messages-turns``): the same episodes from an Anthropic Messages client:
  each call also keeps the client's own request (``client_request``), its whole conversation as
  content blocks, resent every turn.
- **recorded** (``--from-store URL``): every episode of an existing store (real agent episodes,
  e.g. tau2's), re-stored in both layouts.

"Before" writes each call whole in the JSON layout every store used before migration 0004 (the
rows those writers wrote, ``encoding`` 0); "after" goes through ``Calls.insert`` (``repo.calls``) one call
per commit, as a live agent's calls arrive. Sizes, per backend:

- SQLite: the bytes stored in the ``calls`` rows (sum of each column's length) and the database's
  pages (after a checkpoint) less those of the empty store.
- PostgreSQL: ``pg_total_relation_size('calls')`` (heap, TOAST, indexes) less the empty table's,
  and the stored column bytes (``pg_column_size``: after TOAST compression).

Then a least-squares line of store bytes against episode tokens (the final context) over the agent
episodes, with its R²: "after" must be linear (R² ~ 1, constant bytes per token), "before" is not
(bytes per token grow with T). The claim's payload is reported too: the JSON of the episodes' calls
as ``POST /trainer/claim`` serializes them (``contract.entities.Call``), whole (``calls: "whole"``,
what every claim shipped before) and in delta form (``calls: "delta"``, what the trainer asks for
now: compact rows as stored, so only the "after" layout has deltas to ship), with the same fit.

Run: ``python -m bench.store_growth`` (about a minute; ``--pg-url ''`` skips PostgreSQL). The last
line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import random
import sqlite3
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import MetaData, Table, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from contract import entities
from proxy.store.db import make_engine, migrate_async, sqlite_file
from proxy.store.models import Call
from proxy.store.records import NewCall
from proxy.store.repository import Repository
from proxy.store.rows import CALL_FIELDS, ROW_FIELDS, call_records, call_values

VOCAB = 150_000
WORDS = "the a tool call file line test error value result parser returns input output".split()


def _text(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, tokens * 4 // 5)))[: tokens * 4]


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _call(
    episode_id: str,
    turn: int,
    prompt: list[int],
    completion: list[int],
    messages: list[Any],
    rng: random.Random,
    client: dict[str, Any] | None = None,
) -> NewCall:
    logprobs = [float(-rng.random() * 3) for _ in completion]
    return NewCall(
        api="messages" if client is not None else "chat",
        client_request=client,
        episode_id=episode_id,
        kind="chat",
        stream=False,
        request={"model": "policy", "messages": messages, "temperature": 1.0, "max_tokens": 512},
        response={"id": f"chatcmpl-{uuid.uuid4().hex}", "choices": [{"index": 0, "finish_reason": "stop"}]},
        status_code=200,
        error=None,
        prompt_token_ids=prompt,
        choices=[
            {
                "index": 0,
                "token_ids": completion,
                "logprobs": logprobs,
                "finish_reason": "stop",
                "stop_reason": None,
                "text": _text(rng, len(completion)),
                "tool_calls": None,
            }
        ],
        exact_ids=True,
        model_requested="policy",
        model_served="policy-v1",
        policy_version=1,
        replica="vllm-0",
        started_at=time.time() + turn * 1e-3,
        latency_ms=100.0,
        ttft_ms=None,
        prompt_tokens=len(prompt),
        completion_tokens=len(completion),
        notes={"sampling": {"mode": "sampled", "temperature": 1.0}},
    )


def episode(
    episode_id: str, turns: int, *, first: int, answer: int, tool: int, seed: int, client: bool = False
) -> tuple[list[NewCall], int]:
    """An episode's calls and its final context in tokens (last prompt + last completion); with
    ``client``, as a Messages client sends them (its own conversation in ``client_request``)."""
    rng = random.Random(seed)
    prompt = _ids(rng, first)
    system, task = _text(rng, first // 2), _text(rng, first - first // 2)
    messages: list[Any] = [{"role": "system", "content": system}, {"role": "user", "content": task}]
    own: list[Any] = [{"role": "user", "content": [{"type": "text", "text": task}]}]
    calls = []
    for turn in range(turns):
        completion = _ids(rng, answer)
        request = {"model": "policy", "max_tokens": 512, "system": system, "messages": list(own)} if client else None
        calls.append(_call(episode_id, turn, list(prompt), completion, list(messages), rng, request))
        said, result = _text(rng, answer), _text(rng, tool)
        messages = [*messages, {"role": "assistant", "content": said}, {"role": "tool", "content": result}]
        own = [
            *own,
            {"role": "assistant", "content": [{"type": "tool_use", "id": f"t{turn}", "name": "run", "input": said}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{turn}", "content": result}]},
        ]
        prompt = prompt + completion + _ids(rng, tool)
    return calls, len(calls[-1].prompt_token_ids or []) + answer


async def _episodes_table(engine: AsyncEngine, ids: list[str]) -> None:
    group = str(uuid.uuid4())

    def run(conn: Any) -> None:
        groups = Table("groups", MetaData(), autoload_with=conn)
        episodes = Table("episodes", MetaData(), autoload_with=conn)
        now = time.time()
        conn.execute(
            groups.insert(),
            [
                {
                    "id": group,
                    "task_id": "t",
                    "size": len(ids),
                    "metadata": {},
                    "status": "open",
                    "created_at": now,
                    "train_status": "pending",
                }
            ],
        )
        conn.execute(
            episodes.insert(),
            [
                {
                    "id": eid,
                    "group_id": group,
                    "group_index": i,
                    "task_id": "t",
                    "metadata": {},
                    "status": "open",
                    "created_at": now,
                }
                for i, eid in enumerate(ids)
            ],
        )

    async with engine.begin() as conn:
        await conn.run_sync(run)


async def _write_json_layout(engine: AsyncEngine, calls: list[NewCall]) -> None:
    """The rows writers stored before migration 0004, one call per commit like the recorder's live
    calls (a plain SQLAlchemy insert: its write time is not the old recorder's)."""
    async with engine.connect() as conn:
        table = await conn.run_sync(lambda c: Table("calls", MetaData(), autoload_with=c))
    for ordinal, call in enumerate(calls):
        row = dict(zip(CALL_FIELDS, call_values(call), strict=True)) | {"ordinal": ordinal}
        async with engine.begin() as conn:
            await conn.execute(table.insert(), [row])


async def _sizes(engine: AsyncEngine, url: str) -> dict[str, int]:
    columns = [*ROW_FIELDS, "id", "ordinal"]
    if (path := sqlite_file(url)) is not None:
        payload = " + ".join(f'coalesce(length(CAST("{c}" AS BLOB)), 0)' for c in columns)
        with contextlib.closing(sqlite3.connect(path)) as db:
            stored = db.execute(f"SELECT coalesce(sum({payload}), 0) FROM calls").fetchone()[0]
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            pages = db.execute("PRAGMA page_count").fetchone()[0]
            size = db.execute("PRAGMA page_size").fetchone()[0]
        return {"row_bytes": int(stored), "file_bytes": int(pages) * int(size)}
    async with engine.connect() as conn:
        payload = " + ".join(f'coalesce(pg_column_size("{c}"), 0)' for c in columns)
        stored = (await conn.execute(text(f"SELECT coalesce(sum({payload}), 0) FROM calls"))).scalar_one()
        total = (await conn.execute(text("SELECT pg_total_relation_size('calls')"))).scalar_one()
        return {"row_bytes": int(stored), "file_bytes": int(total)}


async def pg_admin(base: str, statement: str) -> None:
    """CREATE or DROP DATABASE (outside a transaction, as PostgreSQL requires)."""
    engine = create_async_engine(base, isolation_level="AUTOCOMMIT")
    try:
        async with engine.connect() as conn:
            await conn.execute(text(statement))
    finally:
        await engine.dispose()


async def _fresh(base: str | None, tmp: Path, name: str) -> str:
    if base is None:
        url = f"sqlite+aiosqlite:///{tmp / name}.db"
    else:
        db = f"flywheel_growth_{uuid.uuid4().hex[:10]}"
        await pg_admin(base, f'CREATE DATABASE "{db}"')
        url = base.rsplit("/", 1)[0] + "/" + db
    await migrate_async(url)
    return url


async def _drop(url: str, base: str | None) -> None:
    if base is not None:
        await pg_admin(base, f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[1]}" WITH (FORCE)')


async def measure(url: str, layout: str, workload: list[list[NewCall]]) -> dict[str, Any]:
    """Store ``workload`` (one list of calls per episode) in ``layout``; bytes, write time, claim bytes."""
    engine = make_engine(url)
    try:
        empty = await _sizes(engine, url)
        ids = [calls[0].episode_id for calls in workload]
        await _episodes_table(engine, ids)
        started = time.perf_counter()
        if layout == "before":
            for calls in workload:
                await _write_json_layout(engine, calls)
        else:
            repo = Repository(url)
            try:
                for calls in workload:
                    for call in calls:
                        await repo.calls.insert([call])
            finally:
                await repo.close()
        seconds = time.perf_counter() - started
        full = await _sizes(engine, url)
    finally:
        await engine.dispose()
    repo = Repository(url)
    try:
        read_started = time.perf_counter()
        for eid in ids:
            await repo.episodes.get_episode(eid)
        read_s = time.perf_counter() - read_started
    finally:
        await repo.close()
    count = sum(len(c) for c in workload)
    return {
        "row_bytes": full["row_bytes"] - empty["row_bytes"],
        "file_bytes": full["file_bytes"] - empty["file_bytes"],
        "write_ms_per_call": 1000 * seconds / count,
        "read_ms_per_call": 1000 * read_s / count,
        "claim_bytes": await claim_bytes(url, delta=False),
        "claim_delta_bytes": await claim_bytes(url, delta=True),
        "calls": count,
    }


async def _call_rows(url: str) -> list[Any]:
    """Every stored call row, by episode and ordinal (the order ``call_records`` rebuilds in)."""
    engine = make_engine(url)
    try:
        async with engine.connect() as conn:
            table = Call.__table__
            return list((await conn.execute(select(table).order_by(table.c.episode_id, table.c.ordinal))).all())
    finally:
        await engine.dispose()


async def claim_bytes(url: str, *, delta: bool) -> int:
    """Bytes of every stored call as a claim serializes it (``entities.Call`` JSON), whole or in delta form."""
    rows = await _call_rows(url)
    return sum(len(entities.Call.model_validate(r).model_dump_json()) for r in call_records(rows, delta=delta))


def fit(points: list[tuple[float, float]]) -> dict[str, float]:
    """Least squares bytes = a + b * tokens, with R²."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    a = my - b * mx
    ss = sum((y - my) ** 2 for _, y in points)
    res = sum((y - a - b * x) ** 2 for x, y in points)
    return {"intercept": a, "bytes_per_token": b, "r2": 1 - res / ss if ss else 1.0}


def _line(backend: str, key: str, layout: str, m: dict[str, Any]) -> str:
    return (
        f"{backend:10} {key:11} {layout:6} tokens {m['episode_tokens']:6d}  calls {m['calls']:4d}  "
        f"store {m['bytes_per_episode'] / 1e3:9.1f} KB/episode ({m['bytes_per_call'] / 1e3:7.2f} KB/call; "
        f"rows {m['row_bytes_per_episode'] / 1e3:9.1f} KB)  write {m['write_ms_per_call']:6.2f} ms/call  "
        f"read {m['read_ms_per_call']:6.2f} ms/call  claim {m['claim_bytes_per_episode'] / 1e3:8.1f} KB/episode "
        f"(delta form {m['claim_delta_bytes_per_episode'] / 1e3:8.1f})"
    )


async def recorded(url: str) -> tuple[list[list[NewCall]], int]:
    """Every episode with calls in the store at ``url`` (e.g. a run's ``proxy.db`` after real tau2
    or OpenHands episodes), whole, as a workload; and the mean final context in tokens."""
    rows = await _call_rows(url)
    episodes: dict[str, list[NewCall]] = {}
    for record in call_records(rows):
        whole = {f.name: getattr(record, f.name) for f in dataclasses.fields(NewCall)}
        episodes.setdefault(record.episode_id, []).append(NewCall(**whole))
    if not episodes:
        raise SystemExit(f"no recorded calls in {url}")
    contexts = [
        len(calls[-1].prompt_token_ids or []) + len((calls[-1].choices or [{}])[0].get("token_ids") or [])
        for calls in episodes.values()
    ]
    return list(episodes.values()), round(sum(contexts) / len(contexts))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    backends: list[str | None] = [None] + ([args.pg_url] if args.pg_url else [])
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="flywheel-growth-") as tmp:
        for base in backends:
            name = "sqlite" if base is None else "postgresql"
            results: dict[str, Any] = {}
            workloads: dict[str, tuple[list[list[NewCall]], int]] = {}
            math_eps = [
                episode(str(uuid.uuid4()), 1, first=150, answer=300, tool=0, seed=s)[0]
                for s in range(args.math_episodes)
            ]
            workloads["math"] = (math_eps, 450)
            if args.from_store:
                workloads["recorded"] = await recorded(args.from_store)
            for turns in args.turns:
                made = [
                    episode(str(uuid.uuid4()), turns, first=1000, answer=150, tool=450, seed=s)
                    for s in range(args.episodes)
                ]
                workloads[f"agent_{turns}"] = ([calls for calls, _ in made], made[0][1])
            for turns in args.messages_turns:
                made = [
                    episode(str(uuid.uuid4()), turns, first=1000, answer=150, tool=450, seed=s, client=True)
                    for s in range(args.episodes)
                ]
                workloads[f"messages_{turns}"] = ([calls for calls, _ in made], made[0][1])
            for key, (eps, tokens) in workloads.items():
                for layout in ("before", "after"):
                    # the same episodes (fresh ids) in a fresh store
                    copies = [
                        [dataclasses.replace(c, episode_id=eid) for c in calls]
                        for calls, eid in ((calls, str(uuid.uuid4())) for calls in eps)
                    ]
                    url = await _fresh(base, Path(tmp), f"{key}-{layout}")
                    try:
                        m = await measure(url, layout, copies)
                    finally:
                        await _drop(url, base)
                    m["episode_tokens"] = tokens
                    m["bytes_per_episode"] = m["file_bytes"] / len(eps)
                    m["row_bytes_per_episode"] = m["row_bytes"] / len(eps)
                    m["bytes_per_call"] = m["file_bytes"] / m["calls"]
                    m["claim_bytes_per_episode"] = m["claim_bytes"] / len(eps)
                    m["claim_delta_bytes_per_episode"] = m["claim_delta_bytes"] / len(eps)
                    results.setdefault(key, {})[layout] = m
                    print(_line(name, key, layout, m), flush=True)
            fits = {}
            for label, prefix, layout, field in (
                ("before", "agent_", "before", "row_bytes_per_episode"),
                ("after", "agent_", "after", "row_bytes_per_episode"),
                ("claim whole", "agent_", "after", "claim_bytes_per_episode"),
                ("claim delta", "agent_", "after", "claim_delta_bytes_per_episode"),
                ("msgs before", "messages_", "before", "row_bytes_per_episode"),
                ("msgs after", "messages_", "after", "row_bytes_per_episode"),
            ):
                points = [
                    (r[layout]["episode_tokens"], r[layout][field]) for k, r in results.items() if k.startswith(prefix)
                ]
                if len(points) < 2:
                    continue
                fits[label] = f = fit(points)
                per_token = ", ".join(f"{x:.0f} tok: {y / x:.1f} B/tok" for x, y in points)
                line = f"bytes = {f['intercept']:.0f} + {f['bytes_per_token']:.1f} * tokens  R² {f['r2']:.4f}"
                print(f"{name:10} fit {label:11} {line}  ({per_token})", flush=True)
            out[name] = {"workloads": results, "fit": fits}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=lambda s: [int(x) for x in s.split(",")], default=[5, 10, 20, 30, 40, 50])
    parser.add_argument(
        "--messages-turns", type=lambda s: [int(x) for x in s.split(",") if x], default=[10, 50], help="'' skips"
    )
    parser.add_argument("--episodes", type=int, default=2, help="episodes per agent workload")
    parser.add_argument("--math-episodes", type=int, default=100, help="one-call episodes of the math workload")
    parser.add_argument(
        "--from-store", default="", help="also a 'recorded' workload: every episode of this store URL (real episodes)"
    )
    parser.add_argument(
        "--pg-url", default="postgresql+asyncpg://postgres@127.0.0.1:5432/test", help="'' skips PostgreSQL"
    )
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
