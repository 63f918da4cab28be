"""Retention (issue 50): bodies and token ids purged past their TTL with the counts kept, episodes
deleted on request from every table and the export, the audit log, the refusals, and a SQLite file
that reuses what was freed. On real SQLite and PostgreSQL stores; no model call is made (calls are
written through the repository, the routes run in-process)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sqlite3
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import create_async_engine

from contract.client import AsyncProxyClient, Episode
from proxy.errors import Conflict
from proxy.store.db import is_sqlite, sqlite_file
from proxy.store.models import Base, Call
from proxy.store.repository import Repository
from proxy.store.rows import json_text
from tests.proxy.conftest import ADMIN, ADMIN_KEY, episode_auth, fake_upstream, make_settings, new_group, running_app
from tests.support.records import chat_call

SECRET = "the user's street address is 221B"
"""Text that only bodies hold: after a purge or a deletion no row may contain it."""


@pytest.fixture
async def repo(store_url: str) -> AsyncIterator[Repository]:
    repository = Repository(store_url, min_rewarded=2)
    try:
        yield repository
    finally:
        await repository.close()


def _body(n: int = 0, size: int = 0) -> dict[str, Any]:
    padding = "x" * size
    return {"model": "policy", "messages": [{"role": "user", "content": f"{SECRET} #{n} {padding}"}]}


async def _record(repo: Repository, episode_id: str, *, size: int = 0) -> None:
    """Two calls, the second continuing the first (stored as a delta on it), with secret bodies."""
    first = chat_call(
        episode_id,
        request=_body(0, size),
        response={"choices": [{"message": {"content": SECRET}}]},
        client_request={"input": SECRET},
        api="responses",
        notes={"sampling": {"mode": "constrained", "grammar": {"json": SECRET}}},
    )
    second = chat_call(
        episode_id,
        request={"model": "policy", "messages": [*_body(0, size)["messages"], {"role": "user", "content": "more"}]},
        prompt_token_ids=[1, 2, 3, 4, 5, 6, 7],
        choices=[{"index": 0, "token_ids": [8, 9], "logprobs": [-0.5, -0.25], "finish_reason": "length"}],
        started_at=time.time() + 0.001,
        notes={"sampling": {"mode": "sampled"}},
    )
    await repo.calls.insert([first])
    await repo.calls.insert([second])


async def _group(repo: Repository, rewards: tuple[float | None, ...], *, size: int = 0) -> list[str]:
    """A group whose episodes each made two calls, rewarded (a float) or left open (None)."""
    group = await repo.episodes.create_group(task_id="t", size=len(rewards), metadata={})
    ids = [e.id for e in group.episodes or []]
    for episode_id, reward in zip(ids, rewards, strict=True):
        await _record(repo, episode_id, size=size)
        if reward is not None:
            await repo.episodes.set_reward(episode_id, reward=reward, call_rewards=None, metadata=None)
    return ids


async def _acked(repo: Repository, status: str = "trained") -> list[str]:
    """A complete group a trainer claimed and acked (``trained`` or ``skipped``)."""
    ids = await _group(repo, (1.0, 0.0))
    group_id = (await repo.episodes.get_episode(ids[0], with_calls=False)).group_id
    claim = await repo.leases.claim(owner="t", max_groups=100, lease_s=60, max_staleness=None, current_version=0)
    assert group_id in [g.id for g in claim.groups]
    await repo.leases.ack(lease_id=claim.lease_id, group_ids=[group_id or ""], step=1, status=status)  # type: ignore[arg-type]
    await repo.leases.release(lease_id=claim.lease_id)  # the other groups it leased: back to the claims
    return ids


async def _rows_with(url: str, needle: str) -> dict[str, int]:
    """How many rows of each table of the schema hold ``needle`` anywhere (every column as text)."""
    engine = create_async_engine(url)
    found: dict[str, int] = {}
    try:
        async with engine.connect() as conn:
            for table in Base.metadata.sorted_tables:
                rows = (await conn.execute(select(table))).all()
                hits = sum(1 for row in rows if needle in repr(tuple(row)) or needle.encode() in _raw(row))
                if hits:
                    found[table.name] = hits
    finally:
        await engine.dispose()
    return found


def _raw(row: Any) -> bytes:
    return b"".join(v for v in tuple(row) if isinstance(v, bytes))


async def _json_layout(url: str, episode_id: str) -> None:
    """Turn the episode's first call into the JSON layout (ids in the JSON columns, no packed ones)."""
    engine = create_async_engine(url, json_serializer=json_text)
    choices = [{"index": 0, "token_ids": [4, 5], "logprobs": [-0.1, -0.2], "finish_reason": "stop"}]
    try:
        async with engine.begin() as conn:
            await conn.execute(
                update(Call.__table__)
                .where(Call.episode_id == episode_id, Call.ordinal == 0)
                .values(encoding=0, prompt_token_ids=[1, 2, 3], prompt_ids=None, choices=choices, choice_ids=None)
                .values(choice_logprobs=None)
            )
    finally:
        await engine.dispose()


