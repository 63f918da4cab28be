"""The compact call layout (proxy/store/delta.py) is exact: every call reads back byte for byte as
the JSON layout returned it, and the trainer's samples do not change, on SQLite and PostgreSQL.

Three copies of the same episodes are compared: written as stores before migration 0004 wrote them
(the JSON layout, ``encoding`` 0, read through the legacy path), written by today's writers
(deltas), and converted by migration 0004 (through Alembic from revision 0003, and by its
``convert`` stopped half way then resumed).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import struct
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from sqlalchemy import MetaData, Table, select
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from contract.client import Call as WireCall
from contract.client import Claim as WireClaim
from contract.client import Episode as WireEpisode
from proxy.store.db import MIGRATIONS, is_sqlite, make_engine, migrate_async
from proxy.store.delta import unpack_ids
from proxy.store.models import Call
from proxy.store.records import CallRecord, NewCall
from proxy.store.repository import Repository
from proxy.store.rows import CALL_FIELDS, call_records, call_values, json_text
from tests.conftest import _drop_pg_database, _pg_database
from tests.support.records import chat_call
from trainer.data import DataStats, episode_samples

T0 = 1_700_000_000.0
SAMPLED = {"sampling": {"mode": "sampled", "temperature": 1.0}}


def f32(x: float) -> float:
    """``x`` rounded to float32, as vLLM's log-probs are."""
    return float(struct.unpack("<f", struct.pack("<f", x))[0])


def new_call(
    episode_id: str,
    at: float,
    *,
    prompt: list[int] | None,
    messages: list[dict[str, Any]],
    choices: list[dict[str, Any]],
    **changes: Any,
) -> NewCall:
    fields: dict[str, Any] = {
        "request": {"model": "policy", "messages": messages, "temperature": 1.0, "tools": [{"type": "function"}]},
        "response": {"id": f"chatcmpl-{at}", "choices": [{"index": c["index"]} for c in choices]},
        "prompt_token_ids": prompt,
        "choices": choices,
        "started_at": T0 + at,
        "latency_ms": 12.5,
        "prompt_tokens": len(prompt or []),
        "completion_tokens": sum(len(c.get("token_ids") or []) for c in choices),
        "notes": SAMPLED,
    }
    return chat_call(episode_id, **(fields | changes))


def choice(index: int, ids: list[int], *, logprobs: list[Any] | None = None, **extra: Any) -> dict[str, Any]:
    lps = logprobs if logprobs is not None else [f32(-0.05 * (i + 1) - index / 7) for i in range(len(ids))]
    return {
        "index": index,
        "token_ids": ids,
        "logprobs": lps,
        "finish_reason": "stop",
        "stop_reason": None,
        "text": f"answer {index} ✓",
        "tool_calls": extra.pop("tool_calls", None),
        **extra,
    }


def tool_call(i: int) -> dict[str, Any]:
    return {"id": f"call_{i}", "type": "function", "function": {"name": "lookup", "arguments": '{"q": 1}'}}


