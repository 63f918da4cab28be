"""csv-report: per-region totals of sales.csv, recomputed from the seed file."""

from __future__ import annotations

import csv
from decimal import Decimal, InvalidOperation
from pathlib import Path

from workflows.tac.scoring import Checkpoint, Result

TASK_DIR = Path(__file__).resolve().parent


def expected() -> dict[str, Decimal]:
    totals: dict[str, Decimal] = {}
    with open(TASK_DIR / "workspace" / "sales.csv", newline="") as f:
        for row in csv.DictReader(f):
            totals[row["region"]] = totals.get(row["region"], Decimal(0)) + Decimal(row["amount"])
    return totals


def grade_checkpoints(trajectory: str, workspace: Path) -> Result:
    path = workspace / "report.csv"
    lines = path.read_text(errors="replace").strip().splitlines() if path.is_file() else []
    header = bool(lines) and lines[0].strip() == "region,total"
    rows = [line.strip().split(",") for line in lines[1:] if line.strip()]
    want = expected()
    try:
        got = {r[0]: Decimal(r[1]) for r in rows if len(r) == 2}
    except InvalidOperation:
        got = {}
    totals_right = header and len(rows) == len(want) and got == want
    formatted = totals_right and [r[0] for r in rows] == sorted(want) and all(
        r[1] == f"{want[r[0]]:.2f}" for r in rows)
    return Result([Checkpoint(1, int(header)), Checkpoint(1, int(totals_right)), Checkpoint(1, int(formatted))])
