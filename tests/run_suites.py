"""`make test`'s two pytest runs (engine venv, then agents venv) on shared vLLM engines.

Each suite would otherwise start its own engines (about a minute each on 2 cores, plus warm-up).
The engines are the session fixtures' (``tests/conftest.py``: same models, flags and cache size):
the plumbing model's and SmolLM2's, started side by side; each run reaches them through
``FLYWHEEL_TEST_VLLM_URL`` and ``FLYWHEEL_TEST_SMOL_VLLM_URL`` (their logs: ``..._LOG``). Tests that
need an engine with other flags still start their own. ``--beside CMD`` runs a command (``make
lint``) while the engines start, which takes a minute of mostly waiting; its failure fails the run
before any suite starts. Each phase's wall time is printed at the end; the exit status is the
first failing phase's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support.services import shared_engine, smol_model_dir


def main(suites: list[list[str]], beside: str | None = None) -> int:
    started = time.monotonic()
    logs = Path(tempfile.mkdtemp(prefix="flywheel-test-vllm-"))
    engines = {
        "FLYWHEEL_TEST_VLLM": shared_engine(logs / "vllm-tiny.log"),
        "FLYWHEEL_TEST_SMOL_VLLM": shared_engine(logs / "vllm-smol.log", smol_model_dir()),
    }
    phases: list[tuple[str, float]] = []
    try:
        for server in engines.values():
            server.start()
        side = subprocess.Popen(beside, shell=True) if beside else None
        if side is not None:
            code = side.wait()
            phases.append((f"{beside} (beside the engines' start)", time.monotonic() - started))
            if code:
                return code
        env = dict(os.environ)
        for prefix, server in engines.items():
            server.wait_healthy(timeout=600)
            env |= {f"{prefix}_URL": server.url, f"{prefix}_LOG": str(server.log_path)}
        phases.append(("engines started", time.monotonic() - started))
        status = 0
        for command in suites:
            urls = ", ".join(f"{server.model.rsplit('/', 1)[-1]} at {server.url}" for server in engines.values())
            print(f"\n=== {' '.join(command)}  (shared vLLM: {urls}; logs in {logs})", flush=True)
            begin = time.monotonic()
            code = subprocess.call(command, env=env)
            phases.append((" ".join(command[:4]), time.monotonic() - begin))
            status = status or code
        return status
    finally:
        for server in engines.values():
            server.stop()
        print("\n=== wall time per phase", flush=True)
        for name, seconds in phases:
            print(f"{seconds / 60:6.1f} min  {name}", flush=True)


if __name__ == "__main__":
    # argv: [--beside CMD] then suites separated by "::" (each a full command line)
    argv, suites, current = sys.argv[1:], [], []
    beside = None
    if argv[:1] == ["--beside"]:
        beside, argv = argv[1], argv[2:]
    for arg in argv:
        if arg == "::":
            suites.append(current)
            current = []
        else:
            current.append(arg)
    if current:
        suites.append(current)
    sys.exit(main(suites, beside))