# -- purge -------------------------------------------------------------------------------------------


async def test_a_purge_empties_bodies_and_ids_of_done_episodes_and_keeps_their_counts(
    repo: Repository, store_url: str
) -> None:
    trained = await _acked(repo)
    skipped = await _acked(repo, "skipped")
    failed = await _group(repo, (1.0,) + (None,))
    await repo.episodes.abandon(failed[1], reason="gave up")  # one rewarded of two: failed
    lone = (await repo.episodes.create_episode(task_id="t", metadata={})).id
    await _record(repo, lone)
    await repo.episodes.set_reward(lone, reward=0.5, call_rewards=None, metadata=None)
    await _json_layout(store_url, lone)  # a row as written before migration 0004 converted it
    assert (await repo.episodes.get_episode(lone)).calls[0].prompt_token_ids == [1, 2, 3]  # type: ignore[index]
    pending = await _group(repo, (1.0, 0.0))  # complete, waiting for a trainer
    half_open = await _group(repo, (1.0, None))  # one finished, its group still open
    open_lone = (await repo.episodes.create_episode(task_id="t", metadata={})).id
    await _record(repo, open_lone)
    calls_before = await repo.calls.count()
    before = {e: await repo.episodes.get_episode(e) for e in trained}

    # Finished too recently for the cutoff: nothing.
    assert (await repo.retention.purge(before=time.time() - 3600, limit=100)).episodes == 0

    purged = await repo.retention.purge(before=time.time() + 1, limit=100)
    eligible = {*trained, *skipped, *failed, lone}
    assert purged.episodes == len(eligible) and purged.calls == 2 * len(eligible)
    for episode_id in [*trained, *skipped, *failed, lone, *pending, *half_open, open_lone]:
        episode = await repo.episodes.get_episode(episode_id)
        assert (episode.purged_at is not None) == (episode_id in eligible), episode_id
        calls = episode.calls or []
        assert len(calls) == 2  # the rows stay
        if episode_id not in eligible:
            assert calls[1].prompt_token_ids == [1, 2, 3, 4, 5, 6, 7] and SECRET in json.dumps(calls[0].request)
            continue
        for call in calls:
            assert call.request == {} and call.response is None and call.client_request is None
            assert call.prompt_token_ids is None and not call.exact_ids
            assert call.notes is not None and call.notes["purged"] == episode.purged_at
        assert [c.choices for c in calls] == [
            [{"index": 0, "finish_reason": "stop"}],
            [{"index": 0, "finish_reason": "length"}],
        ]
        assert calls[0].notes == {"sampling": {"mode": "constrained"}, "purged": episode.purged_at}
    # The counts, statuses, versions and outcome stay, so dashboards and metrics still count them.
    for episode_id, whole in before.items():
        after = await repo.episodes.get_episode(episode_id)
        assert (after.status, after.reward, after.finished_at) == (whole.status, whole.reward, whole.finished_at)
        keep = ("status_code", "prompt_tokens", "completion_tokens", "policy_version", "latency_ms", "model_served")
        for old, new in zip(whole.calls or [], after.calls or [], strict=True):
            assert {k: getattr(new, k) for k in keep} == {k: getattr(old, k) for k in keep}
    assert await repo.calls.count() == calls_before
    group = await repo.episodes.get_group(before[trained[0]].group_id or "")
    assert (group.status, group.train_status, group.counts) == ("complete", "trained", {"rewarded": 2})
    # No stored byte of a purged episode holds its bodies or ids; the others keep theirs.
    # (An episode's second call stores only the messages after its first's.)
    assert await _rows_with(store_url, SECRET) == {"calls": len(pending) + len(half_open) + 1}
    if is_sqlite(store_url):
        with sqlite3.connect(sqlite_file(store_url) or "") as db:
            marks = ",".join("?" * len(eligible))
            packed = db.execute(
                f"SELECT count(*) FROM calls WHERE episode_id IN ({marks}) AND (prompt_ids IS NOT NULL OR "
                "choice_ids IS NOT NULL OR choice_logprobs IS NOT NULL OR base_ordinal IS NOT NULL)",
                sorted(eligible),
            ).fetchone()[0]
        assert packed == 0
    # Purged once: a second purge finds nothing, and its one audit entry says what it did.
    assert (await repo.retention.purge(before=time.time() + 1, limit=100)).episodes == 0
    [entry] = await repo.retention.audit_log()
    assert (entry.id, entry.actor, entry.action, entry.rows) == (purged.audit_id, "retention", "purge", purged.calls)
    assert entry.detail["episodes"] == len(eligible)


