"""Start the processes a benchmark measures, and account for their CPU and memory.

The proxy is the real ``python -m proxy serve`` (what a user runs) with recording into a SQLite
file in a temp dir and a real admin key; the upstream is ``bench/fake_upstream.py`` in its own
process. CPU is read from ``/proc`` for a whole process tree (uvicorn workers are children).
``run_in_workdir`` runs a bench's event loop in a scratch directory and prints its summary.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvloop

ROOT = Path(__file__).resolve().parents[1]
TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()  # fields from 3 (state) on; the name may hold spaces


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(children.get(current, ()))
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process tree (live processes only)."""
    total = 0
    for p in tree(pid):
        fields = _stat(p)
        if fields is not None:
            total += int(fields[11]) + int(fields[12])
    return total / TICKS


def rss_mb(pid: int) -> float:
    total = 0
    for p in tree(pid):
        fields = _stat(p)
        if fields is not None:
            total += int(fields[21]) * PAGE
    return total / 2**20


def open_fds(pid: int) -> dict[int, int]:
    out = {}
    for p in tree(pid):
        try:
            out[p] = len(os.listdir(f"/proc/{p}/fd"))
        except OSError:
            pass
    return out


def exit_on_sigterm() -> None:
    """Turn SIGTERM (e.g. from ``timeout``) into SystemExit, so ``finally`` blocks stop the children."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run_in_workdir(
    prefix: str, run: Callable[[Path], Coroutine[Any, Any, dict[str, Any]]], *, keep: Callable[[dict[str, Any]], bool]
) -> None:
    """Run a bench under uvloop in a fresh temp dir (its proxy's log and store land there), then
    print its summary as the last line, one JSON object. The dir is kept and named where ``keep``
    says so (``--keep``, or a run that went wrong), else removed."""
    print(f"load average before: {load_average()} (2 cores; other engineers share them)", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    summary = uvloop.run(run(workdir))
    if keep(summary):
        print(f"kept {workdir} (proxy.log, flywheel.db)")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(summary))


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _listening(argv: list[str], name: str) -> tuple[subprocess.Popen[bytes], str]:
    """Start a test double in its own process group from the checkout, and read the address it prints
    (``<name> listening on HOST:PORT``) from its first line."""
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if "listening on" not in line:
        raise RuntimeError(f"{name} did not start: {line!r}")
    return proc, "http://" + line.split("listening on ")[1].split()[0]


@dataclass
class FakeUpstreamProcess:
    """``python -m bench.fake_upstream`` in its own process group."""

    proc: subprocess.Popen[bytes]
    url: str

    @classmethod
    def start(
        cls,
        *,
        tokens: int = 16,
        interval_s: float = 0.5,
        port: int = 0,
        prompt_ids: str = "fixed",
        script: str | None = None,
        answer_log: Path | None = None,
    ) -> FakeUpstreamProcess:
        """``script``: the scripted engine's shell command (``bench/fake_script.py``), its answers in ``answer_log``."""
        scripted = ["--script", script] if script is not None else []
        scripted += ["--answer-log", str(answer_log)] if answer_log is not None else []
        proc, url = _listening(
            [
                sys.executable,
                "-m",
                "bench.fake_upstream",
                "--port",
                str(port),
                "--tokens",
                str(tokens),
                "--interval",
                str(interval_s),
                "--prompt-ids",
                prompt_ids,
                *scripted,
            ],
            "fake_upstream",
        )
        return cls(proc, url)

    def stop(self) -> None:
        _stop(self.proc)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@dataclass
class TokenEngineProcess:
    """``python -m bench.fake_tokens`` (the scripted engine with SmolLM2's token path) in its own process group."""

    proc: subprocess.Popen[bytes]
    url: str

    @classmethod
    def start(cls, model_dir: str, commands: list[str], answer_log: Path) -> TokenEngineProcess:
        scripted = [a for command in commands for a in ("--script", command)]
        argv = [sys.executable, "-m", "bench.fake_tokens", "--model-dir", model_dir, "--answer-log", str(answer_log)]
        return cls(*_listening([*argv, *scripted], "fake_tokens"))

    def stop(self) -> None:
        _stop(self.proc)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@dataclass
class ProxyUnderTest:
    """The real proxy: ``python -m proxy serve`` recording into SQLite under ``workdir``."""

    proc: subprocess.Popen[bytes]
    url: str
    admin_key: str
    db_path: Path
    log_path: Path

    @classmethod
    def start(
        cls,
        upstream_url: str,
        workdir: Path,
        *,
        workers: int = 1,
        source: Path = ROOT,
        extra_env: dict[str, str] | None = None,
        timeout_s: float = 60.0,
    ) -> ProxyUnderTest:
        """``source``: the checkout whose ``proxy`` package runs (another one measures a before/after)."""
        port = free_port()
        admin_key = secrets.token_urlsafe(32)
        db_path = workdir / "flywheel.db"
        env = dict(os.environ)
        env.update(
            {
                "FLYWHEEL_ADMIN_KEY": admin_key,
                "FLYWHEEL_STORE__URL": f"sqlite+aiosqlite:///{db_path}",
                "FLYWHEEL_PORT": str(port),
                "FLYWHEEL_UPSTREAMS": f'[{{"name": "fake_upstream", "url": "{upstream_url}"}}]',
                "PYTHONPATH": str(source),
            }
        )
        env.update(extra_env or {})
        log_path = workdir / "proxy.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "proxy", "serve", "--workers", str(workers)],
                cwd=workdir,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"proxy exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/healthz", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"proxy not healthy after {timeout_s}s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        return cls(proc, url, admin_key, db_path, log_path)

    def create_group(self, size: int, task_id: str) -> list[dict[str, str]]:
        """POST /groups; returns the episode keys ``[{id, api_key, base_url}]``."""
        response = httpx.post(
            f"{self.url}/groups",
            json={"task_id": task_id, "size": size, "metadata": {}},
            headers={"authorization": f"Bearer {self.admin_key}"},
            timeout=30.0,
        )
        if response.status_code != 201:
            raise RuntimeError(f"POST /groups answered {response.status_code}: {response.text}")
        return list(response.json()["episode_keys"])

    def interrupted(self) -> str | None:
        """Why the proxy stopped on its own during the run (a crash, or a signal from elsewhere), or None."""
        if self.proc.poll() is not None:
            return f"the proxy exited with code {self.proc.returncode} during the run"
        log = self.log_path.read_text(errors="replace")
        if "Shutting down" in log or ("Child process" in log and "died" in log):
            return "the proxy shut down during the run (see proxy.log: a crash, or a signal from another process)"
        return None

    def stop(self) -> None:
        _stop(self.proc)
