"""Admission control on ``POST /groups``, in-process on the real stores (SQLite and PostgreSQL).

A trainer states its demand when it claims; the proxy then refuses (429 ``backlog_full`` with
``Retry-After``) a group that could only be trained stale, and admits again once the trainer has
taken groups off the backlog. No model call is needed, so no upstream is ever reached.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from proxy.admission import Admission
from proxy.errors import BacklogFull
from proxy.settings import AdmissionSettings
from proxy.store.repository import Repository
from tests.proxy.conftest import ADMIN, make_settings, new_group, running_app


async def _claim(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    response = await client.post("/trainer/claim", json={"trainer_id": "t1", **body}, headers=ADMIN)
    assert response.status_code == 200, response.text
    return dict(response.json())


async def _finish(client: httpx.AsyncClient, group: dict[str, Any], rewards: tuple[float, ...] = (1.0, 0.0)) -> None:
    for key, reward in zip(group["episode_keys"], rewards, strict=True):
        response = await client.post(f"/episodes/{key['id']}/reward", json={"reward": reward}, headers=ADMIN)
        assert response.status_code == 200, response.text


async def _create(client: httpx.AsyncClient) -> httpx.Response:
    return await client.post("/groups", json={"task_id": "t", "size": 2}, headers=ADMIN)


def _refused_total(metrics: str) -> float:
    (line,) = [x for x in metrics.splitlines() if x.startswith("flywheel_admission_refused_total ")]
    return float(line.split()[1])


async def test_no_trainer_seen_means_open_admission(store_url: str) -> None:
    async with running_app(make_settings(store_url)) as client:
        for _ in range(12):
            assert (await _create(client)).status_code == 201
        state = (await client.get("/trainer/admission", headers=ADMIN)).json()
        assert state["limit"] is None and state["backlog"] == 12 and state["groups"] == {"open": 12}


async def test_a_full_backlog_is_refused_until_the_trainer_takes_groups(store_url: str) -> None:
    async with running_app(make_settings(store_url)) as client:
        await _claim(client, max_groups=2, groups_per_step=2, max_staleness=0, mode="sync")  # limit (0+1)*2*1.0
        first, second = await new_group(client), await new_group(client)
        refused = await _create(client)
        assert refused.status_code == 429
        error = refused.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "backlog_full" and error["param"] is None
        assert "2 groups are already ahead of the trainer (limit 2" in error["message"]
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        for group in (first, second):
            await _finish(client, group)
        assert (await _create(client)).status_code == 429  # complete but untrained: still ahead of the trainer
        claim = await _claim(client, max_groups=2, groups_per_step=2, max_staleness=0, mode="sync")
        assert len(claim["groups"]) == 2
        assert (await _create(client)).status_code == 429  # leased: trained on the current version, still counted
        ids = [g["id"] for g in claim["groups"]]
        ack = await client.post(
            "/trainer/ack", json={"lease_id": claim["lease_id"], "group_ids": ids, "step": 1}, headers=ADMIN
        )
        assert ack.status_code == 200, ack.text
        assert (await _create(client)).status_code == 429  # acked, but the new version is not published yet
        state = (await client.get("/trainer/admission", headers=ADMIN)).json()
        assert state["backlog"] == 0 and state["settling"] == 2
        await _claim(client, max_groups=2, groups_per_step=2, max_staleness=0, mode="sync")  # after its publish
        assert (await _create(client)).status_code == 201  # the trainer took them: room again
        state = (await client.get("/trainer/admission", headers=ADMIN)).json()
        assert state["limit"] == 2 and state["backlog"] == 1 and state["settling"] == 0 and state["refused"] == 4
        assert state["groups"] == {"trained": 2, "open": 1}
        assert state["trainers"]["t1"]["mode"] == "sync" and state["trainers"]["t1"]["groups_per_step"] == 2
        assert _refused_total((await client.get("/metrics")).text) == 4.0


async def test_the_limit_follows_staleness_groups_per_step_and_slack(sqlite_url: str) -> None:
    async with running_app(make_settings(sqlite_url, admission={"slack": 1.5})) as client:
        await _claim(client, max_groups=2, groups_per_step=2, max_staleness=1, mode="async")
        created = [(await _create(client)).status_code for _ in range(7)]
        assert created == [201] * 6 + [429]  # floor((1 + 1) * 2 * 1.5) = 6


async def test_disabled_admission_is_open_whatever_the_trainer_claims(sqlite_url: str) -> None:
    async with running_app(make_settings(sqlite_url, admission={"enabled": False})) as client:
        await _claim(client, max_groups=1, groups_per_step=1, max_staleness=0, mode="sync")
        assert [(await _create(client)).status_code for _ in range(4)] == [201] * 4
        assert _refused_total((await client.get("/metrics")).text) == 0.0


async def test_a_configured_backlog_limit_applies_before_any_trainer(sqlite_url: str) -> None:
    settings = make_settings(sqlite_url, admission={"max_backlog_groups": 2, "retry_after_s": 7})
    async with running_app(settings) as client:
        assert [(await _create(client)).status_code for _ in range(2)] == [201, 201]
        refused = await _create(client)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "7"  # no step time known yet


async def test_a_trainer_without_a_staleness_bound_leaves_admission_open(sqlite_url: str) -> None:
    async with running_app(make_settings(sqlite_url)) as client:
        await _claim(client, max_groups=1, groups_per_step=1, max_staleness=None)
        assert [(await _create(client)).status_code for _ in range(3)] == [201] * 3


async def test_claim_and_renew_validate_the_demand_fields(sqlite_url: str) -> None:
    async with running_app(make_settings(sqlite_url)) as client:
        for body in ({"groups_per_step": 0}, {"mode": "eager"}, {"groups_per_step": "many"}):
            response = await client.post("/trainer/claim", json=body, headers=ADMIN)
            assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
        response = await client.post(
            "/trainer/renew", json={"lease_id": "x", "group_ids": ["g"], "trainer_id": ""}, headers=ADMIN
        )
        assert response.status_code == 400


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_retry_after_follows_the_trainers_step_time_and_a_quiet_trainer_is_forgotten(store_url: str) -> None:
    repo = Repository(store_url)
    clock = _Clock()
    admission = Admission(AdmissionSettings(trainer_timeout_s=300, max_retry_after_s=60), repo, clock=clock)
    try:
        for _ in range(3):  # three steps 20 s apart, each leasing 4 groups in two claims, then acking them
            admission.claimed("t", groups_per_step=4, max_staleness=1, mode="async", leased=2)
            clock.now += 2.0
            admission.claimed("t", groups_per_step=4, max_staleness=1, mode="async", leased=2)  # same step
            clock.now += 18.0
            admission.acked(4)
        admission.claimed("t", groups_per_step=4, max_staleness=1, mode="async", leased=0)  # acks stop counting
        assert admission.limit() == 8 and admission.settling == 0
        assert admission.retry_after(4) == 20  # 4 groups at 4 groups per 20 s
        assert admission.retry_after(1) == 5
        assert admission.retry_after(100) == 60  # capped
        for _ in range(8):
            await repo.episodes.create_group(task_id="t", size=1, metadata={})
        with pytest.raises(BacklogFull) as refused:
            async with admission.admit():
                pytest.fail("admitted over the limit")
        assert refused.value.headers() == {"retry-after": "5"} and admission.refused == 1
        clock.now += 200.0
        admission.renewed("t")  # mid-step: renewals keep the demand alive
        clock.now += 200.0
        assert admission.limit() == 8
        clock.now += 301.0
        assert admission.limit() is None  # the trainer went quiet: open again
        admission.claimed("t", groups_per_step=4, max_staleness=1, mode="async", leased=0)
        await repo.episodes.create_group(task_id="t", size=1, metadata={})  # 9 ahead, limit 8
        admission.acked(4)
        admission.published()  # the acked groups' version is out: they no longer hold places
        assert admission.settling == 0
        with pytest.raises(BacklogFull):
            async with admission.admit():
                pass
        admission.trainers.clear()
        async with admission.admit():
            pass
    finally:
        await repo.close()