async def test_a_purge_goes_batch_by_batch_and_spares_the_source_of_an_open_fork(repo: Repository) -> None:
    ids = [(await repo.episodes.create_episode(task_id="t", metadata={})).id for _ in range(5)]
    for episode_id in ids:
        await _record(repo, episode_id)
        await repo.episodes.set_reward(episode_id, reward=1.0, call_rewards=None, metadata=None)
    fork = await repo.forks.create(ids[0], at=1, size=1, rule="sample", metadata={})
    assert [(await repo.retention.purge(before=time.time() + 1, limit=2)).episodes for _ in range(3)] == [2, 2, 0]
    assert (await repo.episodes.get_episode(ids[0], with_calls=False)).purged_at is None  # its fork replays it
    await repo.episodes.abandon((fork.episodes or [])[0].id, reason="done")  # its group: failed
    assert (await repo.retention.purge(before=time.time() + 1, limit=2)).episodes == 2
    # A purged episode has nothing left to replay: it cannot be forked.
    with pytest.raises(Conflict) as refused:
        await repo.forks.create(ids[0], at=1, size=1, rule="sample", metadata={})
    assert refused.value.code == "episode_purged"


async def test_a_purged_episode_is_never_handed_to_the_trainer_as_trainable(store_url: str) -> None:
    from trainer.counters import DataStats
    from trainer.turns import member_turns

    async with running_app(make_settings(store_url)) as client:
        repo = client.app.state.services.repo  # type: ignore[attr-defined]
        trained = await _acked(repo)
        whole = Episode.model_validate((await client.get(f"/episodes/{trained[0]}", headers=ADMIN)).json())
        assert len(member_turns(whole)) == 2  # whole, both calls are turns

        answer = await client.post("/retention/purge", json={"older_than_s": 1e-6}, headers=ADMIN)
        assert answer.status_code == 200, answer.text
        assert answer.json()["episodes"] == 2 and answer.json()["calls"] == 4
        purged = Episode.model_validate((await client.get(f"/episodes/{trained[0]}", headers=ADMIN)).json())
        assert purged.purged_at is not None

        def retokenize(call: Any) -> None:
            raise AssertionError("a purged call must not be rebuilt from its (empty) messages")

        stats = DataStats()
        assert member_turns(purged, retokenize=retokenize, stats=stats) == []
        assert (stats.calls, stats.calls_purged, stats.calls_failed, stats.calls_dropped_inexact) == (2, 2, 0, 0)
        # The warm start's supervised turns (episodes it lists, not claims) drop them alike.
        supervised = DataStats()
        assert member_turns(purged, retokenize=retokenize, stats=supervised, supervised=True) == []
        assert supervised.calls_purged == 2
        # Nor is it in a claim: its group was trained, and claims take pending groups only.
        claim = await client.post("/trainer/claim", json={"trainer_id": "t", "max_groups": 8}, headers=ADMIN)
        assert claim.json()["groups"] == []

        export = await client.get("/ui/export", params={"format": "jsonl"}, headers=ADMIN)
        rows = {row["episode_id"]: row for row in map(json.loads, export.text.splitlines())}
        row = rows[trained[0]]
        assert row["purged_at"] == purged.purged_at and row["reward"] == 1.0 and row["messages"] == []
        assert [(c["trained"], c["prompt_token_ids"], c["choices"][0]["token_ids"]) for c in row["calls"]] == [
            (False, [], []),
            (False, [], []),
        ]
        page = await client.get(f"/ui/episodes/{trained[0]}", headers=ADMIN)
        assert page.status_code == 200 and "<dt>purged (UTC)</dt>" in page.text


