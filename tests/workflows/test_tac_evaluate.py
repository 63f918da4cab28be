"""``TACWorkflow.evaluate`` and ``play`` on a small task directory: real local runtime, real evaluators
in their subprocess, real scoring; the agent is a script that runs each task's ``solution.json``
terminal steps in the workspace, so no engine and no OpenHands.

Four graded test tasks (checkpoints of 1 and 2 points, 3 in all): one solved (3/3: reward 1.0), one
partly (1/3: reward 1/6, share 1/3), one not at all (0/3: reward 0), and one whose run is abandoned
(0, counted in ``failed``); an ungraded task beside them is left out of the evaluation.
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from tests.support.tac_tasks import build_tasks, scripted_steps
from workflows.base import Endpoint, Episode, EpisodeFailed
from workflows.tac import run as tac_run
from workflows.tac.agent import AgentConfig, AgentRun
from workflows.tac.run import TACOptions, TACWorkflow
from workflows.tac.summary import Graded, summarize
from workflows.tac.task import load_task


@pytest.fixture
def agent_calls() -> list[AgentConfig]:
    """The settings of every agent run the script player below was asked for, in order."""
    return []


@pytest.fixture
def tasks_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, agent_calls: list[AgentConfig]) -> Path:
    """The task directory, with OpenHands replaced by a script player (what the agent's tools would do)."""
    root = build_tasks(tmp_path / "tasks")

    def play_script(instruction: str, workdir: Path, config: AgentConfig) -> AgentRun:
        agent_calls.append(config)
        for step in scripted_steps(root, instruction):
            if step["tool"] == "crash":
                raise EpisodeFailed(step["arguments"]["error"])
            if step["tool"] == "terminal":
                subprocess.run(["bash", "-c", step["arguments"]["command"]], cwd=workdir, check=True, timeout=30)
        return AgentRun(status="finished", ending="finished", events=2, trajectory="[]")

    monkeypatch.setattr(tac_run, "run_agent", play_script)
    return root


def episode(name: str) -> Episode:
    endpoint = Endpoint("http://127.0.0.1:9/v1", "key")
    return Episode(name, name, 0, endpoint.base_url, "key", "policy", endpoint, "http://127.0.0.1:9")


@pytest.mark.parametrize(
    ("name", "reward", "checkpoints"),
    [("solved", 1.0, [[1, 1], [2, 2]]), ("partial", 1 / 6, [[1, 1], [0, 2]]), ("unsolved", 0.0, [[0, 1], [0, 2]])],
)
def test_play_rewards_tacs_score_of_the_evaluators_checkpoints(
    tasks_dir: Path, name: str, reward: float, checkpoints: list[list[int]]
) -> None:
    workflow = TACWorkflow(TACOptions(tasks_dir=tasks_dir, workspace_root=tasks_dir.parent / "ws"))
    outcome = workflow.play(load_task(tasks_dir / name), episode(name))
    assert outcome.reward == pytest.approx(reward)
    assert outcome.metadata["checkpoints"] == checkpoints
    assert outcome.metadata["final_score"] == [sum(r for r, _ in checkpoints), 3]
    assert outcome.metadata["ending"] == "finished"
    assert list((tasks_dir.parent / "ws").iterdir()) == []  # the workspace is gone after grading


def test_an_abandoned_run_is_an_error_not_a_score(tasks_dir: Path) -> None:
    workflow = TACWorkflow(TACOptions(tasks_dir=tasks_dir))
    with pytest.raises(EpisodeFailed, match="context window exceeded"):
        workflow.play(load_task(tasks_dir / "abandoned"), episode("abandoned"))


def test_evaluate_summarizes_success_checkpoint_share_and_failures_per_kind(tasks_dir: Path) -> None:
    workflow = TACWorkflow(TACOptions(tasks_dir=tasks_dir, temperature=1.0))
    endpoint = Endpoint("http://127.0.0.1:9/v1", "key")
    report = asyncio.run(workflow.evaluate(endpoint, split="test", limit=None, concurrency=2, model="policy"))
    assert report["workflow"] == "tac" and report["split"] == "test" and report["model"] == "policy"
    assert report["n"] == 4  # the ungraded task is not evaluated
    assert report["accuracy"] == 0.25  # solved only
    assert report["mean_score"] == round((1 + 1 / 3 + 0 + 0) / 4, 4)  # shares of checkpoint points
    assert report["finished_rate"] == 0.75  # the abandoned run did not finish
    assert report["failed"] == {"failed: context window exceeded": 1}
    assert report["by_kind"] == {
        "edit": {"n": 2, "accuracy": 0.0, "mean_score": 0.0, "finished_rate": 0.5},
        "write": {"n": 2, "accuracy": 0.5, "mean_score": round(4 / 3 / 2, 4), "finished_rate": 1.0},
    }
    assert report["policy_versions"] == [] and report["max_iterations"] == 6
    limited = asyncio.run(workflow.evaluate(endpoint, split="test", limit=1, concurrency=1, model="policy"))
    assert (limited["n"], limited["accuracy"], limited["mean_score"]) == (1, 1.0, 1.0)  # the first: solved


def test_evaluate_runs_greedy(tasks_dir: Path, agent_calls: list[AgentConfig]) -> None:
    workflow = TACWorkflow(TACOptions(tasks_dir=tasks_dir, temperature=0.9))
    asyncio.run(workflow.evaluate(Endpoint("http://x/v1", "k"), split="test", limit=2, concurrency=1, model="p"))
    assert [c.temperature for c in agent_calls] == [0.0, 0.0]
    assert {c.model for c in agent_calls} == {"p"} and {c.base_url for c in agent_calls} == {"http://x/v1"}


def test_evaluate_refuses_a_split_without_graded_tasks(tasks_dir: Path) -> None:
    workflow = TACWorkflow(TACOptions(tasks_dir=tasks_dir))
    with pytest.raises(ValueError, match="no graded train TAC tasks"):
        asyncio.run(
            workflow.evaluate(Endpoint("http://x/v1", "k"), split="train", limit=None, concurrency=1, model="p")
        )


# -- the shared summary (workflows/tac/summary.py) ---------------------------------------------------


def test_a_graded_row_is_success_by_the_final_score_and_share_by_the_checkpoints(tmp_path: Path) -> None:
    task = load_task(build_tasks(tmp_path) / "solved")
    bonus = Graded.of(task, {"final_score": [2, 2], "checkpoints": [[1, 2]], "ending": "finished"})
    assert bonus == Graded("write", 1.0, 0.5, "finished")  # an evaluator's bonus final score is success
    partial = Graded.of(task, {"final_score": [1, 3], "checkpoints": [[1, 1], [0, 2]], "ending": "stuck"})
    assert partial == Graded("write", 0.0, 1 / 3, "stuck")
    failed = Graded.failed(task, EpisodeFailed("x" * 300))
    assert failed.ending == "failed: " + "x" * 200 and (failed.success, failed.share) == (0.0, 0.0)


def test_summarize_counts_the_agents_own_ending_and_keeps_kindless_tasks_apart() -> None:
    rows = [
        Graded("write", 1.0, 1.0, "submitted"),
        Graded(None, 0.0, 0.5, "step_limit"),
        Graded(None, 0.0, 0.0, "failed: boom"),
        Graded(None, 0.0, 0.0, "failed: boom"),
    ]
    summary = summarize(rows, "submitted")
    assert summary["n"] == 4 and summary["accuracy"] == 0.25 and summary["mean_score"] == 0.375
    assert summary["submitted_rate"] == 0.25 and "finished_rate" not in summary
    assert summary["failed"] == {"failed: boom": 2}
    assert summary["by_kind"]["-"] == {"n": 3, "accuracy": 0.0, "mean_score": round(0.5 / 3, 4), "submitted_rate": 0.0}
    assert list(summary["by_kind"]) == ["-", "write"]
    with pytest.raises(ValueError, match="no evaluated tasks"):
        summarize([], "finished")
