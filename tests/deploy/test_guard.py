"""The collapse guard on metrics: probes that fall, answers cut at the token limit, warnings, and when it probes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from deploy import loop
from deploy.guard import Guard
from deploy.run_config import GuardSection, RunConfig, RunConfigError

DATA = Path(__file__).parent / "data"
SECTION = GuardSection(probe_every=5, max_drop=0.1, patience=2, window=3, max_cut_fraction=0.5)


def healthy(step: int) -> dict[str, float]:
    return {
        "signals/cut_fraction": 0.05,
        "policy/entropy": 0.5,
        "reward/mean": 0.3 + 0.01 * step,
        "policy/engine_logp_diff_mean": 0.003,
    }


def test_probes_are_due_once_per_multiple_of_probe_every() -> None:
    guard = Guard(SECTION)
    assert [s for s in range(12) if guard.probe_due(s)] == [5, 6, 7, 8, 9, 10, 11]  # nothing probed yet
    guard.observe_probe(5, 3, 0.3)
    assert [s for s in range(5, 16) if guard.probe_due(s)] == [10, 11, 12, 13, 14, 15]
    guard.observe_probe(11, 6, 0.3)  # a late probe still counts for its multiple
    assert not guard.probe_due(14) and guard.probe_due(15)
    assert not Guard(dataclasses.replace(SECTION, action="off")).probe_due(10)
    assert not Guard(dataclasses.replace(SECTION, probe_every=0)).probe_due(10)
    guard.probe_failed(15)  # one failure (an engine restarting): skipped, probes go on
    assert guard.probing and not guard.probe_due(19) and guard.probe_due(20)
    guard.probe_failed(20)  # two in a row: signals only from then on
    assert not guard.probing and not guard.probe_due(25)


def test_a_probe_fall_is_a_collapse_only_after_patience_probes() -> None:
    guard = Guard(SECTION)
    for step, score in ((5, 0.30), (10, 0.42), (15, 0.28)):
        guard.observe_probe(step, step, score)
    assert not guard.verdict.collapsed  # one fall of 0.14: not yet
    guard.observe_probe(20, 20, 0.35)
    assert not guard.verdict.collapsed  # within max_drop of the best: the streak is broken
    guard.observe_probe(25, 25, 0.20)
    guard.observe_probe(30, 30, 0.18)
    verdict = guard.verdict
    assert verdict.collapsed and verdict.at_step == 30
    assert verdict.best is not None and (verdict.best.step, verdict.best.version, verdict.best.score) == (10, 10, 0.42)
    assert verdict.reasons == ["held-out probe fell from 0.420 (step 10) to 0.200 (step 25), 0.180 (step 30)"]
    guard.observe_probe(35, 35, 0.5)  # a collapse once declared stays declared; the new best is still noted
    assert guard.verdict.collapsed and guard.verdict.best is not None and guard.verdict.best.step == 35


def test_the_last_adapter_below_the_best_is_a_collapse_at_the_end() -> None:
    guard = Guard(SECTION)
    guard.observe_probe(10, 10, 0.42)
    guard.observe_probe(12, 12, 0.25)
    guard.final_check(12)
    assert guard.verdict.collapsed and guard.verdict.reasons[-1].endswith("to 0.250 at the end")
    steady = Guard(SECTION)
    steady.observe_probe(10, 10, 0.42)
    steady.observe_probe(12, 12, 0.35)
    steady.final_check(12)
    assert not steady.verdict.collapsed


def test_answers_cut_at_the_token_limit_make_a_collapse_after_patience_windows() -> None:
    guard = Guard(SECTION)
    for step in range(1, 7):
        guard.observe_step(step, healthy(step))
    cut = {
        "signals/cut_fraction": 0.9,
        "policy/entropy": 1.2,
        "reward/mean": 0.05,
        "signals/tool_call_missing": 0.4,
        "policy/engine_logp_diff_mean": 2.5,
    }
    for step in range(7, 12):
        guard.observe_step(step, cut)
    verdict = guard.verdict
    assert verdict.collapsed and verdict.at_step is not None and 7 < verdict.at_step <= 11
    assert verdict.reasons[0].startswith("answers cut at the token limit: ")
    # entropy up, reward down, the engine gap far above numeric noise
    assert [w.split(" ")[0] for w in verdict.warnings] == ["sampling", "train", "engine/trainer"]
    quiet = Guard(SECTION)
    for step in range(1, 30):
        quiet.observe_step(step, healthy(step))
    assert not quiet.verdict.collapsed and quiet.verdict.warnings == []


def test_off_watches_nothing() -> None:
    guard = Guard(dataclasses.replace(SECTION, action="off"))
    for step in range(1, 20):
        guard.observe_step(step, {"signals/cut_fraction": 1.0})
        guard.observe_probe(step, step, 1.0 / step)
    guard.final_check(20)
    assert not guard.verdict.collapsed and guard.probes == []


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"probe_every": -1}, "guard.probe_every must be >= 0"),
        ({"patience": 0}, "guard.window and guard.patience must be >= 1"),
        ({"max_drop": 0.0}, "guard.max_drop must be in (0, 1]"),
        ({"max_cut_fraction": 2.0}, "guard.max_cut_fraction must be in (0, 1]"),
    ],
)
def test_bad_settings_are_refused(fields: dict[str, float], message: str) -> None:
    with pytest.raises(RunConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        GuardSection(**fields)  # type: ignore[arg-type]


STACK = SimpleNamespace(proxy_url="http://proxy", key="k")


def _serving(version: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxy's ``GET /policy`` answers ``version`` (its adapter ``policy-v{version}``)."""

    def get(url: str, **_: Any) -> httpx.Response:
        assert url == "http://proxy/policy"
        return httpx.Response(200, json={"version": version, "name": f"policy-v{version}"})

    monkeypatch.setattr(loop.httpx, "get", get)


