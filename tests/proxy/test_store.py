"""The repository on both real stores: SQLite (WAL) and PostgreSQL (fresh database per test)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from proxy.errors import Conflict, EpisodeClosed, InvalidRequest, NotFound
from proxy.recorder import Recorder
from proxy.store.db import is_sqlite, migrate_async, sqlite_file
from proxy.store.records import CallRecord, NewCall
from proxy.store.repository import Repository
from proxy.store.rows import CALL_FIELDS, ROW_FIELDS
from tests.support.records import chat_call


@pytest.fixture
async def repo(store_url: str) -> AsyncIterator[Repository]:
    repository = Repository(store_url, min_rewarded=2)
    try:
        yield repository
    finally:
        await repository.close()


def call(
    episode_id: str, *, started_at: float | None = None, version: int | None = 0, prompt: list[int] | None = None
) -> NewCall:
    return chat_call(
        episode_id,
        prompt_token_ids=prompt or [1, 2, 3],
        policy_version=version,
        started_at=started_at if started_at is not None else time.time(),
    )


async def test_group_creation_is_whole(repo: Repository) -> None:
    group = await repo.episodes.create_group(
        task_id="t", size=3, metadata={"k": 1}, episode_metadata=[{"i": 0}, {"i": 1}, {"i": 2}]
    )
    stored = await repo.episodes.get_group(group.id)
    assert stored.size == 3 and stored.status == "open" and stored.metadata == {"k": 1}
    assert [e.metadata["i"] for e in stored.episodes or []] == [0, 1, 2]
    assert stored.counts == {"open": 3}


async def test_calls_get_ordinals_in_start_order_and_round_trip_exactly(repo: Repository) -> None:
    episode = await repo.episodes.create_episode(task_id="t", metadata={})
    other = await repo.episodes.create_episode(task_id="t", metadata={})
    now = time.time()
    await repo.calls.insert(
        [
            call(episode.id, started_at=now + 1, prompt=[9]),
            call(episode.id, started_at=now),
            call(other.id, started_at=now),
        ]
    )
    await repo.calls.insert([call(episode.id, started_at=now + 2, prompt=[7, 8])])
    stored = await repo.episodes.get_episode(episode.id)
    assert [c.ordinal for c in stored.calls or []] == [0, 1, 2]
    assert [c.prompt_token_ids for c in stored.calls or []] == [[1, 2, 3], [9], [7, 8]]
    first = (stored.calls or [])[0]
    assert first.choices[0]["token_ids"] == [4, 5] and first.choices[0]["logprobs"] == [-0.1, -0.2]
    assert first.exact_ids is True and first.policy_version == 0
    assert [c.ordinal for c in (await repo.episodes.get_episode(other.id)).calls or []] == [0]


async def test_a_bad_record_does_not_sink_its_batch(repo: Repository) -> None:
    episode = await repo.episodes.create_episode(task_id="t", metadata={})
    missing = "00000000-0000-0000-0000-000000000000"
    [alone] = await repo.calls.insert([call(missing)])
    assert isinstance(alone, NotFound) and alone.code == "episode_not_found"
    stored, refused = await repo.calls.insert([call(episode.id), call(missing)])
    assert stored is None and isinstance(refused, NotFound)
    assert await repo.calls.count(episode.id) == 1 and await repo.calls.count() == 1


def varied_calls(episode_id: str, other_id: str, t0: float) -> list[list[NewCall]]:
    """Two batches whose values exercise every column's encoding: JSON None and empty containers,
    non-ASCII text, extreme floats, integer keys, an integer past 64 bits, ints given for floats,
    both booleans; out-of-order and tied start times for the ordinals."""

    def variant(eid: str, started_at: float, **changes: Any) -> NewCall:
        return dataclasses.replace(call(eid, started_at=started_at), **changes)

    first = [
        variant(
            episode_id,
            t0 + 2,
            request={
                "model": "policy",
                "messages": [{"role": "user", "content": "héllo ✓"}],
                "temperature": 0.7,
                "n": 1,
                "stop": [],
                "extra": {},
            },
            response=None,
            error={"message": "upstream failed", "code": None},
            prompt_token_ids=None,
            choices=[],
            exact_ids=False,
            policy_version=None,
            replica=None,
            ttft_ms=None,
            prompt_tokens=None,
            completion_tokens=None,
            notes=None,
        ),
        variant(
            episode_id,
            t0,
            stream=True,
            latency_ms=3,
            ttft_ms=1,  # ints where the columns are floats
            choices=[
                {
                    "index": 0,
                    "token_ids": [0, 49151],
                    "logprobs": [-1e-05, -9999.0, -0.0, 1e16],
                    "finish_reason": "length",
                    "text": "",
                    "tool_calls": None,
                }
            ],
            notes={"dropped": ["seed"], 7: "int key", "big": 2**70},
        ),
        variant(
            other_id,
            t0 + 1,
            model_served=None,
            notes={},
            api="messages",
            response_id="msg_01",
            client_request={"system": [{"type": "text", "text": "ü"}], "max_tokens": 8},
        ),
        variant(episode_id, t0 + 2, response={"choices": [], "usage": {"prompt_tokens": 3}}),  # tie: batch order
    ]
    return [first, [variant(episode_id, t0 - 5, policy_version=7, response={})]]  # continues the ordinals


def typed(value: Any) -> Any:
    """``value`` with the type of every scalar made explicit: 1 and 1.0 and True differ."""
    if isinstance(value, dict):
        return {key: typed(item) for key, item in value.items()}
    if isinstance(value, list):
        return [typed(item) for item in value]
    return (type(value).__name__, value)


async def _store_and_read(url: str, *, sqlite_fast_path: bool) -> tuple[list[CallRecord], list[CallRecord]]:
    repository = Repository(url, sqlite_fast_path=sqlite_fast_path)
    try:
        episode = await repository.episodes.create_episode(task_id="t", metadata={})
        other = await repository.episodes.create_episode(task_id="t", metadata={})
        for batch in varied_calls(episode.id, other.id, 1_700_000_000.25):
            await repository.calls.insert(batch)
        assert await repository.episodes.episode_state(episode.id) == ("open", None, None)
        assert await repository.episodes.episode_state("00000000-0000-0000-0000-000000000000") is None
        return (
            (await repository.episodes.get_episode(episode.id)).calls or [],
            (await repository.episodes.get_episode(other.id)).calls or [],
        )
    finally:
        await repository.close()


def _raw_calls(url: str) -> list[tuple[Any, ...]]:
    """Every stored column of every call with SQLite's own type for it, episode ids left out."""
    path = sqlite_file(url)
    assert path is not None
    columns = [name for name in ROW_FIELDS if name != "episode_id"] + ["ordinal"]
    with contextlib.closing(sqlite3.connect(path)) as conn:
        select_list = ", ".join(f'typeof("{name}"), "{name}"' for name in columns)
        return conn.execute(f"SELECT id, {select_list} FROM calls ORDER BY id").fetchall()


