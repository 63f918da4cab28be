"""Why a group was never trained, as a value (issue 48): the ack's typed ``reason`` and the claim's
own (``stale``, ``teacher``) kept in ``groups.train_reason``, filtered by (``GET /groups``) and
counted by in one query (``GET /groups/skips``), through the routes and the contract's client; old
rows get theirs from their notes once, in migration 0011. SQLite and PostgreSQL, no model call."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from contract.client import AsyncProxyClient
from proxy.store.db import alembic_config, migrate_async
from proxy.store.repository import Repository
from tests.proxy.conftest import ADMIN, ADMIN_KEY, make_settings, new_group, running_app
from tests.proxy.test_store import call

TEACHERS = [{"name": "demo", "url": "http://teacher", "model": "demonstrator"}]
"""A teacher the proxy serves: its groups are skipped by the claim (never called here)."""


async def _rewarded(client: httpx.AsyncClient, metadata: dict[str, Any] | None = None) -> str:
    """A complete group of two episodes rewarded 1 and 0 (no calls: none is needed to ack it)."""
    created = await client.post("/groups", json={"task_id": "t", "size": 2, "metadata": metadata or {}}, headers=ADMIN)
    assert created.status_code == 201, created.text
    for key, reward in zip(created.json()["episode_keys"], (1.0, 0.0), strict=True):
        response = await client.post(f"/episodes/{key['id']}/reward", json={"reward": reward}, headers=ADMIN)
        assert response.status_code == 200, response.text
    return str(created.json()["id"])


async def _stale_group(store_url: str) -> str:
    """A complete group whose calls v1 served, found stale by a claim at v5 (``max_staleness`` 1)."""
    repo = Repository(store_url, min_rewarded=2)
    try:
        group = await repo.episodes.create_group(task_id="t", size=2, metadata={})
        for episode, reward in zip(group.episodes or [], (1.0, 0.0), strict=True):
            await repo.calls.insert([call(episode.id, version=1)])
            await repo.episodes.set_reward(episode.id, reward=reward, call_rewards=None, metadata=None)
        claim = await repo.leases.claim(owner="t", max_groups=1, lease_s=60, max_staleness=1, current_version=5)
        assert claim.groups == [] and claim.stale == 1
    finally:
        await repo.close()
    return group.id


async def test_each_skip_keeps_its_typed_reason_and_is_filtered_and_counted_by_it(store_url: str) -> None:
    stale = await _stale_group(store_url)
    async with running_app(make_settings(store_url, teachers=TEACHERS)) as client:
        transport = httpx.ASGITransport(app=client.app)  # type: ignore[attr-defined]
        proxy = AsyncProxyClient("http://proxy", ADMIN_KEY, transport=transport)
        equal, few, unsaid, trained = [await _rewarded(client) for _ in range(4)]
        teacher = await _rewarded(client, {"source": "teacher:demo"})
        claim = await proxy.claim(trainer_id="t", max_groups=10, lease_s=60, max_staleness=None)
        assert sorted(g.id for g in claim.groups) == sorted([equal, few, unsaid, trained])  # never the teacher's
        ack: dict[str, Any] = {"lease_id": claim.lease_id, "group_ids": [equal], "step": 1}

        # An unknown reason, one only the proxy gives, and a reason on a trained ack: 400, nothing acked.
        for body, message in (
            ({"status": "skipped", "reason": "bored"}, "Input should be 'equal'"),
            ({"status": "skipped", "reason": "stale"}, "Input should be 'equal'"),
            ({"status": "trained", "reason": "equal"}, "a reason is for a skipped ack"),
        ):
            refused = await client.post("/trainer/ack", json={**ack, **body}, headers=ADMIN)
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert (error["type"], error["param"]) == ("invalid_request_error", "reason")
            assert message in error["message"]
        assert (await proxy.group(equal)).train_status == "pending"

        [acked] = await proxy.ack(
            lease_id=claim.lease_id, group_ids=[equal], step=1, status="skipped", reason="equal", note="all 2 equal"
        )
        assert (acked.train_status, acked.train_reason, acked.train_note) == ("skipped", "equal", "all 2 equal")
        await proxy.ack(lease_id=claim.lease_id, group_ids=[few], step=1, status="skipped", reason="few")
        await proxy.ack(lease_id=claim.lease_id, group_ids=[unsaid], step=1, status="skipped", note="why not")
        await proxy.ack(lease_id=claim.lease_id, group_ids=[trained], step=1, status="trained")
        # An ack retried (same lease and step) is a no-op that keeps the reason.
        [again] = await proxy.ack(lease_id=claim.lease_id, group_ids=[few], step=1, status="skipped", reason="few")
        assert again.train_reason == "few"

        reasons = {g: (await proxy.group(g)).train_reason for g in (equal, few, unsaid, trained, teacher, stale)}
        assert reasons == {
            equal: "equal",
            few: "few",
            unsaid: None,
            trained: None,
            teacher: "teacher",
            stale: "stale",
        }
        teacher_note = (await proxy.group(teacher)).train_note or ""
        assert teacher_note.startswith("teacher:demo: demonstrations")

        for reason, expected in (
            ("equal", [equal]),
            ("few", [few]),
            ("teacher", [teacher]),
            ("stale", [stale]),
            ("other", [unsaid]),
            ("nonfinite", []),
        ):
            assert [g.id for g in await proxy.groups(train_reason=reason)] == expected, reason  # type: ignore[arg-type]
        assert [g.id for g in await proxy.groups(train_status="skipped", train_reason="other")] == [unsaid]
        bad = await client.get("/groups", params={"train_reason": "bored"}, headers=ADMIN)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "train_reason"

        counted = {"equal": 1, "few": 1, "other": 1, "teacher": 1, "stale": 1}
        assert await proxy.skip_counts() == counted
        raw = await client.get("/groups/skips", headers=ADMIN)
        assert raw.status_code == 200 and raw.json() == counted
        assert (await client.get("/groups/skips")).status_code == 401  # admin only, like every control route
        await proxy.aclose()


async def test_the_store_keeps_a_reason_for_skips_only(store_url: str) -> None:
    repo = Repository(store_url, min_rewarded=2)
    try:
        ids = []
        for _ in range(2):
            group = await repo.episodes.create_group(task_id="t", size=2, metadata={})
            for episode, reward in zip(group.episodes or [], (1.0, 0.0), strict=True):
                await repo.episodes.set_reward(episode.id, reward=reward, call_rewards=None, metadata=None)
            ids.append(group.id)
        claim = await repo.leases.claim(owner="t", max_groups=2, lease_s=60, max_staleness=None, current_version=0)
        skipped, trained = ids
        await repo.leases.ack(
            lease_id=claim.lease_id, group_ids=[skipped], step=1, status="skipped", reason="nonfinite", note="nan"
        )
        # A reason handed with a trained ack (the route refuses it) is never stored.
        await repo.leases.ack(lease_id=claim.lease_id, group_ids=[trained], step=1, status="trained", reason="empty")
        assert (await repo.episodes.get_group(skipped)).train_reason == "nonfinite"
        assert (await repo.episodes.get_group(trained)).train_reason is None
        assert await repo.episodes.skip_counts() == {"nonfinite": 1}
        assert [g.id for g in await repo.episodes.list_groups(train_reason="nonfinite")] == [skipped]
        assert await repo.episodes.list_groups(train_reason="other") == []
    finally:
        await repo.close()


NOTES = {
    "equal": ("skipped", "all 3 rewards equal (1): no signal", "equal"),
    "shaping": (
        "skipped",
        "all 4 outcomes equal (0): per-turn returns differ by shaping alone (call rewards, turn_discount), "
        "no outcome signal (shaping=always trains on them)",
        "shaping_only",
    ),
    "few": (
        "skipped",
        "1 rewarded episodes (or penalized abandons, or rewarded choices): GRPO compares at least 2",
        "few",
    ),
    "few_old": ("skipped", "1 rewarded episodes (or penalized abandons, or rewarded choices) < min_rewarded 2", "few"),
    "empty": ("skipped", "no trainable calls (see the data counters)", "empty"),
    "nonfinite": ("skipped", "non-finite gradient (grad_norm=nan)", "nonfinite"),
    "teacher": ("skipped", "teacher:demo: demonstrations, never trained on-policy (GRPO)", "teacher"),
    "stale": ("stale", "oldest call at policy v1, current v5", "stale"),
    # A trainer before one note per group wrote its lease's reasons into every note: not one reason.
    "joined": ("skipped", "all 8 rewards equal (0): no signal; all 8 rewards equal (1): no signal", None),
    "unknown": ("skipped", "a reason no report knows yet", None),
    "lookalike": ("skipped", "2 rewarded episodes, but the judge was down", None),  # not the trainer's wording
    "trained_noted": ("trained", "no trainable calls (see the data counters)", None),  # only skips have one
    "unnoted": ("skipped", None, None),
    "trained": ("trained", None, None),
    "pending": ("pending", None, None),
}
"""(train status, note, the reason migration 0011 reads from it) of rows stored before it."""


async def test_migration_0011_reads_each_old_rows_reason_from_its_note_once(store_url: str) -> None:
    from alembic import command

    await asyncio.to_thread(command.downgrade, alembic_config(store_url), "0010")
    engine = create_async_engine(store_url)
    try:
        async with engine.begin() as conn:
            for gid, (status, note, _) in NOTES.items():
                await conn.execute(
                    text(
                        "INSERT INTO groups (id, task_id, size, metadata, status, created_at, train_status, train_note)"
                        " VALUES (:id, 't', 2, '{}', 'complete', 0, :status, :note)"
                    ),
                    {"id": gid, "status": status, "note": note},
                )
        await migrate_async(store_url)
        async with engine.connect() as conn:
            stored = dict((await conn.execute(text("SELECT id, train_reason FROM groups"))).all())
    finally:
        await engine.dispose()
    assert stored == {gid: reason for gid, (_, _, reason) in NOTES.items()}


@pytest.mark.parametrize("reason", ["other", "teacher"])
async def test_a_group_without_skips_counts_nothing(store_url: str, reason: str) -> None:
    async with running_app(make_settings(store_url)) as client:
        await new_group(client)
        assert (await client.get("/groups/skips", headers=ADMIN)).json() == {}
        listed = await client.get("/groups", params={"train_reason": reason}, headers=ADMIN)
        assert listed.status_code == 200 and listed.json()["data"] == []
