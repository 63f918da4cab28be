"""AdapterTable on its own: which upstream model a requested name means, publishing to every
replica, and what a failed or conflicting publish leaves serving.

The store is real (SQLite in a temp dir). The replicas are the named fake upstream: one fake vLLM
per replica host, each with its own loaded adapters (``engines``), so a test isolates the proxy's
routing and publishing from the engine (the real engine's adapter loading is tested in
tests/trainer/test_publish.py and the integration tests).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple

import httpx
import pytest

from proxy.adapters import AdapterTable
from proxy.errors import Conflict, InvalidRequest, UpstreamError, UpstreamUnavailable
from proxy.store.records import PolicyVersionRecord
from proxy.store.repository import Repository
from proxy.store.sessions import Sessions
from proxy.store.versions import Versions
from proxy.upstream import Upstreams
from tests.proxy.conftest import fake_upstream, make_settings

HOSTS = ("upstream-0", "upstream-1")
Respond = Callable[[httpx.Request, dict[str, Any]], httpx.Response | None]


def fake_replicas(
    engines: dict[str, dict[str, str]], seen: list[tuple[str, dict[str, Any]]], respond: Respond | None = None
) -> httpx.MockTransport:
    """The named fake upstream, one fake vLLM per host: ``engines[host]`` is that engine's adapters."""
    fakes = {host: fake_upstream(seen=seen, respond=respond, adapters=loaded) for host, loaded in engines.items()}

    async def handler(request: httpx.Request) -> httpx.Response:
        return await fakes[request.url.host].handle_async_request(request)

    return httpx.MockTransport(handler)


class Proxy(NamedTuple):
    """One proxy replica's policy table and the upstream replicas it sees."""

    table: AdapterTable
    upstreams: Upstreams


class Cluster:
    """Two fake vLLM replicas and a real SQLite store; ``proxy()`` makes one more proxy replica's
    policy table over them (several share the store and the engines, as proxy replicas do)."""

    def __init__(self, sqlite_url: str, respond: Respond | None = None, **policy: Any) -> None:
        self.engines: dict[str, dict[str, str]] = {host: {} for host in HOSTS}
        self.seen: list[tuple[str, dict[str, Any]]] = []
        self.settings = make_settings(
            sqlite_url, upstreams=[{"name": h, "url": f"http://{h}"} for h in HOSTS], policy=policy
        )
        self.repo = Repository(sqlite_url, min_rewarded=2)
        self.respond = respond
        self._upstreams: list[Upstreams] = []

    def proxy(self, versions: Versions | None = None) -> Proxy:
        def respond(request: httpx.Request, body: dict[str, Any]) -> httpx.Response | None:
            return self.respond(request, body) if self.respond else None  # tests change it as they go

        upstreams = Upstreams(self.settings, transport=fake_replicas(self.engines, self.seen, respond))
        for replica in upstreams.replicas:
            replica.healthy = True  # as the health loop leaves them once the engines answer
        self._upstreams.append(upstreams)
        return Proxy(AdapterTable(self.settings.policy, versions or self.repo.versions, upstreams), upstreams)

    def table(self) -> AdapterTable:
        return self.proxy().table

    def loads(self) -> list[tuple[str, str]]:
        """(host, adapter name) of every load request the engines received."""
        return [
            (path.split("/")[0], body["lora_name"]) for path, body in self.seen if path.endswith("/load_lora_adapter")
        ]

    async def close(self) -> None:
        for upstreams in self._upstreams:
            await upstreams.close()
        await self.repo.close()


@pytest.fixture
async def cluster(sqlite_url: str) -> AsyncIterator[Cluster]:
    made = Cluster(sqlite_url, keep_versions=2)
    try:
        yield made
    finally:
        await made.close()


def refuse_loads_on(hosts: tuple[str, ...], status: int, message: str = "boom") -> Respond:
    def respond(request: httpx.Request, body: dict[str, Any]) -> httpx.Response | None:
        if request.url.host in hosts and request.url.path == "/v1/load_lora_adapter":
            return httpx.Response(status, json={"error": {"message": message, "code": status}})
        return None

    return respond