def episodes() -> dict[str, list[NewCall]]:
    """Episode id -> its calls in start order: every case the layout must keep exact."""
    system = {"role": "system", "content": "You are an agent. Ünïcode ✓"}
    out: dict[str, list[NewCall]] = {}

    single = "00000000-0000-4000-8000-000000000001"
    out[single] = [new_call(single, 0, prompt=[1, 2, 3], messages=[system], choices=[choice(0, [4, 5, 0])])]

    # Multi-turn with tool calls, a break (a prompt that does not extend: an earlier turn re-rendered),
    # a failed call in between, a streamed call, and a retry (the same prompt answered again).
    multi = "00000000-0000-4000-8000-000000000002"
    m: list[dict[str, Any]] = [system, {"role": "user", "content": "find x"}]
    p = [100, 101, 102]
    calls = []
    c0 = choice(0, [7, 8, 9], tool_calls=[tool_call(0)])
    calls.append(new_call(multi, 1, prompt=p, messages=list(m), choices=[c0]))
    m = [*m, {"role": "assistant", "content": None, "tool_calls": [tool_call(0)]}, {"role": "tool", "content": "1"}]
    p = [*p, 7, 8, 9, 200, 201]
    c1 = choice(0, [10, 11], tool_calls=[tool_call(1)])
    calls.append(new_call(multi, 2, prompt=p, messages=list(m), choices=[c1], stream=True, ttft_ms=3.0))
    failed = new_call(multi, 3, prompt=None, messages=list(m), choices=[], status_code=502, response=None)
    calls.append(dataclasses.replace(failed, error={"message": "upstream failed", "code": None}, exact_ids=False))
    m = [*m, {"role": "assistant", "content": "partial", "x": 1}, {"role": "user", "content": "go on"}]
    p = [*p, 10, 11, 202]
    calls.append(new_call(multi, 4, prompt=p, messages=list(m), choices=[choice(0, [12])]))
    calls.append(new_call(multi, 5, prompt=list(p), messages=list(m), choices=[choice(0, [13, 14])]))  # retry
    broken = [*p[:-2], 999, 13, 14, 203]  # not an extension: the trainer breaks here
    # the same message with 1.0 for 1: equal in Python, different JSON text: not inherited
    m2 = [*m[:-2], {"role": "assistant", "content": "partial", "x": 1.0}, m[-1], {"role": "user", "content": "more"}]
    calls.append(new_call(multi, 6, prompt=broken, messages=m2, choices=[choice(0, [15, 16])]))
    m2 = [*m2, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "end"}]
    calls.append(new_call(multi, 7, prompt=[*broken, 15, 16, 204], messages=m2, choices=[choice(0, [17])]))
    out[multi] = calls

    # n > 1: the next call continues the third choice; odd log-probs (float64-only values, -0.0,
    # ints) and a choice without ids.
    wide = "00000000-0000-4000-8000-000000000003"
    first = [
        choice(0, [30, 31], logprobs=[-0.1, -0.0]),
        choice(1, [32], logprobs=[-1e-05]),
        choice(2, [33, 34, 2**31 - 1]),
    ]
    calls = [new_call(wide, 1, prompt=[1, 2], messages=[system], choices=first)]
    calls.append(
        new_call(wide, 2, prompt=[1, 2, 33, 34, 2**31 - 1, 5], messages=[system], choices=[choice(0, [35, 36])])
    )
    odd = [choice(0, [37], logprobs=[0, -1]), {**choice(1, [38]), "token_ids": None}]
    calls.append(new_call(wide, 3, prompt=[1, 2, 33, 34, 2**31 - 1, 5, 35, 36], messages=[system], choices=odd))
    out[wide] = calls

    # Ids the binary layout cannot hold (past int32, a bool): stored whole, as JSON.
    odd_ids = "00000000-0000-4000-8000-000000000004"
    calls = [new_call(odd_ids, 1, prompt=[1, 2**40], messages=[system], choices=[choice(0, [3, True])])]
    calls.append(new_call(odd_ids, 2, prompt=[1, 2**40, 3, 1, 5], messages=[system], choices=[choice(0, [6])]))
    out[odd_ids] = calls

    # A Messages agent and a stateless Responses agent: each resends its own whole conversation
    # (``client_request``) every turn, besides the chat request the proxy executed. The Responses
    # agent's third turn rewrites its first input item: its list is not inherited, its prompt is.
    for eid, api, key in (
        ("00000000-0000-4000-8000-000000000005", "messages", "messages"),
        ("00000000-0000-4000-8000-000000000006", "responses", "input"),
    ):
        own: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": "list the files"}]}]
        chat = [system, {"role": "user", "content": "list the files"}]
        p, calls = [1, 2, 3], []
        for turn in range(4):
            if api == "responses" and turn == 2:
                own = [{**own[0], "content": "list the files, please"}, *own[1:]]
            sampled = [40 + turn, 41 + turn]
            client = {"model": "policy", "max_tokens": 64, "system": "be brief", key: list(own), "stream": False}
            calls.append(
                new_call(eid, 10 + turn, prompt=list(p), messages=list(chat), choices=[choice(0, sampled)], api=api)
            )
            calls[-1] = dataclasses.replace(calls[-1], client_request=client)
            own = [*own, {"role": "assistant", "content": f"turn {turn}"}, {"role": "user", "content": "ok"}]
            chat = [*chat, {"role": "assistant", "content": f"turn {turn}"}, {"role": "user", "content": "ok"}]
            p = [*p, *sampled, 50 + turn]
        out[eid] = calls
    return out


