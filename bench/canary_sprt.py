"""How the canary test (``proxy/canary.py``, issue 50) decides under continuous monitoring: simulated canaries.

Each run is one canary: rewards arrive one at a time, each in the canary arm with probability
``--share`` and otherwise in the baseline arm, drawn from the truth's distributions, and the test's
verdict is looked at after every reward until it is no longer ``continue`` (a bound crossed, or the
smaller arm reached ``--max-per-arm`` and ``at_cap`` decided). The truths: Bernoulli rewards with a
baseline at p = 0.3, 0.5 and 0.8, and Beta rewards (continuous on [0, 1]) with a Beta(2, 2) baseline,
each with the canary equal, better by 0.1, worse by 0.1 and worse by exactly ``--margin``.

Per truth: runs, the share rolled back on evidence (upper bound below 0), promoted on evidence
(lower bound above -margin), undecided at the cap (the cap's verdict, ``at_cap``, applies), and the
median and 90th percentile of the pairs (rewards in the smaller arm) to the verdict. The ``error``
column is the share of runs that made the error the test bounds, next to its bound: rolled back when
the canary is not worse (<= alpha), promoted when worse by margin or more (<= beta); between 0 and
-margin (none here) no verdict is an error. Every figure is measured in the run; nothing is stored.

    python -m bench.canary_sprt                    # 500 runs per truth, seed 0
    python -m bench.canary_sprt --runs 50 --seed 3

Pure Python on one core: about 10 microseconds per reward, so the equal and worse-by-margin truths
(thousands of pairs each) dominate the time. Prints a table and, as the LAST line, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from proxy.canary import CanarySettings, CanaryTest

Draw = Callable[[random.Random], float]


@dataclass(frozen=True)
class Truth:
    family: str
    baseline_mean: float
    diff: float
    canary: Draw
    baseline: Draw


def bernoulli(p: float) -> Draw:
    return lambda rng: 1.0 if rng.random() < p else 0.0


def beta_with_mean(mean: float, concentration: float = 4.0) -> Draw:
    """Beta(mean * k, (1 - mean) * k): Beta(2, 2) at mean 0.5."""
    a, b = mean * concentration, (1 - mean) * concentration
    return lambda rng: rng.betavariate(a, b)


def truths(margin: float) -> list[Truth]:
    out = []
    diffs = (0.0, 0.1, -0.1, -margin)
    for p in (0.3, 0.5, 0.8):
        out += [Truth("bernoulli", p, d, bernoulli(p + d), bernoulli(p)) for d in diffs]
    out += [Truth("beta", 0.5, d, beta_with_mean(0.5 + d), beta_with_mean(0.5)) for d in diffs]
    return out


def simulate(truth: Truth, settings: CanarySettings, share: float, rng: random.Random) -> tuple[str, bool, int]:
    """One canary to its verdict, looked at after every reward: (verdict, capped, pairs)."""
    test = CanaryTest(settings)
    while test.verdict == "continue":
        if rng.random() < share:
            test.add("canary", truth.canary(rng))
        else:
            test.add("baseline", truth.baseline(rng))
    decision = test.decide()
    return decision.verdict, decision.capped, decision.pairs


def cell(truth: Truth, settings: CanarySettings, share: float, runs: int, seed: int) -> dict[str, Any]:
    rng = random.Random(f"{seed}/{truth.family}/{truth.baseline_mean}/{truth.diff}")
    results = [simulate(truth, settings, share, rng) for _ in range(runs)]
    rolled = sum(v == "rollback" and not c for v, c, _ in results) / runs
    promoted = sum(v == "promote" and not c for v, c, _ in results) / runs
    pairs = sorted(p for _, _, p in results)
    if truth.diff >= 0:
        error, bound = rolled, settings.alpha
    elif truth.diff <= -settings.margin + 1e-12:
        error, bound = promoted, settings.beta
    else:
        error, bound = None, None
    return {
        "reward": truth.family,
        "baseline_mean": truth.baseline_mean,
        "diff": round(truth.diff, 4),
        "runs": runs,
        "rolled_back": rolled,
        "promoted": promoted,
        "undecided": sum(c for _, c, _ in results) / runs,
        "median_pairs": statistics.median(pairs),
        "p90_pairs": pairs[min(len(pairs) - 1, int(0.9 * len(pairs)))],
        "error": error,
        "error_bound": bound,
    }


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--runs", type=int, default=500, help="simulated canaries per truth")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--share", type=float, default=0.5, help="share of rewards in the canary arm")
    parser.add_argument("--alpha", type=float, default=0.05)
    parser.add_argument("--beta", type=float, default=0.05)
    parser.add_argument("--margin", type=float, default=0.05)
    parser.add_argument("--min-per-arm", type=int, default=20)
    parser.add_argument("--max-per-arm", type=int, default=5000)
    args = parser.parse_args()
    settings = CanarySettings(
        alpha=args.alpha,
        beta=args.beta,
        margin=args.margin,
        min_per_arm=args.min_per_arm,
        max_per_arm=args.max_per_arm,
    )
    started = time.monotonic()
    rows = []
    for truth in truths(args.margin):
        rows.append(cell(truth, settings, args.share, args.runs, args.seed))
        print(f"[canary_sprt] {truth.family} p={truth.baseline_mean} diff={truth.diff:+.3f}", file=sys.stderr)
    seconds = time.monotonic() - started
    print(
        f"canary share {args.share}, alpha {args.alpha}, beta {args.beta}, margin {args.margin}, "
        f"min/max per arm {args.min_per_arm}/{args.max_per_arm} (at the cap: {settings.at_cap}), seed {args.seed}"
    )
    head = "| reward | baseline | diff | runs | rolled back % | promoted % | undecided % | median pairs | p90 pairs |"
    print(head + " error % (bound) |\n" + "|---" * 10 + "|")
    for r in rows:
        err = "-" if r["error"] is None else f"{pct(r['error'])} (<= {pct(r['error_bound'])})"
        print(
            f"| {r['reward']} | {r['baseline_mean']} | {r['diff']:+.2f} | {r['runs']} | {pct(r['rolled_back'])} | "
            f"{pct(r['promoted'])} | {pct(r['undecided'])} | {r['median_pairs']:g} | {r['p90_pairs']} | {err} |"
        )
    print(f"{seconds:.1f} s")
    print(json.dumps({"settings": settings.model_dump(), "share": args.share, "seed": args.seed, "rows": rows}))


if __name__ == "__main__":
    main()
