"""``make run``'s group counts (``deploy/groups.py``) from a store of known outcomes, read through a
real proxy process exactly as the launcher reads it, and checked against the store itself.

The store is brought to a known mix (trained, stale, skipped for each of the trainer's reasons,
failed, still pending, still open) by the proxy's own routes and the repository; the skip notes are
the ones the trainer's own ``build_batch`` writes. No model call is made: the calls are written into
the store directly, so the proxy routes to no engine at all.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from contract.client import Episode, Group
from deploy import groups as report
from proxy.store.repository import Repository
from tests.proxy.test_store import call as stored_call
from tests.support.services import ADMIN_KEY, ProxyProcess, serving_proxy
from tests.trainer.test_data import FAILED_ALIKE, SYSTEM, call, group, shaped, untrainable_group
from trainer.data import build_batch
from trainer.learner import StepStats
from trainer.loop import step_metrics
from trainer.members import Rules

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
NO_ENGINE = "http://127.0.0.1:9"
"""Nothing listens there: this test makes no model call."""


def _notes() -> dict[str, str]:
    """The skip notes the trainer writes, from its own ``build_batch`` (and its non-finite step)."""
    groups = [group("g-equal", [1.0, 1.0, 1.0]), group("g-few", [1.0], abandoned=1), untrainable_group("g-empty")]
    batch = build_batch(groups, max_seq_len=64)
    shaping = build_batch([shaped("g-shaping", FAILED_ALIKE)], rules=Rules(turn_credit="discounted"))
    return {
        "equal": batch.skipped["g-equal"],
        "shaping_only": shaping.skipped["g-shaping"],
        "few": batch.skipped["g-few"],
        "empty": batch.skipped["g-empty"],
        "nonfinite": "non-finite gradient (grad_norm=nan)",  # trainer/loop.py, Trainer._drop_nonfinite
        "other": "a reason no report knows yet",
        # What a trainer before one note per group wrote: its lease's reasons, in every group's note.
        "joined": "all 8 rewards equal (0): no signal; all 8 rewards equal (1): no signal",
    }


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[ProxyProcess]:
    env = {"FLYWHEEL_ADMISSION__MAX_BACKLOG_GROUPS": "10", "FLYWHEEL_ADMISSION__RETRY_AFTER_S": "2"}
    with serving_proxy(NO_ENGINE, tmp_path, **env) as process:
        yield process


def _post(proxy: ProxyProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{proxy.url}{path}", json=body, headers=ADMIN, timeout=30)


async def _group(proxy: ProxyProcess, repo: Repository, rewards: tuple[float | None, ...], calls: int = 1) -> str:
    """A group whose episodes each made ``calls`` calls at policy v0, then got ``rewards`` (None: abandoned)."""
    created = _post(proxy, "/groups", {"task_id": "t", "size": len(rewards)})
    assert created.status_code == 201, created.text
    for key, reward in zip(created.json()["episode_keys"], rewards, strict=True):
        for _ in range(calls):
            await repo.calls.insert([stored_call(key["id"], version=0)])
        if reward is None:
            assert _post(proxy, f"/episodes/{key['id']}/abandon", {"reason": "scripted"}).status_code == 200
        else:
            assert _post(proxy, f"/episodes/{key['id']}/reward", {"reward": reward}).status_code == 200
    return str(created.json()["id"])


def _claim(proxy: ProxyProcess, n: int, max_staleness: int) -> dict[str, Any]:
    body = {"trainer_id": "t", "max_groups": n, "max_staleness": max_staleness, "groups_per_step": 2}
    response = _post(proxy, "/trainer/claim", body)
    assert response.status_code == 200, response.text
    return dict(response.json())


def _ack(proxy: ProxyProcess, lease_id: str, ids: list[str], status: str, note: str | None) -> None:
    body = {"lease_id": lease_id, "group_ids": ids, "step": 1, "status": status, "note": note}
    assert _post(proxy, "/trainer/ack", body).status_code == 200


async def _known_store(proxy: ProxyProcess, notes: dict[str, str]) -> dict[str, str]:
    """1 stale, 1 trained, one skipped per note, 1 failed, 1 pending, 9 open (the 10th refused)."""
    repo = Repository(proxy.store_url)
    try:
        await _group(proxy, repo, (1.0, 0.0))
        await repo.versions.add(version=2, name="policy-v2", adapter_path="/a", metadata={})
        assert _claim(proxy, 2, max_staleness=1)["stale"] == 1  # two versions behind, one allowed
        trained = await _group(proxy, repo, (1.0, 0.0), calls=2)
        skipped = {await _group(proxy, repo, (1.0, 1.0)): note for note in notes.values()}
        await _group(proxy, repo, (1.0, None))  # one rewarded of two: failed (min_rewarded 2)
        claim = _claim(proxy, 10, max_staleness=5)
        assert sorted(g["id"] for g in claim["groups"]) == sorted([trained, *skipped])
        _ack(proxy, claim["lease_id"], [trained], "trained", None)
        for group_id, note in skipped.items():  # as the trainer acks: one note, one reason per group
            _ack(proxy, claim["lease_id"], [group_id], "skipped", note)
        _claim(proxy, 2, max_staleness=5)  # the next step's claim: nothing complete yet
        await _group(proxy, repo, (0.0, 1.0))  # complete, not yet claimed
    finally:
        await repo.close()
    statuses = [_post(proxy, "/groups", {"task_id": "t", "size": 2}).status_code for _ in range(10)]
    assert statuses == [201] * 9 + [429]  # still running; with the one pending, the 10th would be the 11th ahead
    return {gid: note for gid, note in skipped.items()}


async def test_the_report_counts_every_group_by_what_became_of_it_as_the_store_holds_it(
    proxy: ProxyProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    notes = _notes()
    await _known_store(proxy, notes)
    monkeypatch.setattr(report, "PAGE", 4)  # the skipped groups come in two pages
    read = report.skip_notes(proxy.url, ADMIN_KEY)
    assert read is not None and sorted(read) == sorted(notes.values())
    log = tmp_path / "workflow.log"
    summary = {"workflow": "math", "groups": 7, "admission_waits": 4, "admission_wait_s": 8.0}
    log.write_text("[12:00:00] abandoned e1 (t): timeout\n" + json.dumps(summary) + "\n  stopping\n")
    counts = report.group_counts(report.admission_state(proxy.url, ADMIN_KEY), read, report.workflow_summary(log))
    assert counts == {
        "generated": 20,
        "trained": 1,
        "skipped": 7,
        "skipped_stale": 1,
        "skipped_equal": 2,
        "skipped_shaping_only": 1,
        "skipped_few": 1,
        "skipped_empty": 1,
        "skipped_nonfinite": 1,
        "skipped_other": 1,
        "skipped_other_notes": ["a reason no report knows yet"],
        "failed": 1,
        "left_pending": 1,
        "left_open": 9,
        "stale_fraction": round(1 / 20, 4),
        "admission_limit": 10,
        "admission_refusals": 1,
        "admission_waits": 4,
        "admission_wait_s": 8.0,
    }
    # The same numbers as the store itself holds.
    with sqlite3.connect(tmp_path / "flywheel.db") as db:
        outcomes = dict(db.execute("select train_status, count(*) from groups where status = 'complete' group by 1"))
        stored = [n for (n,) in db.execute("select train_note from groups where train_status = 'skipped'")]
        by_status = dict(db.execute("select status, count(*) from groups group by 1"))
    assert outcomes == {"trained": 1, "skipped": 7, "stale": 1, "pending": 1}
    assert by_status == {"complete": 10, "failed": 1, "open": 9}
    assert sum(counts[f"skipped_{r}"] for r in (*report.SKIP_REASONS, "other")) == len(stored) == counts["skipped"]
    printed = report.summary(counts, 1.0)
    assert "20 generated, 1 trained (1.0 calls per trained episode), 1 skipped stale" in printed
    assert (
        "7 skipped by the trainer: 2 equal rewards, 1 equal outcomes (shaping alone), 1 too few members, "
        "1 no trainable tokens" in printed
    )
    assert "1 non-finite gradient, 1 other; 1 failed, 1 left pending, 9 left open" in printed


def test_each_skip_note_the_trainer_writes_has_its_reason() -> None:
    notes = _notes()
    assert {kind: report.skip_reason(note) for kind, note in notes.items()} == {
        "equal": "equal",
        "shaping_only": "shaping_only",
        "few": "few",
        "empty": "empty",
        "nonfinite": "nonfinite",
        "other": "other",
        "joined": "equal",
    }
    assert report.skip_reason(f"{notes['equal']}; {notes['few']}") == "other"  # two reasons: neither
    assert report.skip_reason("") == "other"


def test_calls_per_trained_episode_counts_the_trained_episodes_only() -> None:
    """A step that trained a group of 2-call episodes and skipped a group of 1-call ones: 2 calls per
    trained episode (counting the skipped group's calls too gave 3, as every call over every member)."""
    two_calls = [
        Episode(
            id=f"t-{i}",
            status="rewarded",
            reward=float(i),
            calls=[call(0, SYSTEM + [i], [20 + i, 2]), call(1, SYSTEM + [i, 20 + i, 2, 9], [30, 2])],
        )
        for i in range(2)
    ]
    groups = [Group(id="g-trained", task_id="t", status="complete", episodes=two_calls), group("g-eq", [1.0, 1.0])]
    batch = build_batch(groups, max_seq_len=64)
    assert batch.trained == ["g-trained"] and batch.skipped_equal == 1
    metrics = step_metrics(batch, groups, StepStats(), current=0, stale=0, wait_s=0.0, pass_threshold=1.0)
    assert (metrics["data/calls_trained"], metrics["data/episodes_trained"]) == (4, 2)
    assert metrics["data/calls"] / metrics["data/members"] == 3.0  # the old figure's mistake
    steps = [
        {"step": 1, "metrics": metrics},
        {"step": 2, "metrics": {"data/calls_trained": 2, "data/episodes_trained": 2}},
    ]
    assert report.calls_per_trained_episode(steps) == 1.5
    assert report.calls_per_trained_episode([{"step": 1, "metrics": {}}]) is None


def test_missing_sources_are_reported_as_unknown_not_zero(tmp_path: Path) -> None:
    counts = report.group_counts({}, None, report.workflow_summary(tmp_path / "no-such.log"))
    assert counts["generated"] is None and counts["skipped_stale"] is None and counts["stale_fraction"] is None
    assert counts["skipped_equal"] is None and counts["skipped_other"] is None
    assert counts["admission_refusals"] is None and counts["admission_waits"] is None
    assert report.skip_notes(NO_ENGINE, ADMIN_KEY) is None