DELTAS = {  # calls stored as deltas (prompt ids, messages or both) per episode
    "00000000-0000-4000-8000-000000000001": 0,
    "00000000-0000-4000-8000-000000000002": 5,  # all but the first and the break
    "00000000-0000-4000-8000-000000000003": 2,
    "00000000-0000-4000-8000-000000000004": 0,  # no packable prompt: no base
    "00000000-0000-4000-8000-000000000005": 3,  # prompt, messages and the client's list
    "00000000-0000-4000-8000-000000000006": 3,
}
CLIENT_DELTAS = {  # calls whose client_request list is stored as a delta
    "00000000-0000-4000-8000-000000000005": 3,
    "00000000-0000-4000-8000-000000000006": 2,  # not the turn whose first item was rewritten
}


@pytest.fixture(params=["sqlite", "postgres"])
async def urls(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Callable[[str], Any]]:
    """A factory of empty databases (not migrated) on the backend."""
    made: list[str] = []

    async def fresh(name: str) -> str:
        if request.param == "sqlite":
            url = f"sqlite+aiosqlite:///{tmp_path / name}.db"
        else:
            url = await _pg_database()
        made.append(url)
        return url

    yield fresh
    for url in made:
        if not is_sqlite(url):
            await _drop_pg_database(url)


async def _insert_rows(engine: AsyncEngine, table: str, rows: list[dict[str, Any]]) -> None:
    def run(conn: Any) -> None:
        reflected = Table(table, MetaData(), autoload_with=conn)
        conn.execute(reflected.insert(), rows)

    async with engine.begin() as conn:
        await conn.run_sync(run)


async def _write_episode_rows(engine: AsyncEngine) -> None:
    await _insert_rows(
        engine,
        "episodes",
        [
            {"id": eid, "task_id": "t", "metadata": {}, "status": "open", "created_at": T0, "group_index": None}
            for eid in episodes()
        ],
    )


async def _write_legacy(url: str) -> None:
    """The episodes as every writer stored them before migration 0004: JSON arrays, whole requests."""
    engine = make_engine(url)
    try:
        await _write_episode_rows(engine)
        rows = [
            dict(zip(CALL_FIELDS, call_values(call), strict=True)) | {"ordinal": ordinal}
            for calls in episodes().values()
            for ordinal, call in enumerate(calls)
        ]
        await _insert_rows(engine, "calls", rows)
    finally:
        await engine.dispose()


async def _legacy_and_new(urls: Any) -> tuple[str, str]:
    """Two migrated stores: ``legacy`` holding every episode as written before 0004, ``new`` only
    the episode rows (a test writes the calls through the repository)."""
    legacy_url, new_url = await urls("legacy"), await urls("new")
    for url in (legacy_url, new_url):
        await migrate_async(url)
    await _write_legacy(legacy_url)
    engine = make_engine(new_url)
    try:
        await _write_episode_rows(engine)
    finally:
        await engine.dispose()
    return legacy_url, new_url


async def _read(url: str) -> dict[str, list[CallRecord]]:
    repo = Repository(url)
    try:
        return {eid: (await repo.episodes.get_episode(eid)).calls or [] for eid in episodes()}
    finally:
        await repo.close()


def _bytes(record: CallRecord) -> bytes:
    return orjson.dumps(dataclasses.asdict(record), option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SORT_KEYS)


def _typed(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_typed(v) for v in value]
    return (type(value).__name__, math.copysign(1, value) if type(value) is float else None, value)


