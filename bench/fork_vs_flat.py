"""Flat GRPO against fork mode on the calc tool agent, at the same minutes and seeds (issue 34).

For each seed, two arms run one after the other on this machine, each on its own stack (vLLM,
proxy, trainer, workflow: ``deploy/loop.py``'s pieces, as ``make run`` runs them) from
``configs/run-tools.yaml`` (``--config``), made private to the arm (``bench/_runs.py``):

- **flat**: the config's workflow as shipped;
- **fork**: the same, plus ``--fork-share S --fork-rule R`` (``workflows/forking.py``): after a
  group ends, one of its rewarded episodes is forked and the fork group replays the source's calls
  up to the fork point from the record (``proxy/replay.py``), then samples.

Each arm: ``--minutes`` of training and the last adapter's evaluation (the config's eval arguments:
greedy, the held-out split), against the base model's evaluation, run once per seed by its first
arm. From the arm's store: generated tokens (completion tokens of the calls the engine answered),
replayed calls, the tokens they did not generate, and the engine time they saved (their source
calls' latency: wall time under the run's concurrency, so an upper bound), trained tokens
(``data/loss_tokens`` summed over the steps), fork groups, fork episodes and how many diverged before their fork point.
Reported per arm and seed, then the mean gain per arm and held-out gain per million generated
tokens, whichever side wins. Prints a table and, as the LAST line, one JSON object.

Time: per arm ``--minutes`` plus about 9 minutes (vLLM start, the adapter's evaluation on 2 cores),
plus 3 per seed for the base model's; the default (2 seeds, 30 minutes) is about 2 hours 35
minutes. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._runs import isolated
from deploy.guard import Guard
from deploy.loop import _evaluate, _steps, _train
from deploy.run_config import RunConfig, load_run_config
from deploy.stack import Stack


def log(message: str) -> None:
    print(f"[fork_vs_flat {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def store_figures(db: Path) -> dict[str, Any]:
    """What the arm generated, replayed and forked, read from its SQLite store."""
    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            "SELECT c.completion_tokens, c.notes, c.latency_ms FROM calls c WHERE c.status_code = 200"
        ).fetchall()
        generated = replayed = replayed_tokens = 0
        saved_ms = 0.0
        sources: list[tuple[str, int]] = []
        for tokens, notes, _ in rows:
            replay = ((json.loads(notes) if notes else None) or {}).get("replay")  # the JSON column holds null
            if replay:
                replayed += 1
                replayed_tokens += int(tokens or 0)
                sources.append((replay["source_episode_id"], int(replay["source_ordinal"])))
            else:
                generated += int(tokens or 0)
        for episode_id, ordinal in sources:
            found = conn.execute(
                "SELECT latency_ms FROM calls WHERE episode_id = ? AND ordinal = ?", (episode_id, ordinal)
            ).fetchone()
            saved_ms += float(found[0]) if found else 0.0
        forks = conn.execute(
            "SELECT count(*), sum(diverged_at IS NOT NULL), count(DISTINCT group_id) FROM episodes "
            "WHERE fork_of IS NOT NULL"
        ).fetchone()
        groups = conn.execute("SELECT count(*) FROM groups").fetchone()[0]
    return {
        "generated_tokens": generated,
        "replayed_calls": replayed,
        "replayed_tokens": replayed_tokens,
        "engine_seconds_saved": round(saved_ms / 1000, 1),
        "groups": int(groups),
        "fork_groups": int(forks[2] or 0),
        "fork_episodes": int(forks[0] or 0),
        "fork_diverged": int(forks[1] or 0),
    }


def run_arm(
    config: RunConfig, run_dir: Path, *, minutes: float, stop: list[bool], before: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One arm; ``before`` is the seed's base-model evaluation when an earlier arm already ran it (the
    same greedy evaluation of the same base model on the same split: ~3 minutes not spent twice)."""
    stack = Stack(config, data_dir=run_dir)
    try:
        stack.start()
        if before is None:
            before = _evaluate(stack, config, run_dir, "before")
        started = time.monotonic()
        _train(stack, config, run_dir, time.time() + minutes * 60, stop, Guard(config.guard))
        train_seconds = time.monotonic() - started
        steps = _steps(stack, -1)
        after = _evaluate(stack, config, run_dir, "after")
    finally:
        stack.stop()
    trained = sum(float(s["metrics"].get("data/loss_tokens", 0.0)) for s in steps)
    figures = store_figures(run_dir / "flywheel.db")
    return before, {
        "before": before.get("accuracy"),
        "after": after.get("accuracy"),
        "gain": round(float(after.get("accuracy", 0.0)) - float(before.get("accuracy", 0.0)), 4),
        "steps": len(steps),
        "train_minutes": round(train_seconds / 60, 2),
        "trained_tokens": int(trained),
        "generated_per_trained": round(figures["generated_tokens"] / trained, 2) if trained else None,
        **figures,
    }


def table(results: dict[str, dict[int, dict[str, Any]]]) -> str:
    keys = ("before", "after", "gain", "steps", "generated_tokens", "trained_tokens", "generated_per_trained",
            "replayed_calls", "replayed_tokens", "engine_seconds_saved", "fork_groups", "fork_episodes",
            "fork_diverged")  # fmt: skip
    lines = ["| arm | seed | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for arm, seeds in results.items():
        for seed, row in seeds.items():
            lines.append(f"| {arm} | {seed} | " + " | ".join(str(row.get(k)) for k in keys) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/run-tools.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--fork-share", type=float, default=0.5)
    parser.add_argument("--fork-rule", default="failure", choices=["uniform", "failure", "entropy"])
    parser.add_argument("--keep", action="store_true", help="keep the arms' directories (logs, stores)")
    args = parser.parse_args()
    base = load_run_config(Path(args.config))
    arms = {"flat": (), "fork": ("--fork-share", str(args.fork_share), "--fork-rule", args.fork_rule)}
    stop = [False]

    def interrupt(*_: Any) -> None:
        stop[0] = True

    signal.signal(signal.SIGTERM, interrupt)
    workdir = Path(tempfile.mkdtemp(prefix="fork_vs_flat-"))
    results: dict[str, dict[int, dict[str, Any]]] = {arm: {} for arm in arms}
    try:
        for seed in args.seeds:
            before: dict[str, Any] | None = None
            for arm, extra in arms.items():
                run_dir = workdir / f"{arm}-seed{seed}"
                run_dir.mkdir(parents=True)
                config = isolated(base, run_dir, minutes=args.minutes, seed=seed, workflow_args=extra)
                log(f"{arm}, seed {seed}: {args.minutes} minutes")
                before, results[arm][seed] = run_arm(config, run_dir, minutes=args.minutes, stop=stop, before=before)
                log(f"{arm}, seed {seed}: {results[arm][seed]}")
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    summary: dict[str, Any] = {}
    for arm, seeds in results.items():
        rows = list(seeds.values())
        generated = sum(r["generated_tokens"] for r in rows)
        summary[arm] = {
            "mean_gain": round(sum(r["gain"] for r in rows) / len(rows), 4) if rows else None,
            "gain_per_million_generated": round(sum(r["gain"] for r in rows) / generated * 1e6, 3)
            if generated
            else None,
        }
    print(table(results))
    print(json.dumps({"arms": results, "summary": summary, "minutes": args.minutes, "config": args.config}))


if __name__ == "__main__":
    main()
