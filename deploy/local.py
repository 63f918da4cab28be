"""The local launcher behind ``make serve`` and ``make run``: one machine, every process supervised.

``serve`` brings up vLLM (restarted if its engine dies) and the proxy on SQLite, then waits for
Ctrl-C. ``run`` (``deploy/loop.py``) adds the trainer and a workflow for a time budget, evaluates
before and after, and writes a report. Both read a run config (``deploy/run_config.py``); the
processes they share are in ``deploy/stack.py``. Either way, every child is stopped on exit.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Any

from deploy.agreement import check as check_agreement
from deploy.loop import run
from deploy.run_config import RunConfig, RunConfigError, load_run_config
from deploy.stack import Stack, log


def serve(config: RunConfig) -> None:
    data_dir = config.data_path
    stack = Stack(config, data_dir=data_dir)
    check_agreement(config, stack.model_dir)
    stopping = False

    def _stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        stack.start()
        log("ready. Create an episode and point any OpenAI client at its base_url:")
        print(
            f'  curl -s {stack.proxy_url}/episodes -H "authorization: Bearer $(cat {data_dir}/admin.key)" '
            "-H 'content-type: application/json' -d '{\"task_id\": \"demo\"}'",
            flush=True,
        )
        print('  # then: OpenAI(base_url=<base_url>, api_key=<api_key>) with model="policy"; Ctrl-C stops', flush=True)
        while not stopping:
            time.sleep(0.5)
            if not stack.proxy.alive():
                log(f"the proxy exited; see {stack.proxy.log_path}")
                break
    finally:
        stack.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m deploy.local", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["serve", "run"])
    parser.add_argument("--config", default="configs/run-local.yaml", help="the run config (configs/run-*.yaml)")
    parser.add_argument("--seed", type=int, help="override the config's seed (run: a new run with this seed)")
    parser.add_argument("--budget-steps", type=int, help="override the config's budget_steps (train this many steps)")
    args = parser.parse_args(argv)
    try:
        config = load_run_config(args.config).with_seed(args.seed).with_budget_steps(args.budget_steps)
    except RunConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        if args.command == "serve":
            serve(config)
        else:
            run(config)
    except RunConfigError as exc:  # the processes' settings disagree: nothing was started
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
