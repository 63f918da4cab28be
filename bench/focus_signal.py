"""How much of the generation can train, with and without ``--focus`` (issue 34), at one policy.

GRPO learns only from a group whose rewards differ (the trainer skips the others), so the share of
generated groups that disagree is the share of generation that teaches. ``--focus F``
(``workflows/picking.py``) sends a share F of task draws where groups are likely to disagree. This
bench isolates the draw from training: one stack (vLLM and the proxy, no trainer, so every group is
sampled from the base model), the config's workflow run for ``--groups`` groups per arm on the same
seed, ``--focus F`` first, then the seeded order alone (an arm without focus reads nothing back
from the store, so the first arm's groups cannot inform it; the focus arm starts with no record
and learns its kinds' rates as it goes). The config's ``--max-pending`` is dropped: no trainer
claims the groups.

Per arm: groups with two or more rewards, the share whose rewards differ, the same per task kind,
focused draws, minutes. Prints a table and, as the LAST line, one JSON object. Time: about 2
minutes for vLLM, then each arm's groups (calc: about 4 minutes per 50 groups of 4 on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._runs import isolated
from deploy.loop import _agents_python, _child_env
from deploy.run_config import RunConfig, load_run_config
from deploy.stack import Stack


def log(message: str) -> None:
    print(f"[focus_signal {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def without_option(args: tuple[str, ...], name: str) -> list[str]:
    """``args`` without the option ``name`` and its value."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == name:
            skip = True
        else:
            out.append(arg)
    return out


def run_arm(stack: Stack, config: RunConfig, *, groups: int, focus: float, log_path: Path) -> dict[str, Any]:
    argv = [
        _agents_python(),
        *("-m", "workflows", "run", config.workflow.name),
        *("--proxy", stack.proxy_url, "--seed", str(config.seed), "--groups", str(groups)),
        *without_option(config.workflow.args, "--max-pending"),
        *(("--focus", str(focus)) if focus > 0 else ()),
    ]
    started = time.monotonic()
    with log_path.open("wb") as err:
        done = subprocess.run(argv, env=_child_env(stack, config), stdout=subprocess.PIPE, stderr=err, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the workflow run failed ({done.returncode}); its log: {log_path}")
    summary = json.loads(done.stdout.decode().strip().splitlines()[-1])
    signal = summary["signal"]
    return {
        "focus": focus,
        "groups": signal["groups"],
        "disagreed": signal["disagreed"],
        "share": signal["share"],
        "by_kind": {k: f"{v['disagreed']}/{v['groups']}" for k, v in signal["by_kind"].items()},
        "focused_draws": signal["focused_draws"],
        "mean_reward": summary["mean_reward"],
        "minutes": round((time.monotonic() - started) / 60, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/run-tools.yaml")
    parser.add_argument("--groups", type=int, default=64, help="groups per arm")
    parser.add_argument("--focus", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="focus_signal-"))
    config = isolated(load_run_config(Path(args.config)), workdir, minutes=1, seed=args.seed)  # no training: unused
    stack = Stack(config, data_dir=workdir)
    arms: dict[str, dict[str, Any]] = {}
    try:
        stack.start()
        for name, focus in (("focus", args.focus), ("order", 0.0)):
            log(f"{name}: {args.groups} groups of {config.workflow.name}, seed {args.seed}")
            arms[name] = run_arm(stack, config, groups=args.groups, focus=focus, log_path=workdir / f"{name}.log")
            log(f"{name}: {arms[name]}")
    finally:
        stack.stop()
    keys = ("focus", "groups", "disagreed", "share", "by_kind", "focused_draws", "mean_reward", "minutes")
    print("| arm | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
    for name, row in arms.items():
        print(f"| {name} | " + " | ".join(str(row[k]) for k in keys) + " |")
    order, focus = arms["order"]["share"], arms["focus"]["share"]
    ratio = round(focus / order, 3) if order else None
    print(json.dumps({"arms": arms, "share_ratio_focus_over_order": ratio, "seed": args.seed, "config": args.config}))


if __name__ == "__main__":
    main()
