"""hello-file: greeting.txt exists and says exactly 'hello flywheel'."""

from __future__ import annotations

from pathlib import Path

from workflows.tac.scoring import Checkpoint, Result


def grade_checkpoints(trajectory: str, workspace: Path) -> Result:
    path = workspace / "greeting.txt"
    exists = path.is_file()
    exact = exists and path.read_text(errors="replace").strip() == "hello flywheel"
    return Result([Checkpoint(1, int(exists)), Checkpoint(1, int(exact))])
