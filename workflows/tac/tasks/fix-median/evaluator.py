"""fix-median: call the workspace's stats.py on hidden cases (this runs in the evaluator subprocess)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from workflows.tac.scoring import Checkpoint, Result


def passes(fn: object, cases: list[tuple[list[float], float]]) -> bool:
    try:
        return callable(fn) and all(abs(fn(list(xs)) - want) < 1e-9 for xs, want in cases)
    except Exception:  # the agent's code may raise anything: that case fails
        return False


def grade_checkpoints(trajectory: str, workspace: Path) -> Result:
    module = None
    spec = importlib.util.spec_from_file_location("workspace_stats", workspace / "stats.py")
    if spec is not None and spec.loader is not None and (workspace / "stats.py").is_file():
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception:  # a syntax error fails every checkpoint
            module = None
    median = getattr(module, "median", None)
    mean = getattr(module, "mean", None)
    odd = passes(median, [([3, 1, 2], 2), ([7], 7), ([5, 9, 1, 3, 4], 4)])
    even = passes(median, [([1, 2, 3, 4], 2.5), ([10, 2], 6), ([4, 1, 3, 2, 8, 6], 3.5)])
    mean_ok = passes(mean, [([1, 2, 3, 4], 2.5), ([5], 5)])
    return Result([Checkpoint(1, int(odd)), Checkpoint(1, int(even)), Checkpoint(1, int(mean_ok))])
