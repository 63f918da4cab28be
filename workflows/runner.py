"""Turn a workflow's tasks into groups of episodes on the proxy, run them concurrently, post rewards.

One group per task draw: ``POST /groups`` (size N), then N episode functions at once, at most
``concurrency`` episodes running overall. A group is created only when a slot for it frees up, so
its episodes start soon after and ask for ``policy`` (the latest adapter) when they run. Each
episode ends in exactly one of: rewarded (its function returned an ``Outcome``), abandoned (its
function raised or timed out: the error is the reason; no reward is made up), or ``error`` (the
proxy refused the reward or abandon, e.g. because its reaper abandoned the episode first).

``loop`` keeps drawing tasks (cycling through a seeded shuffle, balanced over the workflow's
strata) until ``stop()``; ``max_pending`` pauses it while the trainer has that many complete
groups left to claim, so the data it trains on stays close to the current policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from proxy.client import AsyncProxyClient, EpisodeKey, ProxyError
from workflows.base import EPISODE_POOL, Endpoint, Episode, EpisodeFailed, Outcome, Split, Workflow

PENDING_POLL_S = 2.0
T = TypeVar("T")


@dataclass(frozen=True)
class RunConfig:
    proxy_url: str
    admin_key: str
    groups: int = 1
    """Groups to run (ignored with ``loop``)."""
    group_size: int = 4
    """Episodes per group: GRPO's G."""
    concurrency: int = 4
    """Episodes running at once, over all groups."""
    split: Split = "train"
    loop: bool = False
    model: str = "policy"
    episode_timeout_s: float | None = None
    """Default: the workflow's own ``episode_timeout_s``."""
    seed: int = 0
    """Seeds the task order."""
    max_pending: int | None = None
    passthrough_key: str | None = None
    """Key for ``/passthrough/v1`` (an agent key); default: the admin key."""

    def __post_init__(self) -> None:
        if self.groups < 1 and not self.loop:
            raise ValueError(f"groups must be >= 1 (got {self.groups}), or use loop")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1 (got {self.group_size}); GRPO needs >= 2 to learn")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1 (got {self.concurrency})")


def task_order(tasks: list[T], seed: int, stratum: Callable[[T], str | None]) -> list[T]:
    """The seeded order the runner draws groups in: a shuffle, balanced over strata where given.

    Each stratum is shuffled apart, then the strata are interleaved by position: the i-th of n
    tasks of a stratum sits at (i + 0.5) / n, so any window of consecutive tasks holds each
    stratum in proportion to its size (ties in stratum order, which the seed also shuffles)."""
    rng = random.Random(seed)
    strata: dict[str | None, list[T]] = {}
    for task in tasks:
        strata.setdefault(stratum(task), []).append(task)
    if list(strata) == [None]:
        rng.shuffle(tasks)
        return tasks
    labels = list(strata)
    rng.shuffle(labels)
    keyed: list[tuple[float, int, T]] = []
    for rank, label in enumerate(labels):
        members = strata[label]
        rng.shuffle(members)
        keyed += [((i + 0.5) / len(members), rank, task) for i, task in enumerate(members)]
    keyed.sort(key=lambda k: (k[0], k[1]))
    return [task for _, _, task in keyed]


Status = Literal["rewarded", "abandoned", "error"]


@dataclass(frozen=True)
class EpisodeResult:
    episode_id: str
    group_id: str
    task_id: str
    status: Status
    reward: float | None
    error: str | None
    seconds: float
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GroupResult:
    group_id: str
    task_id: str
    status: str
    """The proxy's view once every episode ended: complete, failed (too few rewarded) or open."""
    episodes: list[EpisodeResult]


