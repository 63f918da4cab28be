"""sql-shop: the answers are recomputed from shop.sql, so the checkpoints follow the data."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

from workflows.tac.scoring import Checkpoint, Result

TASK_DIR = Path(__file__).resolve().parent


def expected() -> tuple[str, int]:
    db = sqlite3.connect(":memory:")
    db.executescript((TASK_DIR / "workspace" / "shop.sql").read_text())
    top = db.execute("SELECT c.name FROM customers c JOIN orders o ON o.customer_id = c.id "
                     "GROUP BY c.id ORDER BY SUM(o.amount) DESC LIMIT 1").fetchone()[0]
    march = db.execute("SELECT COUNT(*) FROM orders WHERE placed_on LIKE '2024-03-%'").fetchone()[0]
    return str(top), int(march)


def answer(text: str, key: str) -> str | None:
    match = re.search(rf"^\s*{key}\s*:\s*(.+?)\s*$", text, re.MULTILINE | re.IGNORECASE)
    return match.group(1) if match else None


def grade_checkpoints(trajectory: str, workspace: Path) -> Result:
    path = workspace / "answers.txt"
    text = path.read_text(errors="replace") if path.is_file() else ""
    top, march = expected()
    return Result([Checkpoint(1, int((answer(text, "top_customer") or "").lower() == top.lower())),
                   Checkpoint(1, int(answer(text, "march_orders") == str(march)))])