async def publish(table: AdapterTable, path: str, version: int | None = None) -> PolicyVersionRecord:
    return await table.publish(adapter_path=path, version=version, metadata={"source": "test"})


# -- resolving a requested model ------------------------------------------------------------------


async def test_names_resolve_to_the_base_model_before_anything_is_published(cluster: Cluster) -> None:
    table = cluster.table()
    assert table.resolve("policy") == ("policy-base", 0)
    assert table.resolve("policy-base") == ("policy-base", 0)
    assert table.resolve("policy-v7") == ("policy-v7", 7)  # an explicit version passes through
    assert table.resolve("policy-v") == ("policy-v", None)
    assert table.resolve("policy-v7-old") == ("policy-v7-old", None)
    assert table.resolve("gpt-4o") == ("gpt-4o", None)  # not an alias unless configured
    assert table.is_alias("policy") and not table.is_alias("policy-base") and not table.is_alias("policy-v1")


async def test_aliases_follow_the_published_version(sqlite_url: str) -> None:
    cluster = Cluster(sqlite_url, aliases=["policy", "gpt-4o"])
    try:
        table = cluster.table()
        await publish(table, "/a/1")
        await publish(table, "/a/2")
        assert [table.resolve(m) for m in ("policy", "gpt-4o")] == [("policy-v2", 2)] * 2
        assert table.resolve("policy-v1") == ("policy-v1", 1)  # an older version stays addressable
        assert table.resolve("policy-base") == ("policy-base", 0)
    finally:
        await cluster.close()


async def test_the_adapter_prefix_is_matched_literally(sqlite_url: str) -> None:
    cluster = Cluster(sqlite_url, adapter_prefix="run.1+v")
    try:
        table = cluster.table()
        assert table.resolve("run.1+v3") == ("run.1+v3", 3)
        assert table.resolve("runX1+v3") == ("runX1+v3", None)  # "." and "+" are not patterns
        assert table.resolve("run.11v3") == ("run.11v3", None)
        assert (await publish(table, "/a/1")).name == "run.1+v1"
        assert table.resolve("policy") == ("run.1+v1", 1)
    finally:
        await cluster.close()


async def test_another_replicas_publish_is_seen_on_refresh(cluster: Cluster) -> None:
    mine, theirs = cluster.table(), cluster.table()
    await publish(theirs, "/a/1")
    assert mine.resolve("policy") == ("policy-base", 0)  # until it re-reads the store
    await mine.refresh()
    assert mine.resolve("policy") == ("policy-v1", 1)


async def test_the_refresh_loop_outlives_a_store_failure(sqlite_url: str) -> None:
    class FlakyVersions(Versions):
        failures = 2

        async def current(self) -> PolicyVersionRecord | None:
            if self.failures:
                self.failures -= 1
                raise ConnectionError("database is unreachable")
            return await super().current()

    cluster = Cluster(sqlite_url, refresh_s=0.01)
    sessions = Sessions(sqlite_url)
    flaky = FlakyVersions(sessions)
    try:
        await publish(cluster.table(), "/a/1")
        table = cluster.proxy(flaky).table
        loop = asyncio.create_task(table.refresh_loop())
        try:
            for _ in range(500):
                if table.current is not None:
                    break
                await asyncio.sleep(0.01)
        finally:
            loop.cancel()
        assert flaky.failures == 0 and table.resolve("policy") == ("policy-v1", 1)
    finally:
        await sessions.close()
        await cluster.close()


# -- publishing -----------------------------------------------------------------------------------


async def test_publish_loads_the_adapter_on_every_replica_then_switches(cluster: Cluster) -> None:
    table, upstreams = cluster.proxy()
    record = await table.publish(adapter_path="/a/1", version=None, metadata={"step": 1})
    assert (record.version, record.name, record.adapter_path, record.metadata) == (1, "policy-v1", "/a/1", {"step": 1})
    assert cluster.engines == {host: {"policy-v1": "/a/1"} for host in HOSTS}
    assert sorted(cluster.loads()) == [(host, "policy-v1") for host in HOSTS]
    assert all(r.adapters == {"policy-v1"} for r in upstreams.replicas)
    assert table.resolve("policy") == ("policy-v1", 1)
    stored = await cluster.repo.versions.current()
    assert stored is not None and (stored.version, stored.adapter_path) == (1, "/a/1")


