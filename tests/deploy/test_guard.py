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
from deploy.guard import EarlyWarning, Guard
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
        ({"early_window": -1}, "guard.early_window and guard.early_zero_steps must be >= 0 (0: off)"),
        ({"early_success_fall": 1.5}, "guard.early_success_fall must be in [0, 1] (0: off)"),
        ({"early_entropy_fall": 1.0}, "guard.early_entropy_fall must be in [0, 1)"),
        ({"early_shaping_only_share": 0.0}, "guard.early_shaping_only_share must be in (0, 1]"),
        ({"early_min_success": -0.1}, "guard.early_min_success must be in [0, 1]"),
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

    # The early warnings (issue 44) on the real collapse: its outcome rule fires at step 30 (train
    # success 0 on steps 28-30), which the probe at step 30 confirms, and none on the healthy run.
    assert [(w.rule, w.step, w.confirmed) for w in verdict.early_warnings] == [("outcome", 30, True)]

    masked, run = _replay("issue28_calc_seed1_masked.json")
    assert not masked.verdict.collapsed and masked.verdict.warnings == [], masked.verdict
    assert masked.verdict.early_warnings == []  # entropy 0.19 -> 0.01, but its success never fell by half
    assert run["eval_after"] > run["eval_before"] + 0.15


# -- early warnings (issue 44) ---------------------------------------------------------------------

ISSUE44_PROBES = {10: (10, 0.40), 20: (20, 0.35), 30: (30, 0.00), 40: (40, 0.00)}


@pytest.fixture
def issue44_run() -> list[dict[str, Any]]:
    """Issue 44's run (configs/run-tools.yaml, the calc agent, 54 steps, a fresh seed), step metrics
    RECONSTRUCTED from the figures the issue reports (its raw metrics are not available), not recorded:

    - train success (``reward/pass_rate``; ``reward/mean`` the same, the episode reward being the
      outcome) rises 0.25 -> 0.50 by step 5, holds 0.25-0.5625 (the issue: 0.2-0.56) to step 28 in a
      fixed pattern averaging 0.41, is 0.0625 at step 29 (the issue gives no figure) and 0.00 on
      every step from 30 to 43, where the guard stopped the run;
    - sampling entropy (``policy/entropy``) falls linearly through the issue's 0.18 (step 1), 0.10
      (step 10) and 0.04 (step 30), on to 0.027 at step 43;
    - every step trains its 4 groups (``groups_per_step: 4``) and skips none for equal rewards (the
      issue: "0 groups skipped for equal rewards, with every outcome 0"); ``data/groups_skipped_shaping_only``
      did not exist then and is absent.

    The probes are the issue's (``ISSUE44_PROBES``: version = step): 0.40, 0.35, 0.00, 0.00 at steps
    10-40; a probe at any other step after 29 is assumed to score 0.00 as those at 30 and 40 did."""
    held = [0.4375, 0.3125, 0.5, 0.375, 0.5625, 0.25, 0.4375, 0.375]

    def success(step: int) -> float:
        if step <= 5:
            return [0.25, 0.3125, 0.375, 0.4375, 0.5][step - 1]
        if step <= 28:
            return held[(step - 6) % len(held)]
        return 0.0625 if step == 29 else 0.0

    def entropy(step: int) -> float:
        if step <= 10:
            return 0.18 - (step - 1) * 0.08 / 9
        return 0.10 - (step - 10) * 0.003 if step <= 30 else 0.04 - (step - 30) * 0.001

    steps = [
        {
            "step": step,
            "reward/mean": success(step),
            "reward/pass_rate": success(step),
            "policy/entropy": round(entropy(step), 4),
            "data/groups_trained": 4,
            "data/groups_skipped_equal": 0,
        }
        for step in range(1, 44)
    ]
    by_step = {m["step"]: m for m in steps}  # the issue's figures, as the docstring states them
    assert by_step[5]["reward/pass_rate"] == 0.5
    assert all(0.2 <= by_step[s]["reward/pass_rate"] <= 0.5625 for s in range(6, 29))
    assert all(by_step[s]["reward/pass_rate"] == 0 for s in range(30, 44))
    assert [by_step[s]["policy/entropy"] for s in (1, 10, 30)] == [0.18, 0.10, 0.04]
    return steps