async def test_the_sweeper_purges_in_the_background_once_a_ttl_is_set(store_url: str) -> None:
    settings = make_settings(store_url, retention={"bodies_ttl_s": 0.05, "interval_s": 0.05})
    async with running_app(settings) as client:
        repo = client.app.state.services.repo  # type: ignore[attr-defined]
        trained = await _acked(repo)
        deadline = time.monotonic() + 10
        while (await repo.episodes.get_episode(trained[1], with_calls=False)).purged_at is None:
            assert time.monotonic() < deadline, "the sweeper never purged the trained group"
            await asyncio.sleep(0.05)
        audit = await client.get("/retention/audit", headers=ADMIN)
        assert {e["actor"] for e in audit.json()["data"]} == {"retention"}


# -- delete on request -------------------------------------------------------------------------------


async def test_a_deleted_episode_is_gone_from_every_table_and_the_export(store_url: str) -> None:
    async with running_app(make_settings(store_url)) as client:
        repo: Repository = client.app.state.services.repo  # type: ignore[attr-defined]
        ids = await _group(repo, (1.0, 0.0, 0.5))
        target = ids[0]
        group_id = (await repo.episodes.get_episode(target, with_calls=False)).group_id or ""
        # Its fork replays its calls: their copies are its content too, and go with it.
        fork = await repo.forks.create(target, at=1, size=2, rule="sample", metadata={})
        for episode in fork.episodes or []:
            await _record(repo, episode.id)
            await repo.episodes.set_reward(episode.id, reward=1.0, call_rewards=None, metadata=None)
        # Before: its row and its forks' (``fork_of``), its calls, and the fork group's metadata name it.
        assert await _rows_with(store_url, target) == {"episodes": 3, "calls": 2, "groups": 1}

        answer = await client.delete(f"/episodes/{target}", headers=ADMIN)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        forks = [e.id for e in fork.episodes or []]
        assert body["episodes"] == [target, *sorted(forks)] and body["forks"] == 2 and body["calls"] == 6
        assert body["groups_deleted"] == [fork.id] and body["groups_changed"] == [group_id]

        # Every table: only the audit entry of the deletion names it.
        assert await _rows_with(store_url, target) == {"audit_log": 1}
        for gone in [*forks, fork.id]:
            assert await _rows_with(store_url, gone) == {}
        missing = await client.get(f"/episodes/{target}", headers=ADMIN)
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
        export = await client.get("/ui/export", params={"format": "jsonl"}, headers=ADMIN)
        exported = {json.loads(line)["episode_id"] for line in export.text.splitlines()}
        assert exported == set(ids[1:])
        # Its group keeps the others, sized to them.
        group = (await client.get(f"/groups/{group_id}", headers=ADMIN)).json()
        assert (group["size"], group["status"], group["counts"]) == (2, "complete", {"rewarded": 2})

        [entry] = (await client.get("/retention/audit", headers=ADMIN)).json()["data"]
        key_id = hashlib.sha256(ADMIN_KEY.encode()).hexdigest()[:16]
        assert (entry["actor"], entry["action"], entry["target"]) == (f"admin:{key_id}", "delete_episode", target)
        assert entry["rows"] == 6 + 3 + 1 and entry["detail"]["forks"] == 2
        assert ADMIN_KEY not in json.dumps(entry)


async def test_a_deleted_open_episode_takes_no_more_calls(store_url: str) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    chat = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with running_app(make_settings(store_url), transport=fake_upstream(seen)) as client:
        group = await new_group(client, size=2)
        episode_id = group["episode_keys"][0]["id"]
        url = f"/episodes/{episode_id}/v1/chat/completions"
        assert (await client.post(url, json=chat, headers=episode_auth(group))).status_code == 200
        asked = len(seen)
        deleted = await client.delete(f"/episodes/{episode_id}", headers=ADMIN)
        assert deleted.status_code == 200 and deleted.json()["calls"] == 1
        # Refused at once (the gate forgot it was open), never sent to the engine nor recorded.
        late = await client.post(url, json=chat, headers=episode_auth(group))
        assert late.status_code == 404 and late.json()["error"]["code"] == "episode_not_found"
        assert len(seen) == asked
        left = (await client.get(f"/groups/{group['id']}", headers=ADMIN)).json()
        assert (left["size"], left["status"], left["counts"]) == (1, "open", {"open": 1})