async def test_only_the_last_keep_versions_stay_loaded(cluster: Cluster) -> None:
    table, upstreams = cluster.proxy()
    for version in (1, 2, 3, 4):
        await publish(table, f"/a/{version}")
    assert cluster.engines == {host: {"policy-v3": "/a/3", "policy-v4": "/a/4"} for host in HOSTS}
    assert all(r.adapters == {"policy-v3", "policy-v4"} for r in upstreams.replicas)


async def test_an_explicit_version_may_skip_numbers_but_never_go_back(cluster: Cluster) -> None:
    table = cluster.table()
    assert (await publish(table, "/a/5", version=5)).name == "policy-v5"
    cluster.seen.clear()
    for stale in (5, 3):
        with pytest.raises(Conflict) as refused:
            await publish(table, f"/a/{stale}", version=stale)
        assert (refused.value.status_code, refused.value.code, refused.value.param) == (
            409,
            "version_conflict",
            "version",
        )
    assert cluster.loads() == []  # refused before any replica was touched
    assert (await publish(table, "/a/6")).version == 6


async def test_concurrent_publishes_get_distinct_versions(cluster: Cluster) -> None:
    table = cluster.table()
    records = await asyncio.gather(*(publish(table, f"/a/{i}") for i in range(3)))
    assert sorted(r.version for r in records) == [1, 2, 3]
    assert table.resolve("policy") == ("policy-v3", 3)


async def test_a_replica_that_misses_the_adapter_leaves_rotation_and_gets_it_on_sync(sqlite_url: str) -> None:
    cluster = Cluster(sqlite_url, refuse_loads_on(("upstream-1",), 500), keep_versions=2)
    try:
        table, upstreams = cluster.proxy()
        record = await publish(table, "/a/1")
        ok, missed = upstreams.replicas
        assert record.version == 1 and table.resolve("policy") == ("policy-v1", 1)
        assert ok.healthy and not missed.healthy  # not routed to until it holds the adapter
        assert cluster.engines == {"upstream-0": {"policy-v1": "/a/1"}, "upstream-1": {}}
        cluster.respond = None  # the replica recovers; the health loop syncs it before it takes traffic
        await upstreams.check_all(table.sync_replica)
        assert missed.healthy and cluster.engines["upstream-1"] == {"policy-v1": "/a/1"}
    finally:
        await cluster.close()


async def test_an_unreachable_replica_does_not_stop_the_publish(sqlite_url: str) -> None:
    def unreachable(request: httpx.Request, body: dict[str, Any]) -> httpx.Response | None:
        if request.url.host == "upstream-0":
            raise httpx.ConnectError("connection refused", request=request)
        return None

    cluster = Cluster(sqlite_url, unreachable)
    try:
        table, upstreams = cluster.proxy()
        assert (await publish(table, "/a/1")).version == 1
        assert [r.healthy for r in upstreams.replicas] == [False, True]
        assert cluster.engines["upstream-1"] == {"policy-v1": "/a/1"}
    finally:
        await cluster.close()


async def test_only_healthy_replicas_are_loaded_while_one_is(cluster: Cluster) -> None:
    table, upstreams = cluster.proxy()
    upstreams.replicas[1].healthy = False
    await publish(table, "/a/1")
    assert cluster.loads() == [("upstream-0", "policy-v1")]
    cluster.seen.clear()
    for replica in upstreams.replicas:
        replica.healthy = False
    await publish(table, "/a/2")  # none healthy: every replica is tried
    assert sorted(cluster.loads()) == [(host, "policy-v2") for host in HOSTS]


