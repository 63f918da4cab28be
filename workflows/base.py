"""What a workflow is: its tasks, and one episode function. The runner does everything else.

A new workflow is one module with a subclass of ``Workflow``::

    @dataclass(frozen=True)
    class Options:
        level: int = 1
        \"\"\"Shown by ``python -m workflows list``; set with ``-o level=2``.\"\"\"

    class Echo(Workflow[str, Options]):
        name = "echo"
        options_type = Options

        def tasks(self, split):
            return ["hello", "world"]

        def task_id(self, task):
            return f"echo/{task}"

        async def run_episode(self, task, episode):
            client = openai.AsyncOpenAI(base_url=episode.base_url, api_key=episode.api_key)
            reply = await client.chat.completions.create(model=episode.model, messages=[...])
            return Outcome(reward=float(task in (reply.choices[0].message.content or "")))

and ``python -m workflows run my_package.echo:Echo --proxy ...`` runs it. An episode function
returns an ``Outcome`` or raises; the runner abandons an episode whose function raised, with the
error as its reason, and never invents a reward for it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Literal, TypeVar

from contract.vocabulary import Abandoned

Split = Literal["train", "val", "test"]
"""``val``: a fixed share of the train tasks (``VAL_EVERY``) held out of training, for probes while a
run trains (``deploy/guard.py``); ``train`` is the rest. ``test`` is the final evaluation's."""
Source = Literal["train", "test"]
"""The task lists a workflow provides (``Workflow.tasks``); ``split_tasks`` carves ``val`` out of train."""
VAL_EVERY = 20
"""One train task in this many (by a stable hash of its id) is held out as ``val``: 44 of math's 960,
141 of calc's 2000."""
VAL_MIN_TRAIN = 200
"""A train split smaller than this holds nothing out (its ``val`` is empty): a handful of tasks is
all there is to train on."""
T = TypeVar("T")
O = TypeVar("O")  # noqa: E741 - the workflow's options dataclass
R = TypeVar("R")