async def test_a_users_episodes_are_deleted_on_request(store_url: str) -> None:
    settings = make_settings(store_url, retention={"user_key": "end_user"})
    async with running_app(settings) as client:
        repo: Repository = client.app.state.services.repo  # type: ignore[attr-defined]
        group = await repo.episodes.create_group(
            task_id="t", size=2, metadata={}, episode_metadata=[{"end_user": "alice"}, {"end_user": "bob"}]
        )
        in_group = [e.id for e in group.episodes or []]
        alone = [
            (await repo.episodes.create_episode(task_id="t", metadata={"end_user": u})).id for u in ("alice", "al")
        ]
        for episode_id in [*in_group, *alone]:
            await _record(repo, episode_id)
        proxy = AsyncProxyClient("http://proxy", ADMIN_KEY, transport=httpx.ASGITransport(app=client.app))  # type: ignore[attr-defined]
        try:
            deleted = await proxy.delete_user("alice")
            assert sorted(deleted.episodes) == sorted([in_group[0], alone[0]]) and deleted.calls == 4
            assert deleted.groups_changed == [group.id] and deleted.groups_deleted == []
            again = await proxy.delete_user("alice")  # nothing more: a repeat is harmless
            assert again.episodes == [] and again.calls == 0
            left = await repo.episodes.get_group(group.id)
            assert [e.id for e in left.episodes or []] == [in_group[1]] and left.size == 1 and left.status == "open"
            assert (await repo.episodes.get_episode(alone[1])).metadata == {"end_user": "al"}
            entries = await proxy.audit_log()
            assert [(e.action, e.target, e.rows) for e in entries] == [
                ("delete_user", "user:alice", 0),
                ("delete_user", "user:alice", 4 + 2),
            ]
            one = await proxy.delete_episode(alone[1])
            assert one.episodes == [alone[1]] and one.audit_id == (await proxy.audit_log(limit=1))[0].id
            assert [e.action for e in await proxy.audit_log(before_id=one.audit_id)] == ["delete_user"] * 2
        finally:
            await proxy.aclose()
        assert await _rows_with(store_url, SECRET) == {"calls": 1}  # bob's first call (the second is a delta)


async def test_a_group_that_loses_members_keeps_consistent_counts(repo: Repository) -> None:
    # An open group whose last open member is deleted completes, as a reward would complete it.
    completes = await _group(repo, (1.0, 0.0, None))
    await repo.retention.delete_episode(completes[2], actor="admin:test")
    group = await repo.episodes.get_group((await repo.episodes.get_episode(completes[0])).group_id or "")
    assert (group.size, group.status, group.counts) == (2, "complete", {"rewarded": 2})
    assert group.completed_at is not None
    # A complete group pending training whose rewarded members no longer suffice (2 of its 2 left)
    # fails: the trainer never gets it.
    fails = await _group(repo, (1.0, 0.0, None))
    await repo.episodes.abandon(fails[2], reason="gave up")
    await repo.retention.delete_episode(fails[0], actor="admin:test")
    group = await repo.episodes.get_group((await repo.episodes.get_episode(fails[1])).group_id or "")
    assert (group.size, group.status, group.train_status) == (2, "failed", "pending")
    assert group.counts == {"rewarded": 1, "abandoned": 1}
    # A trained group keeps its history.
    trained = await _acked(repo)
    await repo.retention.delete_episode(trained[0], actor="admin:test")
    group = await repo.episodes.get_group((await repo.episodes.get_episode(trained[1])).group_id or "")
    assert (group.size, group.status, group.train_status, group.trained_step) == (1, "complete", "trained", 1)
    # A group left without members is deleted with its last one.
    [last] = await _group(repo, (1.0,))
    group_id = (await repo.episodes.get_episode(last)).group_id or ""
    deleted = await repo.retention.delete_episode(last, actor="admin:test")
    assert deleted.groups_deleted == [group_id] and deleted.groups_changed == []
    assert group_id not in {g.id for g in await repo.episodes.list_groups()}
    # A lapsed lease on a pending group is cleared: its trainer learns it lost the group.
    lapsed = await _group(repo, (1.0, 0.0, 1.0))
    lapsed_group = (await repo.episodes.get_episode(lapsed[0], with_calls=False)).group_id or ""
    claim = await repo.leases.claim(owner="t", max_groups=10, lease_s=0.01, max_staleness=None, current_version=0)
    assert lapsed_group in [g.id for g in claim.groups]
    await asyncio.sleep(0.05)
    await repo.retention.delete_episode(lapsed[2], actor="admin:test")
    with pytest.raises(Conflict) as lost:
        await repo.leases.renew(lease_id=claim.lease_id, group_ids=[lapsed_group], lease_s=60)
    assert lost.value.code == "lease_lost"
    again = await repo.leases.claim(owner="t", max_groups=10, lease_s=60, max_staleness=None, current_version=0)
    assert {g.id: len(g.episodes or []) for g in again.groups}[lapsed_group] == 2


