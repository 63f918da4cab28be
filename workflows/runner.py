"""Turn a workflow's tasks into groups of episodes on the proxy, run them concurrently, post rewards.

One group per task draw: ``POST /groups`` (size N), then N episode functions at once, at most
``concurrency`` episodes running overall. A group is created only when a slot for it frees up, so
its episodes start soon after and ask for ``policy`` (the latest adapter) when they run. Each
episode ends in exactly one of: rewarded (its function returned an ``Outcome``), abandoned (its
function raised or timed out: the error is the reason; no reward is made up), or ``error`` (the
proxy refused the reward or abandon, e.g. because its reaper abandoned the episode first).

With ``reward`` ``judge`` or ``mix`` (``workflows/judge``), an episode whose function returned is
not rewarded at once: once every episode of its group has ended, the judge scores the returned ones
side by side (one request) and their rewards are posted then; if the judge gives up they are
abandoned with its reason. Episodes whose function raised are abandoned as ever and not judged.

Fork mode (``fork_share`` > 0): after a group ends, while fork groups stay within that share of
all groups, one of its rewarded episodes is forked where ``fork_rule`` says (``forking.py``) and
the fork group's episodes run the same task with the same agent; the proxy replays the source's
calls up to the fork point (``proxy/replay.py``). Skips and divergences are in the summary.

``loop`` keeps drawing tasks (cycling through a seeded shuffle, balanced over the workflow's
strata; with ``focus``, a share of draws goes to tasks whose groups are likely to disagree:
``picking.py``) until ``stop()``; ``max_pending`` pauses it while the trainer has that many complete
groups left to claim, so the data it trains on stays close to the current policy.

With ``source`` (``--source teacher:<name>``) every group and episode carries ``metadata.source``:
the proxy then has that teacher answer the agents' calls (``proxy/teachers.py``), recorded as
demonstrations for a warm start and never trained on-policy; a teacher never runs the test split.

Admission control: the proxy refuses a group that could only be trained stale (429 ``backlog_full``,
``proxy/admission.py``). The runner then waits the answer's ``Retry-After`` (at most
``admission_max_wait_s`` per wait; a stop cuts the wait short) and asks again, for as long as it
takes: the task is never dropped. Waits and their seconds are counted in the summary
(``admission_waits``, ``admission_wait_s``); a task whose group was never created because the run
stopped while it waited is counted in ``groups_not_created``.

A group creation the proxy did not answer (a read timeout on an overloaded machine: the request may
or may not have created a group) is asked again after a pause, up to ``UNANSWERED_LIMIT`` times in a
row, and counted in ``create_unanswered``; a group created but never answered has no episode that
is played, so the proxy's deadline abandons it and it is never trained.

Beside it: ``config.py`` (``RunConfig``), ``results.py`` (what the run reports), ``failures.py``
(an episode's error as its abandon reason and cause).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from contract.client import AsyncProxyClient, CreatedGroup, EpisodeKey, ProxyError, ProxyUnreachable
from contract.vocabulary import AbandonCause
from workflows.base import EPISODE_POOL, INFRASTRUCTURE, Endpoint, Episode, Outcome, Workflow
from workflows.config import RunConfig
from workflows.failures import cause_of, check_outcome, describe_error
from workflows.forking import ForkPoint, fork_point
from workflows.judge import JUDGE_FAILED, Judge, JudgedGroup, abandon, reward_group
from workflows.picking import TaskPicker
from workflows.results import EpisodeResult, GroupResult, RunStats, Status

# What callers import from here; ``RunConfig``, the results and ``describe_error`` live beside it.
__all__ = [
    "INFRASTRUCTURE",
    "AsyncProxyClient",
    "EpisodeResult",
    "GroupResult",
    "RunConfig",
    "RunStats",
    "Runner",
    "describe_error",
    "task_order",
]

PENDING_POLL_S = 2.0
"""Seconds between asks for the trainer's pending groups while ``max_pending`` holds the run back."""
ADMISSION_WAIT_S = 5.0
"""Wait after a 429 ``backlog_full`` that carries no ``Retry-After``."""
UNANSWERED_LIMIT = 5
"""Unanswered group creations in a row before the runner gives up (each took the client's timeout)."""
UNANSWERED_WAIT_S = 2.0
"""Pause before asking again for a group creation the proxy did not answer."""
RECALL_GROUPS = 1000
"""With ``focus``: the most finished groups read back from the store to seed the task statistics."""
T = TypeVar("T")


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