@dataclass
class RunStats:
    groups: list[GroupResult] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    @property
    def episodes(self) -> list[EpisodeResult]:
        return [e for g in self.groups for e in g.episodes]

    def summary(self) -> dict[str, Any]:
        episodes = self.episodes
        rewards = [e.reward for e in episodes if e.reward is not None]
        by_status = {s: sum(e.status == s for e in episodes) for s in ("rewarded", "abandoned", "error")}
        return {
            "groups": len(self.groups),
            "groups_by_status": {
                s: sum(g.status == s for g in self.groups) for s in sorted({g.status for g in self.groups})
            },
            "episodes": len(episodes),
            **by_status,
            "mean_reward": sum(rewards) / len(rewards) if rewards else None,
            "episode_seconds_mean": (sum(e.seconds for e in episodes) / len(episodes)) if episodes else None,
            "wall_seconds": round(time.monotonic() - self.started, 2),
            "errors": [
                {"episode_id": e.episode_id, "error": (e.error or "")[:300]} for e in episodes if e.status != "rewarded"
            ][:20],
        }


INFRASTRUCTURE = "infrastructure: "
"""Prefix of abandon reasons that are not the agent's doing (the trainer never penalizes them)."""


def _infrastructure(exc: BaseException) -> bool:
    """A model call that failed on the proxy or the engine (5xx, connection, transport timeout), not the agent."""
    status = getattr(exc, "status_code", None)
    name = type(exc).__name__
    return (
        (isinstance(status, int) and status >= 500)
        or isinstance(exc, ConnectionError)
        or name in ("APIConnectionError", "APITimeoutError", "ConnectError", "ReadError", "RemoteProtocolError")
    )


def describe_error(exc: BaseException) -> str:
    """A reason to store with an abandoned episode: the error and where it came from."""
    if isinstance(exc, TimeoutError):
        return "timeout: the episode ran past its time limit"
    if _infrastructure(exc):
        return INFRASTRUCTURE + f"{type(exc).__name__}: {exc}"[:2000]
    if isinstance(exc, EpisodeFailed):
        return str(exc) or "EpisodeFailed"
    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    where = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in reversed(frames))
    return f"{type(exc).__name__}: {exc}" + (f" [at {where}]" if where else "")


