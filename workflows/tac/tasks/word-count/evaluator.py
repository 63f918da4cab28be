"""word-count: line and word counts of notes.txt, as wc counts them, recomputed from the seed."""

from __future__ import annotations

import json
from pathlib import Path

from workflows.tac.scoring import Checkpoint, Result

TASK_DIR = Path(__file__).resolve().parent


def grade_checkpoints(trajectory: str, workspace: Path) -> Result:
    text = (TASK_DIR / "workspace" / "notes.txt").read_text()
    lines, words = text.count("\n"), len(text.split())
    try:
        counts = json.loads((workspace / "counts.json").read_text())
    except (OSError, ValueError):
        counts = None
    if not isinstance(counts, dict):
        counts = {}
    return Result([Checkpoint(1, int(counts.get("lines") == lines)), Checkpoint(1, int(counts.get("words") == words))])
