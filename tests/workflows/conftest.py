"""Workflow test helpers: run ``python -m workflows`` and read back what it recorded through the
real proxy (the ``proxy`` fixture of ``tests/conftest.py``, in front of the session's real vLLM).

Workflows that need the agents venv (OpenHands, tau2) are tested either inside it (marked
``agents``) or, from the engine venv, by running ``python -m workflows`` with the agents
interpreter (``FLYWHEEL_AGENTS_PYTHON``).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import httpx

from tests.support.services import ADMIN_KEY, ROOT, ProxyProcess
from workflows.base import Episode

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before any test module imports litellm (tau2)

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def agents_python() -> str:
    return os.environ.get("FLYWHEEL_AGENTS_PYTHON", str(ROOT / ".venv-agents" / "bin" / "python"))


def admin_get(proxy: ProxyProcess, path: str, **params: Any) -> Any:
    response = httpx.get(f"{proxy.url}{path}", headers=ADMIN, params=params, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


async def ask(episode: Episode, question: str, *, max_tokens: int, temperature: float) -> None:
    """One chat call from inside an episode, as its agent would make it (the proxy records it)."""
    async with httpx.AsyncClient(timeout=120) as http:
        response = await http.post(
            f"{episode.base_url}/chat/completions",
            headers={"Authorization": f"Bearer {episode.api_key}"},
            json={
                "model": episode.model,
                "max_tokens": max_tokens,
                "temperature": temperature,
                "messages": [{"role": "user", "content": question}],
            },
        )
    response.raise_for_status()


def groups_of(proxy: ProxyProcess, workflow: str) -> list[dict[str, Any]]:
    """The groups ``workflow`` created on ``proxy`` (the runner names itself in their metadata)."""
    return [g for g in admin_get(proxy, "/groups", limit=100)["data"] if g["metadata"].get("workflow") == workflow]


def episode_count(proxy: ProxyProcess) -> int:
    return len(admin_get(proxy, "/episodes", limit=1000)["data"])


def run_workflow(
    proxy: ProxyProcess,
    command: str,
    workflow: str,
    *,
    options: dict[str, object] | None = None,
    timeout: float = 300,
    **flags: object,
) -> dict[str, Any]:
    """``python -m workflows COMMAND WORKFLOW --proxy URL --flag value ... -o key=value ...`` as a
    user runs it (``group_size=2`` is ``--group-size 2``); it must succeed, and the JSON it prints
    last (``run``'s summary, ``eval``'s report) is returned."""
    args = [command, workflow, "--proxy", proxy.url]
    for flag, value in flags.items():
        args += [f"--{flag.replace('_', '-')}", str(value)]
    for key, value in (options or {}).items():
        args += ["-o", f"{key}={value}"]
    done = run_cli(*args, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


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
