"""Late rewards (issue 50): an episode awaiting its reward outlives the idle reaper, takes no more
calls, is no admission traffic, and its reward days later completes its group; ``max_wait_s``
bounds the wait. Both stores, through the control API, with the store's clock moved ahead."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from proxy.store.episodes import Episodes
from proxy.store.records import NewCall
from tests.proxy.conftest import ADMIN, episode_auth, fake_upstream, make_settings, running_app
from tests.proxy.test_dialect_routes import streaming
from tests.proxy.test_errors_and_auth import CHAT, assert_error
from tests.support.records import chat_call

DAY_S = 86400.0
IDLE_S = 1800.0


class Clock:
    """The store's clock (``Episodes.clock``), moved ahead by hand."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def __call__(self) -> float:
        return time.time() + self.ahead


@pytest.fixture
async def client(store_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with running_app(make_settings(store_url), transport=fake_upstream()) as c:
        yield c


def _episodes(client: httpx.AsyncClient) -> Episodes:
    episodes: Episodes = client.app.state.services.repo.episodes  # type: ignore[attr-defined]
    return episodes


def _clock(client: httpx.AsyncClient) -> Clock:
    clock = Clock()
    _episodes(client).clock = clock
    return clock


async def _group(client: httpx.AsyncClient, size: int, task_id: str = "review-1") -> dict[str, Any]:
    created = await client.post("/groups", json={"task_id": task_id, "size": size}, headers=ADMIN)
    assert created.status_code == 201, created.text
    group: dict[str, Any] = created.json()
    return group


async def _post(client: httpx.AsyncClient, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    answer = await client.post(path, json=body, headers=ADMIN)
    assert answer.status_code == 200, answer.text
    reply: dict[str, Any] = answer.json()
    return reply


async def _status(client: httpx.AsyncClient, path: str) -> Any:
    return (await client.get(path, headers=ADMIN)).json()["status"]


async def test_the_sweeper_leaves_an_awaiting_episode_and_its_reward_two_days_later_completes_the_group(
    client: httpx.AsyncClient,
) -> None:
    clock = _clock(client)
    group = await _group(client, 3)
    waiting, rewarded, idle = (e["id"] for e in group["episode_keys"])
    awaiting = await _post(client, f"/episodes/{waiting}/await_reward")
    assert awaiting["status"] == "awaiting" and awaiting["awaiting_since"] is not None
    assert (await _post(client, f"/episodes/{waiting}/await_reward"))["status"] == "awaiting"  # again: a no-op
    await _post(client, f"/episodes/{rewarded}/reward", {"reward": 0.0})
    # Awaiting, it takes no more model calls: its agent said it is done.
    assert_error(
        await client.post(f"/episodes/{waiting}/v1/chat/completions", json=CHAT, headers=episode_auth(group)),
        409,
        "conflict_error",
        "episode_closed",
    )
    clock.ahead = 2 * DAY_S
    assert await _episodes(client).abandon_expired(idle_s=IDLE_S) == 1  # the ordinary open one only
    assert await _status(client, f"/episodes/{idle}") == "abandoned"
    assert await _status(client, f"/episodes/{waiting}") == "awaiting"
    assert await _status(client, f"/groups/{group['id']}") == "open"
    late = await _post(client, f"/episodes/{waiting}/reward", {"reward": 1.0})
    assert late["status"] == "rewarded" and late["finished_at"] >= time.time() + DAY_S
    assert late["awaiting_since"] == awaiting["awaiting_since"]  # kept: the group is known as a late one
    finished = (await client.get(f"/groups/{group['id']}", headers=ADMIN)).json()
    assert finished["status"] == "complete" and finished["counts"] == {"rewarded": 2, "abandoned": 1}


async def test_a_task_pattern_makes_idle_episodes_await_and_max_wait_abandons_them(client: httpx.AsyncClient) -> None:
    clock = _clock(client)
    late_group = await _group(client, 2, task_id="review-7")
    other_group = await _group(client, 2, task_id="math-3")
    clock.ahead = IDLE_S + 60
    swept = await _episodes(client).abandon_expired(idle_s=IDLE_S, late_tasks=["review-*"], max_wait_s=DAY_S)
    assert swept == 2  # math-3's two; review-7's start awaiting
    for key in late_group["episode_keys"]:
        episode = (await client.get(f"/episodes/{key['id']}", headers=ADMIN)).json()
        assert episode["status"] == "awaiting" and episode["awaiting_since"] >= time.time() + IDLE_S
    assert await _status(client, f"/groups/{other_group['id']}") == "failed"
    clock.ahead += DAY_S / 2  # within max_wait: left alone
    assert await _episodes(client).abandon_expired(idle_s=IDLE_S, late_tasks=["review-*"], max_wait_s=DAY_S) == 0
    first, second = (k["id"] for k in late_group["episode_keys"])
    await _post(client, f"/episodes/{first}/reward", {"reward": 1.0})
    clock.ahead += DAY_S  # past max_wait: abandoned with its reason
    assert await _episodes(client).abandon_expired(idle_s=IDLE_S, late_tasks=["review-*"], max_wait_s=DAY_S) == 1
    expired = (await client.get(f"/episodes/{second}", headers=ADMIN)).json()
    assert expired["status"] == "abandoned" and expired["abandon_cause"] == "deadline"
    assert "no late reward within 86400s" in expired["abandon_reason"]
    assert await _status(client, f"/groups/{late_group['id']}") == "failed"  # one rewarded of min_rewarded 2
    assert_error(
        await client.post(f"/episodes/{second}/reward", json={"reward": 1.0}, headers=ADMIN),
        409,
        "conflict_error",
        "episode_abandoned",
    )


async def test_awaiting_groups_are_no_admission_traffic(client: httpx.AsyncClient) -> None:
    episodes = _episodes(client)
    group = await _group(client, 2)
    assert await episodes.count_backlog() == 1
    first, second = (k["id"] for k in group["episode_keys"])
    await _post(client, f"/episodes/{first}/await_reward")
    assert await episodes.count_backlog() == 1  # the other episode is still in flight
    await _post(client, f"/episodes/{second}/reward", {"reward": 0.0})
    assert await episodes.count_backlog() == 0  # only a late reward is left: no traffic
    await _post(client, f"/episodes/{first}/reward", {"reward": 1.0})
    assert await episodes.count_backlog() == 1  # complete: the trainer's to take


async def test_a_late_group_is_offered_whatever_its_staleness(client: httpx.AsyncClient) -> None:
    """The claim's staleness bound is for groups that waited on the trainer: a late group goes to
    the trainer, whose own ``late`` rule judges its age (``trainer/data.py``)."""
    repo = client.app.state.services.repo  # type: ignore[attr-defined]
    late, ordinary = await _group(client, 2), await _group(client, 2)
    for group in (late, ordinary):  # a call each, served by v0, before any episode finishes
        await repo.calls.insert([_call(k["id"]) for k in group["episode_keys"]])
    first, second = (k["id"] for k in late["episode_keys"])
    await _post(client, f"/episodes/{first}/await_reward")
    await _post(client, f"/episodes/{second}/reward", {"reward": 0.0})
    await _post(client, f"/episodes/{first}/reward", {"reward": 1.0})
    for key, reward in zip(ordinary["episode_keys"], (0.0, 1.0), strict=True):
        await _post(client, f"/episodes/{key['id']}/reward", {"reward": reward})
    claim = await repo.leases.claim(owner="t", max_groups=4, lease_s=60, max_staleness=1, current_version=5)
    assert [g.id for g in claim.groups] == [late["id"]] and claim.stale == 1


def _call(episode_id: str) -> NewCall:
    return chat_call(episode_id, prompt_token_ids=[1, 2], policy_version=0, started_at=time.time())


async def test_await_reward_refuses_finished_and_unknown_episodes(client: httpx.AsyncClient) -> None:
    group = await _group(client, 2)
    rewarded, abandoned = (k["id"] for k in group["episode_keys"])
    await _post(client, f"/episodes/{rewarded}/reward", {"reward": 1.0})
    await _post(client, f"/episodes/{abandoned}/abandon", {"reason": "crashed"})
    assert_error(
        await client.post(f"/episodes/{rewarded}/await_reward", headers=ADMIN),
        409,
        "conflict_error",
        "episode_rewarded",
    )
    assert_error(
        await client.post(f"/episodes/{abandoned}/await_reward", headers=ADMIN),
        409,
        "conflict_error",
        "episode_abandoned",
    )
    missing = "00000000-0000-4000-8000-000000000000"
    assert (await client.post(f"/episodes/{missing}/await_reward", headers=ADMIN)).status_code == 404
    assert (await client.post(f"/episodes/{rewarded}/await_reward")).status_code == 401  # admin key only


async def test_a_recorded_answer_names_its_episode_and_a_passthrough_one_none(client: httpx.AsyncClient) -> None:
    """The receipt: a workflow that awaits a late reward knows which episode to reward."""
    group = await _group(client, 1)
    episode_id = group["episode_keys"][0]["id"]
    recorded = await client.post(f"/episodes/{episode_id}/v1/chat/completions", json=CHAT, headers=episode_auth(group))
    assert recorded.status_code == 200, recorded.text
    assert recorded.headers["x-flywheel-episode-id"] == episode_id
    passthrough = await client.post("/passthrough/v1/chat/completions", json=CHAT, headers=ADMIN)
    assert passthrough.status_code == 200, passthrough.text
    assert "x-flywheel-episode-id" not in passthrough.headers and "x-flywheel-call-id" not in passthrough.headers


async def test_feedback_on_one_call_names_it_by_the_receipt_its_answer_carried(store_url: str) -> None:
    """Every recorded answer, streamed ones too (their headers leave before the record is written),
    carries the call's receipt; ``call_rewards`` keyed by it is stored under the call's ordinal,
    the same reward posted again by ordinal is the same reward, and a receipt of another episode's
    call (or of none) is a 400 that changes nothing."""
    async with running_app(make_settings(store_url), transport=fake_upstream(respond=streaming)) as client:
        await _feedback_by_receipt(client)


async def _feedback_by_receipt(client: httpx.AsyncClient) -> None:
    group = await _group(client, 2)
    first, other = (k["id"] for k in group["episode_keys"])
    url = f"/episodes/{first}/v1/chat/completions"
    plain = await client.post(url, json=CHAT, headers=episode_auth(group))
    streamed = await client.post(url, json={**CHAT, "stream": True}, headers=episode_auth(group))
    elsewhere = await client.post(f"/episodes/{other}/v1/chat/completions", json=CHAT, headers=episode_auth(group, 1))
    receipts = [r.headers["x-flywheel-call-id"] for r in (plain, streamed, elsewhere)]
    assert all(r.startswith("call_") for r in receipts) and len(set(receipts)) == 3
    stored = (await client.get(f"/episodes/{first}", headers=ADMIN)).json()["calls"]
    assert [(c["ordinal"], c["receipt"]) for c in stored] == [(0, receipts[0]), (1, receipts[1])]
    refused = await client.post(
        f"/episodes/{first}/reward", json={"reward": 1.0, "call_rewards": {receipts[2]: 0.0}}, headers=ADMIN
    )
    assert_error(refused, 400, "invalid_request_error")
    assert receipts[2] in refused.json()["error"]["message"]
    assert (await client.get(f"/episodes/{first}", headers=ADMIN)).json()["status"] == "open"
    body = {"reward": 1.0, "call_rewards": {receipts[1]: -0.5}}
    rewarded = await _post(client, f"/episodes/{first}/reward", body)
    assert rewarded["call_rewards"] == {"1": -0.5}
    again = await _post(client, f"/episodes/{first}/reward", {"reward": 1.0, "call_rewards": {"1": -0.5}})
    assert again["call_rewards"] == {"1": -0.5}