def test_a_probe_scores_the_version_current_when_it_starts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The trainer publishes v6 while a probe of v5 runs: asked for the moving ``policy`` alias, the
    probe is answered by both and would be filed under v6 (and a rollback would republish v6); asked
    for ``policy-v5`` by name, every answer is v5's."""

    def evaluate(stack: Any, config: RunConfig, run_dir: Path, label: str, args: tuple[str, ...]) -> dict[str, Any]:
        pinned = "--model" in args and args[args.index("--model") + 1] == "policy-v5"
        return {"accuracy": 0.4, "policy_versions": ["5"] if pinned else ["5", "6"]}

    _serving(5, monkeypatch)
    monkeypatch.setattr(loop, "_evaluate", evaluate)
    guard = Guard(SECTION)
    loop._probe(STACK, RunConfig(guard=SECTION), tmp_path, 10, guard)  # type: ignore[arg-type]
    assert guard.verdict.last is not None and (guard.verdict.last.step, guard.verdict.last.version) == (10, 5)

    # A probe recorded before (a resumed run's) that two versions answered is refused, not filed.
    monkeypatch.setattr(loop, "_evaluate", lambda *_: {"accuracy": 0.9, "policy_versions": ["5", "6"]})
    loop._probe(STACK, RunConfig(guard=SECTION), tmp_path, 15, guard)  # type: ignore[arg-type]
    assert [p.step for p in guard.probes] == [10] and guard.probe_failures == 1


def test_a_collapse_in_the_signals_rolls_back_after_probing_stopped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Probes failed twice (probing off), then the signals declare a collapse: the launcher still
    republishes the best version it kept."""
    section = dataclasses.replace(SECTION, action="rollback")
    guard = Guard(section)
    for step in range(1, 6):
        guard.observe_step(step, healthy(step))
    guard.observe_probe(5, 5, 0.42)
    guard.probe_failed(10)
    guard.probe_failed(15)
    for step in range(6, 16):
        guard.observe_step(step, {**healthy(step), "signals/cut_fraction": 0.9})
    assert guard.verdict.collapsed and not guard.probing
    rolled: list[int | None] = []

    def rollback(stack: Any, run_dir: Path, g: Guard) -> int:
        rolled.append(g.verdict.best.version if g.verdict.best else None)
        return 7

    monkeypatch.setattr(loop, "_rollback", rollback)
    monkeypatch.setattr(loop, "_probe", lambda *_: pytest.fail("probing stopped: no further probe"))
    assert loop._finish_guard(STACK, RunConfig(guard=section), tmp_path, guard, 15) == 7  # type: ignore[arg-type]
    assert rolled == [5]


def _replay(name: str) -> tuple[Guard, dict[str, Any]]:
    """Feed a recorded run's step metrics and probes to a guard with the default settings, in the
    order the launcher does (a probe after its step)."""
    run = json.loads((DATA / name).read_text())
    guard = Guard(GuardSection(action="warn"))
    probes = {p["step"]: p for p in run["probes"]}
    for metrics in run["steps"]:
        step = metrics["step"]
        guard.observe_step(step, {k: v for k, v in metrics.items() if v is not None})
        if step in probes:
            guard.observe_probe(step, probes[step]["version"], probes[step]["score"])
    guard.final_check(run["steps"][-1]["step"])
    return guard, run


def test_the_recorded_issue_28_collapse_is_caught_and_the_masked_run_is_not() -> None:
    """Issue 28 on real metrics: the calc agent, seed 1, 54 steps on one machine (the files say
    which), trained with its constrained tool-call tokens scored without the engine's grammar mask
    (the rule before the fix) and with it."""
    unmasked, run = _replay("issue28_calc_seed1_unmasked.json")
    verdict = unmasked.verdict
    assert verdict.collapsed and verdict.best is not None and verdict.best.step == 10, verdict
    assert verdict.at_step is not None and verdict.at_step <= 30
    assert any(w.startswith("engine/trainer log-prob gap") for w in verdict.warnings), verdict.warnings
    assert run["eval_after"] < run["eval_before"]  # what a rollback to the best probe saves

    masked, run = _replay("issue28_calc_seed1_masked.json")
    assert not masked.verdict.collapsed and masked.verdict.warnings == [], masked.verdict
    assert run["eval_after"] > run["eval_before"] + 0.15