async def test_the_sqlite_fast_path_and_the_engine_path_store_identical_calls(store_url: str, tmp_path: Path) -> None:
    """The same calls through the SQLite fast path and through SQLAlchemy (on SQLite, and on
    PostgreSQL) read back equal field by field and type for type; on SQLite the stored rows
    themselves are equal, JSON text included."""
    fast_url = f"sqlite+aiosqlite:///{tmp_path / 'fast-path.db'}"
    await migrate_async(fast_url)
    fast = await _store_and_read(fast_url, sqlite_fast_path=True)
    engine = await _store_and_read(store_url, sqlite_fast_path=False)
    assert [c.ordinal for c in fast[0]] == [0, 1, 2, 3] and [c.ordinal for c in fast[1]] == [0]
    assert fast[0][0].latency_ms == 3.0 and fast[0][1].response is None and fast[0][3].policy_version == 7
    for fast_calls, engine_calls in zip(fast, engine, strict=True):
        assert len(fast_calls) == len(engine_calls)
        for fast_call, engine_call in zip(fast_calls, engine_calls, strict=True):
            for name in CALL_FIELDS + ["id", "ordinal"]:
                if name != "episode_id":
                    assert typed(getattr(fast_call, name)) == typed(getattr(engine_call, name)), name
    if is_sqlite(store_url):
        assert _raw_calls(fast_url) == _raw_calls(store_url)


