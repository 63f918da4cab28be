"""Grade a local TAC task's workspace: ``python -m workflows.tac.evaluate`` (TAC's ``eval.py`` contract).

    python -m workflows.tac.evaluate --task-dir DIR --workspace W --trajectory_path T --result_path R

Imports ``DIR/evaluator.py``, calls ``grade_checkpoints(trajectory, workspace)`` and writes TAC's
result file to ``R``. The runtime runs this in a subprocess with a time limit, so an evaluator (or
code it imports from the agent's workspace) that hangs or crashes cannot take the runner down; a
crash is a failed evaluation, never a score.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from workflows.tac.scoring import Result


def grade(task_dir: Path, workspace: Path, trajectory: str) -> Result:
    spec = importlib.util.spec_from_file_location(
        f"tac_evaluator_{task_dir.name.replace('-', '_')}", task_dir / "evaluator.py"
    )
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot load {task_dir / 'evaluator.py'}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.grade_checkpoints(trajectory, workspace)
    if not isinstance(result, Result):
        raise TypeError(f"{task_dir.name}: grade_checkpoints returned {type(result).__name__}, not a Result")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task-dir", type=Path, required=True)
    parser.add_argument("--workspace", type=Path, required=True)
    parser.add_argument("--trajectory_path", type=Path, required=True)
    parser.add_argument("--result_path", type=Path, required=True)
    args = parser.parse_args(argv)
    trajectory = args.trajectory_path.read_text() if args.trajectory_path.exists() else ""
    result = grade(args.task_dir.resolve(), args.workspace.resolve(), trajectory)
    args.result_path.write_text(json.dumps(result.to_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
