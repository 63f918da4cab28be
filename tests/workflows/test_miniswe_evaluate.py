"""``MiniSweWorkflow.evaluate`` on the small task directory of ``tests/support/tac_tasks.py``: the same local runtime,
evaluators and summary as ``tac`` (``workflows/tac/summary.py``), the rate of its own ending
(``submitted``) beside them; mini-swe-agent is replaced by a script player, so no engine, no agent."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from tests.support.tac_tasks import build_tasks, scripted_steps
from workflows.base import Endpoint, EpisodeFailed
from workflows.miniswe import run as miniswe_run
from workflows.miniswe.agent import AgentConfig, AgentRun
from workflows.miniswe.run import MiniSweOptions, MiniSweWorkflow

ENDINGS = {"solved": "submitted", "partial": "step_limit", "unsolved": "submitted"}
"""How the script player says each task's run ended (the abandoned one raises)."""


@pytest.fixture
def agent_calls() -> list[AgentConfig]:
    return []


@pytest.fixture
def tasks_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, agent_calls: list[AgentConfig]) -> Path:
    root = build_tasks(tmp_path / "tasks")

    def play_script(instruction: str, workdir: Path, config: AgentConfig) -> AgentRun:
        agent_calls.append(config)
        steps = scripted_steps(root, instruction)
        for step in steps:
            if step["tool"] == "crash":
                raise EpisodeFailed(step["arguments"]["error"])
            if step["tool"] == "terminal":
                subprocess.run(["bash", "-c", step["arguments"]["command"]], cwd=workdir, check=True, timeout=30)
        ending = ENDINGS[instruction.split()[1].rstrip(":")]  # "Task <name>: ..."
        return AgentRun(ending=ending, exit_status=ending, steps=len(steps), format_errors=0, trajectory="{}")

    monkeypatch.setattr(miniswe_run, "run_agent", play_script)
    return root


def test_evaluate_reports_tacs_summary_with_the_submitted_rate(tasks_dir: Path, agent_calls: list[AgentConfig]) -> None:
    workflow = MiniSweWorkflow(MiniSweOptions(tasks_dir=tasks_dir, temperature=1.0))
    endpoint = Endpoint("http://127.0.0.1:9/v1", "key")
    report = asyncio.run(workflow.evaluate(endpoint, split="test", limit=None, concurrency=2, model="policy"))
    assert report["workflow"] == "miniswe" and report["n"] == 4
    assert report["accuracy"] == 0.25 and report["mean_score"] == round((1 + 1 / 3) / 4, 4)
    assert report["submitted_rate"] == 0.5 and "finished_rate" not in report
    assert report["failed"] == {"failed: context window exceeded": 1}
    assert report["by_kind"] == {
        "edit": {"n": 2, "accuracy": 0.0, "mean_score": 0.0, "submitted_rate": 0.5},
        "write": {"n": 2, "accuracy": 0.5, "mean_score": round(4 / 3 / 2, 4), "submitted_rate": 0.5},
    }
    assert (report["step_limit"], report["max_tokens"]) == (6, 256)
    assert {c.temperature for c in agent_calls} == {0.0} and len(agent_calls) == 4  # greedy, graded tasks only
    assert {c.base_url for c in agent_calls} == {endpoint.base_url}  # mini-swe-agent asks the endpoint itself