def in_val(task_id: str) -> bool:
    """Whether a train task is held out as ``val``: a stable hash of its id, the same on every machine."""
    return int(hashlib.sha256(task_id.encode()).hexdigest()[:8], 16) % VAL_EVERY == 0


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible base URL (ending in ``/v1``) and the key that goes with it."""

    base_url: str
    api_key: str


@dataclass(frozen=True)
class Episode:
    """Everything an agent needs to be recorded under one episode of a group."""

    id: str
    group_id: str
    index: int
    """Position in the group (0-based)."""
    base_url: str
    """Episode-scoped OpenAI base URL: ``<proxy>/episodes/<id>/v1``."""
    api_key: str
    """The episode's own key: it reaches this episode's model calls and nothing else."""
    model: str
    """Model name to ask for; ``policy`` routes to the latest published adapter."""
    passthrough: Endpoint
    """Unrecorded route (``<proxy>/passthrough/v1``) for user simulators and judges: never trained on."""
    proxy_url: str

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.base_url, self.api_key)


@dataclass(frozen=True)
class Outcome:
    """An episode's result: its reward and what to store beside it."""

    reward: float | None
    """The workflow's own (verifier's) reward; None when it has no check for the task, which only the
    judge can then reward (``--reward judge``: ``workflows/judge``)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    call_rewards: dict[int, float] | None = None
    """Optional per-call rewards keyed by call ordinal (0-based)."""


INFRASTRUCTURE = "infrastructure: "
"""How the reason of an abandon with cause ``infrastructure`` starts, for people reading it; the
trainer goes by the cause (``contract.vocabulary.BLAMELESS``), never by the words."""


class EpisodeFailed(Exception):
    """Raise from an episode function to abandon the episode with this reason (no reward)."""


class Workflow(ABC, Generic[T, O]):
    """A task set and the episode function that plays one task through the proxy."""

    name: ClassVar[str]
    options_type: ClassVar[type[Any]]
    """A frozen dataclass of the workflow's options (``-o key=value`` on the command line)."""
    requires: ClassVar[tuple[str, ...]] = ()
    """Top-level packages the workflow imports lazily; checked when it is loaded by name."""
    episode_timeout_s: ClassVar[float] = 600.0
    """Default wall-clock limit of one episode; past it the episode is abandoned."""
    abandoned: ClassVar[Abandoned] = "penalize"
    """What the trainer does with this workflow's abandoned episodes (recorded on each group):
    ``penalize`` counts them with the failure reward, because in an agent workflow an abandon (a
    crash, a timeout, a context overflow) is the agent's doing; ``skip`` leaves them out of the
    baseline. Abandons caused by the proxy or the engine are never penalized (``runner.INFRASTRUCTURE``)."""

    def __init__(self, options: O) -> None:
        self.options = options

    @abstractmethod
    def tasks(self, split: Source) -> Sequence[T]:
        """The split's tasks in a fixed order (the runner shuffles with its own seed)."""

    def split_tasks(self, split: Split) -> list[T]:
        """The tasks a run uses for ``split``: ``test`` as ``tasks`` gives them; ``train`` without, and
        ``val`` only, the held-out share (``in_val``), so a probe never scores a task trained on."""
        if split == "test":
            return list(self.tasks("test"))
        train = list(self.tasks("train"))
        if len(train) < VAL_MIN_TRAIN:
            return train if split == "train" else []
        return [t for t in train if in_val(self.task_id(t)) == (split == "val")]

    @abstractmethod
    def task_id(self, task: T) -> str:
        """A stable id for the task: the group's ``task_id``."""

    def task_metadata(self, task: T) -> dict[str, Any]:
        """JSON stored on the group, so a group can be traced back to its task."""
        return {}

    def describe_task(self, task: T) -> str:
        """The task as a judge should read it (``--reward judge``): what the agent was asked to do.

        The default is the task's metadata as JSON, else its id; a workflow overrides it with the
        real instruction (math: the question; tac: ``task.md``)."""
        metadata = self.task_metadata(task)
        return json.dumps(metadata, sort_keys=True, default=str) if metadata else self.task_id(task)

    def stratum(self, task: T) -> str | None:
        """A label the runner balances its task order over (a task kind), or None for a plain shuffle.

        With strata, every run of consecutive groups holds each stratum in proportion to its share
        of the split, so a trainer step of a few groups sees every kind instead of a random two:
        with a shared output token (an operation name) a step of one kind pulls that token toward
        that kind's answer for all of them."""
        return None

    def kind(self, task: T) -> str | None:
        """The family whose outcomes ``--focus`` pools for a task with little record of its own
        (``picking.py``): tasks of a kind are about as likely to split a group. Its stratum by
        default; a workflow whose order needs no balancing may still name kinds here."""
        return self.stratum(task)

    @abstractmethod
    async def run_episode(self, task: T, episode: Episode) -> Outcome:
        """Play ``task`` with an agent whose model calls go to ``episode``; return its reward."""

    async def evaluate(
        self, endpoint: Endpoint, *, split: Split, limit: int | None, concurrency: int, model: str
    ) -> dict[str, Any]:
        """Score ``model`` on ``split`` through ``endpoint`` (unrecorded); workflows without one raise."""
        raise NotImplementedError

    async def start(self) -> None:
        """Open shared resources (HTTP clients) before the first episode."""

    async def close(self) -> None:
        """Release what ``start`` opened."""


EPISODE_POOL: ContextVar[Executor | None] = ContextVar("flywheel_episode_pool", default=None)
"""The runner's thread pool, sized to its concurrency (asyncio's default pool has only cpus + 4 threads)."""


async def in_thread(fn: Callable[..., R], *args: Any) -> R:
    """Run a blocking agent (OpenHands, tau2) on the runner's thread pool.

    A timed-out episode's thread cannot be killed; it runs on until its next model call, which the
    proxy refuses once the episode is abandoned (409 ``episode_closed``), so it ends soon after."""
    return await asyncio.get_running_loop().run_in_executor(EPISODE_POOL.get(), fn, *args)