class Runner:
    def __init__(
        self,
        workflow: Workflow[Any, Any],
        config: RunConfig,
        client: AsyncProxyClient,
        *,
        on_episode: Callable[[EpisodeResult], None] | None = None,
        on_group: Callable[[GroupResult], None] | None = None,
        on_admission_wait: Callable[[float], None] | None = None,
        judge: Judge | None = None,
    ) -> None:
        if config.reward != "verifier" and judge is None:
            raise ValueError(f"reward {config.reward!r} needs a judge")
        self.workflow = workflow
        self.config = config
        self.client = client
        self.judge = judge if config.reward != "verifier" else None
        self.stats = RunStats(judge=self.judge.stats if self.judge is not None else None)
        self._on_episode = on_episode or (lambda _: None)
        self._on_group = on_group or (lambda _: None)
        self._on_admission_wait = on_admission_wait or (lambda _: None)
        self._episode_slots = asyncio.Semaphore(config.concurrency)
        self._stopping = asyncio.Event()
        self._timeout = config.episode_timeout_s or workflow.episode_timeout_s
        self._picker: TaskPicker[Any] | None = None
        """The next task to draw (``picking.py``); made when the run starts."""
        self._rng = random.Random(config.seed)
        """Fork points (``forking.py``), seeded like the task order."""
        self._passthrough = Endpoint(f"{client.proxy_url}/passthrough/v1", config.passthrough_key or config.admin_key)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def stop(self) -> None:
        """Create no more groups; episodes already created run to their end."""
        self._stopping.set()

    async def run(self) -> RunStats:
        tasks = self.workflow.split_tasks(self.config.split)
        if not tasks:
            raise ValueError(f"workflow {self.workflow.name!r} has no {self.config.split} tasks")
        tasks = task_order(tasks, self.config.seed, self.workflow.stratum)
        self._picker = TaskPicker(
            tasks, self.workflow.task_id, focus=self.config.focus, seed=self.config.seed, kind=self.workflow.kind
        )
        if self.config.focus > 0:
            await self._recall(self._picker)
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
                job = loop.create_task(self._group(self._picker.next(), pool))
                self.stats.focused_draws = self._picker.focused
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

    async def _recall(self, picker: TaskPicker[Any]) -> None:
        """Seed the task statistics with this workflow's finished groups already in the store (a
        resumed run's, earlier runs'), newest first, at most ``RECALL_GROUPS`` (one read each)."""
        offset = 0
        while self.stats.recalled_groups < RECALL_GROUPS:
            page = await self.client.groups(status="complete", limit=200, offset=offset)
            if not page:
                return
            offset += len(page)
            for listed in page:
                meta = listed.metadata
                if meta.get("workflow") != self.workflow.name or meta.get("split") != self.config.split:
                    continue
                if "fork" in meta:  # a fork group's rewards compare one state, not the task
                    continue
                group = await self.client.group(listed.id)
                picker.observe(group.task_id, [e.reward for e in group.episodes or () if e.reward is not None])
                self.stats.recalled_groups += 1

    async def _wait_for_trainer(self) -> None:
        if self.config.max_pending is None:
            return
        while not self._stopping.is_set() and await self.client.pending_groups() >= self.config.max_pending:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), PENDING_POLL_S)

    async def _create(self, task: Any, task_id: str) -> CreatedGroup | None:
        """The task's group, asked for again after each admission refusal; None if the run stopped first."""
        wf, cfg = self.workflow, self.config
        source = {"source": cfg.source} if cfg.source is not None else {}  # who answers (a teacher)
        unanswered = 0
        while True:
            try:
                return await self.client.create_group(
                    task_id,
                    cfg.group_size,
                    metadata={
                        "workflow": wf.name,
                        "split": cfg.split,
                        "task": wf.task_metadata(task),
                        "abandoned": wf.abandoned,
                        **source,
                    },
                    episode_metadata=[{"index": i, **source} for i in range(cfg.group_size)],
                )
            except ProxyUnreachable:
                unanswered += 1
                self.stats.create_unanswered += 1
                if unanswered >= UNANSWERED_LIMIT:
                    raise
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), UNANSWERED_WAIT_S)
                if self._stopping.is_set():
                    self.stats.groups_not_created += 1
                    return None
                continue
            except ProxyError as exc:
                if exc.status != 429 or exc.code != "backlog_full":
                    raise
                wait_s = min(exc.retry_after_s or ADMISSION_WAIT_S, cfg.admission_max_wait_s)
            self.stats.admission_waits += 1
            self._on_admission_wait(wait_s)
            started = time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), wait_s)
            self.stats.admission_wait_s += time.monotonic() - started
            if self._stopping.is_set():
                self.stats.groups_not_created += 1
                return None

    async def _group(self, task: Any, pool: ThreadPoolExecutor) -> None:
        task_id = self.workflow.task_id(task)
        created = await self._create(task, task_id)
        if created is None:
            return
        group = await self._play(task, task_id, created, pool)
        if self._fork_due():
            await self._fork(task, task_id, group, pool)

    async def _play(
        self, task: Any, task_id: str, created: CreatedGroup, pool: ThreadPoolExecutor, fork: ForkPoint | None = None
    ) -> GroupResult:
        """Run a created group's episodes (a fork group's too: the same agent, unchanged) and report it."""
        ended = await asyncio.gather(
            *(self._episode(task, task_id, created.id, key, i, pool) for i, key in enumerate(created.episode_keys))
        )
        results, attempts = await self._judged(task, task_id, created.id, ended)
        status: str  # the proxy's GroupStatus, or why it is unknown
        diverged = 0
        try:
            found = await self.client.group(created.id)
            status = found.status
            diverged = sum(e.diverged_at is not None for e in found.episodes or ())
        except ProxyError as exc:
            status = f"unknown ({exc.message})"
        group = GroupResult(
            group_id=created.id,
            task_id=task_id,
            status=status,
            episodes=results,
            judge_attempts=attempts,
            fork=fork,
            diverged=diverged,
            kind=self.workflow.kind(task),
        )
        self.stats.groups.append(group)
        if fork is None and self._picker is not None:
            self._picker.observe(task_id, [e.reward for e in results if e.reward is not None])
        self._on_group(group)
        return group

    def _fork_due(self) -> bool:
        """Fork mode: whether one more fork group keeps forks within ``fork_share`` of all groups."""
        share = self.config.fork_share
        if share <= 0 or self._stopping.is_set():
            return False
        forks = sum(g.fork is not None for g in self.stats.groups)
        return forks + 1 <= share * (len(self.stats.groups) + 1)

    async def _fork(self, task: Any, task_id: str, group: GroupResult, pool: ThreadPoolExecutor) -> None:
        """Fork the finished ``group`` where its rule says (``forking.py``) and play the fork group."""
        cfg = self.config
        try:
            episodes = [await self.client.episode(e.episode_id) for e in group.episodes if e.status == "rewarded"]
            point = fork_point(episodes, cfg.fork_rule, self._rng)
            if isinstance(point, str):
                self.stats.forks_skipped[point] = self.stats.forks_skipped.get(point, 0) + 1
                return
            created = await self.client.fork(
                point.source, point.at, cfg.fork_size or cfg.group_size, on_divergence=cfg.fork_on_divergence
            )
        except ProxyError as exc:  # e.g. 429 backlog_full: the fork is skipped, never waited for
            why = f"refused ({exc.status} {exc.code or ''})".replace(" )", ")")
            self.stats.forks_skipped[why] = self.stats.forks_skipped.get(why, 0) + 1
            return
        await self._play(task, task_id, created, pool, fork=point)

    async def _judged(
        self, task: Any, task_id: str, group_id: str, ended: list[EpisodeResult | _Played]
    ) -> tuple[list[EpisodeResult], int | None]:
        """The group's results once the judge has scored its played episodes (none to score: as they are)."""
        played = {p.episode_id: p for p in ended if isinstance(p, _Played)}
        if self.judge is None or not played:
            return [r for r in ended if isinstance(r, EpisodeResult)], None
        try:
            judged = await reward_group(
                self.client,
                self.judge,
                group_id=group_id,
                task=self.workflow.describe_task(task),
                episode_ids=list(played),
                mode=self.config.reward,
                weight=self.config.judge_weight,
                verifier={i: p.outcome.reward for i, p in played.items()},
                metadata={i: p.outcome.metadata for i, p in played.items()},
            )
        except asyncio.CancelledError:
            for episode_id in played:
                with contextlib.suppress(Exception):
                    await asyncio.shield(
                        self.client.abandon(
                            episode_id, "interrupted: the runner stopped mid-judgement", cause="interrupted"
                        )
                    )
            raise
        except Exception as exc:  # a bug or an odd endpoint: the episodes still end, with the reason
            self.judge.stats.failed += 1
            reason = JUDGE_FAILED + describe_error(exc)
            judged = JudgedGroup([await abandon(self.client, e, reason) for e in played], 0)
        by_id = {s.episode_id: s for s in judged.episodes}
        results = []
        for item in ended:
            if isinstance(item, _Played):
                s = by_id[item.episode_id]
                item = EpisodeResult(
                    episode_id=s.episode_id,
                    group_id=group_id,
                    task_id=task_id,
                    status=s.status,
                    reward=s.reward,
                    error=s.error,
                    seconds=round(time.monotonic() - item.started, 3),
                    metadata=s.metadata,
                )
                self._on_episode(item)
            results.append(item)
        return results, judged.attempts

    async def _episode(
        self, task: Any, task_id: str, group_id: str, key: EpisodeKey, index: int, pool: ThreadPoolExecutor
    ) -> EpisodeResult | _Played:
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
                check_outcome(outcome, self.config.reward)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await asyncio.shield(
                        self.client.abandon(key.id, "interrupted: the runner stopped mid-episode", cause="interrupted")
                    )
                raise
            except Exception as exc:  # the agent failed: abandon with its error, never a made-up reward
                result = await self._finish(
                    key.id, group_id, task_id, started, None, describe_error(exc), cause=cause_of(exc)
                )
            else:
                if self.judge is not None:  # rewarded once the whole group has ended (_judged)
                    return _Played(key.id, outcome, started)
                result = await self._finish(key.id, group_id, task_id, started, outcome, None)
            finally:
                EPISODE_POOL.reset(token)
        self._on_episode(result)
        return result

    async def _finish(
        self,
        episode_id: str,
        group_id: str,
        task_id: str,
        started: float,
        outcome: Outcome | None,
        error: str | None,
        cause: AbandonCause = "agent",
    ) -> EpisodeResult:
        status: Status
        if outcome is not None and outcome.reward is None:  # check_outcome lets it through only for the judge
            outcome, error = None, "no verifier reward and no judge"
        try:
            if outcome is not None and outcome.reward is not None:
                await self.client.reward(
                    episode_id, outcome.reward, metadata=outcome.metadata or None, call_rewards=outcome.call_rewards
                )
                status = "rewarded"
            else:
                await self.client.abandon(episode_id, error or "abandoned", cause=cause)
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


@dataclass(frozen=True)
class _Played:
    """An episode whose function returned, waiting for the judge (reward ``judge`` or ``mix``)."""

    episode_id: str
    outcome: Outcome
    started: float
