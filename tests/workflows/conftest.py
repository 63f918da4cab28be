"""Workflow test fixtures: a real proxy (subprocess, SQLite) in front of the session's real vLLM.

Workflows that need the agents venv (OpenHands, tau2) are tested either inside it (marked
``agents``) or, from the engine venv, by running ``python -m workflows`` with the agents
interpreter (``FLYWHEEL_AGENTS_PYTHON``).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.services import ADMIN_KEY, ROOT, ProxyProcess, serving_proxy

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before any test module imports litellm (tau2)

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def agents_python() -> str:
    return os.environ.get("FLYWHEEL_AGENTS_PYTHON", str(ROOT / ".venv-agents" / "bin" / "python"))


@pytest.fixture(scope="module")
def proxy(vllm_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    """``python -m proxy serve`` on a fresh SQLite store, routing ``policy`` to the real vLLM."""
    with serving_proxy(vllm_url, tmp_path_factory.mktemp("proxy")) as server:
        yield server


def admin_get(proxy: ProxyProcess, path: str, **params: Any) -> Any:
    response = httpx.get(f"{proxy.url}{path}", headers=ADMIN, params=params, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def run_cli(
    *args: str, python: str | None = None, timeout: float = 300, env: dict[str, str] | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    """``python -m workflows ...`` as a user runs it (admin key from the environment)."""
    full_env = {
        **os.environ,
        "FLYWHEEL_ADMIN_KEY": ADMIN_KEY,
        "PYTHONPATH": str(ROOT),
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        **(env or {}),
    }
    return subprocess.run(
        [python or agents_python(), "-m", "workflows", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