def assert_same(got: dict[str, list[CallRecord]], want: dict[str, list[CallRecord]], *, ids: bool = True) -> None:
    assert got.keys() == want.keys()
    for eid in want:
        assert len(got[eid]) == len(want[eid]), eid
        for g, w in zip(got[eid], want[eid], strict=True):
            if not ids:
                g = dataclasses.replace(g, id=w.id)
            assert _bytes(g) == _bytes(w), (eid, g.ordinal)
            assert _typed(dataclasses.asdict(g)) == _typed(dataclasses.asdict(w)), (eid, g.ordinal)
            # dict key order too: the JSON a client is sent keeps it
            assert list(g.request) == list(w.request) and [list(c) for c in g.choices] == [list(c) for c in w.choices]


def _samples(records: dict[str, list[CallRecord]] | dict[str, list[dict[str, Any]]]) -> str:
    """The trainer's samples of the episodes, from store records or from claim JSON (a delta
    claim's calls are rejoined first, as ``contract.client`` does)."""
    stats = DataStats()
    out = []
    for eid, calls in records.items():
        wire = [WireCall.model_validate(c if isinstance(c, dict) else dataclasses.asdict(c)) for c in calls]
        episode = WireEpisode(id=eid, status="rewarded", reward=1.0, calls=wire).rejoined()
        out += [dataclasses.asdict(s) for s in episode_samples(episode, group_id="g", max_seq_len=4096, stats=stats)]
    return repr((out, dataclasses.asdict(stats)))  # repr: NaN log-probs compare equal


async def _compact_columns(url: str) -> list[tuple[Any, ...]]:
    engine = make_engine(url)
    try:
        async with engine.connect() as conn:
            t = Call.__table__.c
            rows = await conn.execute(
                select(
                    t.episode_id,
                    t.ordinal,
                    t.encoding,
                    t.base_ordinal,
                    t.prompt_choice,
                    t.prompt_ids,
                    t.messages_from,
                    t.client_from,
                ).order_by(t.episode_id, t.ordinal)
            )
            return [tuple(r) for r in rows.all()]
    finally:
        await engine.dispose()


def _expected_deltas(columns: list[tuple[Any, ...]]) -> None:
    by_episode: dict[str, int] = {}
    client: dict[str, int] = {}
    for eid, _, encoding, base, _, _, _, client_from in columns:
        assert encoding == 1
        by_episode[eid] = by_episode.get(eid, 0) + (base is not None)
        if client_from is not None:
            client[eid] = client.get(eid, 0) + 1
    assert by_episode == DELTAS
    assert client == CLIENT_DELTAS


async def test_written_compactly_every_call_reads_back_as_the_json_layout_did(urls: Any) -> None:
    legacy_url, new_url = await _legacy_and_new(urls)
    legacy = await _read(legacy_url)
    for eid, calls in episodes().items():  # the JSON layout returns the calls as they were written
        assert [c.request for c in legacy[eid]] == [c.request for c in calls]

    repo = Repository(new_url)
    try:
        everything = [c for calls in episodes().values() for c in calls]
        # Batches that hold several calls of one episode, and one call per batch.
        await repo.calls.insert(everything[:5])
        for c in everything[5:-3]:
            await repo.calls.insert([c])
        assert repo.layout.base_reads == 1  # the odd-ids episode: none of its calls can be a base to cache
    finally:
        await repo.close()
    cold = Repository(new_url)  # a restarted proxy: the last calls are read back from the store
    try:
        await cold.calls.insert(everything[-3:])  # the Responses agent's last three turns
        assert cold.layout.base_reads == 1 and cold.layout.calls_delta == 3
    finally:
        await cold.close()

    columns = await _compact_columns(new_url)
    _expected_deltas(columns)
    prompts = {(eid, o): (choice, ids) for eid, o, _, _, choice, ids, _, _ in columns}
    # the second multi-turn call stores only the 2 ids after call 0's prompt and completion
    assert prompts[("00000000-0000-4000-8000-000000000002", 1)] == (
        0,
        b"".join(struct.pack("<i", i) for i in (200, 201)),
    )
    assert prompts[("00000000-0000-4000-8000-000000000003", 1)][0] == 2  # continues the third choice
    assert unpack_ids(prompts[("00000000-0000-4000-8000-000000000002", 4)][1]) == []  # the retry: prompt alone

    new = await _read(new_url)
    assert_same(new, legacy, ids=False)
    assert _samples(new) == _samples(legacy)


