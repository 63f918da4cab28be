"""Launch a script or module under ``torchrun --standalone`` (gloo on the CPU here), as the trainer's
multi-rank tests do: the engine venv's Python, the repository importable, one OpenMP thread per rank."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.services import ROOT, engine_python


def torchrun(
    nproc: int, *args: str, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node=nproc *args``, output captured."""
    python = engine_python() if os.path.exists(engine_python()) else sys.executable
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(
        [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args],
        cwd=ROOT,
        env=full_env,
        text=True,
        capture_output=True,
        timeout=timeout,
    )
