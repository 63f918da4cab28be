"""``make run``'s group counts (``deploy/groups.py``) from a store of known outcomes, read through a
real proxy process exactly as the launcher reads it (the contract's client), and checked against
the store itself.

The store is brought to a known mix (trained, stale, skipped for each of the trainer's reasons and
for one it did not give, a teacher's group, failed, still pending, still open) by the proxy's own
routes and the repository; each skip is acked with the typed reason and note the trainer's own
``build_batch`` gives it. No model call is made: the calls are written into the store directly, so
the proxy routes to no engine at all.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import httpx
import pytest

from contract.client import Episode, Group
from contract.vocabulary import SkipCount
from deploy import groups as report
from proxy.store.repository import Repository
from tests.proxy.test_store import call as stored_call
from tests.support.services import ADMIN_KEY, ProxyProcess, serving_proxy
from tests.trainer.test_data import FAILED_ALIKE, SYSTEM, call, group, shaped, untrainable_group
from tests.trainer.test_late import timed_group
from trainer.data import Late, build_batch
from trainer.learner import StepStats
from trainer.loop import step_metrics
from trainer.members import Rules

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
NO_ENGINE = "http://127.0.0.1:9"
"""Nothing listens there: this test makes no model call."""
TEACHERS = json.dumps([{"name": "demo", "url": NO_ENGINE, "model": "demonstrator"}])
"""A teacher the proxy serves; its group is skipped by the claim, never called."""


def _skips() -> list[tuple[str | None, str]]:
    """(typed reason, note) of each skip the trainer acks, from its own ``build_batch`` (and its
    non-finite step), and one acked without a reason (a trainer before reasons were typed)."""
    groups = [group("g-equal", [1.0, 1.0, 1.0]), group("g-few", [1.0], abandoned=1), untrainable_group("g-empty")]
    batch = build_batch(groups, max_seq_len=64)
    shaping = build_batch([shaped("g-shaping", FAILED_ALIKE)], rules=Rules(turn_credit="discounted"))
    zeros = build_batch([group("g-zeros", [0.0, 0.0])], max_seq_len=64)
    past = Late(current_version=1, staleness_bound=1, after_s=float("inf"), max_versions=0)  # awaited, a version behind
    late = build_batch([timed_group("g-late", version=0, started_at=0.0, awaited=True)], late=past)
    made = [
        (batch, "g-equal"), (zeros, "g-zeros"), (shaping, "g-shaping"), (batch, "g-few"), (batch, "g-empty"),
        (late, "g-late"),
    ]  # fmt: skip
    return [
        *((b.reasons[g], b.skipped[g]) for b, g in made),
        ("nonfinite", "non-finite gradient (grad_norm=nan)"),  # trainer/loop.py, Trainer._drop_nonfinite
        (None, "a reason no report knows yet"),
    ]


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[ProxyProcess]:
    env = {
        "FLYWHEEL_ADMISSION__MAX_BACKLOG_GROUPS": "11",
        "FLYWHEEL_ADMISSION__RETRY_AFTER_S": "2",
        "FLYWHEEL_TEACHERS": TEACHERS,
    }
    with serving_proxy(NO_ENGINE, tmp_path, **env) as process:
        yield process


def _post(proxy: ProxyProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{proxy.url}{path}", json=body, headers=ADMIN, timeout=30)


async def _group(
    proxy: ProxyProcess, repo: Repository, rewards: tuple[float | None, ...], calls: int = 1, **metadata: Any
) -> str:
    """A group whose episodes each made ``calls`` calls at policy v0, then got ``rewards`` (None: abandoned)."""
    created = _post(proxy, "/groups", {"task_id": "t", "size": len(rewards), "metadata": metadata})
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


def _ack(proxy: ProxyProcess, lease_id: str, ids: list[str], status: str, reason: str | None, note: str | None) -> None:
    body = {"lease_id": lease_id, "group_ids": ids, "step": 1, "status": status, "reason": reason, "note": note}
    assert _post(proxy, "/trainer/ack", body).status_code == 200


async def _known_store(proxy: ProxyProcess, skips: list[tuple[str | None, str]]) -> None:
    """1 stale, 1 trained, one skipped per skip, 1 teacher's, 1 failed, 1 pending, 10 open (the 11th refused)."""
    repo = Repository(proxy.store_url)
    try:
        await _group(proxy, repo, (1.0, 0.0))
        await repo.versions.add(version=2, name="policy-v2", adapter_path="/a", metadata={})
        assert _claim(proxy, 2, max_staleness=1)["stale"] == 1  # two versions behind, one allowed
        trained = await _group(proxy, repo, (1.0, 0.0), calls=2)
        skipped = {await _group(proxy, repo, (1.0, 1.0)): skip for skip in skips}
        await _group(proxy, repo, (1.0, 0.0), source="teacher:demo")  # skipped by the claim: never trained
        await _group(proxy, repo, (1.0, None))  # one rewarded of two: failed (min_rewarded 2)
        claim = _claim(proxy, 10, max_staleness=5)
        assert sorted(g["id"] for g in claim["groups"]) == sorted([trained, *skipped])
        _ack(proxy, claim["lease_id"], [trained], "trained", None, None)
        for group_id, (reason, note) in skipped.items():  # as the trainer acks: one reason and note per group
            _ack(proxy, claim["lease_id"], [group_id], "skipped", reason, note)
        _claim(proxy, 2, max_staleness=5)  # the next step's claim: nothing complete yet
        await _group(proxy, repo, (0.0, 1.0))  # complete, not yet claimed
    finally:
        await repo.close()
    statuses = [_post(proxy, "/groups", {"task_id": "t", "size": 2}).status_code for _ in range(11)]
    assert statuses == [201] * 10 + [429]  # still running; with the one pending, the 11th would be the 12th ahead


