"""The evaluation both TAC-task workflows report (``tac``: OpenHands, ``miniswe``: mini-swe-agent).

Greedy runs of graded tasks, each reduced to a ``Graded`` row, then one summary: ``accuracy`` is
success (every checkpoint passed: the final score's result reaches its total), ``mean_score`` the
mean share of checkpoint points passed, ``<ending>_rate`` the share of runs the agent ended its own
normal way (``finished`` for OpenHands, ``submitted`` for mini-swe-agent), all also ``by_kind``. A
run abandoned with an error scores 0 and is counted in ``failed`` by its reason, so a report never
silently drops a task. Written once, so the two agents' numbers mean the same.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from workflows.base import Endpoint, Episode, EpisodeFailed, Outcome, in_thread
from workflows.tac.task import TACTask

FAILED = "failed: "
"""How a failed run's ``ending`` starts (then its error, cut to 200 characters)."""


@dataclass(frozen=True)
class Graded:
    """One evaluated task: its kind, success (0 or 1), share of checkpoint points passed, how it ended."""

    kind: str | None
    success: float
    share: float
    ending: str

    @classmethod
    def of(cls, task: TACTask, metadata: Mapping[str, Any]) -> Graded:
        """A graded outcome's row, from the metadata ``play`` records (``final_score``, ``checkpoints``, ``ending``)."""
        result, total = metadata["final_score"]
        checks = metadata["checkpoints"]
        share = sum(r for r, _ in checks) / max(sum(t for _, t in checks), 1)
        return cls(task.kind, float(result >= total), share, str(metadata["ending"]))

    @classmethod
    def failed(cls, task: TACTask, error: Exception) -> Graded:
        """An abandoned run: 0, with its reason."""
        return cls(task.kind, 0.0, 0.0, f"{FAILED}{str(error)[:200]}")


async def run_greedy(
    play: Callable[[TACTask, Episode], Outcome],
    tasks: Sequence[TACTask],
    endpoint: Endpoint,
    *,
    concurrency: int,
    model: str,
) -> list[Graded]:
    """``play`` each task once through ``endpoint`` (unrecorded), ``concurrency`` at once, in task order."""
    slots = asyncio.Semaphore(concurrency)
    proxy = endpoint.base_url.rstrip("/").removesuffix("/v1")  # play() may ask <proxy_url>/v1

    async def one(task: TACTask) -> Graded:
        run_id = str(uuid.uuid4())
        episode = Episode(run_id, run_id, 0, endpoint.base_url, endpoint.api_key, model, endpoint, proxy)
        async with slots:
            try:
                outcome = await in_thread(play, task, episode)
            except EpisodeFailed as exc:
                return Graded.failed(task, exc)
        return Graded.of(task, outcome.metadata)

    return list(await asyncio.gather(*(one(t) for t in tasks)))


def rates(rows: Sequence[Graded], ending: str) -> dict[str, float]:
    """Success, mean share of checkpoints and the share of runs that ended ``ending``."""
    if not rows:
        raise ValueError("no evaluated tasks to summarize")
    return {
        "accuracy": sum(r.success for r in rows) / len(rows),
        "mean_score": round(sum(r.share for r in rows) / len(rows), 4),
        f"{ending}_rate": sum(r.ending == ending for r in rows) / len(rows),
    }


def summarize(rows: Sequence[Graded], ending: str) -> dict[str, Any]:
    """``n``, the rates over all rows, ``failed`` (count per reason) and the rates ``by_kind`` ("-": no kind)."""
    by_kind: dict[str, list[Graded]] = defaultdict(list)
    failed: dict[str, int] = defaultdict(int)
    for row in rows:
        by_kind[row.kind or "-"].append(row)
        if row.ending.startswith(FAILED):
            failed[row.ending] += 1
    return {
        "n": len(rows),
        **rates(rows, ending),
        "failed": dict(failed),
        "by_kind": {k: {"n": len(v), **rates(v, ending)} for k, v in sorted(by_kind.items())},
    }
