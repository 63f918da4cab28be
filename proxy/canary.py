"""The statistics of a canary rollout: roll a new adapter back, promote it, or keep collecting (issue 50).

A canary serves a new adapter to a share of new episodes (the *canary* arm) while the others stay
on the current one (the *baseline* arm). Rewards arrive one at a time in either arm, and the proxy
looks at them after every one, so the test must stay valid under continuous monitoring: a
fixed-sample test peeked at after every reward rolls back a good canary far more often than its
nominal level. This module is the statistics only, pure (no I/O, no clock): ``CanaryTest`` takes
``(arm, reward)`` pairs and answers a ``Decision`` that carries its evidence.

The test: a time-uniform confidence sequence for the mean difference Delta = E[canary] - E[baseline],
built on paired differences. The i-th canary reward is paired with the i-th baseline reward; each
pair's difference D_i = C_i - B_i lies in [-w, w] (w = high - low) and has mean Delta, so
Y_i = (D_i + w) / 2w lies in [0, 1]. Its bounds are the predictable plug-in empirical-Bernstein
confidence sequence (PrPl-EB) of Waudby-Smith and Ramdas, "Estimating means of bounded random
variables by betting", JRSS-B 86(1), 2024 (arXiv:2010.09686), Theorem 2, taken one-sided:

    upper(t)  = (sum l_i Y_i + log(1/alpha) + sum v_i psi(l_i)) / sum l_i        l_i at level alpha
    lower(t)  = (sum l_i Y_i - log(1/beta)  - sum v_i psi(l_i)) / sum l_i        l_i at level beta
    l_i       = min(sqrt(2 log(1/a) / (s2_{i-1} i log(1 + i))), 1/2)               predictable
    v_i       = 4 (Y_i - m_{i-1})^2,  psi(l) = (-log(1 - l) - l) / 4
    m_t       = (1/2 + sum Y_i) / (t + 1),  s2_t = (1/4 + sum (Y_i - m_i)^2) / (t + 1)

Each bound is the boundary of a nonnegative supermartingale (Ville's inequality), exact for any
bounded rewards: no normality, no asymptotics, no variance assumed (it adapts to the observed one).
The running intersection is kept (the upper bound never rises, the lower never falls), which stays
valid. Pairing rather than one bound per arm: for equal shares the difference's bound is about
sqrt(2) times one arm's, where two per-arm bounds add up to twice one arm's at half the level each;
with a small canary share (10 %) the two are about even, and the unpaired baseline rewards only
enter the reported means.

What the error rates mean. Assume, within each arm, that every reward has the same mean given all
earlier rewards (independent and identically distributed episodes suffice), that the arms are
independent, that which arm an episode lands in does not depend on its reward, and that rewards lie
in ``[low, high]``. Then, however often ``decide`` is called and whenever the caller stops:

- a canary that is in truth not worse (Delta >= 0) is ever rolled back on evidence with probability
  at most ``alpha``: a rollback needs upper < 0 <= Delta;
- a canary that is in truth worse by ``margin`` or more (Delta <= -margin) is ever promoted with
  probability at most ``beta``: a promotion needs lower > -margin >= Delta.

A canary worse by less than ``margin`` may go either way (the indifference zone). Nothing is decided
before each arm holds ``min_per_arm`` rewards. At ``max_per_arm`` pairs with neither bound crossed,
``at_cap`` decides: ``rollback`` by default (keep the baseline: the canary was not shown
non-inferior, and ``beta`` still bounds every promotion), marked ``capped`` in the evidence; such a
rollback is outside ``alpha``'s guarantee. The first verdict sticks (later rewards, from episodes
still in flight, update the evidence, not the verdict); when both bounds cross on the same pair the
rollback wins. The state is a function of the sequence of rewards per arm, so replaying the stored
``(arm, reward)`` pairs in their order (``CanaryTest.replay``) rebuilds the same decision.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

Arm = Literal["canary", "baseline"]
Verdict = Literal["continue", "promote", "rollback"]
ARMS: tuple[Arm, Arm] = ("canary", "baseline")
METHOD = "paired PrPl-EB confidence sequence (Waudby-Smith & Ramdas 2024, Thm 2), one-sided"
LAMBDA_CAP = 0.5
"""Largest bet l_i (the paper's c; it suggests 1/2 or 3/4): any value below 1 keeps the bound valid."""


class CanarySettings(BaseModel):
    """The canary test's parameters (frozen: a running test's settings never change under it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    alpha: float = Field(default=0.05, gt=0, lt=1)
    """The most probability of ever rolling back, on evidence, a canary that is in truth not worse."""
    beta: float = Field(default=0.05, gt=0, lt=1)
    """The most probability of ever promoting a canary that is in truth worse by ``margin`` or more."""
    margin: float = Field(default=0.05, ge=0)
    """Non-inferiority margin in reward units: promoted once shown worse by less than this."""
    min_per_arm: int = Field(default=20, ge=1)
    """No verdict before each arm holds this many rewards."""
    max_per_arm: int = Field(default=5000, ge=1)
    """Pairs (rewards in the smaller arm) after which ``at_cap`` decides if neither bound crossed."""
    at_cap: Literal["rollback", "promote"] = "rollback"
    """The verdict at ``max_per_arm`` without evidence: ``rollback`` keeps the baseline (safe, the
    default); ``promote`` ships a canary merely not shown worse, outside ``beta``'s guarantee."""
    low: float = 0.0
    high: float = 1.0
    """The range every reward lies in; the test's guarantees hold only for rewards inside it."""

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if not (math.isfinite(self.low) and math.isfinite(self.high) and self.low < self.high):
            raise ValueError(f"reward range needs finite low < high, got [{self.low}, {self.high}]")
        if self.margin >= self.high - self.low:
            raise ValueError(f"margin {self.margin} must be below the reward range's width {self.high - self.low}")
        if self.max_per_arm < self.min_per_arm:
            raise ValueError(f"max_per_arm {self.max_per_arm} is below min_per_arm {self.min_per_arm}")
        return self


class ArmStats(BaseModel):
    """One arm's rewards so far (all of them, paired or not)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    n: int
    mean: float | None
    """None before the first reward."""


class Decision(BaseModel):
    """A verdict and its evidence; ``evidence()`` is the plain JSON-ready dict the proxy stores and shows."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    verdict: Verdict
    reason: str
    """One line saying which bound crossed what, or why it is too early."""
    canary: ArmStats
    baseline: ArmStats
    pairs: int
    """Pairs the bounds are built on: the smaller arm's count."""
    lower: float
    """Lower confidence bound (level ``beta``) on canary - baseline, in reward units."""
    upper: float
    """Upper confidence bound (level ``alpha``) on canary - baseline, in reward units."""
    alpha: float
    beta: float
    margin: float
    low: float
    high: float
    min_per_arm: int
    max_per_arm: int
    capped: bool
    """The verdict came from ``max_per_arm`` (``at_cap``), not from a bound."""
    decided_at_pairs: int | None
    """The pair count at which the verdict was reached; None while continuing."""
    method: str = METHOD

    def evidence(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class _Bound:
    """One side of the confidence sequence at level ``level``: its own predictable bets l_i."""

    __slots__ = ("log_inv", "sum_l", "sum_ly", "sum_vpsi")

    def __init__(self, level: float) -> None:
        self.log_inv = math.log(1 / level)
        self.sum_l = self.sum_ly = self.sum_vpsi = 0.0

    def add(self, y: float, i: int, var_prev: float, v: float) -> None:
        lam = min(math.sqrt(2 * self.log_inv / (var_prev * i * math.log(1 + i))), LAMBDA_CAP)
        self.sum_l += lam
        self.sum_ly += lam * y
        self.sum_vpsi += v * (-math.log1p(-lam) - lam) / 4

    def centre_and_radius(self) -> tuple[float, float]:
        return self.sum_ly / self.sum_l, (self.log_inv + self.sum_vpsi) / self.sum_l


class CanaryTest:
    """Accumulates a canary's rewards and decides, after every pair, by the module's test.

    Deterministic: the same rewards in the same order per arm give the same state, bit for bit
    (how the two arms interleave does not matter: only the pairs do).
    """

    def __init__(self, settings: CanarySettings | None = None) -> None:
        self.settings = settings or CanarySettings()
        s = self.settings
        self._width = s.high - s.low
        self._n = {"canary": 0, "baseline": 0}
        self._sum = {"canary": 0.0, "baseline": 0.0}
        self._pending: dict[str, deque[float]] = {"canary": deque(), "baseline": deque()}
        self._pairs = 0
        self._sum_y = 0.0
        self._sum_sq = 0.0
        self._mean_y = 0.5  # m_0
        self._var_y = 0.25  # s2_0
        self._upper_side = _Bound(s.alpha)
        self._lower_side = _Bound(s.beta)
        self._upper_y = 1.0  # running intersection, in the [0, 1] scale of Y
        self._lower_y = 0.0
        self._verdict: Verdict = "continue"
        self._reason = f"collecting: no verdict before {s.min_per_arm} rewards per arm"
        self._capped = False
        self._decided_at: int | None = None

    @classmethod
    def replay(cls, rewards: Iterable[tuple[str, float]], settings: CanarySettings | None = None) -> CanaryTest:
        """Rebuild a test from stored ``(arm, reward)`` pairs in their order (after a restart)."""
        test = cls(settings)
        for arm, reward in rewards:
            test.add(arm, reward)
        return test

    @property
    def verdict(self) -> Verdict:
        """The verdict so far, without building a ``Decision`` (cheap enough to ask after every reward)."""
        return self._verdict

    @property
    def pairs(self) -> int:
        return self._pairs

    def add(self, arm: str, reward: float) -> None:
        """One reward of one arm; raises ValueError for an unknown arm or a reward outside ``[low, high]``."""
        s = self.settings
        if arm not in ARMS:
            raise ValueError(f"arm must be 'canary' or 'baseline', got {arm!r}")
        if not (isinstance(reward, int | float) and s.low <= reward <= s.high):  # NaN fails both comparisons
            raise ValueError(
                f"{arm} reward {reward!r} is outside the canary test's range [{s.low}, {s.high}]: "
                "its error rates hold only for bounded rewards (set low/high to the workflow's range)"
            )
        reward = float(reward)
        self._n[arm] += 1
        self._sum[arm] += reward
        other = "baseline" if arm == "canary" else "canary"
        if self._pending[other]:
            paired = self._pending[other].popleft()
            canary, baseline = (reward, paired) if arm == "canary" else (paired, reward)
            self._add_pair(canary - baseline)
        else:
            self._pending[arm].append(reward)

    def _add_pair(self, diff: float) -> None:
        y = min(max((diff + self._width) / (2 * self._width), 0.0), 1.0)
        i = self._pairs + 1
        v = 4 * (y - self._mean_y) ** 2
        self._upper_side.add(y, i, self._var_y, v)
        self._lower_side.add(y, i, self._var_y, v)
        self._pairs = i
        self._sum_y += y
        self._mean_y = (0.5 + self._sum_y) / (i + 1)
        self._sum_sq += (y - self._mean_y) ** 2
        self._var_y = (0.25 + self._sum_sq) / (i + 1)
        centre, radius = self._upper_side.centre_and_radius()
        self._upper_y = min(self._upper_y, centre + radius)
        centre, radius = self._lower_side.centre_and_radius()
        self._lower_y = max(self._lower_y, centre - radius)
        if self._verdict == "continue":
            self._judge()

    def bounds(self) -> tuple[float, float]:
        """(lower, upper) confidence bounds on canary - baseline, in reward units."""
        return self._to_diff(self._lower_y), self._to_diff(self._upper_y)

    def _to_diff(self, y: float) -> float:
        return (2 * y - 1) * self._width

    def _judge(self) -> None:
        s, pairs = self.settings, self._pairs
        if pairs < s.min_per_arm:
            return
        lower, upper = self.bounds()
        if upper < 0:
            self._verdict = "rollback"
            self._reason = (
                f"canary worse: upper bound on canary - baseline {upper:+.4f} < 0 after {pairs} pairs (alpha={s.alpha})"
            )
        elif lower > -s.margin:
            self._verdict = "promote"
            self._reason = (
                f"canary not worse by margin {s.margin}: lower bound on canary - baseline {lower:+.4f} > "
                f"{-s.margin:+.4f} after {pairs} pairs (beta={s.beta})"
            )
        elif pairs >= s.max_per_arm:
            self._verdict, self._capped = s.at_cap, True
            self._reason = (
                f"no bound crossed in max_per_arm={s.max_per_arm} pairs (bounds [{lower:+.4f}, {upper:+.4f}]): "
                + (
                    "kept the baseline, canary not shown non-inferior"
                    if s.at_cap == "rollback"
                    else "promoted, not shown worse"
                )
            )
        else:
            self._reason = (
                f"collecting: bounds [{lower:+.4f}, {upper:+.4f}] on canary - baseline after {pairs} pairs "
                f"cross neither 0 (rollback) nor {-s.margin:+.4f} (promote)"
            )
            return
        self._decided_at = pairs

    def decide(self) -> Decision:
        """The verdict with its evidence (the first verdict reached sticks)."""
        s = self.settings
        lower, upper = self.bounds()
        return Decision(
            verdict=self._verdict,
            reason=self._reason,
            canary=self._arm("canary"),
            baseline=self._arm("baseline"),
            pairs=self._pairs,
            lower=lower,
            upper=upper,
            alpha=s.alpha,
            beta=s.beta,
            margin=s.margin,
            low=s.low,
            high=s.high,
            min_per_arm=s.min_per_arm,
            max_per_arm=s.max_per_arm,
            capped=self._capped,
            decided_at_pairs=self._decided_at,
        )

    def _arm(self, arm: Arm) -> ArmStats:
        n = self._n[arm]
        return ArmStats(n=n, mean=self._sum[arm] / n if n else None)