async def _claimed_calls(url: str, *, delta: bool) -> tuple[dict[str, list[dict[str, Any]]], int]:
    """Every episode's calls as a claim sends them (``contract.entities.Call`` JSON), and the bytes they take."""
    engine = make_engine(url)
    try:
        async with engine.connect() as conn:
            t = Call.__table__
            rows = (await conn.execute(select(t).order_by(t.c.episode_id, t.c.ordinal))).all()
    finally:
        await engine.dispose()
    out: dict[str, list[dict[str, Any]]] = {eid: [] for eid in episodes()}
    size = 0
    for record in call_records(rows, delta=delta):
        wire = WireCall.model_validate(record).model_dump(mode="json")
        size += len(orjson.dumps(wire))
        out[record.episode_id].append(wire)
    return out, size


def _rejoined(calls: dict[str, list[dict[str, Any]]]) -> dict[str, list[bytes]]:
    """Each episode's calls as a trainer reads them (``contract.client``), rejoined, as JSON bytes;
    without the row id, which each store numbers in its own insert order (``assert_same``'s ``ids``)."""
    out = {}
    for eid, wire in calls.items():
        episode = WireEpisode.model_validate({"id": eid, "status": "rewarded", "calls": wire}).rejoined()
        dumps = (c.model_dump(exclude={"id"}) for c in episode.calls or [])
        out[eid] = [orjson.dumps(d, option=orjson.OPT_SORT_KEYS) for d in dumps]
    return out


async def test_a_delta_claim_rejoins_to_the_whole_calls_in_fewer_bytes(urls: Any) -> None:
    """What a trainer's claim ships with ``calls: "delta"``: compact rows as stored (prompt ids and
    messages after their base's), JSON-layout rows whole. Rejoined by the trainer's client, every
    call equals the whole claim's byte for byte, key order and float bits included, and the
    trainer's samples do not change."""
    legacy_url, new_url = await _legacy_and_new(urls)
    repo = Repository(new_url)
    try:
        await repo.calls.insert([c for calls in episodes().values() for c in calls])
    finally:
        await repo.close()

    whole, whole_bytes = await _claimed_calls(new_url, delta=False)
    shipped, delta_bytes = await _claimed_calls(new_url, delta=True)
    deltas = {eid: sum(c["delta"] is not None for c in calls) for eid, calls in shipped.items()}
    assert deltas == DELTAS
    assert all(c["delta"] is None for calls in whole.values() for c in calls)
    assert delta_bytes < whole_bytes
    assert _rejoined(shipped) == _rejoined(whole)
    for eid, calls in whole.items():  # rejoined through the client = whole through the client, exactly
        want = [WireCall.model_validate(c) for c in calls]
        got = WireEpisode.model_validate({"id": eid, "status": "rewarded", "calls": shipped[eid]}).rejoined().calls
        assert got is not None
        assert [_typed(c.model_dump()) for c in got] == [_typed(c.model_dump()) for c in want]
        assert [list(c.request) for c in got] == [list(c.request) for c in want]  # key order kept

    assert _samples(shipped) == _samples(whole)

    legacy, _ = await _claimed_calls(legacy_url, delta=True)  # a store from before 0004: whole calls
    assert all(c["delta"] is None for calls in legacy.values() for c in calls)
    assert _rejoined(legacy) == _rejoined(whole)