async def test_the_report_counts_every_group_by_what_became_of_it_as_the_store_holds_it(
    proxy: ProxyProcess, tmp_path: Path
) -> None:
    await _known_store(proxy, _skips())
    read = report.skips(proxy.url, ADMIN_KEY)
    assert read is not None and read.other_notes == ["a reason no report knows yet"]
    assert report.skip_notes is report.skips  # the name deploy/loop.py calls
    log = tmp_path / "workflow.log"
    summary = {"workflow": "math", "groups": 7, "admission_waits": 4, "admission_wait_s": 8.0}
    log.write_text("[12:00:00] abandoned e1 (t): timeout\n" + json.dumps(summary) + "\n  stopping\n")
    counts = report.group_counts(report.admission_state(proxy.url, ADMIN_KEY), read, report.workflow_summary(log))
    assert counts == {
        "generated": 23,
        "trained": 1,
        "skipped": 9,
        "skipped_stale": 1,
        "skipped_equal": 2,
        "skipped_shaping_only": 1,
        "skipped_few": 1,
        "skipped_empty": 1,
        "skipped_nonfinite": 1,
        "skipped_teacher": 1,
        "skipped_late": 1,
        "skipped_other": 1,
        "skipped_other_notes": ["a reason no report knows yet"],
        "failed": 1,
        "left_pending": 1,
        "left_open": 10,
        "stale_fraction": round(1 / 23, 4),
        "admission_limit": 11,
        "admission_refusals": 1,
        "admission_waits": 4,
        "admission_wait_s": 8.0,
    }
    # The same numbers as the store itself holds.
    with sqlite3.connect(tmp_path / "flywheel.db") as db:
        outcomes = dict(db.execute("select train_status, count(*) from groups where status = 'complete' group by 1"))
        reasons = dict(
            db.execute("select train_reason, count(*) from groups where train_status = 'skipped' group by 1")
        )
        by_status = dict(db.execute("select status, count(*) from groups group by 1"))
    assert outcomes == {"trained": 1, "skipped": 9, "stale": 1, "pending": 1}
    assert by_status == {"complete": 12, "failed": 1, "open": 10}
    skip_keys = [k for k in get_args(SkipCount) if k != "stale"]
    assert {k: counts[f"skipped_{k}"] for k in skip_keys} == {r or "other": n for r, n in reasons.items()}
    assert sum(counts[f"skipped_{k}"] for k in skip_keys) == counts["skipped"]
    printed = report.summary(counts, 1.0)
    assert "23 generated, 1 trained (1.0 calls per trained episode), 1 skipped stale" in printed
    assert (
        "9 skipped by the trainer: 2 equal rewards, 1 equal outcomes (shaping alone), 1 too few members, "
        "1 no trainable tokens" in printed
    )
    assert (
        "1 non-finite gradient, 1 teacher demonstrations, 1 late past the age limit, 1 other; 1 failed, "
        "1 left pending, 10 left open" in printed
    )


def test_the_report_has_a_count_for_every_reason_a_group_is_skipped_for() -> None:
    """A reason added to the vocabulary without its ``skipped_<reason>`` key would never be reported."""
    stored = {k: n for n, k in enumerate(get_args(SkipCount), 1) if k != "stale"}  # each its own count
    counts = report.group_counts(None, report.Skips(stored, []), {})
    assert {k: counts[f"skipped_{k}"] for k in stored} == stored
    assert "skipped_stale" in counts  # from the admission's groups by outcome


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
    assert report.admission_state(NO_ENGINE, ADMIN_KEY) is None
    assert report.skips(NO_ENGINE, ADMIN_KEY) is None
    counts = report.group_counts(None, None, report.workflow_summary(tmp_path / "no-such.log"))
    assert counts["generated"] is None and counts["skipped_stale"] is None and counts["stale_fraction"] is None
    assert counts["skipped_equal"] is None and counts["skipped_other"] is None and counts["skipped_teacher"] is None
    assert counts["admission_refusals"] is None and counts["admission_waits"] is None
    assert counts["skipped_other_notes"] == []
