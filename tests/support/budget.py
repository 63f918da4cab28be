"""The suite's time budget: each test file's wall time against ``tests/budget.toml``, printed at the end.

A slow suite is run rarely, so a change that adds minutes should show in its own run, not in a
later one. This plugin sums each file's setup, call and teardown times (session fixtures such as
an engine start land on the first test that asks for them), and the terminal summary lists the
files over their budget, the files the budget does not know, and the whole run against its total.
It never fails a run: timings differ between machines (the budget was measured on the slowest
two-core machine the suite runs on, named in the file); a file over budget is for its author to
look at. The budget also orders the run: files are collected longest first (tests within a file
keep their order), so that ``pytest -n 2 --dist loadfile --no-loadscope-reorder`` (``make test``;
xdist would otherwise reorder the files by their count of tests) hands the long files out first
and the short ones fill in around them (longest-processing-time-first scheduling), not a 4-minute
file last while the other worker idles. ``--budget-report DIR`` writes the run's figures to
``DIR/<pid>.json`` (``make test`` runs two pytest processes), and ``python -m tests.support.budget
MACHINE DIR/*.json`` rewrites the budget from them.
"""

from __future__ import annotations

import json
import os
import sys
import time
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest

BUDGET = Path(__file__).resolve().parents[1] / "budget.toml"
SLACK = 1.25
"""A file is over budget past this factor of its figure plus ``SLACK_S``: timings of the same code
swing 10-20% between runs on one machine."""
SLACK_S = 5.0


class Budget:
    def __init__(self, report: Path | None) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.started = time.monotonic()
        self.report = report

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        files: dict[str, float] = tomllib.loads(BUDGET.read_text()).get("files", {}) if BUDGET.exists() else {}
        items.sort(key=lambda item: -files.get(item.nodeid.split("::", 1)[0], 0.0))  # stable: in-file order kept

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid.split("::", 1)[0]] += report.duration

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        wall = time.monotonic() - self.started
        if self.report is not None:
            self.report.mkdir(parents=True, exist_ok=True)
            figures = {"wall_s": wall, "files": dict(self.seconds)}
            (self.report / f"{os.getpid()}.json").write_text(json.dumps(figures, indent=1))
        if not BUDGET.exists() or not self.seconds:
            return
        budget = tomllib.loads(BUDGET.read_text())
        files: dict[str, float] = budget.get("files", {})
        over = [
            (path, spent, files[path])
            for path, spent in self.seconds.items()
            if path in files and spent > files[path] * SLACK + SLACK_S
        ]
        unknown = [(path, spent) for path, spent in self.seconds.items() if path not in files and spent > SLACK_S]
        write = terminalreporter.write_line
        terminalreporter.section("time budget (tests/budget.toml)")
        write(f"measured on: {budget.get('machine', 'unknown')}")
        for path, spent, allowed in sorted(over, key=lambda row: row[2] - row[1]):
            write(f"OVER  {path}: {spent:.0f} s against {allowed:.0f} s")
        for path, spent in sorted(unknown, key=lambda row: -row[1]):
            write(f"NEW   {path}: {spent:.0f} s (not in the budget)")
        known = sum(files[path] for path in self.seconds if path in files)
        write(f"these files: {sum(self.seconds.values()) / 60:.1f} min of tests against {known / 60:.1f} budgeted")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--budget-report", type=Path, default=None, help="a folder: each file's seconds as JSON there")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(Budget(config.getoption("--budget-report")), "flywheel-budget")


def write_budget(reports: list[Path], machine: str) -> None:
    """Rewrite ``tests/budget.toml`` from runs' reports (one per suite), each file at its measured
    seconds rounded up to the next 5."""
    files: dict[str, float] = {}
    for report in reports:
        files |= json.loads(report.read_text())["files"]
    lines = [
        "# Each test file's wall seconds (setup, call, teardown; a session engine's start counts on the",
        "# first file that asks for it) as measured in one `make test` run, rounded up to the next 5.",
        "# tests/support/budget.py prints the files over it after every run. Rewrite after a change that",
        '# moves time on purpose: make test PYTEST_ARGS="--budget-report DIR", then',
        "# python -m tests.support.budget MACHINE DIR/*.json",
        f'machine = "{machine}"',
        "",
        "[files]",
    ]
    lines += [f'"{path}" = {5 * -(-seconds // 5):.0f}' for path, seconds in sorted(files.items())]
    BUDGET.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: python -m tests.support.budget MACHINE REPORT.json [REPORT.json ...]")
    write_budget([Path(arg) for arg in sys.argv[2:]], sys.argv[1])
