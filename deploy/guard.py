"""The collapse guard: read a run's step metrics and held-out probes, and say when the policy collapses.

Why. A policy can learn and then collapse while training goes on (issue 28: the calc agent rose from
0.27 to 0.69 train pass rate by step 9 and fell to 0.04 held-out by step 54, its tool calls filled
with whitespace and cut at ``max_tokens``), and a launcher that evaluates only the last adapter then
reports the collapsed one as its "after". The guard watches two kinds of evidence:

- **probes**: every ``probe_every`` steps the launcher evaluates the current adapter greedily on the
  workflow's ``val`` split (train tasks held out of training, ``workflows/base.py``), asking for it by
  its versioned name, so versions the trainer publishes meanwhile do not answer it. A probe score
  more than ``max_drop`` below the best so far, ``patience`` probes in a row, is a collapse.
- **signals** in the trainer's step metrics (``trainer/metrics.py`` ``collapse_signals``): the share of
  sampled answers cut at the token limit (``signals/cut_fraction``), calls that required a tool call
  and made none (``signals/tool_call_missing``), the sampling entropy (``policy/entropy``) and the
  train reward (``reward/mean``), each as the mean of the last ``window`` steps against the first
  ``window``. A cut fraction above ``max_cut_fraction`` and above twice its start, ``patience``
  windows in a row, is a collapse; the other signals, and an engine/trainer log-prob gap above
  ``GAP_WARN_NATS``, are reported as warnings only (entropy rises and rewards fall in
  healthy runs too).

- **early warnings** (issue 44: a calc run whose train success fell to 0 at step 30 while its
  sampling entropy fell to a quarter, the groups training on per-call shaping rewards alone, was
  declared collapsed by its probes only at step 40): two rules over the step metrics, each over
  windows of ``early_window`` steps, watching a run once some window's train success reached
  ``early_min_success``. The *trend* rule fires when the last window's train success is
  ``early_success_fall`` (a fraction) below the best earlier window's and the sampling entropy
  ``early_entropy_fall`` below that window's; the *outcome* rule when ``early_zero_steps`` trained
  steps in a row had no outcome signal (train success 0, or ``early_shaping_only_share`` of the
  groups counted in ``data/groups_skipped_shaping_only``). A warning makes a probe due at once;
  that probe confirms it (a collapse) when it is more than ``max_drop`` below the best probe, or
  clears it (the rules rest for ``early_window`` steps). Without probes the warning is the collapse.

``Guard`` is pure (no I/O): the launcher feeds it steps and probes and acts on its verdict
(``deploy/loop.py``): ``warn`` logs it, ``stop`` ends training, ``rollback`` ends training and
publishes the best probed adapter again, so the final evaluation scores that one; the report says
which happened either way.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from deploy.run_config import GuardSection

PROBE_FAILURES = 2
"""Failed probes in a row after which the guard stops probing."""
GAP_WARN_NATS = 0.1
"""A mean engine/trainer log-prob gap (``policy/engine_logp_diff_mean``) above this over the last
window is warned about: issue 28's collapse began as a gap that grew from 0.9 to 5.9 nats on
constrained tokens scored without the engine's grammar mask; with the mask a step's mean stayed at
most 0.013 (bf16, 54 steps) and about 2e-6 in float32, and bf16 kernels' rounding on unconstrained
tokens is 0.03-0.04."""


@dataclass(frozen=True)
class Probe:
    step: int
    version: int | None
    """The policy version the probe scored (None: unknown)."""
    score: float


@dataclass
class EarlyWarning:
    rule: str
    """``trend`` (entropy and train success fell) or ``outcome`` (steps without an outcome signal)."""
    step: int
    """The step whose metrics fired it."""
    message: str
    figures: dict[str, Any]
    probe: Probe | None = None
    """The probe that answered it (None: none yet, or no probes)."""
    confirmed: bool | None = None
    """True: a collapse; False: the probe cleared it; None: not probed yet."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "step": self.step,
            "message": self.message,
            "figures": self.figures,
            "probe": _probe_dict(self.probe),
            "confirmed": self.confirmed,
        }


def _probe_dict(p: Probe | None) -> dict[str, Any] | None:
    return None if p is None else {"step": p.step, "version": p.version, "score": p.score}