class Runner:
    def __init__(
        self,
        workflow: Workflow[Any, Any],
        config: RunConfig,
        client: AsyncProxyClient,
        *,
        on_episode: Callable[[EpisodeResult], None] | None = None,
        on_group: Callable[[GroupResult], None] | None = None,
    ) -> None:
        self.workflow = workflow
        self.config = config
        self.client = client
        self.stats = RunStats()
        self._on_episode = on_episode or (lambda _: None)
        self._on_group = on_group or (lambda _: None)
        self._episode_slots = asyncio.Semaphore(config.concurrency)
        self._stopping = asyncio.Event()
        self._timeout = config.episode_timeout_s or workflow.episode_timeout_s
        self._passthrough = Endpoint(f"{client.proxy_url}/passthrough/v1", config.passthrough_key or config.admin_key)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def stop(self) -> None:
        """Create no more groups; episodes already created run to their end."""
        self._stopping.set()

    async def run(self) -> RunStats:
        tasks = list(self.workflow.tasks(self.config.split))
        if not tasks:
            raise ValueError(f"workflow {self.workflow.name!r} has no {self.config.split} tasks")
        tasks = task_order(tasks, self.config.seed, self.workflow.stratum)
        in_flight = max(1, math.ceil(self.config.concurrency / self.config.group_size)) + 1
        group_slots = asyncio.Semaphore(in_flight)
        running: set[asyncio.Task[None]] = set()
        loop = asyncio.get_running_loop()
        pool = ThreadPoolExecutor(max_workers=self.config.concurrency + 2, thread_name_prefix="episode")
        fatal: list[BaseException] = []  # a group that could not even be created (e.g. 401) ends the run
        await self.workflow.start()
        try:
            n = 0
            while (self.config.loop or n < self.config.groups) and not self._stopping.is_set():
                await group_slots.acquire()
                if self._stopping.is_set():
                    group_slots.release()
                    break
                await self._wait_for_trainer()
                job = loop.create_task(self._group(tasks[n % len(tasks)], pool))
                running.add(job)

                def finished(j: asyncio.Task[None]) -> None:
                    running.discard(j)
                    group_slots.release()
                    if not j.cancelled() and j.exception() is not None:
                        fatal.append(j.exception())  # type: ignore[arg-type]
                        self._stopping.set()

                job.add_done_callback(finished)
                n += 1
            await asyncio.gather(*running)
            if fatal:
                raise fatal[0]
        finally:
            for job in running:
                job.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(*running, return_exceptions=True)
            await self.workflow.close()
            pool.shutdown(wait=False, cancel_futures=True)
        return self.stats

    async def _wait_for_trainer(self) -> None:
        if self.config.max_pending is None:
            return
        while not self._stopping.is_set() and await self.client.pending_groups() >= self.config.max_pending:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), PENDING_POLL_S)

    async def _group(self, task: Any, pool: ThreadPoolExecutor) -> None:
        wf, cfg = self.workflow, self.config
        task_id = wf.task_id(task)
        created = await self.client.create_group(
            task_id,
            cfg.group_size,
            metadata={
                "workflow": wf.name,
                "split": cfg.split,
                "task": wf.task_metadata(task),
                "abandoned": wf.abandoned,
            },
            episode_metadata=[{"index": i} for i in range(cfg.group_size)],
        )
        results = await asyncio.gather(
            *(self._episode(task, task_id, created.id, key, i, pool) for i, key in enumerate(created.episode_keys))
        )
        status: str  # the proxy's GroupStatus, or why it is unknown
        try:
            status = (await self.client.group(created.id)).status
        except ProxyError as exc:
            status = f"unknown ({exc.message})"
        group = GroupResult(group_id=created.id, task_id=task_id, status=status, episodes=list(results))
        self.stats.groups.append(group)
        self._on_group(group)

    async def _episode(
        self, task: Any, task_id: str, group_id: str, key: EpisodeKey, index: int, pool: ThreadPoolExecutor
    ) -> EpisodeResult:
        episode = Episode(
            id=key.id,
            group_id=group_id,
            index=index,
            base_url=key.base_url,
            api_key=key.api_key,
            model=self.config.model,
            passthrough=self._passthrough,
            proxy_url=self.client.proxy_url,
        )
        async with self._episode_slots:
            started = time.monotonic()
            token = EPISODE_POOL.set(pool)
            try:
                outcome = await asyncio.wait_for(self.workflow.run_episode(task, episode), self._timeout)
                _check_outcome(outcome)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.client.abandon(key.id, "interrupted: the runner stopped mid-episode"))
                raise
            except Exception as exc:  # the agent failed: abandon with its error, never a made-up reward
                result = await self._finish(key.id, group_id, task_id, started, None, describe_error(exc))
            else:
                result = await self._finish(key.id, group_id, task_id, started, outcome, None)
            finally:
                EPISODE_POOL.reset(token)
        self._on_episode(result)
        return result

    async def _finish(
        self, episode_id: str, group_id: str, task_id: str, started: float, outcome: Outcome | None, error: str | None
    ) -> EpisodeResult:
        status: Status
        try:
            if outcome is not None:
                await self.client.reward(
                    episode_id, outcome.reward, metadata=outcome.metadata or None, call_rewards=outcome.call_rewards
                )
                status = "rewarded"
            else:
                await self.client.abandon(episode_id, error or "abandoned")
                status = "abandoned"
        except ProxyError as exc:
            status, error = "error", f"{error + '; ' if error else ''}could not finish the episode: {exc}"
        return EpisodeResult(
            episode_id=episode_id,
            group_id=group_id,
            task_id=task_id,
            status=status,
            reward=outcome.reward if outcome is not None and status == "rewarded" else None,
            error=error,
            seconds=round(time.monotonic() - started, 3),
            metadata=outcome.metadata if outcome is not None else {},
        )


def _check_outcome(outcome: Any) -> None:
    if not isinstance(outcome, Outcome):
        raise EpisodeFailed(f"episode function returned {type(outcome).__name__}, not an Outcome")
    if not math.isfinite(outcome.reward):
        raise EpisodeFailed(f"episode function returned a non-finite reward ({outcome.reward})")
