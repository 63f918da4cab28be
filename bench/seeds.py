"""Does learning hold on any seed? ``make run`` over seeds and step counts, one table (issue 44).

For each step count and seed, the run config (``--config``) runs as ``make run`` runs it
(``python -m deploy.local run``: the base model's held-out evaluation, ``--steps`` GRPO steps, the
final adapter's evaluation), on a private copy (``bench/_runs.py``: its own directory and ports) with
the config's guard as shipped. A rollback is reported, not hidden: a run that needed one does not
count as holding. Each cell (step count) gets the mean gain, its spread (min, max, sample standard
deviation), how many runs ended above their baseline and how many the guard rolled back.

The cells are resumable: a run whose ``report.json`` exists is read, not rerun, and an interrupted
one resumes (the launcher skips the phases it finished), so a five-seed table can be built over
several sittings into the same ``--out``. Step budgets make a run's length a count of steps, so the
table means the same on any machine; the machine is named in the output (CPU model and the
instruction sets the engine and trainer choose by).

Prints one row per run, one per cell, then, as the LAST line, one JSON object. Run it alone on the
machine: two cores hold one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench._runs import private
from deploy.run_config import load_run_config
from deploy.vllm import ROOT


def log(message: str) -> None:
    print(f"[seeds {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def machine() -> str:
    """The CPU and what the engine and trainer pick by: native bf16 (AVX512-BF16, AMX) or not."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.machine()} ({os.cpu_count()} cores)"
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    sets = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{model}, {os.cpu_count()} cores, {'/'.join(sets) or 'no AVX2'}"


def finished(cell_dir: Path) -> dict[str, Any] | None:
    """The report of the cell's finished run, if there is one."""
    reports = sorted(cell_dir.glob("runs/*/report.json"))
    return json.loads(reports[-1].read_text()) if reports else None


def row(report: dict[str, Any]) -> dict[str, Any]:
    """What the table keeps of a run's report."""
    before, after = report.get("eval_before"), report.get("eval_after")
    guard = report.get("guard") or {}
    return {
        "before": before,
        "after": after,
        "gain": round(after - before, 4) if before is not None and after is not None else None,
        "steps": report.get("steps"),
        "minutes": report.get("minutes"),
        "rolled_back_to": guard.get("rolled_back_to"),
        "collapsed": guard.get("collapsed"),
        "eval_n": report.get("eval_n"),
    }


def cell(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean gain and spread over a cell's runs; a rolled-back run is counted apart, not as holding."""
    gains = [r["gain"] for r in rows if r["gain"] is not None]
    return {
        "runs": len(rows),
        "mean_gain": round(statistics.fmean(gains), 4) if gains else None,
        "min_gain": min(gains, default=None),
        "max_gain": max(gains, default=None),
        "stdev_gain": round(statistics.stdev(gains), 4) if len(gains) > 1 else None,
        "above_baseline": sum(1 for r in rows if (r["gain"] or 0) > 0 and r["rolled_back_to"] is None),
        "rolled_back": sum(1 for r in rows if r["rolled_back_to"] is not None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/run-tools.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[11, 12, 13, 14, 15])
    parser.add_argument("--steps", type=int, nargs="+", default=[7])
    parser.add_argument("--out", type=Path, default=ROOT / "data" / "seeds", help="cells are kept (and resumed) here")
    parser.add_argument("--dry-run", action="store_true", help="only print the table of the runs already finished")
    args = parser.parse_args()
    base = load_run_config(Path(args.config))
    name = Path(args.config).stem
    results: dict[int, dict[int, dict[str, Any]]] = {}
    for steps in args.steps:
        results[steps] = {}
        for seed in args.seeds:
            cell_dir = args.out / f"{name}-steps{steps}-seed{seed}"
            report = finished(cell_dir)
            if report is None and not args.dry_run:
                cell_dir.mkdir(parents=True, exist_ok=True)
                private(base, cell_dir, seed=seed, budget_steps=steps, resume=True)
                log(f"{name}: {steps} steps, seed {seed} -> {cell_dir}")
                env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
                command = [sys.executable, "-m", "deploy.local", "run", "--config", str(cell_dir / "run.yaml")]
                with (cell_dir / "launcher.log").open("a") as out:
                    code = subprocess.run(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
                report = finished(cell_dir)
                if report is None:
                    log(f"{name}: {steps} steps, seed {seed}: no report (exit {code}; see {cell_dir}/launcher.log)")
                    continue
            if report is not None:
                results[steps][seed] = row(report)
                log(f"{name}: {steps} steps, seed {seed}: {results[steps][seed]}")
    keys = ("before", "after", "gain", "steps", "minutes", "rolled_back_to", "eval_n")
    print(f"machine: {machine()}; config: {args.config}")
    print("| steps | seed | " + " | ".join(keys) + " |\n|---|---|" + "---|" * len(keys))
    for steps, seeds in results.items():
        for seed, r in seeds.items():
            print(f"| {steps} | {seed} | " + " | ".join(str(r[k]) for k in keys) + " |")
    cells = {steps: cell(list(seeds.values())) for steps, seeds in results.items()}
    for steps, c in cells.items():
        print(f"{steps} steps: " + ", ".join(f"{k} {v}" for k, v in c.items()))
    print(json.dumps({"machine": machine(), "config": args.config, "runs": results, "cells": cells}))


if __name__ == "__main__":
    main()