def _issue44_probe(step: int) -> tuple[int, float]:
    if step in ISSUE44_PROBES:
        return ISSUE44_PROBES[step]
    assert step > 29, f"no probe score for step {step}: the fixture assumes 0.00 after step 29 only"
    return step, 0.0


def _launch(section: GuardSection, steps: list[dict[str, Any]], probe: Any) -> tuple[Guard, list[int]]:
    """What ``loop._train`` does with the guard: each step observed, a probe whenever one is due,
    training ended at a collapse (``stop``/``rollback``); the guard and the steps probed."""
    guard, probed = Guard(section), []
    for metrics in steps:
        step = metrics["step"]
        guard.observe_step(step, {k: v for k, v in metrics.items() if k != "step"})
        if guard.probe_due(step):
            probed.append(step)
            guard.observe_probe(step, *probe(step))
        if guard.verdict.collapsed:
            break
    return guard, probed


def test_issue_44_early_warning_acts_at_step_31_where_the_probes_waited_for_step_40(
    issue44_run: list[dict[str, Any]],
) -> None:
    """With the default settings the trend rule fires at step 31 (train success 0.150 over steps
    27-31 against 0.4375 over steps 4-8, -66%; entropy 0.136 -> 0.043, -68%); its immediate probe
    scores 0.00 against the best 0.40 and the collapse is declared there, nine steps before the
    probes alone declared it. The rollback target is the same: v10's adapter."""
    guard, probed = _launch(GuardSection(), issue44_run, _issue44_probe)
    verdict = guard.verdict
    assert verdict.collapsed and verdict.at_step == 31, verdict
    assert probed == [10, 20, 30, 31]  # 31: the early warning's probe, not a multiple of probe_every
    [early] = verdict.early_warnings
    assert (early.rule, early.step, early.confirmed) == ("trend", 31, True)
    assert early.probe is not None and (early.probe.step, early.probe.score) == (31, 0.0)
    figures = early.figures
    assert figures["window"] == [27, 31] and figures["best_window"] == [4, 8]
    assert figures["success"] == pytest.approx(0.15) and figures["best_success"] == pytest.approx(0.4375)
    assert figures["success_fall"] == pytest.approx(0.657, abs=1e-3)
    assert figures["entropy_fall"] == pytest.approx(0.680, abs=1e-3)
    assert verdict.reasons[0].startswith("early warning (trend) at step 31: train success 0.438 (steps 4-8) -> 0.150")
    assert "the probe at step 31 scored 0.000 vs the best 0.400 (step 10)" in verdict.reasons[0]
    assert verdict.best is not None and (verdict.best.step, verdict.best.version) == (10, 10)
    report = verdict.as_dict()  # what report.json's "guard" carries
    assert [(w["rule"], w["step"], w["confirmed"]) for w in report["early_warnings"]] == [("trend", 31, True)]
    assert report["early_warnings"][0]["figures"]["best_window"] == [4, 8]
    assert [p["step"] for p in report["probes"]] == [10, 20, 30, 31]

    # The outcome rule alone: three trained steps at train success 0 (30-32), shaping rewards only.
    outcome, _ = _launch(dataclasses.replace(GuardSection(), early_success_fall=0), issue44_run, _issue44_probe)
    [early] = outcome.verdict.early_warnings
    assert (early.rule, early.step, outcome.verdict.at_step) == ("outcome", 32, 32)
    assert early.figures["steps"] == [30, 32] and early.figures["groups_skipped_equal"] == 0
    assert "without an outcome signal (steps 30-32): train success 0" in early.message

    # The old behaviour (early warnings off): the probes at 30 and 40, patience 2, collapse at step 40.
    old, probed = _launch(dataclasses.replace(GuardSection(), early_window=0), issue44_run, _issue44_probe)
    assert old.verdict.at_step == 40 and probed == [10, 20, 30, 40] and old.verdict.early_warnings == []
    assert old.verdict.reasons == ["held-out probe fell from 0.400 (step 10) to 0.000 (step 30), 0.000 (step 40)"]