async def test_migrations_build_exactly_the_models_schema(store_url: str) -> None:
    """Alembic's head and the ORM models agree, column for column and index for index."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext
    from sqlalchemy.ext.asyncio import create_async_engine

    from proxy.store.models import Base

    engine = create_async_engine(store_url)
    try:
        async with engine.connect() as conn:
            diff = await conn.run_sync(lambda c: compare_metadata(MigrationContext.configure(c), Base.metadata))
    finally:
        await engine.dispose()
    assert diff == []


async def test_a_call_is_found_by_the_answer_id_its_client_saw(repo: Repository) -> None:
    episode = await repo.episodes.create_episode(task_id="t", metadata={})
    translated = call(episode.id, started_at=time.time() + 1)
    translated.api, translated.client_request, translated.response_id = "responses", {"input": "x"}, "resp_1"
    await repo.calls.insert([call(episode.id), translated])
    found = await repo.calls.by_response_id("resp_1")
    assert found is not None and (found.ordinal, found.api, found.client_request) == (1, "responses", {"input": "x"})
    assert (await repo.episodes.get_episode(episode.id)).calls[0].api == "chat"  # type: ignore[index]
    assert await repo.calls.by_response_id("resp_2") is None


async def test_reward_completes_the_group_once_all_are_finished(repo: Repository) -> None:
    group = await repo.episodes.create_group(task_id="t", size=3, metadata={})
    a, b, c = (e.id for e in group.episodes or [])
    await repo.episodes.set_reward(a, reward=1.0, call_rewards=None, metadata=None)
    await repo.episodes.set_reward(b, reward=0.0, call_rewards=None, metadata={"why": "wrong"})
    assert (await repo.episodes.get_group(group.id)).status == "open"
    assert (await repo.episodes.abandon(c, reason="agent crashed")).abandon_cause == "agent"
    done = await repo.episodes.get_group(group.id)
    assert done.status == "complete" and done.completed_at is not None
    assert done.counts == {"rewarded": 2, "abandoned": 1}


async def test_reward_idempotency_and_conflicts(repo: Repository) -> None:
    episode = await repo.episodes.create_episode(task_id=None, metadata={})
    first, changed = await repo.episodes.set_reward(episode.id, reward=0.5, call_rewards=None, metadata={"a": 1})
    assert changed
    again, changed = await repo.episodes.set_reward(episode.id, reward=0.5, call_rewards=None, metadata={"a": 1})
    assert not changed and again.finished_at == first.finished_at
    with pytest.raises(Conflict):
        await repo.episodes.set_reward(episode.id, reward=0.5, call_rewards=None, metadata={"a": 2})
    with pytest.raises(NotFound):
        await repo.episodes.set_reward(
            "00000000-0000-0000-0000-000000000000", reward=1, call_rewards=None, metadata=None
        )
    with pytest.raises(InvalidRequest):
        other = await repo.episodes.create_episode(task_id=None, metadata={})
        await repo.episodes.set_reward(other.id, reward=1, call_rewards={"0": 1.0}, metadata=None)  # it has no calls
    assert (await repo.episodes.get_episode(other.id)).status == "open"


async def test_concurrent_rewards_of_one_group_complete_it(repo: Repository) -> None:
    """Two rewards racing must not both miss the other's write (group row lock / BEGIN IMMEDIATE)."""
    for _ in range(3):
        group = await repo.episodes.create_group(task_id="t", size=6, metadata={})
        await asyncio.gather(
            *(
                repo.episodes.set_reward(e.id, reward=float(i), call_rewards=None, metadata=None)
                for i, e in enumerate(group.episodes or [])
            )
        )
        assert (await repo.episodes.get_group(group.id)).status == "complete"


async def test_idle_episodes_are_abandoned_and_unblock_their_group(repo: Repository) -> None:
    group = await repo.episodes.create_group(task_id="t", size=3, metadata={})
    a, b, c = (e.id for e in group.episodes or [])
    await repo.episodes.set_reward(a, reward=1.0, call_rewards=None, metadata=None)
    await repo.episodes.set_reward(b, reward=0.0, call_rewards=None, metadata=None)
    assert await repo.episodes.abandon_expired(idle_s=3600) == 0
    await asyncio.sleep(0.05)
    assert await repo.episodes.abandon_expired(idle_s=0.01) == 1
    stored = await repo.episodes.get_episode(c)
    assert stored.status == "abandoned" and "no reward" in (stored.abandon_reason or "")
    assert stored.abandon_cause == "deadline"  # not the agent's doing: the trainer never penalizes it
    assert (await repo.episodes.get_group(group.id)).status == "complete"


