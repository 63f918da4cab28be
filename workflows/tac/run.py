"""OpenHands on TheAgentCompany-layout tasks: the agent works, the task's evaluator scores checkpoints.

Reward = TAC's final score ``0.5 * result/total + 0.5 * (result // total)``. An episode whose
task could not be set up, whose agent run failed, or whose evaluator failed is abandoned with that
error; only a graded run gets a reward. A task without an evaluator (no checkpoints) is not graded:
its episodes need ``--reward judge``, which scores each group's runs against ``task.md``.

Tasks come from ``tasks_dir`` (default: the six bundled ones) or, with ``family=N``, from N tasks of
the generated family (``family.py``), written once into ``$FLYWHEEL_CACHE/tac-family``. A
``splits.yml`` that lists ``val`` (the family's) decides all three splits; otherwise ``val`` is
carved out of train as for every workflow (``Workflow.split_tasks``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from workflows.base import Endpoint, Episode, Outcome, Source, Split, Workflow, in_thread
from workflows.tac.agent import AgentConfig, run_agent
from workflows.tac.family import ensure as ensure_family
from workflows.tac.runtime import DockerRuntime, LocalRuntime, Runtime
from workflows.tac.scoring import score
from workflows.tac.summary import run_greedy, summarize
from workflows.tac.task import BUNDLED, TACTask, load_tasks, split_names


@dataclass(frozen=True)
class TACOptions:
    tasks_dir: Path = BUNDLED
    """Directory of TAC-layout tasks (default: the bundled local tasks)."""
    family: int | None = None
    """N: instead of tasks_dir, N generated local tasks (workflows/tac/family.py; train/val/test 80/10/10)."""
    family_seed: int = 0
    """Seed of the generated family (family=N); each (seed, N) is generated once into $FLYWHEEL_CACHE/tac-family."""
    tasks: list[str] | None = None
    """Only these task names (comma-separated)."""
    runtime: Literal["local", "docker"] = "local"
    """local: temp workspace on this host (tasks without services); docker: official TAC images."""
    max_iterations: int = 6
    """Agent steps per episode (TAC's harness uses 100; a step is one LLM call)."""
    temperature: float = 1.0
    """Agent sampling temperature."""
    max_output_tokens: int = 256
    """Cap per agent step: the prompt leaves ~1.9k of 8k tokens for the whole episode."""
    max_input_tokens: int = 8192
    """The served context (vLLM --max-model-len); OpenHands' prompt and tools take ~6.3k of 8k."""
    system_prompt: Literal["openhands", "short"] = "openhands"
    """openhands: the SDK's own prompt; short: a compact one for small-context models."""
    keep_workspaces: bool = False
    """Keep each episode's workspace and trajectory for inspection (default: deleted after grading)."""
    workspace_root: Path | None = None
    """Parent of the per-episode temp directories (default: the system temp dir)."""
    server_hostname: str = "localhost"
    """docker runtime: where TAC's services (GitLab, RocketChat, ownCloud, Plane) run."""
    env_model: str = "policy-base"
    """docker runtime: LLM for TAC's NPCs and LLM-graded checkpoints (through /passthrough/v1)."""

    def __post_init__(self) -> None:
        if self.max_iterations < 1:
            raise ValueError(f"max_iterations must be >= 1, got {self.max_iterations}")
        if self.family is not None and self.family < 1:
            raise ValueError(f"family must be a number of tasks >= 1, got {self.family}")
        if self.family is not None and self.tasks_dir != BUNDLED:
            raise ValueError(
                "family=N generates its own tasks: leave tasks_dir unset, or point it at a generated directory"
            )


class TACWorkflow(Workflow[TACTask, TACOptions]):
    """OpenHands (terminal + file editor) on TheAgentCompany-layout tasks; reward = TAC's score."""

    name = "tac"
    options_type = TACOptions
    requires = ("openhands", "litellm")
    episode_timeout_s = 1800.0

    @cached_property
    def tasks_root(self) -> Path:
        """``tasks_dir``, or the generated family's directory (generated on first use)."""
        if self.options.family is None:
            return self.options.tasks_dir
        return ensure_family(self.options.family, self.options.family_seed)

    def tasks(self, split: Source | Split) -> Sequence[TACTask]:
        tasks = load_tasks(self.tasks_root, split)
        if self.options.tasks:
            unknown = set(self.options.tasks) - {t.name for t in tasks}
            if unknown:
                raise ValueError(f"no {split} TAC tasks named {sorted(unknown)} in {self.tasks_root}")
            tasks = [t for t in tasks if t.name in self.options.tasks]
        return tasks

    def split_tasks(self, split: Split) -> list[TACTask]:
        """splits.yml's own three splits where it lists ``val`` (the family's), else the base rule."""
        if "val" in split_names(self.tasks_root):
            return list(self.tasks(split))
        return super().split_tasks(split)

    def stratum(self, task: TACTask) -> str | None:
        """A generated task's kind, so every stretch of a run holds each kind; None for hand-written ones."""
        return task.kind

    def task_id(self, task: TACTask) -> str:
        return f"tac/{task.name}"

    def task_metadata(self, task: TACTask) -> dict[str, Any]:
        return {"task": task.name, "runtime": self.options.runtime, **({"kind": task.kind} if task.kind else {})}

    def describe_task(self, task: TACTask) -> str:
        return task.instruction

    def runtime(self, passthrough: Endpoint) -> Runtime:
        if self.options.runtime == "docker":
            return DockerRuntime(
                server_hostname=self.options.server_hostname,
                env_llm=passthrough,
                env_model=self.options.env_model,
                keep=self.options.keep_workspaces,
            )
        return LocalRuntime(root=self.options.workspace_root, keep=self.options.keep_workspaces)

    def play(self, task: TACTask, episode: Episode) -> Outcome:
        """Set up, run the agent, grade, clean up (blocking: runs in the runner's thread pool)."""
        runtime = self.runtime(episode.passthrough)
        prepared = runtime.prepare(task, episode.id)
        try:
            opts = self.options
            run = run_agent(
                prepared.instruction,
                prepared.workdir,
                AgentConfig(
                    model=episode.model,
                    base_url=f"{episode.proxy_url}/v1",
                    api_key=episode.api_key,
                    conversation_id=episode.id,
                    max_iterations=opts.max_iterations,
                    temperature=opts.temperature,
                    max_output_tokens=opts.max_output_tokens,
                    max_input_tokens=opts.max_input_tokens,
                    system_prompt=opts.system_prompt,
                    file_editor=prepared.file_editor,
                    terminal_params=prepared.terminal_params,
                ),
            )
            result = runtime.evaluate(prepared, run.trajectory) if task.graded else None
        finally:
            runtime.cleanup(prepared)
        if result is None:  # no checkpoints: the judge rewards it (the runner refuses it otherwise)
            return Outcome(reward=None, metadata={"checkpoints": None, "ending": run.ending, "events": run.events})
        final = result.final_score
        return Outcome(
            reward=score(final),
            metadata={
                "checkpoints": [[c.result, c.total] for c in result.checkpoints],
                "final_score": [final.result, final.total],
                "ending": run.ending,
                "events": run.events,
            },
        )

    async def run_episode(self, task: TACTask, episode: Episode) -> Outcome:
        return await in_thread(self.play, task, episode)

    async def evaluate(
        self, endpoint: Endpoint, *, split: Split, limit: int | None, concurrency: int, model: str
    ) -> dict[str, Any]:
        """Greedy agent runs on the split's first ``limit`` graded tasks through ``endpoint`` (unrecorded).

        ``accuracy`` is success (reward 1.0: every checkpoint passed), ``mean_score`` the mean share
        of checkpoints passed, both also ``by_kind``. A run the agent ended badly (a context overflow,
        a refused call, a crashed tool) scores 0 and is counted in ``failed`` with its reason, so a
        report never silently drops a task; ``finished_rate`` is the share that called ``finish``
        (``summary.py``, shared with ``miniswe``)."""
        tasks = [t for t in self.split_tasks(split) if t.graded][:limit]
        if not tasks:
            raise ValueError(f"no graded {split} TAC tasks to evaluate")
        greedy = TACWorkflow(dataclasses.replace(self.options, temperature=0.0))
        started = time.monotonic()
        rows = await run_greedy(greedy.play, tasks, endpoint, concurrency=concurrency, model=model)
        return {
            "workflow": self.name,
            "split": split,
            "model": model,
            **summarize(rows, "finished"),
            "policy_versions": [],  # OpenHands does not expose the X-Policy-Version header
            "max_iterations": self.options.max_iterations,
            "max_output_tokens": self.options.max_output_tokens,
            "seconds": round(time.monotonic() - started, 2),
        }
