"""The canary rollout in the proxy (issue 50): a published adapter serves a share of new episodes,
their rewards and the baseline's decide it by ``proxy/canary.py``'s test, and every decision is
stored with its evidence; manual promote and rollback through the control API.

In-process app on both stores (``store_url``). The upstream is the named fake (``fake_upstream``):
it isolates the proxy, whose routing is what is tested here (which adapter name an episode's call
is sent under, ``model_served`` and ``x-policy-version``); the engine's adapter loading is tested
in tests/trainer/test_publish.py.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from proxy.canary import CanarySettings, CanaryTest
from proxy.store.canaries import draw_arm
from proxy.store.repository import Repository
from tests.proxy.conftest import ADMIN, fake_upstream, make_settings, running_app
from tests.proxy.test_errors_and_auth import CHAT, assert_error

TEST = {"min_per_arm": 3, "margin": 0.1, "alpha": 0.1, "beta": 0.1}
"""Small enough to decide within about ten pairs of rewards that differ by the whole range."""


@asynccontextmanager
async def proxy(store_url: str, share: float) -> AsyncIterator[httpx.AsyncClient]:
    settings = make_settings(store_url, policy={"canary": {"share": share, **TEST}})
    async with running_app(settings, transport=fake_upstream()) as client:
        yield client


async def publish(client: httpx.AsyncClient, path: str) -> dict[str, Any]:
    response = await client.post("/policy/publish", json={"adapter_path": path}, headers=ADMIN)
    assert response.status_code == 201, response.text
    return response.json()


async def new_episode(client: httpx.AsyncClient) -> dict[str, Any]:
    response = await client.post("/episodes", json={"task_id": "t"}, headers=ADMIN)
    assert response.status_code == 201, response.text
    return response.json()


async def served(client: httpx.AsyncClient, episode: dict[str, Any]) -> tuple[str, int]:
    """(adapter the call was sent under, x-policy-version) of one policy call of the episode."""
    response = await client.post(
        "/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {episode['api_key']}"}
    )
    assert response.status_code == 200, response.text
    return response.json()["model"], int(response.headers["x-policy-version"])


async def reward(client: httpx.AsyncClient, episode_id: str, value: float) -> httpx.Response:
    return await client.post(f"/episodes/{episode_id}/reward", json={"reward": value}, headers=ADMIN)


async def canary_state(client: httpx.AsyncClient) -> dict[str, Any]:
    response = await client.get("/policy/canary", headers=ADMIN)
    assert response.status_code == 200, response.text
    return response.json()


async def arms(store_url: str, ids: list[str]) -> dict[str, tuple[str | None, int | None]]:
    repo = Repository(store_url)
    try:
        return {i: arm for i in ids if (arm := await repo.versions.canaries.arm_of(i)) is not None}
    finally:
        await repo.close()


async def by_arm(client: httpx.AsyncClient, n: int) -> dict[str, list[dict[str, Any]]]:
    """At least ``n`` new episodes in each arm (the arm is drawn from the id, as the store does)."""
    split: dict[str, list[dict[str, Any]]] = {"canary": [], "baseline": []}
    while min(len(v) for v in split.values()) < n:
        episode = await new_episode(client)
        split[draw_arm(episode["id"], 0.5)].append(episode)
    return split


def metric(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{name}{{{wanted}}} (\S+)$" if labels else rf"^{name} (\S+)$"
    match = re.search(pattern, text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


async def test_share_zero_publishes_to_everyone_as_before(store_url: str) -> None:
    async with proxy(store_url, 0.0) as client:
        await publish(client, "/a/1")
        before = await new_episode(client)
        await publish(client, "/a/2")
        after = await new_episode(client)
        assert await served(client, before) == ("policy-v2", 2)
        assert await served(client, after) == ("policy-v2", 2)
        state = await canary_state(client)
        assert state["share"] == 0.0 and state["running"] is None and state["decisions"] == []
        assert state["current_version"] == 2
        assert (await arms(store_url, [after["id"]]))[after["id"]] == (None, None)


async def test_a_canary_serves_its_arm_and_the_others_stay_on_the_current(store_url: str) -> None:
    async with proxy(store_url, 0.5) as client:
        first = await publish(client, "/a/1")  # nothing current yet: it switches everyone
        assert first["version"] == 1
        before = await new_episode(client)
        await publish(client, "/a/2")
        assert (await client.get("/policy", headers=ADMIN)).json()["version"] == 1
        state = await canary_state(client)
        assert state["running"]["canary_version"] == 2 and state["running"]["baseline_version"] == 1
        assert state["running"]["share"] == 0.5 and state["running"]["settings"]["min_per_arm"] == 3
        assert state["evidence"]["verdict"] == "continue" and state["evidence"]["pairs"] == 0
        assert metric((await client.get("/metrics", headers=ADMIN)).text, "flywheel_canary_version") == 2.0

        group = (await client.post("/groups", json={"task_id": "t", "size": 12}, headers=ADMIN)).json()
        lone = await by_arm(client, 2)
        episodes = (
            [{"id": k["id"], "api_key": k["api_key"]} for k in group["episode_keys"]]
            + lone["canary"]
            + lone["baseline"]
        )
        stored = await arms(store_url, [e["id"] for e in episodes] + [before["id"]])
        assert stored[before["id"]] == (None, None)  # created before the canary: stays on the current
        assert await served(client, before) == ("policy-v1", 1)
        for episode in episodes:
            arm = draw_arm(episode["id"], 0.5)
            assert stored[episode["id"]] == (arm, 2)
            assert await served(client, episode) == (("policy-v2", 2) if arm == "canary" else ("policy-v1", 1))
        assert {stored[e["id"]][0] for e in episodes} == {"canary", "baseline"}
        call = (await client.get(f"/episodes/{lone['canary'][0]['id']}", headers=ADMIN)).json()["calls"][0]
        assert call["model_served"] == "policy-v2" and call["policy_version"] == 2
        assert_error(await client.post("/policy/publish", json={"adapter_path": "/a/3"}, headers=ADMIN), 409,
                     "conflict_error", "canary_pending")  # fmt: skip
        assert [v["version"] for v in (await client.get("/policy/versions", headers=ADMIN)).json()["data"]] == [2, 1]


async def _decide_by_rewards(
    client: httpx.AsyncClient, canary_reward: float, baseline_reward: float
) -> tuple[list[dict[str, Any]], int]:
    """Reward new episodes pair by pair (canary, then baseline) until the canary is decided; returns
    the canary arm's episodes and the pairs rewarded."""
    split = await by_arm(client, 14)
    for i, (canary, baseline) in enumerate(zip(split["canary"], split["baseline"], strict=False), start=1):
        assert (await reward(client, canary["id"], canary_reward)).status_code == 200
        assert (await reward(client, baseline["id"], baseline_reward)).status_code == 200
        if (await canary_state(client))["running"] is None:
            return split["canary"], i
    raise AssertionError("the canary was never decided")