@pytest.fixture
def healthy_run() -> list[dict[str, Any]]:
    """A healthy calc run (synthetic): sampling entropy falls slowly (0.18 -> 0.12 over 54 steps)
    while train success rises 0.25 -> ~0.6 in sixteenths, with noise of up to 0.125 and two steps in
    a row at 0 (steps 20-21). Each is short of a rule: the window of steps 20-24 (0.2125) is 45%
    below the best earlier one (0.3875, steps 15-19; the trend rule wants 50%), the outcome rule
    wants three steps, and one group in four skipped as shaping-only is below its 0.75 share."""
    noise = [0.0, 0.0625, -0.0625, 0.125, -0.125, 0.0625, 0.0, -0.0625]
    steps = []
    for step in range(1, 55):
        success = min(max(round((0.25 + 0.35 * step / 54 + noise[step % len(noise)]) * 16) / 16, 0.0), 1.0)
        if step in (20, 21):
            success = 0.0
        steps.append(
            {
                "step": step,
                "reward/mean": success,
                "reward/pass_rate": success,
                "policy/entropy": round(0.18 - 0.06 * step / 54, 4),
                "data/groups_trained": 3,
                "data/groups_skipped_shaping_only": 1,
                "data/groups_skipped_equal": 0,
            }
        )
    return steps


def test_a_healthy_run_raises_no_early_warning(healthy_run: list[dict[str, Any]]) -> None:
    guard, probed = _launch(GuardSection(), healthy_run, lambda step: (step, 0.3 + step / 200))
    assert guard.verdict.early_warnings == [] and not guard.verdict.collapsed, guard.verdict
    assert probed == [10, 20, 30, 40, 50]  # the regular schedule, no extra probe
    # The same run with a sharper entropy fall still warns of nothing: train success did not fall.
    sharp = [{**m, "policy/entropy": round(0.18 * (1 - m["step"] / 60), 4)} for m in healthy_run]
    guard, _ = _launch(GuardSection(), sharp, lambda step: (step, 0.3 + step / 200))
    assert guard.verdict.early_warnings == []
    # Three zero steps instead of two do warn; the probe clears it (0.40 against the best 0.40).
    zeros = [{**m, "reward/pass_rate": 0.0, "reward/mean": 0.0} if m["step"] == 22 else m for m in healthy_run]
    guard, probed = _launch(GuardSection(), zeros, lambda step: (step, 0.40))
    [early] = guard.verdict.early_warnings
    assert (early.rule, early.step, early.confirmed) == ("outcome", 22, False) and 22 in probed
    assert not guard.verdict.collapsed


def test_shaping_only_groups_probes_off_and_settings_off() -> None:
    """``data/groups_skipped_shaping_only``: steps where 3 of 4 groups had equal outcomes count as
    steps without an outcome signal even at a train success above 0; without probes the warning is
    itself the collapse; every rule can be turned off."""
    steps = [
        {"step": s, "reward/pass_rate": 0.4, "policy/entropy": 0.1, "data/groups_trained": 4} for s in range(1, 11)
    ] + [
        {
            "step": s,
            "reward/pass_rate": 0.1,
            "policy/entropy": 0.1,
            "data/groups_trained": 1,
            "data/groups_skipped_shaping_only": 3,
        }
        for s in range(11, 16)
    ]
    no_probes = dataclasses.replace(GuardSection(), probe_every=0)  # entropy flat: no trend warning
    guard, probed = _launch(no_probes, steps, lambda step: pytest.fail("no probes"))
    [early] = guard.verdict.early_warnings
    assert (early.rule, early.step, guard.verdict.at_step, probed) == ("outcome", 13, 13, [])
    assert early.figures["shaping_only_share"] == [0.75, 0.75, 0.75] and early.confirmed
    assert guard.verdict.reasons[0].endswith("; no probe to confirm it")
    for off in ({"early_window": 0}, {"early_zero_steps": 0, "early_success_fall": 0}, {"early_min_success": 0.5}):
        quiet, _ = _launch(dataclasses.replace(no_probes, **off), steps, lambda step: pytest.fail("no probes"))
        assert quiet.verdict.early_warnings == [] and not quiet.verdict.collapsed, off
    # The metric absent, the same success figures: no outcome rule (an absent count is 0).
    absent = [{k: v for k, v in m.items() if k != "data/groups_skipped_shaping_only"} for m in steps]
    quiet, _ = _launch(no_probes, absent, lambda step: pytest.fail("no probes"))
    assert quiet.verdict.early_warnings == []