async def test_recent_calls_keep_an_episode_alive(repo: Repository) -> None:
    episode = await repo.episodes.create_episode(task_id="t", metadata={})
    await asyncio.sleep(0.3)
    await repo.calls.insert([call(episode.id, started_at=time.time())])
    assert await repo.episodes.abandon_expired(idle_s=0.2) == 0
    assert (await repo.episodes.get_episode(episode.id)).status == "open"


async def _complete_group(repo: Repository, rewards: tuple[float, ...] = (1.0, 0.0), version: int = 0) -> str:
    group = await repo.episodes.create_group(task_id="t", size=len(rewards), metadata={})
    for episode, reward in zip(group.episodes or [], rewards, strict=True):
        await repo.calls.insert([call(episode.id, version=version)])
        await repo.episodes.set_reward(episode.id, reward=reward, call_rewards=None, metadata=None)
    return group.id


async def test_claim_is_exclusive_and_expired_leases_are_offered_again(repo: Repository) -> None:
    first_id = await _complete_group(repo)
    second_id = await _complete_group(repo)
    claim = await repo.leases.claim(owner="a", max_groups=1, lease_s=60, max_staleness=None, current_version=0)
    assert [g.id for g in claim.groups] == [first_id]
    episodes = claim.groups[0].episodes or []
    assert {e.reward for e in episodes} == {1.0, 0.0} and all(len(e.calls or []) == 1 for e in episodes)
    other = await repo.leases.claim(owner="b", max_groups=5, lease_s=0.05, max_staleness=None, current_version=0)
    assert [g.id for g in other.groups] == [second_id]  # the leased group is not offered twice
    await asyncio.sleep(0.1)
    retry = await repo.leases.claim(owner="c", max_groups=5, lease_s=60, max_staleness=None, current_version=0)
    assert [g.id for g in retry.groups] == [second_id]  # b's lease expired
    with pytest.raises(Conflict):
        await repo.leases.ack(lease_id=other.lease_id, group_ids=[second_id], step=1, status="trained")
    await repo.leases.ack(lease_id=retry.lease_id, group_ids=[second_id], step=1, status="trained")
    await repo.leases.ack(lease_id=retry.lease_id, group_ids=[second_id], step=1, status="trained")  # idempotent
    with pytest.raises(Conflict):
        await repo.leases.ack(lease_id=retry.lease_id, group_ids=[second_id], step=2, status="trained")
    assert (await repo.episodes.get_group(second_id)).trained_step == 1
    assert (
        await repo.leases.claim(owner="d", max_groups=5, lease_s=60, max_staleness=None, current_version=0)
    ).groups == []


async def test_stale_groups_are_marked_and_skipped(repo: Repository) -> None:
    old = await _complete_group(repo, version=1)
    fresh = await _complete_group(repo, version=4)
    claim = await repo.leases.claim(owner="t", max_groups=5, lease_s=60, max_staleness=2, current_version=5)
    assert [g.id for g in claim.groups] == [fresh] and claim.stale == 1
    stale = await repo.episodes.get_group(old)
    assert stale.train_status == "stale" and "v1" in (stale.train_note or "")


async def test_a_fork_groups_age_is_its_sampled_calls_not_its_replayed_ones(repo: Repository) -> None:
    """A fork replays calls its source's old version sampled: context only, so they do not make the
    fork group stale; the calls it sampled itself do."""
    source_group = await _complete_group(repo, version=1)
    source = (await repo.episodes.get_group(source_group)).episodes or []
    fork = await repo.forks.create(source[0].id, at=1, size=2, rule="sample", metadata={})
    for episode in fork.episodes or []:
        replayed = chat_call(episode.id, policy_version=1, notes={"replay": {"source_ordinal": 0}})
        sampled = chat_call(episode.id, policy_version=4)
        assert await repo.calls.insert([replayed]) == [None]
        assert await repo.calls.insert([sampled]) == [None]
        await repo.episodes.set_reward(
            episode.id, reward=float(episode.group_index or 0), call_rewards=None, metadata=None
        )
    claim = await repo.leases.claim(owner="t", max_groups=5, lease_s=60, max_staleness=2, current_version=5)
    assert [g.id for g in claim.groups] == [fork.id] and claim.stale == 1  # the source group (v1) is stale