async def test_a_worse_canary_is_rolled_back_with_its_evidence(store_url: str) -> None:
    async with proxy(store_url, 0.5) as client:
        await publish(client, "/a/1")
        await publish(client, "/a/2")
        canary_episodes, pairs = await _decide_by_rewards(client, 0.0, 1.0)
        expected = CanaryTest.replay([("canary", 0.0), ("baseline", 1.0)] * pairs, CanarySettings(**TEST)).decide()
        assert expected.verdict == "rollback" and expected.decided_at_pairs == pairs
        state = await canary_state(client)
        [decision] = state["decisions"]
        assert decision["canary_version"] == 2 and decision["baseline_version"] == 1
        assert decision["verdict"] == "rollback" and decision["manual"] is False
        assert decision["evidence"] == expected.evidence() and decision["reason"] == expected.reason
        assert state["current_version"] == 1
        fresh = await new_episode(client)
        assert (await arms(store_url, [fresh["id"]]))[fresh["id"]] == (None, None)
        assert await served(client, fresh) == ("policy-v1", 1)
        metrics = (await client.get("/metrics", headers=ADMIN)).text
        assert metric(metrics, "flywheel_canary_decisions_total", manual="false", verdict="rollback") == 1.0
        assert metric(metrics, "flywheel_canary_version") == 0.0
        # A later reward of the retired canary's episodes changes no decision.
        late = canary_episodes[pairs]
        assert (await reward(client, late["id"], 0.0)).status_code == 200
        assert (await canary_state(client))["decisions"] == state["decisions"]
        assert (await publish(client, "/a/3"))["version"] == 3  # the next adapter starts its own canary
        assert (await canary_state(client))["running"]["baseline_version"] == 1


async def test_a_better_canary_is_promoted_and_becomes_the_current(store_url: str) -> None:
    async with proxy(store_url, 0.5) as client:
        await publish(client, "/a/1")
        await publish(client, "/a/2")
        await _decide_by_rewards(client, 1.0, 0.0)
        [decision] = (await canary_state(client))["decisions"]
        assert decision["verdict"] == "promote" and decision["manual"] is False
        assert decision["evidence"]["lower"] > -TEST["margin"]
        assert (await client.get("/policy", headers=ADMIN)).json()["version"] == 2
        fresh = await new_episode(client)
        assert await served(client, fresh) == ("policy-v2", 2)


