"""``make run``'s group counts (``deploy/groups.py``) from a real store state, read through the in-process proxy.

The store is brought to a known mix (trained, stale, skipped for equal rewards, failed, still
pending, still open) by the proxy's own routes and the repository; the report must count each.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from deploy.groups import group_counts, workflow_summary
from proxy.store.db import migrate_async
from proxy.store.repository import Repository
from tests.proxy.conftest import ADMIN, make_settings, running_app
from tests.proxy.test_store import call


async def _group(client: httpx.AsyncClient, repo: Repository, rewards: tuple[float | None, ...]) -> str:
    """A group whose episodes each made one call at policy v0, then got ``rewards`` (None: abandoned)."""
    group = (await client.post("/groups", json={"task_id": "t", "size": len(rewards)}, headers=ADMIN)).json()
    for key, reward in zip(group["episode_keys"], rewards, strict=True):
        await repo.insert_calls([call(key["id"], version=0)])
        if reward is None:
            await client.post(f"/episodes/{key['id']}/abandon", json={"reason": "scripted"}, headers=ADMIN)
        else:
            await client.post(f"/episodes/{key['id']}/reward", json={"reward": reward}, headers=ADMIN)
    return str(group["id"])


async def _claim(client: httpx.AsyncClient, n: int, max_staleness: int) -> dict[str, Any]:
    body = {"trainer_id": "t", "max_groups": n, "max_staleness": max_staleness, "groups_per_step": 2}
    return dict((await client.post("/trainer/claim", json=body, headers=ADMIN)).json())


async def test_the_report_counts_every_group_by_what_became_of_it(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'flywheel.db'}"
    await migrate_async(url)
    repo = Repository(url)
    settings = make_settings(url, admission={"max_backlog_groups": 6, "retry_after_s": 2})
    try:
        async with running_app(settings) as client:
            stale = await _group(client, repo, (1.0, 0.0))
            await repo.add_policy_version(version=2, name="policy-v2", adapter_path="/a", metadata={})
            # two versions later, a trainer that takes nothing older than 1 version marks it stale
            assert (await _claim(client, 2, max_staleness=1))["stale"] == 1
            trained, equal = await _group(client, repo, (1.0, 0.0)), await _group(client, repo, (1.0, 1.0))
            await _group(client, repo, (1.0, None))  # one rewarded of two: failed (min_rewarded 2)
            claim = await _claim(client, 2, max_staleness=5)
            assert sorted(g["id"] for g in claim["groups"]) == sorted([trained, equal])
            for status, ids in (("trained", [trained]), ("skipped", [equal])):
                body = {"lease_id": claim["lease_id"], "group_ids": ids, "step": 1, "status": status}
                assert (await client.post("/trainer/ack", json=body, headers=ADMIN)).status_code == 200
            await _claim(client, 2, max_staleness=5)  # the next step's claim: nothing complete yet
            await _group(client, repo, (0.0, 1.0))  # complete, not yet claimed
            statuses = [
                (await client.post("/groups", json={"task_id": "t", "size": 2}, headers=ADMIN)).status_code
                for _ in range(6)  # still running; with the one pending, the 6th would be the 7th ahead
            ]
            assert statuses == [201] * 5 + [429]
            admission = (await client.get("/trainer/admission", headers=ADMIN)).json()
    finally:
        await repo.close()
    steps = [{"step": 1, "metrics": {"data/groups_skipped_equal": 1, "data/groups_trained": 1}}]
    log = tmp_path / "workflow.log"
    summary = {"workflow": "math", "groups": 7, "admission_waits": 4, "admission_wait_s": 8.0}
    log.write_text("[12:00:00] abandoned e1 (t): timeout\n" + json.dumps(summary) + "\n  stopping\n")
    counts = group_counts(admission, steps, workflow_summary(log))
    assert counts == {
        "generated": 10,
        "trained": 1,
        "skipped_stale": 1,
        "skipped_equal": 1,
        "skipped_other": 0,
        "failed": 1,
        "left_pending": 1,
        "left_open": 5,
        "stale_fraction": 0.1,
        "admission_limit": 6,
        "admission_refusals": 1,
        "admission_waits": 4,
        "admission_wait_s": 8.0,
    }
    assert stale  # the stale group is the one counted under skipped_stale


def test_missing_sources_are_reported_as_unknown_not_zero(tmp_path: Path) -> None:
    counts = group_counts({}, [], workflow_summary(tmp_path / "no-such.log"))
    assert counts["generated"] is None and counts["skipped_stale"] is None and counts["stale_fraction"] is None
    assert counts["admission_refusals"] is None and counts["admission_waits"] is None