@dataclass
class Verdict:
    collapsed: bool = False
    at_step: int | None = None
    """The step at which the collapse was declared."""
    reasons: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    best: Probe | None = None
    last: Probe | None = None
    probes: list[Probe] = field(default_factory=list)
    """Every probe, in order (the learning curve draws them)."""
    early_warnings: list[EarlyWarning] = field(default_factory=list)
    """Every early warning fired, in order, each with the probe that answered it."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "collapsed": self.collapsed,
            "at_step": self.at_step,
            "reasons": self.reasons,
            "warnings": self.warnings,
            "early_warnings": [w.as_dict() for w in self.early_warnings],
            "best_probe": _probe_dict(self.best),
            "last_probe": _probe_dict(self.last),
            "probes": [_probe_dict(p) for p in self.probes],
        }


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _float(value: Any) -> float | None:
    """A metric's value as a float; None when it is absent or not a number."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _shaping_only_share(metrics: dict[str, Any]) -> float:
    """The share of a step's groups whose outcomes were all equal, so that only per-call shaping
    rewards told their members apart (``data/groups_skipped_shaping_only``; absent: 0)."""
    shaping = _float(metrics.get("data/groups_skipped_shaping_only")) or 0.0
    total = shaping + (_float(metrics.get("data/groups_trained")) or 0.0)
    return shaping / total if total else 0.0