@pytest.mark.parametrize(
    ("status", "message", "error", "http", "hint"),
    [
        (400, "adapter config not found", InvalidRequest, 400, False),
        (404, "Not Found", InvalidRequest, 400, True),  # the route is missing: runtime LoRA updating is off
        (404, "The lora adapter cannot be found", InvalidRequest, 400, False),
        (500, "CUDA out of memory", UpstreamError, 502, False),
    ],
)
async def test_a_publish_no_replica_takes_leaves_the_old_version_serving(
    sqlite_url: str, status: int, message: str, error: type[Exception], http: int, hint: bool
) -> None:
    cluster = Cluster(sqlite_url)
    try:
        table, upstreams = cluster.proxy()
        await publish(table, "/a/1")
        cluster.respond = refuse_loads_on(HOSTS, status, message)
        with pytest.raises(error) as failed:
            await publish(table, "/a/2")
        assert getattr(failed.value, "status_code", None) == http and message in str(failed.value)
        assert ("VLLM_ALLOW_RUNTIME_LORA_UPDATING" in str(failed.value)) is hint
        assert table.resolve("policy") == ("policy-v1", 1)
        stored = await cluster.repo.versions.current()
        assert stored is not None and stored.version == 1
        assert cluster.engines == {host: {"policy-v1": "/a/1"} for host in HOSTS}  # nothing unloaded
        assert all(r.healthy for r in upstreams.replicas)  # a refused adapter takes no replica out of rotation
        cluster.respond = None
        assert (await publish(table, "/a/2")).version == 2  # the failed attempt used up no version
    finally:
        await cluster.close()


async def test_no_replica_at_all_is_unavailable(sqlite_url: str) -> None:
    def down(request: httpx.Request, body: dict[str, Any]) -> httpx.Response | None:
        raise httpx.ConnectError("connection refused", request=request)

    cluster = Cluster(sqlite_url, down)
    try:
        table = cluster.table()
        with pytest.raises(UpstreamUnavailable) as failed:
            await publish(table, "/a/1")
        assert failed.value.status_code == 502 and table.current is None
        assert await cluster.repo.versions.current() is None
    finally:
        await cluster.close()


async def test_republishing_the_same_adapter_under_its_name_is_accepted(cluster: Cluster) -> None:
    """A retried publish (or a restarted proxy) finds the adapter loaded already: same path, no reload."""
    for engine in cluster.engines.values():
        engine["policy-v1"] = "/a/1"
    table, upstreams = cluster.proxy()
    assert (await publish(table, "/a/1", version=1)).version == 1
    assert not [b for p, b in cluster.seen if p.endswith("/unload_lora_adapter")]
    assert all(r.adapters == {"policy-v1"} for r in upstreams.replicas)


async def test_a_conflicting_publish_from_a_lagging_replica_leaves_the_served_adapter_alone(cluster: Cluster) -> None:
    """Two proxy replicas, one store, one set of engines. The second has not refreshed since the first
    published v2; a publish of v2 through it (another trainer's adapter) is refused, and the engines
    keep serving the published v2 under that name, not the refused adapter."""
    first, lagging = cluster.table(), cluster.table()
    await publish(first, "/a/1")
    await lagging.refresh()
    await publish(first, "/trainer-a/2")
    with pytest.raises(Conflict):
        await publish(lagging, "/trainer-b/2", version=2)
    assert cluster.engines == {host: {"policy-v1": "/a/1", "policy-v2": "/trainer-a/2"} for host in HOSTS}
    stored = await cluster.repo.versions.current()
    assert stored is not None and stored.adapter_path == "/trainer-a/2"


async def test_a_stale_adapter_under_the_published_name_is_replaced_on_every_replica(cluster: Cluster) -> None:
    """Left by another run on a shared engine: another adapter under the name is unloaded and ours
    loaded, never served silently."""
    for engine in cluster.engines.values():
        engine["policy-v1"] = "/old/run/adapter"
    await publish(cluster.table(), "/new/adapter")
    assert cluster.engines == {host: {"policy-v1": "/new/adapter"} for host in HOSTS}


async def test_an_engine_error_page_is_quoted_not_parsed(sqlite_url: str) -> None:
    def error_page(request: httpx.Request, body: dict[str, Any]) -> httpx.Response | None:
        if request.url.path == "/v1/load_lora_adapter":
            return httpx.Response(503, text="<html>Service Unavailable</html>")
        return None

    cluster = Cluster(sqlite_url, error_page)
    try:
        with pytest.raises(UpstreamError) as failed:
            await publish(cluster.table(), "/a/1")
        assert failed.value.status_code == 502 and "503 <html>Service Unavailable</html>" in failed.value.message
    finally:
        await cluster.close()
