"""json-config: two values changed, the rest untouched."""

from __future__ import annotations

import json
from pathlib import Path

from workflows.tac.scoring import Checkpoint, Result

TASK_DIR = Path(__file__).resolve().parent


def grade_checkpoints(trajectory: str, workspace: Path) -> Result:
    original = json.loads((TASK_DIR / "workspace" / "config.json").read_text())
    try:
        config = json.loads((workspace / "config.json").read_text())
    except (OSError, ValueError):
        return Result([Checkpoint(1, 0), Checkpoint(1, 0), Checkpoint(1, 0)])
    if not isinstance(config, dict):
        return Result([Checkpoint(1, 0), Checkpoint(1, 0), Checkpoint(1, 0)])
    rest_kept = {k: v for k, v in config.items() if k not in {"debug", "port"}} == {
        k: v for k, v in original.items() if k not in {"debug", "port"}}
    port = config.get("port")
    return Result([Checkpoint(1, int(rest_kept)), Checkpoint(1, int(config.get("debug") is False)),
                   Checkpoint(1, int(port == 8080 and not isinstance(port, bool)))])
