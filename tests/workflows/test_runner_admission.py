"""The runner under the proxy's admission control, against the in-process app on a real SQLite store.

The episodes make no model call (they return their reward at once), so no upstream is involved: what
is tested is that a 429 ``backlog_full`` on ``POST /groups`` makes the runner wait ``Retry-After`` and
ask again until the trainer (here a loop of real claims and acks over HTTP) makes room, that every
task still gets its group, and that a stop during a wait is counted, not lost unseen.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from contract.client import AsyncProxyClient, ProxyError
from proxy.store.db import migrate_async
from tests.proxy.conftest import ADMIN, ADMIN_KEY, make_settings, running_app
from workflows.base import Episode, Outcome, Split, Workflow
from workflows.runner import RunConfig, Runner


@dataclass(frozen=True)
class NoOptions:
    pass


class Instant(Workflow[str, NoOptions]):
    """Episode ``i`` is rewarded ``i % 2`` at once: every group completes with a reward spread."""

    name = "instant"
    options_type = NoOptions

    def tasks(self, split: Split) -> Sequence[str]:
        return ["a", "b", "c"]

    def task_id(self, task: str) -> str:
        return f"instant/{task}"

    async def run_episode(self, task: str, episode: Episode) -> Outcome:
        return Outcome(reward=float(episode.index % 2))


@contextlib.asynccontextmanager
async def admitting(tmp_path: Path, retry_after_s: int) -> AsyncIterator[tuple[httpx.AsyncClient, AsyncProxyClient]]:
    """The app on a fresh SQLite store, admitting one group of backlog at a time, and the runner's
    client for it (in-process, no socket)."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'flywheel.db'}"
    await migrate_async(url)
    settings = make_settings(url, admission={"max_backlog_groups": 1, "retry_after_s": retry_after_s})
    async with running_app(settings) as app_client:
        transport = httpx.ASGITransport(app=app_client.app)  # type: ignore[attr-defined]
        client = AsyncProxyClient("http://proxy", ADMIN_KEY, transport=transport)
        try:
            yield app_client, client
        finally:
            await client.aclose()


def instant_runner(
    client: AsyncProxyClient, *, groups: int, group_size: int, concurrency: int, on_wait: Callable[[float], None] | None
) -> Runner:
    """A runner of the ``Instant`` workflow on ``client``."""
    config = RunConfig(
        proxy_url="http://proxy", admin_key=ADMIN_KEY, groups=groups, group_size=group_size, concurrency=concurrency
    )
    return Runner(Instant(NoOptions()), config, client, on_admission_wait=on_wait)


async def _trainer(client: AsyncProxyClient, trained: list[str], done: asyncio.Event) -> None:
    """Claims one group at a time and acks it, as ``python -m trainer run`` would (no training);
    ``done`` once three groups are trained."""
    step = 0
    while True:
        claim = await client.claim(trainer_id="t", max_groups=1, lease_s=60, max_staleness=None)
        if claim.groups:
            step += 1
            ids = [g.id for g in claim.groups]
            await client.ack(lease_id=claim.lease_id, group_ids=ids, step=step, status="trained")
            trained += ids
            if len(trained) >= 3:
                done.set()
        await asyncio.sleep(0.2)


async def test_the_runner_waits_out_refusals_and_every_task_gets_its_group(tmp_path: Path) -> None:
    async with admitting(tmp_path, retry_after_s=1) as (app_client, client):
        waits: list[float] = []
        runner = instant_runner(client, groups=3, group_size=2, concurrency=4, on_wait=waits.append)
        trained: list[str] = []
        done = asyncio.Event()
        trainer = asyncio.create_task(_trainer(client, trained, done))
        try:
            stats = await asyncio.wait_for(runner.run(), 60)
            await asyncio.wait_for(done.wait(), 10)
        finally:
            trainer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await trainer
        summary = stats.summary()
        assert summary["groups"] == 3 and summary["groups_by_status"] == {"complete": 3}
        assert sorted(g.task_id for g in stats.groups) == ["instant/a", "instant/b", "instant/c"]
        assert sorted(trained) == sorted(g.group_id for g in stats.groups)
        assert summary["admission_waits"] >= 1 and waits == [1.0] * summary["admission_waits"]
        assert summary["admission_wait_s"] >= 0.9 * summary["admission_waits"]
        assert summary["groups_not_created"] == 0
        state = (await app_client.get("/trainer/admission", headers=ADMIN)).json()
        assert state["refused"] == summary["admission_waits"]  # each refusal was one wait, none unseen
        assert state["groups"] == {"trained": 3}


