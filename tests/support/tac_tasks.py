"""A small task directory in TheAgentCompany's layout for the tac and miniswe workflows' tests.

Four graded test tasks (checkpoints of 1 and 2 points, 3 in all): one a script solves (3/3), one
partly (1/3), one not at all (0/3), one whose run is abandoned; an ungraded task beside them. Each
task's ``solution.json`` holds what a script player (standing in for the agent) runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped,unused-ignore]

from workflows.tac.task import load_task

EVALUATOR = """
from pathlib import Path

from workflows.tac.scoring import Checkpoint, Result


def grade_checkpoints(trajectory: str, workspace: Path) -> Result:
    a = workspace / "a.txt"
    b = workspace / "b.txt"
    b_points = (b.is_file()) + (b.is_file() and b.read_text().strip() == "bee")
    return Result([Checkpoint(1, int(a.is_file())), Checkpoint(2, int(b_points))])
"""

SOLUTIONS: dict[str, tuple[str, list[dict[str, Any]]]] = {
    "solved": ("write", [{"tool": "terminal", "arguments": {"command": "touch a.txt && echo bee > b.txt"}}]),
    "partial": ("write", [{"tool": "terminal", "arguments": {"command": "touch a.txt"}}]),
    "unsolved": ("edit", [{"tool": "terminal", "arguments": {"command": "echo nothing useful"}}]),
    "abandoned": ("edit", [{"tool": "crash", "arguments": {"error": "context window exceeded"}}]),
}
"""Task name -> its kind and its script's steps (``finish`` is appended)."""


def build_tasks(root: Path) -> Path:
    """The four graded tasks above plus an ungraded one, all in the test split."""
    for name, (kind, steps) in SOLUTIONS.items():
        task = root / name
        task.mkdir(parents=True)
        (task / "task.md").write_text(f"Task {name}: create a.txt, and b.txt saying bee.\n")
        (task / "evaluator.py").write_text(EVALUATOR)
        (task / "spec.json").write_text(json.dumps({"kind": kind}))
        finish = {"tool": "finish", "arguments": {"message": "done"}}
        (task / "solution.json").write_text(json.dumps({"steps": [*steps, finish]}))
    (root / "ungraded").mkdir()
    (root / "ungraded" / "task.md").write_text("Task ungraded: write anything.\n")
    names = [*SOLUTIONS, "ungraded"]
    (root / "splits.yml").write_text(yaml.safe_dump({"train": [], "val": [], "test": names}))
    return root


def scripted_steps(root: Path, instruction: str) -> list[dict[str, Any]]:
    """The solution.json steps of the task whose instruction the agent was given."""
    [task] = [p for p in root.iterdir() if (p / "task.md").is_file() and load_task(p).instruction == instruction]
    steps: list[dict[str, Any]] = json.loads((task / "solution.json").read_text())["steps"]
    return steps
