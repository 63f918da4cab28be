"""`make test`'s two pytest runs (engine venv, then agents venv) on one shared vLLM.

Each suite would otherwise start its own engine (about a minute on 2 cores, plus the model's
warm-up). The engine is the session fixture's (``tests/conftest.py``: same model, flags and
cache size); each run reaches it through ``FLYWHEEL_TEST_VLLM_URL`` (its log:
``FLYWHEEL_TEST_VLLM_LOG``). Tests that need an engine with other flags still start their own. The
exit status is the first failing suite's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.support.services import shared_engine


def main(suites: list[list[str]]) -> int:
    log = Path(tempfile.mkdtemp(prefix="flywheel-test-vllm-")) / "vllm.log"
    server = shared_engine(log)
    server.start()
    try:
        server.wait_healthy(timeout=600)
        env = dict(os.environ, FLYWHEEL_TEST_VLLM_URL=server.url, FLYWHEEL_TEST_VLLM_LOG=str(log))
        status = 0
        for command in suites:
            print(f"\n=== {' '.join(command)}  (shared vLLM at {server.url}, log {log})", flush=True)
            code = subprocess.call(command, env=env)
            status = status or code
        return status
    finally:
        server.stop()


if __name__ == "__main__":
    # argv: suites separated by "::" (each a full command line)
    argv, suites, current = sys.argv[1:], [], []
    for arg in argv:
        if arg == "::":
            suites.append(current)
            current = []
        else:
            current.append(arg)
    if current:
        suites.append(current)
    sys.exit(main(suites))