class Guard:
    """Steps and probes in, a ``Verdict`` out; the first collapse declared stays declared."""

    def __init__(self, section: GuardSection) -> None:
        self.section = section
        self.steps: list[tuple[int, dict[str, Any]]] = []
        self.verdict = Verdict()
        self.probes: list[Probe] = self.verdict.probes
        self.probing = True
        """False once ``PROBE_FAILURES`` probes failed in a row (an empty val split, an evaluation that
        cannot run): signals only from then on. One failure (an engine restarting) is skipped."""
        self.probe_failures = 0
        self._last_probe: int | None = None
        self._cut_streak = 0
        self._pending: EarlyWarning | None = None
        """An early warning waiting for its probe."""
        self._early_rest_until = 0
        """Early warnings fire again only after this step (a probe cleared the last one)."""

    def probe_due(self, step: int) -> bool:
        """Whether the launcher should probe after ``step`` (one probe per multiple of probe_every)."""
        every = self.section.probe_every
        if self.section.action == "off" or every == 0 or not self.probing:
            return False
        if self._pending is not None and (self._last_probe is None or step > self._last_probe):
            return True  # an early warning: probe now (after a failed probe, at the next step)
        if step < every:
            return False
        return self._last_probe is None or step // every > self._last_probe // every

    def observe_step(self, step: int, metrics: dict[str, Any]) -> None:
        if self.section.action == "off":
            return
        self.steps.append((step, metrics))
        self._check_signals(step)
        self._check_early(step)

    def probe_failed(self, step: int) -> None:
        """A probe could not run: skipped; ``PROBE_FAILURES`` in a row turn probing off."""
        self.probe_failures += 1
        self._last_probe = step  # not due again for this multiple
        self.probing = self.probe_failures < PROBE_FAILURES
        if not self.probing and self._pending is not None:  # no probe will answer it: it is the evidence
            self._declare_early(step, self._pending)

    def observe_probe(self, step: int, version: int | None, score: float) -> None:
        if self.section.action == "off":
            return
        self.probe_failures = 0
        self._last_probe = step
        probe = Probe(step, version, score)
        best = self.verdict.best
        self.probes.append(probe)
        self.verdict.last = probe
        fell = best is not None and score < best.score - self.section.max_drop
        if self._pending is not None:
            self._answer_early(self._pending, probe, best, fell)
        if best is None or score > best.score:
            self.verdict.best = probe
            return
        falls = [p for p in self.probes[-self.section.patience :] if p.score < best.score - self.section.max_drop]
        if len(falls) == self.section.patience and len(self.probes) > self.section.patience:
            scores = ", ".join(f"{p.score:.3f} (step {p.step})" for p in falls)
            self._declare(step, f"held-out probe fell from {best.score:.3f} (step {best.step}) to {scores}")

    def final_check(self, step: int) -> None:
        """After training: a last probe more than ``max_drop`` below the best is a collapse, however
        few probes fell (a run that collapses in its last steps)."""
        best, last = self.verdict.best, self.verdict.last
        if self.section.action == "off" or best is None or last is None or last is best:
            return
        if last.score < best.score - self.section.max_drop:
            self._declare(
                step, f"held-out probe fell from {best.score:.3f} (step {best.step}) to {last.score:.3f} at the end"
            )

    def _series(self, key: str) -> list[float]:
        return [float(m[key]) for _, m in self.steps if isinstance(m.get(key), int | float)]

    def _check_signals(self, step: int) -> None:
        w = self.section.window
        if len(self.steps) < 2 * w:
            return
        cut = self._series("signals/cut_fraction")
        start, now = _mean(cut[:w]), _mean(cut[-w:])
        if start is not None and now is not None and now > self.section.max_cut_fraction and now > 2 * start:
            self._cut_streak += 1
            if self._cut_streak >= self.section.patience:
                self._declare(step, f"answers cut at the token limit: {now:.2f} of the last {w} steps vs {start:.2f}")
        else:
            self._cut_streak = 0
        self.verdict.warnings = []
        for key, label, rise, fall in (
            ("policy/entropy", "sampling entropy", 0.5, None),  # relative rise
            ("signals/tool_call_missing", "required tool calls missing", None, None),
            ("reward/mean", "train reward", None, 0.15),  # absolute fall
        ):
            series = self._series(key)
            first, last = _mean(series[:w]), _mean(series[-w:])
            if first is None or last is None:
                continue
            worse = (
                last > first * (1 + rise)
                if rise is not None
                else last < first - fall
                if fall is not None
                else last > first + 0.2
            )
            if worse:
                self.verdict.warnings.append(f"{label} {first:.3f} -> {last:.3f} (first vs last {w} steps)")
        gap = self._series("policy/engine_logp_diff_mean")
        first, last = _mean(gap[:w]), _mean(gap[-w:])
        if first is not None and last is not None and last > GAP_WARN_NATS:
            self.verdict.warnings.append(
                f"engine/trainer log-prob gap {first:.3f} -> {last:.3f} nats (first vs last {w} steps): "
                "the trainer is updating a policy the engine does not sample"
            )

    # -- early warnings (issue 44) ---------------------------------------------------------------

    def _rows(self) -> list[tuple[int, float, float | None, dict[str, Any]]]:
        """(step, train success, sampling entropy, metrics) of the steps that report a train success:
        ``reward/pass_rate``, else ``reward/mean``."""
        rows = []
        for step, m in self.steps:
            success = next(
                (v for k in ("reward/pass_rate", "reward/mean") if (v := _float(m.get(k))) is not None), None
            )
            if success is not None:
                rows.append((step, success, _float(m.get("policy/entropy")), m))
        return rows

    def _check_early(self, step: int) -> None:
        sec = self.section
        w = sec.early_window
        if (
            w == 0
            or self.verdict.collapsed
            or self._pending is not None
            or step <= self._early_rest_until
            or (sec.early_success_fall == 0 and sec.early_zero_steps == 0)
        ):
            return
        rows = self._rows()
        if not rows or rows[-1][0] != step:
            return
        warning = self._trend(rows) or self._outcome(rows)
        if warning is None:
            return
        self.verdict.early_warnings.append(warning)
        if self.section.probe_every > 0 and self.probing:
            self._pending = warning  # probe_due says so; observe_probe answers it
        else:
            self._declare_early(step, warning)

    def _best_window(self, rows: list[tuple[int, float, float | None, dict[str, Any]]], end: int) -> int | None:
        """The start of the window of ``early_window`` rows ending at or before ``rows[end - 1]`` with
        the highest mean train success (the earliest of equals), if it reaches ``early_min_success``."""
        w = self.section.early_window
        best: tuple[float, int] | None = None
        for start in range(end - w + 1):
            mean = statistics.fmean(r[1] for r in rows[start : start + w])
            if best is None or mean > best[0] + 1e-12:
                best = (mean, start)
        if best is None or best[0] < self.section.early_min_success:
            return None
        return best[1]

    def _trend(self, rows: list[tuple[int, float, float | None, dict[str, Any]]]) -> EarlyWarning | None:
        """The last window's train success ``early_success_fall`` below the best earlier window's, and
        its sampling entropy ``early_entropy_fall`` below that window's."""
        sec, w = self.section, self.section.early_window
        if sec.early_success_fall == 0 or len(rows) < 2 * w:
            return None
        start = self._best_window(rows, len(rows) - w)
        if start is None:
            return None
        best, now = rows[start : start + w], rows[-w:]
        best_success, now_success = statistics.fmean(r[1] for r in best), statistics.fmean(r[1] for r in now)
        if best_success <= 0:
            return None
        success_fall = 1 - now_success / best_success
        if success_fall < sec.early_success_fall - 1e-9:
            return None
        best_entropy = _mean([r[2] for r in best if r[2] is not None])
        now_entropy = _mean([r[2] for r in now if r[2] is not None])
        entropy_fall = None
        if best_entropy and now_entropy is not None:
            entropy_fall = 1 - now_entropy / best_entropy
        if sec.early_entropy_fall > 0 and (entropy_fall is None or entropy_fall < sec.early_entropy_fall - 1e-9):
            return None
        figures = {
            "window": [now[0][0], now[-1][0]],
            "success": round(now_success, 4),
            "best_window": [best[0][0], best[-1][0]],
            "best_success": round(best_success, 4),
            "success_fall": round(success_fall, 4),
            "entropy": None if now_entropy is None else round(now_entropy, 4),
            "best_entropy": None if best_entropy is None else round(best_entropy, 4),
            "entropy_fall": None if entropy_fall is None else round(entropy_fall, 4),
        }
        entropy = (
            ""
            if entropy_fall is None or now_entropy is None or best_entropy is None
            else f", sampling entropy {best_entropy:.3f} -> {now_entropy:.3f} (-{entropy_fall:.0%})"
        )
        message = (
            f"train success {best_success:.3f} (steps {best[0][0]}-{best[-1][0]}) -> {now_success:.3f} "
            f"(steps {now[0][0]}-{now[-1][0]}, -{success_fall:.0%}){entropy}"
        )
        return EarlyWarning("trend", now[-1][0], message, figures)

    def _outcome(self, rows: list[tuple[int, float, float | None, dict[str, Any]]]) -> EarlyWarning | None:
        """``early_zero_steps`` trained steps in a row without an outcome signal, after a window whose
        train success reached ``early_min_success``."""
        sec = self.section
        n = sec.early_zero_steps
        if n == 0 or len(rows) < n:
            return None
        streak = rows[-n:]
        shares = [_shaping_only_share(r[3]) for r in streak]
        if not all(r[1] == 0 or share >= sec.early_shaping_only_share for r, share in zip(streak, shares, strict=True)):
            return None
        start = self._best_window(rows, len(rows) - n)
        if start is None:
            return None
        best = rows[start : start + sec.early_window]
        best_success = statistics.fmean(r[1] for r in best)
        equal = [e for r in streak if (e := _float(r[3].get("data/groups_skipped_equal"))) is not None]
        figures = {
            "steps": [streak[0][0], streak[-1][0]],
            "success": [r[1] for r in streak],
            "shaping_only_share": [round(s, 4) for s in shares],
            "groups_skipped_equal": int(sum(equal)) if equal else None,
            "best_window": [best[0][0], best[-1][0]],
            "best_success": round(best_success, 4),
        }
        what = (
            "train success 0 (every outcome 0: trained on shaping rewards alone)"
            if all(r[1] == 0 for r in streak)
            else f"train success {', '.join(f'{r[1]:.2f}' for r in streak)}, shaping-only group shares "
            + ", ".join(f"{s:.2f}" for s in shares)
        )
        skipped = figures["groups_skipped_equal"]
        message = (
            f"{n} trained steps in a row without an outcome signal (steps {streak[0][0]}-{streak[-1][0]}): {what}; "
            + ("" if skipped is None else f"{skipped} groups skipped for equal rewards; ")
            + f"train success was {best_success:.3f} (steps {best[0][0]}-{best[-1][0]})"
        )
        return EarlyWarning("outcome", streak[-1][0], message, figures)

    def _answer_early(self, warning: EarlyWarning, probe: Probe, best: Probe | None, fell: bool) -> None:
        """The probe after an early warning: a fall below the best probe confirms it (a collapse)."""
        self._pending = None
        warning.probe = probe
        warning.confirmed = fell
        if fell and best is not None:
            self._declare_early(
                probe.step,
                warning,
                f"; the probe at step {probe.step} scored {probe.score:.3f} vs the best {best.score:.3f} "
                f"(step {best.step})",
            )
        else:
            self._early_rest_until = probe.step + self.section.early_window

    def _declare_early(self, step: int, warning: EarlyWarning, confirmation: str = "") -> None:
        self._pending = None
        if not confirmation:
            warning.confirmed = True
            confirmation = "; no probe to confirm it"
        self._declare(step, f"early warning ({warning.rule}) at step {warning.step}: {warning.message}{confirmation}")

    def _declare(self, step: int, reason: str) -> None:
        """Declare a collapse (once); each kind of evidence keeps its latest reason."""
        if not self.verdict.collapsed:
            self.verdict.collapsed = True
            self.verdict.at_step = step
        kind = reason.split(":")[0].split(" fell ")[0]
        self.verdict.reasons = [r for r in self.verdict.reasons if not r.startswith(kind)] + [reason]