def test_a_failed_early_warning_probe_is_retried_at_the_next_step_then_the_warning_decides(
    issue44_run: list[dict[str, Any]],
) -> None:
    guard = Guard(GuardSection())
    for metrics in issue44_run[:30]:
        step = metrics["step"]
        guard.observe_step(step, {k: v for k, v in metrics.items() if k != "step"})
        if guard.probe_due(step):
            guard.observe_probe(step, *ISSUE44_PROBES[step])
    guard.observe_step(31, issue44_run[30])
    assert guard.probe_due(31) and not guard.verdict.collapsed
    guard.probe_failed(31)  # an engine restarting: not again at 31, at the next step
    assert not guard.probe_due(31)
    guard.observe_step(32, issue44_run[31])
    assert guard.probe_due(32)
    guard.probe_failed(32)  # probing is off now: the warning is the collapse
    assert guard.verdict.collapsed and guard.verdict.at_step == 32
    assert guard.verdict.reasons[-1].startswith("early warning (trend) at step 31")


def test_the_learning_curve_draws_probes_evaluations_warning_collapse_and_the_version_scored(tmp_path: Path) -> None:
    """``learning_curve.png``'s artists, as ``run`` passes them: the report's guard section."""
    from matplotlib.figure import Figure

    guard = Guard(GuardSection())
    guard.observe_probe(10, 10, 0.40)
    guard.observe_probe(20, 20, 0.35)
    guard.observe_probe(30, 30, 0.0)
    guard.verdict.collapsed, guard.verdict.at_step = True, 31  # as the issue-44 replay above ends
    guard.verdict.early_warnings.append(EarlyWarning("trend", 31, "train success fell", {}))
    guard.observe_probe(31, 31, 0.0)
    report = {"action": "rollback", "rolled_back_to": 33, **guard.verdict.as_dict()}
    steps = [{"step": s, "metrics": {"reward/mean": 0.3}} for s in range(1, 32)]
    before, after = {"accuracy": 0.27}, {"accuracy": 0.41, "policy_versions": ["33"]}

    ax = loop._draw_curve(Figure().subplots(), steps, before, after, report)
    labels = ax.get_legend_handles_labels()[1]
    assert labels == [
        "train reward (mean per step)",
        "held-out probes (val split, greedy)",
        "eval before: 0.27 (base)",
        "eval after: 0.41 (v33 = v10's adapter, rolled back)",
        "early warning (trend) at step 31",
        "collapse declared at step 31",
    ]
    [reward, probes, warning, collapse] = ax.get_lines()
    assert list(probes.get_xdata()) == [10, 20, 30, 31] and list(probes.get_ydata()) == [0.40, 0.35, 0.0, 0.0]
    assert list(warning.get_xdata()) == [31, 31] and list(collapse.get_xdata()) == [31, 31]
    before_marker, after_marker = ax.collections
    assert before_marker.get_offsets().tolist() == [[0, 0.27]] and after_marker.get_offsets().tolist() == [[31, 0.41]]
    assert ax.get_title().endswith("final evaluation: v33 = v10's adapter, rolled back")

    path = loop._plot(tmp_path, steps, before, after, report)
    assert path == tmp_path / "learning_curve.png" and path.stat().st_size > 10_000
