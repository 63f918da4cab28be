"""``GET /episodes``' filters (the warm start's selection) on both real stores, through the contract's
``episodes`` request, and its bad values refused in the proxy's error shape."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from contract.client import AsyncProxyClient
from tests.proxy.conftest import ADMIN, fake_upstream, make_settings, running_app
from tests.proxy.test_errors_and_auth import assert_error
from tests.support.services import ADMIN_KEY


@pytest.fixture
async def client(store_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with running_app(make_settings(store_url), transport=fake_upstream()) as c:
        yield c


async def _episode(client: httpx.AsyncClient, task_id: str, reward: float | None, **metadata: Any) -> str:
    """A lone episode of ``task_id`` with ``metadata``, rewarded (None: left open)."""
    created = await client.post("/episodes", json={"task_id": task_id, "metadata": metadata}, headers=ADMIN)
    assert created.status_code == 201, created.text
    episode_id = str(created.json()["id"])
    if reward is not None:
        done = await client.post(f"/episodes/{episode_id}/reward", json={"reward": reward}, headers=ADMIN)
        assert done.status_code == 200, done.text
    return episode_id


async def test_filters_select_by_reward_task_set_and_source_on_both_stores(client: httpx.AsyncClient) -> None:
    best = await _episode(client, "t1", 1.0, source="demo:scripted")
    good = await _episode(client, "t2", 0.75, source="self")
    poor = await _episode(client, "t1", 0.25, source="demo:scripted")
    other_task = await _episode(client, "t3", 1.0, source="demo:scripted")
    untagged = await _episode(client, "t1", 1.0)
    numeric_tag = await _episode(client, "t1", 1.0, source=7)  # a tag that is not a string matches no source
    still_open = await _episode(client, "t1", None, source="demo:scripted")
    proxy = AsyncProxyClient("http://proxy", ADMIN_KEY, transport=httpx.ASGITransport(app=client.app))  # type: ignore[attr-defined]

    async def ids(**filters: Any) -> set[str]:
        return {e.id for e in await proxy.episodes(**filters)}

    everything = {best, good, poor, other_task, untagged, numeric_tag, still_open}
    assert await ids() == everything
    assert await ids(status="rewarded") == everything - {still_open}
    assert await ids(min_reward=0.75) == {best, good, other_task, untagged, numeric_tag}
    assert await ids(min_reward=0.7500001) == {best, other_task, untagged, numeric_tag}  # the bound is inclusive
    assert await ids(task_ids=["t2", "t3"]) == {good, other_task}
    assert await ids(source="demo:scripted") == {best, poor, other_task, still_open}
    assert await ids(source="demo") == set()  # exact, not a prefix
    assert await ids(status="rewarded", min_reward=0.5, task_ids=["t1"], source="demo:scripted") == {best}
    assert await ids(task_ids=["nope"]) == set()
    page_one = [e.id for e in await proxy.episodes(status="rewarded", limit=4)]
    page_two = [e.id for e in await proxy.episodes(status="rewarded", limit=4, offset=4)]
    assert len(page_one) == 4 and len(page_two) == 2 and set(page_one + page_two) == everything - {still_open}
    listed = (await proxy.episodes(source="self"))[0]
    assert (listed.task_id, listed.reward, listed.metadata, listed.calls) == ("t2", 0.75, {"source": "self"}, None)
    await proxy.aclose()


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("min_reward=abc", "min_reward"),
        ("min_reward=nan", "min_reward"),
        ("min_reward=inf", "min_reward"),
        ("source=", "source"),
        ("source=" + "x" * 257, "source"),
        ("&".join(["task_id=t"] * 257), "task_id"),
    ],
)
async def test_bad_filter_values_are_400(sqlite_url: str, query: str, param: str) -> None:
    async with running_app(make_settings(sqlite_url), transport=fake_upstream()) as client:
        error = assert_error(await client.get(f"/episodes?{query}", headers=ADMIN), 400, "invalid_request_error")
    assert param in (error["param"] or "") or param in error["message"]