def _load_migration(name: str = "0004_compact_calls") -> Any:
    spec = importlib.util.spec_from_file_location(f"m{name}", MIGRATIONS / "versions" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def _convert(url: str, migration: str = "0004_compact_calls", **kwargs: Any) -> int:
    convert = _load_migration(migration).convert
    engine = create_async_engine(url, json_serializer=json_text)  # as migrations/env.py makes it
    try:
        async with engine.connect() as conn:
            auto = await conn.execution_options(isolation_level="AUTOCOMMIT")
            converted: int = await auto.run_sync(lambda c: convert(c, **kwargs))
            return converted
    finally:
        await engine.dispose()


async def test_migrations_0004_and_0006_convert_in_place_resumably_and_the_samples_do_not_change(urls: Any) -> None:
    # A store written before 0004, upgraded through Alembic.
    old_url = await urls("old")
    await migrate_async(old_url, "0003")
    await _write_legacy(old_url)
    await migrate_async(old_url)

    # The same rows left in the JSON layout at head: the reference, read the way they always were.
    reference_url = await urls("reference")
    await migrate_async(reference_url)
    await _write_legacy(reference_url)
    reference = await _read(reference_url)
    reference_samples = _samples(reference)

    upgraded = await _read(old_url)
    assert_same(upgraded, reference)
    assert _samples(upgraded) == reference_samples
    _expected_deltas(await _compact_columns(old_url))

    # Interrupted after one batch of two episodes: both layouts side by side read the same; running
    # it again converts the rest and nothing twice.
    total = sum(len(calls) for calls in episodes().values())
    first = await _convert(reference_url, batch=2, limit=1)
    assert 0 < first < total
    assert sum(encoding for _, _, encoding, *_ in await _compact_columns(reference_url)) == first
    assert_same(await _read(reference_url), reference)
    assert await _convert(reference_url, batch=1) == total - first
    assert await _convert(reference_url, batch=1) == 0
    resumed = await _read(reference_url)
    assert_same(resumed, reference)
    assert _samples(resumed) == reference_samples

    # Those rows are now what a store at 0005 holds (client lists whole). Migration 0006's
    # conversion, interrupted after one episode, then resumed: the same again, and then nothing.
    assert [c[-1] for c in await _compact_columns(reference_url)] == [None] * total
    client = "0006_client_request_deltas"
    assert await _convert(reference_url, client, batch=1, limit=1) == 3
    assert_same(await _read(reference_url), reference)
    assert await _convert(reference_url, client, batch=1) == 2
    assert await _convert(reference_url, client, batch=1) == 0
    resumed = await _read(reference_url)
    assert_same(resumed, reference)
    assert _samples(resumed) == reference_samples
    _expected_deltas(await _compact_columns(reference_url))


async def test_the_proxy_counts_calls_stored_as_deltas_and_serves_them_whole(sqlite_url: str) -> None:
    """Through the app (isolated by the named fake upstream, which answers every call with prompt ids
    [1, 2, 3]): the second call of an episode repeats the first's prompt and extends its messages,
    so it is stored as a delta; ``GET /episodes/<id>`` serves both calls whole; ``/metrics`` counts."""
    from tests.proxy.conftest import ADMIN, episode_auth, fake_upstream, make_settings, new_group, running_app

    first = [{"role": "user", "content": "hi"}]
    second = [*first, {"role": "assistant", "content": "answer 0"}, {"role": "user", "content": "again"}]
    async with running_app(make_settings(sqlite_url), transport=fake_upstream()) as client:
        group = await new_group(client, size=1)
        episode_id = group["episode_keys"][0]["id"]
        for messages in (first, second):
            body = {"model": "policy", "messages": messages, "max_tokens": 2, "temperature": 1.0}
            response = await client.post("/v1/chat/completions", json=body, headers=episode_auth(group, 0))
            assert response.status_code == 200, response.text
        stored = (await client.get(f"/episodes/{episode_id}", headers=ADMIN)).json()["calls"]
        metrics = (await client.get("/metrics", headers=ADMIN)).text
        reward = await client.post(f"/episodes/{episode_id}/reward", json={"reward": 1.0}, headers=ADMIN)
        assert reward.status_code == 200, reward.text
        claim = {"trainer_id": "t", "max_groups": 1, "lease_id": "lease-delta", "calls": "delta"}
        delta = (await client.post("/trainer/claim", json=claim, headers=ADMIN)).json()
        again = await client.post("/trainer/claim", json={**claim, "calls": "whole"}, headers=ADMIN)  # same lease
        bad = await client.post("/trainer/claim", json={**claim, "calls": "diff"}, headers=ADMIN)
    shipped = delta["groups"][0]["episodes"][0]["calls"]
    assert [c["delta"] for c in shipped] == [
        None,
        {"base_ordinal": 0, "prompt_choice": -1, "messages_from": 1, "client_from": None},
    ]
    assert shipped[1]["prompt_token_ids"] == [] and shipped[1]["request"]["messages"] == second[1:]
    whole = again.json()["groups"][0]["episodes"][0]["calls"]
    assert [c["delta"] for c in whole] == [None, None] and [c["request"]["messages"] for c in whole] == [first, second]
    rejoined = WireClaim.read(delta).groups[0].episodes
    assert rejoined is not None and rejoined[0].calls is not None
    assert [c.model_dump() for c in rejoined[0].calls] == [WireCall.model_validate(c).model_dump() for c in whole]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "calls", bad.text
    assert [c["request"]["messages"] for c in stored] == [first, second]
    assert [c["prompt_token_ids"] for c in stored] == [[1, 2, 3], [1, 2, 3]]
    assert [c["choices"][0]["token_ids"] for c in stored] == [[42, 100], [42, 100]]
    assert [c["choices"][0]["logprobs"] for c in stored] == [[-0.5, -0.25], [-0.5, -0.25]]
    assert 'flywheel_store_calls_stored{layout="delta"} 1.0' in metrics
    assert 'flywheel_store_calls_stored{layout="whole"} 1.0' in metrics
    assert [row[2:] for row in await _compact_columns(sqlite_url)] == [
        (1, None, None, b"\x01\x00\x00\x00\x02\x00\x00\x00\x03\x00\x00\x00", None, None),
        (1, 0, -1, b"", 1, None),
    ]


async def test_a_messages_agent_resending_its_conversation_is_stored_as_deltas(sqlite_url: str) -> None:
    """An Anthropic Messages client sends its whole conversation every turn; through the app (the
    named fake upstream), the second and third calls keep only the new items of both the chat
    request the proxy executed and the client's own ``messages`` (``client_from``), and every
    reader gets them whole: ``GET /episodes/<id>`` returns each call's client request as sent."""
    from tests.proxy.conftest import ADMIN, fake_upstream, make_settings, new_group, running_app

    conversation: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    sent = []
    async with running_app(make_settings(sqlite_url), transport=fake_upstream()) as client:
        group = await new_group(client, size=1)
        episode_id = group["episode_keys"][0]["id"]
        headers = {"x-api-key": group["episode_keys"][0]["api_key"], "anthropic-version": "2023-06-01"}
        for turn in range(3):
            body = {"model": "policy", "max_tokens": 8, "system": "Be brief.", "messages": list(conversation)}
            response = await client.post("/v1/messages", json=body, headers=headers)
            assert response.status_code == 200, response.text
            sent.append(body)
            conversation += [
                {"role": "assistant", "content": response.json()["content"]},
                {"role": "user", "content": f"and {turn}?"},
            ]
        stored = (await client.get(f"/episodes/{episode_id}", headers=ADMIN)).json()["calls"]
    assert [c["client_request"] for c in stored] == sent
    columns = [row[6:] for row in await _compact_columns(sqlite_url)]  # (messages_from, client_from)
    assert columns == [(None, None), (2, 1), (4, 3)]
    engine = make_engine(sqlite_url)
    try:
        async with engine.connect() as conn:
            raw = (await conn.execute(select(Call.__table__.c.client_request).order_by(Call.ordinal))).scalars().all()
    finally:
        await engine.dispose()
    assert [len(r["messages"]) for r in raw] == [1, 2, 2]  # only what each turn added
