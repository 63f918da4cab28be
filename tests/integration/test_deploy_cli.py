"""Every command line of deploy/docker-compose.yml runs here: with ``--help`` appended, and the worker's
workflow options for each GPU config parsed by the real workflows CLI.

Commands come from the rendered compose file. ``python`` is the engine venv (proxy, migrate,
trainer) or the agents venv (the worker: the image's Python 3.12); the working directory is the
repository root, which is the image's /app.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from deploy.compose_check import engine_env, render
from tests.support.services import ROOT, engine_python

ENV_EXAMPLE = ROOT / "deploy" / ".env.example"
SECRETS = {"FLYWHEEL_ADMIN_KEY": "admin-key-for-cli-tests-0123", "POSTGRES_PASSWORD": "unused"}
GPU_CONFIGS = sorted((ROOT / "configs").glob("gpu-*.yaml"))
IMAGE_ENV = {
    "PYTHONPATH": str(ROOT),
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "PATH": os.environ["PATH"],
    "HOME": os.environ.get("HOME", "/root"),
}


def agents_python() -> str:
    return os.environ.get("FLYWHEEL_AGENTS_PYTHON", str(ROOT / ".venv-agents" / "bin" / "python"))


def localized(words: list[str], python: str) -> list[str]:
    out = [python if w in ("python", "python3") else w for w in words]
    return [w.replace("exec python ", f"exec {python} ").replace("$$", "$") for w in out]


def run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, env={**IMAGE_ENV, **env}, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    rendered: dict[str, Any] = render(env_file=ENV_EXAMPLE, env=SECRETS)["services"]
    return rendered


@pytest.mark.parametrize(
    ("service", "usage"),
    [
        ("migrate", "Usage: python -m proxy migrate [OPTIONS]"),
        ("proxy", "Usage: python -m proxy serve [OPTIONS]"),
        ("trainer", "Usage: python -m trainer run [OPTIONS]"),
    ],
)
def test_engine_service_commands_answer_help(services: dict[str, Any], service: str, usage: str) -> None:
    done = run(localized(services[service]["command"], engine_python()) + ["--help"], {})
    assert done.returncode == 0, done.stderr
    assert usage in done.stdout


def test_worker_command_answers_help_in_the_agents_venv(services: dict[str, Any]) -> None:
    python = agents_python()
    if not Path(python).exists():
        pytest.skip(f"no agents venv at {python} (make agents builds it)")
    worker = services["worker"]
    args = worker["environment"]["FLYWHEEL_WORKFLOW_ARGS"]
    env = {**worker["environment"], "FLYWHEEL_WORKFLOW_ARGS": f"{args} --help"}
    done = run(localized(worker["command"], python), env)
    assert done.returncode == 0, done.stderr
    assert "Usage: python -m workflows run [OPTIONS] {name}" in done.stdout


class _Refusing(BaseHTTPRequestHandler):
    """A proxy stand-in that refuses every request with the proxy's 401: a 4xx is never retried, so
    the worker stops at its first call (with nothing listening it would retry for 23.5 s)."""

    def _refuse(self) -> None:
        body = json.dumps({"error": {"message": "invalid admin key", "type": "authentication_error"}}).encode()
        self.send_response(401)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _refuse

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def refusing_proxy() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


@pytest.mark.parametrize("gpu_config", GPU_CONFIGS, ids=lambda p: p.stem)
def test_worker_options_of_each_gpu_config_are_accepted(gpu_config: Path, refusing_proxy: str) -> None:
    """The workflow and its -o options are built for real; only the proxy's first answer stops it (a
    stand-in refusing every call: the worker got as far as asking for a group)."""
    python = agents_python()
    if not Path(python).exists():
        pytest.skip(f"no agents venv at {python} (make agents builds it)")
    worker = render(env_file=ENV_EXAMPLE, env={**SECRETS, **engine_env(gpu_config)})["services"]["worker"]
    argv = [w.replace("http://proxy:8100", refusing_proxy) for w in localized(worker["command"], python)]
    done = run(argv, worker["environment"])
    assert done.returncode == 2, done.stderr
    assert "workflows: proxy answered 401: invalid admin key" in done.stderr
    assert "Invalid value" not in done.stderr


def test_worker_refuses_a_bad_workflow_option(services: dict[str, Any]) -> None:
    """The check above can fail: a misspelt option stops the worker before it contacts the proxy."""
    python = agents_python()
    if not Path(python).exists():
        pytest.skip(f"no agents venv at {python} (make agents builds it)")
    worker = services["worker"]
    env = {**worker["environment"], "FLYWHEEL_WORKFLOW_ARGS": "-o domian=retail"}
    done = run(localized(worker["command"], python), env)
    assert done.returncode == 2
    assert "unknown option 'domian'" in done.stderr


def test_model_fetch_skips_a_finished_download_and_refuses_foreign_files(tmp_path: Path) -> None:
    from deploy.fetch_model import MARKER, fetch

    done = tmp_path / "done"
    done.mkdir()
    (done / MARKER).write_text('{"repo_id": "Qwen/Qwen2.5-1.5B-Instruct"}\n')
    assert fetch("Qwen/Qwen2.5-1.5B-Instruct", done) == done  # no network touched: nothing to import
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="holds files not fetched from Qwen/Qwen2.5-7B-Instruct; remove them first"):
        fetch("Qwen/Qwen2.5-7B-Instruct", foreign)


def test_model_fetch_command_explains_its_usage(services: dict[str, Any]) -> None:
    model = services["model"]
    assert model["entrypoint"] == ["python3", "/flywheel/fetch_model.py"]
    script = ROOT / "deploy" / "fetch_model.py"
    assert len(model["command"]) == 2  # repo id and target directory, as the script requires
    done = run([engine_python(), str(script)], {})
    assert done.returncode == 1 and "usage: fetch_model.py <hf-repo-id> <directory>" in done.stderr