async def test_concurrent_rewards_record_one_decision(store_url: str) -> None:
    async with proxy(store_url, 0.5) as client:
        await publish(client, "/a/1")
        await publish(client, "/a/2")
        split = await by_arm(client, 14)
        rewards = [reward(client, e["id"], 0.0) for e in split["canary"]]
        rewards += [reward(client, e["id"], 1.0) for e in split["baseline"]]
        assert all(r.status_code == 200 for r in await asyncio.gather(*rewards))
        [decision] = (await canary_state(client))["decisions"]
        assert decision["verdict"] == "rollback"
        metrics = (await client.get("/metrics", headers=ADMIN)).text
        assert metric(metrics, "flywheel_canary_decisions_total", manual="false", verdict="rollback") == 1.0


async def test_manual_promote_and_rollback_and_their_conflicts(store_url: str) -> None:
    async with proxy(store_url, 0.5) as client:
        for action in ("promote", "rollback"):
            assert_error(
                await client.post(f"/policy/canary/{action}", headers=ADMIN), 409, "conflict_error", "no_canary"
            )
        assert (await client.post("/policy/canary/promote")).status_code == 401  # admin only
        await publish(client, "/a/1")
        await publish(client, "/a/2")
        rolled = await client.post("/policy/canary/rollback", headers=ADMIN)
        assert rolled.status_code == 200, rolled.text
        assert rolled.json()["verdict"] == "rollback" and rolled.json()["manual"] is True
        assert rolled.json()["evidence"]["verdict"] == "continue"  # the test had not decided
        assert_error(await client.post("/policy/canary/rollback", headers=ADMIN), 409, "conflict_error", "no_canary")
        assert (await client.get("/policy", headers=ADMIN)).json()["version"] == 1
        await publish(client, "/a/3")
        split = await by_arm(client, 1)
        assert await served(client, split["canary"][0]) == ("policy-v3", 3)
        promoted = await client.post("/policy/canary/promote", headers=ADMIN)
        assert promoted.status_code == 200 and promoted.json()["manual"] is True
        assert (await client.get("/policy", headers=ADMIN)).json()["version"] == 3
        assert await served(client, split["baseline"][0]) == ("policy-v3", 3)  # decided: everyone on the current
        decisions = (await canary_state(client))["decisions"]
        assert [(d["canary_version"], d["verdict"]) for d in decisions] == [(3, "promote"), (2, "rollback")]
        metrics = (await client.get("/metrics", headers=ADMIN)).text
        assert metric(metrics, "flywheel_canary_decisions_total", manual="true", verdict="promote") == 1.0
        assert metric(metrics, "flywheel_canary_decisions_total", manual="true", verdict="rollback") == 1.0


async def test_a_reward_outside_the_tests_range_is_refused_while_its_canary_runs(store_url: str) -> None:
    async with proxy(store_url, 0.5) as client:
        await publish(client, "/a/1")
        outside = await new_episode(client)  # no canary: any finite reward, as before
        await publish(client, "/a/2")
        episode = (await by_arm(client, 1))["baseline"][0]
        assert_error(await reward(client, episode["id"], 1.5), 400, "invalid_request_error", "reward_out_of_range")
        got = (await client.get(f"/episodes/{episode['id']}", headers=ADMIN)).json()
        assert got["status"] == "open" and got["reward"] is None  # nothing written
        assert (await reward(client, episode["id"], 1.0)).status_code == 200
        assert (await reward(client, outside["id"], 5.0)).status_code == 200
        assert (await canary_state(client))["evidence"]["baseline"] == {"n": 1, "mean": 1.0}


@pytest.mark.parametrize("share", [0.0, 0.5])
async def test_the_first_publish_switches_everyone(store_url: str, share: float) -> None:
    async with proxy(store_url, share) as client:
        await publish(client, "/a/1")
        assert (await canary_state(client))["running"] is None
        assert await served(client, await new_episode(client)) == ("policy-v1", 1)


async def test_the_current_and_the_canary_stay_loaded_whatever_keep_versions(store_url: str) -> None:
    loaded: dict[str, str] = {}
    settings = make_settings(store_url, policy={"keep_versions": 1, "canary": {"share": 0.5, **TEST}})
    async with running_app(settings, transport=fake_upstream(adapters=loaded)) as client:
        await publish(client, "/a/1")
        await publish(client, "/a/2")
        assert loaded == {"policy-v1": "/a/1", "policy-v2": "/a/2"}  # both arms are served
        assert (await client.post("/policy/canary/promote", headers=ADMIN)).status_code == 200
        await publish(client, "/a/3")
        assert loaded == {"policy-v2": "/a/2", "policy-v3": "/a/3"}  # v1 serves no one any more
