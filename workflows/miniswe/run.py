"""mini-swe-agent on TheAgentCompany-layout tasks: its own loop and bash tool, TAC's evaluators score.

The tasks, their local runtime (a temp workspace, ``init.sh``, the evaluator in a subprocess) and
the reward are ``tac``'s (``workflows/tac``): the same bundled tasks or generated family
(``family=N``), the same splits, reward = TAC's score ``0.5 * result/total + 0.5 * (result //
total)``. Only the agent differs: mini-swe-agent's ``DefaultAgent`` with the package's own ``mini``
config, unchanged (``agent.py``). An episode is graded however the agent ended it (submitted, step
limit, repeated format errors); one whose task could not be set up, whose model call or command
environment failed, or whose evaluator failed is abandoned with that error.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from workflows.base import Endpoint, Episode, Outcome, Source, Split, Workflow, in_thread
from workflows.miniswe.agent import AgentConfig, run_agent
from workflows.tac.run import TACOptions, TACWorkflow
from workflows.tac.runtime import LocalRuntime
from workflows.tac.scoring import score
from workflows.tac.summary import run_greedy, summarize
from workflows.tac.task import BUNDLED, TACTask


@dataclass(frozen=True)
class MiniSweOptions:
    tasks_dir: Path = BUNDLED
    """Directory of TAC-layout tasks (default: tac's bundled local tasks)."""
    family: int | None = None
    """N: instead of tasks_dir, N generated local tasks (workflows/tac/family.py; train/val/test 80/10/10)."""
    family_seed: int = 0
    """Seed of the generated family (family=N), generated once into $FLYWHEEL_CACHE/tac-family."""
    tasks: list[str] | None = None
    """Only these task names (comma-separated)."""
    step_limit: int = 6
    """Model calls per episode (mini-swe-agent's step_limit; its prompt and tool are ~1.0k of SmolLM2's 8k tokens)."""
    temperature: float = 1.0
    """Agent sampling temperature."""
    max_tokens: int = 256
    """Cap per model call: six steps of 256 tokens plus their command outputs fit in 8k."""
    command_timeout_s: int = 30
    """Seconds one bash command may run (mini-swe-agent's LocalEnvironment timeout)."""
    keep_workspaces: bool = False
    """Keep each episode's workspace and trajectory for inspection (default: deleted after grading)."""
    workspace_root: Path | None = None
    """Parent of the per-episode temp directories (default: the system temp dir)."""

    def __post_init__(self) -> None:
        if self.step_limit < 1:
            raise ValueError(f"step_limit must be >= 1, got {self.step_limit}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.command_timeout_s < 1:
            raise ValueError(f"command_timeout_s must be >= 1 second, got {self.command_timeout_s}")
        self.tac  # noqa: B018 - tac's checks of the task options (family with tasks_dir)

    @property
    def tac(self) -> TACOptions:
        """The task options as tac reads them: the same tasks, splits and local runtime."""
        return TACOptions(
            tasks_dir=self.tasks_dir,
            family=self.family,
            family_seed=self.family_seed,
            tasks=self.tasks,
            keep_workspaces=self.keep_workspaces,
            workspace_root=self.workspace_root,
        )


class MiniSweWorkflow(Workflow[TACTask, MiniSweOptions]):
    """mini-swe-agent (bash only, its own prompt and loop) on TAC-layout tasks; reward = TAC's score."""

    name = "miniswe"
    options_type = MiniSweOptions
    requires = ("minisweagent", "litellm")
    episode_timeout_s = 1200.0

    @cached_property
    def tac(self) -> TACWorkflow:
        """tac's workflow over the same tasks: task loading, splits and strata come from it."""
        return TACWorkflow(self.options.tac)

    @property
    def tasks_root(self) -> Path:
        """tac's task directory (the generated family's, generated on first use): the launcher's
        demonstrator plays the scripts there (``deploy/stack.py``)."""
        return self.tac.tasks_root

    def tasks(self, split: Source | Split) -> Sequence[TACTask]:
        return self.tac.tasks(split)

    def split_tasks(self, split: Split) -> list[TACTask]:
        return self.tac.split_tasks(split)

    def stratum(self, task: TACTask) -> str | None:
        return self.tac.stratum(task)

    def task_id(self, task: TACTask) -> str:
        return f"miniswe/{task.name}"

    def task_metadata(self, task: TACTask) -> dict[str, Any]:
        return {"task": task.name, "agent": "mini-swe-agent", **({"kind": task.kind} if task.kind else {})}

    def describe_task(self, task: TACTask) -> str:
        return task.instruction

    def play(self, task: TACTask, episode: Episode) -> Outcome:
        """Set up, run the agent, grade, clean up (blocking: runs in the runner's thread pool)."""
        opts = self.options
        runtime = LocalRuntime(root=opts.workspace_root, keep=opts.keep_workspaces)
        prepared = runtime.prepare(task, episode.id)
        try:
            run = run_agent(
                prepared.instruction,
                prepared.workdir,
                AgentConfig(
                    model=episode.model,
                    base_url=episode.base_url,
                    api_key=episode.api_key,
                    step_limit=opts.step_limit,
                    temperature=opts.temperature,
                    max_tokens=opts.max_tokens,
                    command_timeout_s=opts.command_timeout_s,
                ),
            )
            result = runtime.evaluate(prepared, run.trajectory) if task.graded else None
        finally:
            runtime.cleanup(prepared)
        ran = {
            "ending": run.ending,
            "exit_status": run.exit_status,
            "steps": run.steps,
            "format_errors": run.format_errors,
        }
        if result is None:  # no checkpoints: the judge rewards it (the runner refuses it otherwise)
            return Outcome(reward=None, metadata={"checkpoints": None, **ran})
        final = result.final_score
        return Outcome(
            reward=score(final),
            metadata={
                "checkpoints": [[c.result, c.total] for c in result.checkpoints],
                "final_score": [final.result, final.total],
                **ran,
            },
        )

    async def run_episode(self, task: TACTask, episode: Episode) -> Outcome:
        return await in_thread(self.play, task, episode)

    async def evaluate(
        self, endpoint: Endpoint, *, split: Split, limit: int | None, concurrency: int, model: str
    ) -> dict[str, Any]:
        """Greedy runs on the split's first ``limit`` graded tasks through ``endpoint`` (unrecorded).

        ``accuracy`` is success (every checkpoint passed), ``mean_score`` the mean share of
        checkpoints passed, ``submitted_rate`` the share the agent submitted (format apart from
        success), all also ``by_kind``; a failed run scores 0 and is counted in ``failed``
        (``workflows/tac/summary.py``, shared with ``tac``)."""
        tasks = [t for t in self.split_tasks(split) if t.graded][:limit]
        if not tasks:
            raise ValueError(f"no graded {split} TAC tasks to evaluate")
        greedy = MiniSweWorkflow(dataclasses.replace(self.options, temperature=0.0))
        started = time.monotonic()
        rows = await run_greedy(greedy.play, tasks, endpoint, concurrency=concurrency, model=model)
        return {
            "workflow": self.name,
            "split": split,
            "model": model,
            **summarize(rows, "submitted"),
            "step_limit": self.options.step_limit,
            "max_tokens": self.options.max_tokens,
            "seconds": round(time.monotonic() - started, 2),
        }