async def test_refusals_are_in_the_error_shape_and_delete_nothing(store_url: str) -> None:
    async with running_app(make_settings(store_url)) as client:
        repo: Repository = client.app.state.services.repo  # type: ignore[attr-defined]
        unknown = await client.delete("/episodes/00000000-0000-0000-0000-000000000000", headers=ADMIN)
        assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
        bad = await client.delete("/episodes/not-an-id", headers=ADMIN)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "episode_id"
        no_user = await client.delete("/episodes", headers=ADMIN)
        assert no_user.status_code == 400 and no_user.json()["error"]["type"] == "invalid_request_error"
        for user in ("", "a\x00b"):
            assert (await client.delete("/episodes", params={"user": user}, headers=ADMIN)).status_code == 400
        agent = {"authorization": "Bearer agent-key-0123456789abcdef"}
        denied = await client.delete("/episodes", params={"user": "alice"}, headers=agent)
        assert denied.status_code == 403 and denied.json()["error"]["code"] == "admin_only"
        no_ttl = await client.post("/retention/purge", headers=ADMIN)
        assert no_ttl.status_code == 400 and no_ttl.json()["error"]["param"] == "older_than_s"
        negative = await client.post("/retention/purge", json={"older_than_s": -1}, headers=ADMIN)
        assert negative.status_code == 400

        # An episode in a group under a live lease: 409, and nothing is deleted.
        ids = await _group(repo, (1.0, 0.0))
        leased = await client.post("/trainer/claim", json={"trainer_id": "t", "max_groups": 1}, headers=ADMIN)
        assert len(leased.json()["groups"]) == 1
        refused = await client.delete(f"/episodes/{ids[0]}", headers=ADMIN)
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "group_leased"
        assert len((await repo.episodes.get_episode(ids[0])).calls or []) == 2
        assert (await client.get("/retention/audit", headers=ADMIN)).json()["data"] == []


# -- the store shrinks ---------------------------------------------------------------------------------


def _file_size(path: str) -> int:
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return os.path.getsize(path)


async def _lone_finished(repo: Repository, n: int, size: int) -> list[str]:
    ids = []
    for _ in range(n):
        episode_id = (await repo.episodes.create_episode(task_id="t", metadata={"user": "u"})).id
        await _record(repo, episode_id, size=size)
        await repo.episodes.set_reward(episode_id, reward=1.0, call_rewards=None, metadata=None)
        ids.append(episode_id)
    return ids


@pytest.mark.parametrize("action", ["purge", "delete"])
async def test_what_a_purge_or_deletion_frees_is_reused_or_returned(
    repo: Repository, store_url: str, action: str
) -> None:
    if not is_sqlite(store_url):
        # PostgreSQL: the rows are gone (autovacuum reuses their space); counted, not measured.
        await _lone_finished(repo, 3, 1000)
        if action == "purge":
            await repo.retention.purge(before=time.time() + 1, limit=100)
            assert await _rows_with(store_url, SECRET) == {}
        else:
            await repo.retention.delete_user("u", key="user", actor="admin:test")
            assert await repo.calls.count() == 0 and await repo.episodes.list_episodes() == []
        return
    path = sqlite_file(store_url) or ""
    empty = _file_size(path)
    await _lone_finished(repo, 30, 20_000)
    full = _file_size(path)
    grown = full - empty
    assert grown > 30 * 20_000  # each episode's second call is stored as a delta on its first
    if action == "purge":
        await repo.retention.purge(before=time.time() + 1, limit=1000)
    else:
        await repo.retention.delete_user("u", key="user", actor="admin:test")
    await _lone_finished(repo, 30, 20_000)
    # The same data again fits in the pages the first lot freed: the file grows by a fraction of it.
    assert _file_size(path) - full < grown / 4

    # With incremental auto-vacuum (set once, offline) the file itself shrinks.
    assert await repo.retention.reclaim() == 0  # not set: the freed pages wait for new rows
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA auto_vacuum=INCREMENTAL")
        db.execute("VACUUM")
    before = _file_size(path)
    if action == "purge":
        await repo.retention.purge(before=time.time() + 1, limit=1000)
    else:
        await repo.retention.delete_user("u", key="user", actor="admin:test")
    assert await repo.retention.reclaim() > 0
    assert _file_size(path) < before / 2
    assert await repo.retention.reclaim() == 0