async def test_a_stop_during_a_wait_counts_the_group_not_created(tmp_path: Path) -> None:
    async with admitting(tmp_path, retry_after_s=30) as (_, client):
        refused = asyncio.Event()
        runner = instant_runner(client, groups=2, group_size=2, concurrency=2, on_wait=lambda _: refused.set())
        run = asyncio.create_task(runner.run())
        await asyncio.wait_for(refused.wait(), 10)  # no trainer: the second group is refused
        runner.stop()
        stats = await asyncio.wait_for(run, 10)  # the 30 s Retry-After is cut short by the stop
        summary = stats.summary()
        assert summary["groups"] == 1 and summary["groups_not_created"] == 1 and summary["admission_waits"] == 1


async def test_the_client_reads_retry_after_and_other_refusals_are_not_waited_out(tmp_path: Path) -> None:
    async with admitting(tmp_path, retry_after_s=3) as (_, client):
        await client.create_group("t", 2)
        try:
            await client.create_group("t", 2)
        except ProxyError as exc:
            assert (exc.status, exc.code, exc.error_type, exc.retry_after_s) == (
                429,
                "backlog_full",
                "rate_limit_error",
                3.0,
            )
        else:
            raise AssertionError("the second group was admitted over max_backlog_groups=1")
        runner = instant_runner(client, groups=1, group_size=2000, concurrency=2, on_wait=None)
        try:
            await runner.run()  # size over episodes.max_group_size: a 400 ends the run, no wait
        except ProxyError as exc:
            assert exc.status == 400 and runner.stats.admission_waits == 0
        else:
            raise AssertionError("a group over the size limit was created")


class _LosesFirstAnswer(httpx.AsyncBaseTransport):
    """The app behind a network that drops the answer of the first ``POST /groups``: the group is
    created, the runner only sees a read timeout (an overloaded proxy's answer that came too late)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.dropped = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.method == "POST" and request.url.path == "/groups" and not self.dropped:
            self.dropped += 1
            await response.aread()
            raise httpx.ReadTimeout("no answer within the timeout", request=request)
        return response


async def test_an_unanswered_group_creation_is_asked_again_and_counted(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'flywheel.db'}"
    await migrate_async(url)
    async with running_app(make_settings(url)) as app_client:
        transport = _LosesFirstAnswer(httpx.ASGITransport(app=app_client.app))  # type: ignore[attr-defined]
        client = AsyncProxyClient("http://proxy", ADMIN_KEY, transport=transport)
        runner = Runner(
            Instant(NoOptions()),
            RunConfig(proxy_url="http://proxy", admin_key=ADMIN_KEY, groups=3, group_size=2, concurrency=1),
            client,
        )
        stats = await asyncio.wait_for(runner.run(), 60)  # before: the read timeout ended the run
        summary = stats.summary()
        assert transport.dropped == 1 and summary["create_unanswered"] == 1
        assert summary["groups"] == 3 and summary["groups_by_status"] == {"complete": 3}
        # the group whose answer was lost exists, unplayed: its deadline abandons it, it is never trained
        listed = (await app_client.get("/groups", headers=ADMIN)).json()["data"]
        assert sorted(g["status"] for g in listed) == ["complete", "complete", "complete", "open"]
        await client.aclose()
