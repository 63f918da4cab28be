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
class Verdict:
    collapsed: bool = False
    at_step: int | None = None
    """The step at which the collapse was declared."""
    reasons: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    best: Probe | None = None
    last: Probe | None = None

    def as_dict(self) -> dict[str, Any]:
        def probe(p: Probe | None) -> dict[str, Any] | None:
            return None if p is None else {"step": p.step, "version": p.version, "score": p.score}

        return {
            "collapsed": self.collapsed,
            "at_step": self.at_step,
            "reasons": self.reasons,
            "warnings": self.warnings,
            "best_probe": probe(self.best),
            "last_probe": probe(self.last),
        }


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


class Guard:
    """Steps and probes in, a ``Verdict`` out; the first collapse declared stays declared."""

    def __init__(self, section: GuardSection) -> None:
        self.section = section
        self.steps: list[tuple[int, dict[str, Any]]] = []
        self.probes: list[Probe] = []
        self.verdict = Verdict()
        self.probing = True
        """False once ``PROBE_FAILURES`` probes failed in a row (an empty val split, an evaluation that
        cannot run): signals only from then on. One failure (an engine restarting) is skipped."""
        self.probe_failures = 0
        self._last_probe: int | None = None
        self._cut_streak = 0

    def probe_due(self, step: int) -> bool:
        """Whether the launcher should probe after ``step`` (one probe per multiple of probe_every)."""
        every = self.section.probe_every
        if self.section.action == "off" or every == 0 or step < every or not self.probing:
            return False
        return self._last_probe is None or step // every > self._last_probe // every

    def observe_step(self, step: int, metrics: dict[str, Any]) -> None:
        if self.section.action == "off":
            return
        self.steps.append((step, metrics))
        self._check_signals(step)

    def probe_failed(self, step: int) -> None:
        """A probe could not run: skipped; ``PROBE_FAILURES`` in a row turn probing off."""
        self.probe_failures += 1
        self._last_probe = step  # not due again for this multiple
        self.probing = self.probe_failures < PROBE_FAILURES

    def observe_probe(self, step: int, version: int | None, score: float) -> None:
        if self.section.action == "off":
            return
        self.probe_failures = 0
        self._last_probe = step
        probe = Probe(step, version, score)
        best = self.verdict.best
        self.probes.append(probe)
        self.verdict.last = probe
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

    def _declare(self, step: int, reason: str) -> None:
        """Declare a collapse (once); each kind of evidence keeps its latest reason."""
        if not self.verdict.collapsed:
            self.verdict.collapsed = True
            self.verdict.at_step = step
        kind = reason.split(":")[0].split(" fell ")[0]
        self.verdict.reasons = [r for r in self.verdict.reasons if not r.startswith(kind)] + [reason]
