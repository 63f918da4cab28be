"""bench/seeds.py's table: a run's row from its report, and a cell's mean and spread, with a rolled-back
run counted apart, never as one that held."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.seeds import cell, finished, row


def report(before: float, after: float, rolled_back_to: int | None = None) -> dict[str, Any]:
    return {
        "eval_before": before,
        "eval_after": after,
        "steps": 7,
        "minutes": 6.5,
        "eval_n": 100,
        "guard": {"action": "rollback", "rolled_back_to": rolled_back_to, "collapsed": rolled_back_to is not None},
    }


def test_a_row_is_the_gain_of_the_final_evaluation_over_the_base_model() -> None:
    got = row(report(0.26, 0.39))
    assert got["gain"] == pytest.approx(0.13)
    assert (got["before"], got["after"], got["rolled_back_to"], got["eval_n"]) == (0.26, 0.39, None, 100)


def test_a_cell_gives_mean_and_spread_and_counts_a_rollback_apart() -> None:
    rows = [row(report(0.26, 0.39)), row(report(0.26, 0.46)), row(report(0.27, 0.36, rolled_back_to=10))]
    got = cell(rows)
    assert got["runs"] == 3
    assert got["mean_gain"] == pytest.approx((0.13 + 0.20 + 0.09) / 3, abs=1e-4)
    assert (got["min_gain"], got["max_gain"]) == (pytest.approx(0.09), pytest.approx(0.20))
    assert got["stdev_gain"] == pytest.approx(0.0557, abs=1e-3)
    assert got["above_baseline"] == 2  # the rolled-back run gained, but not by holding
    assert got["rolled_back"] == 1


def test_a_run_below_its_baseline_is_not_above_it() -> None:
    got = cell([row(report(0.43, 0.40)), row(report(0.43, 0.43))])
    assert got["above_baseline"] == 0
    assert got["mean_gain"] == pytest.approx(-0.015)


def test_a_finished_cell_is_read_back_and_an_unfinished_one_is_not(tmp_path: Path) -> None:
    assert finished(tmp_path) is None
    (tmp_path / "runs" / "r1").mkdir(parents=True)
    assert finished(tmp_path) is None  # a run that has not written its report resumes
    (tmp_path / "runs" / "r1" / "report.json").write_text(json.dumps(report(0.26, 0.39)))
    assert finished(tmp_path) == report(0.26, 0.39)
