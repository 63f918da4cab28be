"""The suite's time budget (``tests/support/budget.py``): what the summary says of a run's files."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.support import budget


class Terminal:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def section(self, title: str) -> None:
        self.lines.append(f"== {title}")

    def write_line(self, line: str) -> None:
        self.lines.append(line)


def _run(files: dict[str, float], tmp_path: Path) -> Terminal:
    plugin = budget.Budget(tmp_path / "reports")
    for path, seconds in files.items():
        for phase in ("setup", "call", "teardown"):
            report: Any = SimpleNamespace(nodeid=f"{path}::test_x", duration=seconds / 3, when=phase)
            plugin.pytest_runtest_logreport(report)
    terminal = Terminal()
    plugin.pytest_terminal_summary(terminal)  # type: ignore[arg-type]
    return terminal


def test_files_over_their_budget_and_files_it_lacks_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(budget, "BUDGET", tmp_path / "budget.toml")
    (tmp_path / "budget.toml").write_text(
        'machine = "2-core test box"\n[files]\n"tests/a.py" = 100\n"tests/b.py" = 10\n"tests/c.py" = 60\n'
    )
    lines = _run({"tests/a.py": 90.0, "tests/b.py": 30.0, "tests/new.py": 12.0, "tests/tiny.py": 1.0}, tmp_path).lines
    assert lines == [
        "== time budget (tests/budget.toml)",
        "measured on: 2-core test box",
        "OVER  tests/b.py: 30 s against 10 s",
        "NEW   tests/new.py: 12 s (not in the budget)",
        "these files: 2.2 min of tests against 1.8 budgeted",
    ]
    (written,) = (tmp_path / "reports").iterdir()
    report = json.loads(written.read_text())
    assert report["files"]["tests/b.py"] == pytest.approx(30.0)


def test_the_budget_is_rewritten_from_reports_rounded_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(budget, "BUDGET", tmp_path / "budget.toml")
    (tmp_path / "one.json").write_text(json.dumps({"wall_s": 1, "files": {"tests/a.py": 41.2, "tests/b.py": 5.0}}))
    (tmp_path / "two.json").write_text(json.dumps({"wall_s": 1, "files": {"tests/w.py": 0.3}}))
    budget.write_budget([tmp_path / "one.json", tmp_path / "two.json"], "box")
    written = (tmp_path / "budget.toml").read_text()
    assert 'machine = "box"' in written
    assert written.endswith('[files]\n"tests/a.py" = 45\n"tests/b.py" = 5\n"tests/w.py" = 5\n')