async def test_policy_versions_only_move_forward(repo: Repository) -> None:
    assert await repo.versions.current() is None
    await repo.versions.add(version=1, name="policy-v1", adapter_path="/a/1", metadata={})
    await repo.versions.add(version=3, name="policy-v3", adapter_path="/a/3", metadata={"step": 3})
    with pytest.raises(Conflict):
        await repo.versions.add(version=2, name="policy-v2", adapter_path="/a/2", metadata={})
    current = await repo.versions.current()
    assert current is not None and current.version == 3 and current.metadata == {"step": 3}
    assert await repo.versions.next_number() == 4


async def test_trainer_steps_replace_on_retry(repo: Repository) -> None:
    await repo.steps.add(step=1, metrics={"loss": 0.5})
    await repo.steps.add(step=1, metrics={"loss": 0.4})
    await repo.steps.add(step=2, metrics={"loss": 0.3})
    steps = await repo.steps.list(since_step=0)
    assert [(s.step, s.metrics["loss"]) for s in steps] == [(1, 0.4), (2, 0.3)]


async def test_group_commit_batches_concurrent_calls(repo: Repository) -> None:
    """Many concurrent record() calls share few transactions, and each returns only once committed."""
    episode = await repo.episodes.create_episode(task_id="t", metadata={})
    batches: list[int] = []
    recorder = Recorder(repo.calls, on_batch=lambda n, _s: batches.append(n))
    recorder.start()
    await asyncio.gather(*(recorder.record(call(episode.id)) for _ in range(200)))
    assert await repo.calls.count(episode.id) == 200  # every awaited record is durable
    await recorder.close()
    assert sum(batches) == 200 and len(batches) < 200
    assert sorted(c.ordinal for c in (await repo.episodes.get_episode(episode.id)).calls or []) == list(range(200))


async def test_staleness_scan_looks_at_every_group(repo: Repository) -> None:
    stale = [await _complete_group(repo, version=0) for _ in range(5)]
    fresh = [await _complete_group(repo, version=3) for _ in range(3)]
    claim = await repo.leases.claim(owner="t", max_groups=2, lease_s=60, max_staleness=1, current_version=3)
    assert claim.stale == 5 and [g.id for g in claim.groups] == fresh[:2]
    assert [(await repo.episodes.get_group(g)).train_status for g in stale] == ["stale"] * 5


async def test_a_retried_claim_returns_the_same_groups_and_release_hands_them_back(repo: Repository) -> None:
    first, second = await _complete_group(repo), await _complete_group(repo)
    lease = "11111111-2222-3333-4444-555555555555"
    claim = await repo.leases.claim(
        owner="t", max_groups=1, lease_s=60, max_staleness=None, current_version=0, lease_id=lease
    )
    retry = await repo.leases.claim(
        owner="t", max_groups=1, lease_s=60, max_staleness=None, current_version=0, lease_id=lease
    )
    assert [g.id for g in claim.groups] == [g.id for g in retry.groups] == [first]
    assert retry.lease_id == lease and len(retry.groups[0].episodes or []) == 2
    assert await repo.leases.release(lease_id=lease) == 1
    again = await repo.leases.claim(owner="u", max_groups=2, lease_s=60, max_staleness=None, current_version=0)
    assert [g.id for g in again.groups] == [first, second]
    assert await repo.leases.release(lease_id=lease) == 0  # no longer held by that lease


# -- late calls, leases and lock order ----------------------------------------------------------


def _pg_dsn(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://")


async def _wait_for_lock_wait(dsn: str, bound_s: float = 10.0) -> None:
    """Until some backend of this database waits for a row lock (bounded)."""
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        deadline = time.monotonic() + bound_s
        while time.monotonic() < deadline:
            waiting = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            if waiting:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"nothing waited for a row lock within {bound_s}s")
    finally:
        await conn.close()


async def _try_lock_episode(dsn: str, episode_id: str) -> bool:
    """Whether another transaction can lock the episode row right now (FOR UPDATE NOWAIT)."""
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            await conn.execute("SELECT id FROM episodes WHERE id = $1 FOR UPDATE NOWAIT", episode_id)
        return True
    except asyncpg.exceptions.LockNotAvailableError:
        return False
    finally:
        await conn.close()


