"""TheAgentCompany's scoring: checkpoints, their sum, and the final score.

A task's evaluator grades checkpoints, each ``(total, result)`` points. The final score is
``0.5 * result / total + 0.5 * (result // total)`` over their sum: half partial credit, half
all-or-nothing, so finishing a task is worth as much as all its partial steps together. The
result file (``eval.py --result_path``) is ``{"checkpoints": [{"total", "result"}, ...],
"final_score": {"total", "result"}}``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Checkpoint:
    total: int
    result: int

    def __post_init__(self) -> None:
        if self.total < 1 or not 0 <= self.result <= self.total:
            raise ValueError(f"checkpoint needs total >= 1 and 0 <= result <= total, got {self.total}/{self.result}")


@dataclass(frozen=True)
class Result:
    checkpoints: list[Checkpoint]
    final: Checkpoint | None = None
    """The evaluator's own final score, when it differs from the sum (TAC's bonus strategies)."""

    @property
    def final_score(self) -> Checkpoint:
        if self.final is not None:
            return self.final
        return Checkpoint(total=sum(c.total for c in self.checkpoints), result=sum(c.result for c in self.checkpoints))

    def to_json(self) -> dict[str, Any]:  # the layout of TAC's eval.py result file
        return {"checkpoints": [asdict(c) for c in self.checkpoints], "final_score": asdict(self.final_score)}


def score(final: Checkpoint) -> float:
    """TAC's final score in [0, 1]: ``0.5 * result/total + 0.5 * (result // total)``."""
    return 0.5 * final.result / final.total + 0.5 * (final.result // final.total)


def read_result(path: Path) -> Result:
    """Parse an evaluator's result file; a malformed one is an error, never a score of 0."""
    try:
        data = json.loads(path.read_text())
        checkpoints = [Checkpoint(total=int(c["total"]), result=int(c["result"])) for c in data["checkpoints"]]
        final = data.get("final_score")
        explicit = Checkpoint(total=int(final["total"]), result=int(final["result"])) if final else None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"evaluator result {path} is unreadable: {exc}") from exc
    if not checkpoints:
        raise ValueError(f"evaluator result {path} has no checkpoints")
    return Result(checkpoints, final=explicit)