class OtherWriter:
    """Another proxy's transaction, held open: it rewards an episode and completes its group, and
    commits only when told (what ``set_reward`` does on another replica)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.sqlite = is_sqlite(url)
        self._pg: Any = None
        self._sqlite: sqlite3.Connection | None = None

    async def reward(self, episode_id: str, group_id: str) -> None:
        now = time.time()
        if self.sqlite:
            path = sqlite_file(self.url)
            assert path is not None
            self._sqlite = sqlite3.connect(path, isolation_level=None)
            self._sqlite.execute("BEGIN IMMEDIATE")
            self._sqlite.execute(
                "UPDATE episodes SET status = 'rewarded', reward = 1.0, finished_at = ? WHERE id = ?", (now, episode_id)
            )
            self._sqlite.execute(
                "UPDATE groups SET status = 'complete', completed_at = ? WHERE id = ?", (now, group_id)
            )
            return
        import asyncpg

        self._pg = await asyncpg.connect(_pg_dsn(self.url))
        await self._pg.execute("BEGIN")
        await self._pg.execute("SELECT id FROM groups WHERE id = $1 FOR UPDATE", group_id)
        await self._pg.execute(
            "UPDATE episodes SET status = 'rewarded', reward = 1.0, finished_at = $1 WHERE id = $2", now, episode_id
        )
        await self._pg.execute("UPDATE groups SET status = 'complete', completed_at = $1 WHERE id = $2", now, group_id)

    async def commit(self) -> None:
        if self._sqlite is not None:
            self._sqlite.execute("COMMIT")
            self._sqlite.close()
        else:
            await self._pg.execute("COMMIT")
            await self._pg.close()


async def test_a_call_of_a_finished_episode_is_refused_and_the_rest_of_its_batch_commits(repo: Repository) -> None:
    """Per-call outcomes: a batch keeps its open episodes' calls and refuses the finished one's
    with 409 conflict_error / episode_closed, which the recorder hands to that call alone."""
    finished = await repo.episodes.create_episode(task_id="t", metadata={})
    live = await repo.episodes.create_episode(task_id="t", metadata={})
    await repo.episodes.set_reward(finished.id, reward=1.0, call_rewards=None, metadata=None)
    batches: list[int] = []
    recorder = Recorder(repo.calls, on_batch=lambda n, _s: batches.append(n))
    recorder.start()
    try:
        late, kept = await asyncio.gather(
            recorder.record(call(finished.id)), recorder.record(call(live.id)), return_exceptions=True
        )
    finally:
        await recorder.close()
    assert batches == [2]  # one transaction held both
    assert isinstance(late, EpisodeClosed) and late.code == "episode_closed"
    assert (late.status_code, late.type) == (409, "conflict_error")
    assert kept is None
    assert await repo.calls.count(finished.id) == 0 and await repo.calls.count(live.id) == 1


async def test_a_reward_committing_during_an_insert_refuses_the_late_call(repo: Repository, store_url: str) -> None:
    """A reward another proxy commits while a call's record is being written: the insert waits for
    it and refuses the call inside its own transaction, so nothing is added to the completed group."""
    group = await repo.episodes.create_group(task_id="t", size=2, metadata={})
    a, b = (e.id for e in group.episodes or [])
    lone = await repo.episodes.create_episode(task_id="t", metadata={})
    await repo.calls.insert([call(a), call(b)])
    await repo.episodes.set_reward(a, reward=0.0, call_rewards=None, metadata=None)
    other = OtherWriter(store_url)
    await other.reward(b, group.id)  # the gate saw b open; this reward is mid-commit
    insert = asyncio.create_task(repo.calls.insert([call(b), call(lone.id)]))
    if not other.sqlite:
        await _wait_for_lock_wait(_pg_dsn(store_url))
        assert not insert.done()
    await other.commit()
    late, kept = await asyncio.wait_for(insert, 30)
    assert isinstance(late, EpisodeClosed) and kept is None
    assert await repo.calls.count(b) == 1 and await repo.calls.count(lone.id) == 1
    done = await repo.episodes.get_group(group.id)
    assert done.status == "complete" and done.counts == {"rewarded": 2}


async def test_an_insert_locks_the_group_row_before_its_episode_rows(repo: Repository, store_url: str) -> None:
    """The one lock order (group row, then episode rows by id), as rewards take them: while the
    group is locked by another transaction, an insert waits for it holding no episode row."""
    if is_sqlite(store_url):
        pytest.skip("row locks are PostgreSQL's; SQLite serialises writers with BEGIN IMMEDIATE")
    import asyncpg

    group = await repo.episodes.create_group(task_id="t", size=2, metadata={})
    a = (group.episodes or [])[0].id
    dsn = _pg_dsn(store_url)
    holder = await asyncpg.connect(dsn)
    try:
        await holder.execute("BEGIN")
        await holder.execute("SELECT id FROM groups WHERE id = $1 FOR UPDATE", group.id)
        insert = asyncio.create_task(repo.calls.insert([call(a)]))
        await _wait_for_lock_wait(dsn)
        assert await _try_lock_episode(dsn, a)  # waiting for the group, it holds no episode row
        await holder.execute("ROLLBACK")
    finally:
        await holder.close()
    assert await asyncio.wait_for(insert, 30) == [None]


async def test_the_idle_sweep_locks_episode_rows_in_id_order(repo: Repository, store_url: str) -> None:
    """``abandon_expired`` takes episode rows sorted by id, as inserts do, whatever their order on
    disk: blocked on the higher id, it already holds the lower one (so the two never deadlock)."""
    if is_sqlite(store_url):
        pytest.skip("row locks are PostgreSQL's; SQLite serialises writers with BEGIN IMMEDIATE")
    import asyncpg

    for _ in range(20):  # stored first, the higher id: a scan in storage order would take it first
        first = await repo.episodes.create_episode(task_id="t", metadata={})
        second = await repo.episodes.create_episode(task_id="t", metadata={})
        if first.id > second.id:
            break
        await repo.episodes.abandon(first.id, reason="not this pair")
        await repo.episodes.abandon(second.id, reason="not this pair")
    high, low = first.id, second.id
    assert high > low
    await asyncio.sleep(0.05)
    dsn = _pg_dsn(store_url)
    holder = await asyncpg.connect(dsn)
    try:
        await holder.execute("BEGIN")
        await holder.execute("SELECT id FROM episodes WHERE id = $1 FOR UPDATE", high)
        sweep = asyncio.create_task(repo.episodes.abandon_expired(idle_s=0.01))
        await _wait_for_lock_wait(dsn)
        assert not await _try_lock_episode(dsn, low)  # taken before the wait for the higher id
        await holder.execute("ROLLBACK")
    finally:
        await holder.close()
    assert await asyncio.wait_for(sweep, 30) == 2


async def test_an_expired_lease_acks_only_after_a_renewal(repo: Repository) -> None:
    """An ack needs a live lease; a lapsed lease nobody took over is revived by renewing it; the
    same ack again (a restarted trainer finishing its checkpoint) is a no-op even long after."""
    group_id = await _complete_group(repo)
    claim = await repo.leases.claim(owner="a", max_groups=1, lease_s=0.05, max_staleness=None, current_version=0)
    await asyncio.sleep(0.1)
    with pytest.raises(Conflict) as refused:
        await repo.leases.ack(lease_id=claim.lease_id, group_ids=[group_id], step=1, status="trained")
    assert refused.value.code == "lease_expired" and refused.value.status_code == 409
    assert (await repo.episodes.get_group(group_id)).train_status == "pending"
    before = time.time()
    expires = await repo.leases.renew(lease_id=claim.lease_id, group_ids=[group_id], lease_s=60)
    assert before + 59 < expires <= time.time() + 60
    later = await repo.leases.renew(lease_id=claim.lease_id, group_ids=[group_id], lease_s=120)
    assert later > expires
    await repo.leases.ack(lease_id=claim.lease_id, group_ids=[group_id], step=1, status="trained")
    await repo.leases.ack(lease_id=claim.lease_id, group_ids=[group_id], step=1, status="trained")
    await repo.leases.renew(lease_id=claim.lease_id, group_ids=[group_id], lease_s=60)  # acked: left as it is
    assert (await repo.episodes.get_group(group_id)).trained_step == 1


async def test_a_lease_claimed_again_is_lost_for_renewals_and_acks(repo: Repository) -> None:
    first, second = await _complete_group(repo), await _complete_group(repo)
    a = await repo.leases.claim(owner="a", max_groups=2, lease_s=0.05, max_staleness=None, current_version=0)
    assert [g.id for g in a.groups] == [first, second]
    await asyncio.sleep(0.1)
    b = await repo.leases.claim(owner="b", max_groups=1, lease_s=60, max_staleness=None, current_version=0)
    assert [g.id for g in b.groups] == [first]
    with pytest.raises(Conflict) as lost:
        await repo.leases.renew(lease_id=a.lease_id, group_ids=[first, second], lease_s=60)
    assert lost.value.code == "lease_lost"
    with pytest.raises(Conflict) as expired:  # all or nothing: the renewal extended no group
        await repo.leases.ack(lease_id=a.lease_id, group_ids=[second], step=1, status="trained")
    assert expired.value.code == "lease_expired"
    with pytest.raises(Conflict) as lost_ack:
        await repo.leases.ack(lease_id=a.lease_id, group_ids=[first], step=1, status="trained")
    assert lost_ack.value.code == "lease_lost"
    await repo.leases.ack(lease_id=b.lease_id, group_ids=[first], step=1, status="trained")
    with pytest.raises(Conflict) as other_step:  # b's step 1, not a's: no idempotent pass for another lease
        await repo.leases.ack(lease_id=a.lease_id, group_ids=[first], step=1, status="trained")
    assert other_step.value.code == "already_acked"
    await repo.leases.renew(lease_id=a.lease_id, group_ids=[second], lease_s=60)
    await repo.leases.ack(lease_id=a.lease_id, group_ids=[second], step=1, status="trained")
    assert [(await repo.episodes.get_group(g)).train_status for g in (first, second)] == ["trained", "trained"]


async def test_dashboard_counts_are_reused_within_their_ttl_and_recounted_after(repo: Repository) -> None:
    """The overview's counts scan every table; every open dashboard polls them, so one count serves
    all polls for ``counts_ttl_s`` (``proxy/store/browse.py``), and a later poll sees new rows."""
    first = await repo.browse.counts()
    await repo.episodes.create_group(task_id="t", size=2, metadata={})
    assert await repo.browse.counts() == first  # within the TTL: the same count, not a new scan
    repo.browse._counted = (repo.browse._counted[0] - 60.0, first) if repo.browse._counted else None  # it ages
    after = await repo.browse.counts()
    assert sum(after.episodes.values()) == sum(first.episodes.values()) + 2


async def test_fork_groups_take_the_source_task_and_refuse_what_cannot_be_forked(repo: Repository) -> None:
    group = await repo.episodes.create_group(task_id="t-1", size=2, metadata={"workflow": "calc"})
    source, other = [e.id for e in group.episodes or []]
    for status in (200, 500, 200):  # a failed call is never replayed: two answered calls
        call = chat_call(source, request={"model": "policy", "messages": []})
        call.status_code = status
        assert await repo.calls.insert([call]) == [None]
    with pytest.raises(Conflict):  # running: no outcome to compare against
        await repo.forks.create(source, at=1, size=2, rule="sample", metadata={})
    await repo.episodes.set_reward(source, reward=1.0, call_rewards=None, metadata=None)
    await repo.episodes.abandon(other, reason="x", cause="agent")
    with pytest.raises(Conflict):
        await repo.forks.create(other, at=0, size=2, rule="sample", metadata={})
    with pytest.raises(InvalidRequest):
        await repo.forks.create(source, at=3, size=2, rule="sample", metadata={})
    with pytest.raises(NotFound):
        await repo.forks.create("00000000-0000-0000-0000-000000000000", at=0, size=1, rule="sample", metadata={})
    fork = await repo.forks.create(source, at=2, size=3, rule="abandon", metadata={"note": "n"})
    assert (fork.task_id, fork.size, fork.status) == ("t-1", 3, "open")
    assert fork.metadata == {
        "workflow": "calc",
        "note": "n",
        "fork": {"source_episode_id": source, "source_group_id": group.id, "at": 2, "rule": "abandon"},
    }
    assert [(e.fork_of, e.fork_at, e.fork_rule) for e in fork.episodes or []] == [(source, 2, "abandon")] * 3
    assert len(await repo.forks.replayable(source)) == 2
    assert [c.ordinal for c in await repo.forks.replayable(source)] == [0, 2]
    child = (fork.episodes or [])[0].id
    assert await repo.forks.answered(child) == 0
    assert (await repo.forks.fork_of(child)) is not None and await repo.forks.fork_of(source) is None
    assert await repo.forks.diverge(child, at=1, divergence={"fields": ["tools"], "rule": "abandon"})
    assert not await repo.forks.diverge(child, at=2, divergence={"fields": ["x"], "rule": "abandon"})
    assert (await repo.episodes.get_episode(child)).diverged_at == 1
    assert {e.id for e in await repo.forks.children(source)} == {e.id for e in fork.episodes or []}
