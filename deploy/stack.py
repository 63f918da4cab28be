"""The processes ``make serve`` and ``make run`` share: vLLM (supervised) and the proxy, as children.

With a ``warm_start`` section the stack also starts the scripted demonstrator
(``python -m workflows.tac.demonstrator``, in the style the workflow's agent needs: ``openhands`` for
``tac``, ``mini-swe-agent`` for ``miniswe``) on a free port before the proxy, and names it to the
proxy as a teacher (``FLYWHEEL_TEACHERS``), so the launcher can record demonstrations through it.

Every child runs in its own process group with a parent-death signal, so even a killed launcher
leaves no orphans behind; ``Stack.stop`` stops them in reverse order of start.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from contract.keyfile import key_file_keys
from deploy.run_config import DemonstratorStyle, RunConfig
from deploy.vllm import ROOT, Supervisor, VLLMServer, die_with_parent


def agents_python() -> str:
    """The agents venv's Python (workflows, OpenHands): ``FLYWHEEL_AGENTS_PYTHON``, else ``.venv-agents``."""
    return os.environ.get("FLYWHEEL_AGENTS_PYTHON", str(ROOT / ".venv-agents" / "bin" / "python"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def workflow_options(args: tuple[str, ...]) -> list[str]:
    """The ``-o key=value`` options among a workflow's command-line arguments, in order."""
    options: list[str] = []
    for i, arg in enumerate(args):
        if arg in ("-o", "--option") and i + 1 < len(args):
            options.append(args[i + 1])
        elif arg.startswith("--option="):
            options.append(arg.split("=", 1)[1])
    return options


def demonstrator_command(
    tasks: Path, port: int | str, style: DemonstratorStyle, python: str = sys.executable
) -> list[str]:
    """The demonstrator's command line; the style is always named, so its log shows which one played."""
    return [
        python,
        "-m",
        "workflows.tac.demonstrator",
        "--tasks-dir",
        str(tasks),
        "--port",
        str(port),
        "--style",
        style,
    ]


def log(message: str) -> None:
    print(f"[flywheel {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def admin_key(data_dir: Path) -> str:
    """The admin key: FLYWHEEL_ADMIN_KEY, else ``data/admin.key`` (created 0600 on first use)."""
    if os.environ.get("FLYWHEEL_ADMIN_KEY"):
        return os.environ["FLYWHEEL_ADMIN_KEY"]
    path = data_dir / "admin.key"
    if not path.exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_urlsafe(32) + "\n")
        path.chmod(0o600)
    return (key_file_keys(path.read_text()) or [""])[0]  # the first line; later ones: a rotation's old keys


def dashboard_hint(proxy_url: str, key_file: Path | None) -> str:
    """Where the dashboard is and how to log in: the key's file or variable, never the key."""
    where = f"the key in {key_file}" if key_file is not None else "the key in $FLYWHEEL_ADMIN_KEY"
    return f"dashboard: {proxy_url}/ui/ (once the proxy is up; log in with the admin key: {where})"


@dataclass
class Child:
    """A supervised child process with its own log file."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # The child gets its own descriptor for the log; this process's copy closes once it has started.
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                cwd=ROOT,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 60.0) -> None:
        if not self.alive():
            return
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class Stack:
    """vLLM + proxy, the part ``serve`` and ``run`` share."""

    def __init__(self, config: RunConfig, *, data_dir: Path) -> None:
        self.config = config
        self.data_dir = data_dir
        self.logs = data_dir / "logs"
        engine = config.engine
        self.proxy_config = config.proxy_config_path
        # The proxy's own file (proxy/settings.py validates it when the proxy starts); read here only
        # for the addresses the launcher must know before that.
        proxy_settings = (yaml.safe_load(self.proxy_config.read_text()) or {}).get("proxy", {})
        port = config.proxy_port or proxy_settings.get("port", 8100)
        self.proxy_url = f"http://{proxy_settings.get('host', '127.0.0.1')}:{port}"
        self.model_dir = engine.model or self._model()
        self.key = admin_key(data_dir)
        self.key_file = None if os.environ.get("FLYWHEEL_ADMIN_KEY") else data_dir / "admin.key"
        env = dict(os.environ, FLYWHEEL_ADMIN_KEY=self.key, FLYWHEEL_PORT=str(port))
        store_url = proxy_settings.get("store", {}).get("url", "")
        if store_url.startswith("sqlite") and "///data/" in store_url:  # keep the store beside this run's data
            env["FLYWHEEL_STORE__URL"] = store_url.replace("///data/", f"///{data_dir.resolve()}/")
        if Path(self.model_dir).is_dir():  # what vLLM applies to omitted sampling fields (proxy/sampling.py)
            env.setdefault("FLYWHEEL_SAMPLING__GENERATION_CONFIG", str(self.model_dir))
        self.vllm: VLLMServer | None = None
        self.restarts: list[str] = []
        if engine.url:  # an engine someone else runs (and supervises): route to it, start nothing
            env["FLYWHEEL_UPSTREAMS"] = json.dumps(
                [{"name": "vllm-0", "url": engine.url, "seed_rule": engine.seed_rule}]
            )
        else:
            upstream_url = proxy_settings["upstreams"][0]["url"]
            self.vllm = VLLMServer(
                model=self.model_dir,
                served_name=engine.served_name,
                port=int(upstream_url.rsplit(":", 1)[1].split("/")[0]),
                device=engine.device,
                max_lora_rank=engine.max_lora_rank,
                max_loras=engine.max_loras,
                max_model_len=engine.max_model_len,
                dtype=engine.dtype,
                cpu_kv_cache_gib=engine.cpu_kv_cache_gib,
                chat_template=engine.chat_template,
                tool_call_parser=engine.tool_call_parser,
                gpu_memory_utilization=engine.gpu_memory_utilization,
                log_path=self.logs / "vllm.log",
                extra_args=list(engine.extra_args),
            )
            self.supervisor = Supervisor(self.vllm, on_restart=self._on_restart)
        self.proxy = Child(
            "proxy",
            [sys.executable, "-m", "proxy", "serve", "--config", str(self.proxy_config)],
            self.logs / "proxy.log",
            env,
        )
        self.children: list[Child] = []
        """Processes started on top of the stack (trainer, workflow, evaluation): stopped first."""
        self.demonstrator: Child | None = None
        self.teacher_url: str | None = None
        if config.warm_start is not None:  # the proxy must know the teacher when it starts
            self.teacher_url = f"http://127.0.0.1:{free_port()}"
            teachers = [{"name": config.warm_start.teacher, "url": self.teacher_url, "model": "demonstrator"}]
            env["FLYWHEEL_TEACHERS"] = json.dumps(teachers)

    def spawn(self, child: Child) -> Child:
        self.children.append(child)
        child.start()
        return child

    @staticmethod
    def _model() -> str:
        from deploy.model import fetch

        return str(fetch())

    def _on_restart(self, reason: str) -> None:
        self.restarts.append(reason)
        log(f"vLLM restarted ({reason}); the proxy reloads the current adapter before routing to it")

    def start(self) -> None:
        log(dashboard_hint(self.proxy_url, self.key_file))
        if self.vllm is not None:
            log(f"starting vLLM (log: {self.vllm.log_path}); about a minute on CPU")
            self.vllm.start()
            self.vllm.wait_healthy(timeout=900)
            self.supervisor.start()
            log(f"vLLM healthy at {self.vllm.url}")
        if self.teacher_url is not None:
            self._start_demonstrator(self.teacher_url)
        self.proxy.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if not self.proxy.alive():
                raise SystemExit(f"the proxy exited; see {self.proxy.log_path}")
            try:
                if httpx.get(f"{self.proxy_url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise SystemExit(f"the proxy did not become healthy; see {self.proxy.log_path}")
        log(f"proxy healthy at {self.proxy_url} (log: {self.proxy.log_path}); dashboard at {self.proxy_url}/ui/")

    def demonstrator_tasks(self) -> Path:
        """The demonstrator's tasks: ``warm_start.tasks_dir``, else the workflow's own, as its ``-o``
        options make them (asked of the workflow in the agents venv: ``family=N`` generates them there)."""
        assert self.config.warm_start is not None
        if self.config.warm_start.tasks_dir:
            return ROOT / self.config.warm_start.tasks_dir
        code = (
            "import sys; from workflows.options import parse_options; from workflows.registry import load; "
            "cls = load(sys.argv[1]); print(cls(parse_options(cls.options_type, sys.argv[2:])).tasks_root)"
        )
        argv = [agents_python(), "-c", code, self.config.workflow.name, *workflow_options(self.config.workflow.args)]
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            raise SystemExit(f"could not find the workflow's tasks for the demonstrator: {done.stderr[-2000:]}")
        return Path(done.stdout.strip().splitlines()[-1])

    def _start_demonstrator(self, url: str) -> None:
        style = self.config.demonstrator_style
        assert style is not None
        tasks = self.demonstrator_tasks()
        argv = demonstrator_command(tasks, url.rsplit(":", 1)[1], style)
        self.demonstrator = Child("demonstrator", argv, self.logs / "demonstrator.log")
        self.demonstrator.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if not self.demonstrator.alive():
                raise SystemExit(f"the demonstrator exited; see {self.demonstrator.log_path}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    log(f"demonstrator at {url} ({style} style, tasks {tasks}); the proxy serves it as a teacher")
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise SystemExit(f"the demonstrator did not become healthy; see {self.demonstrator.log_path}")

    def stop(self) -> None:
        for child in reversed(self.children):
            child.stop()
        if self.vllm is not None:
            self.supervisor.stop()
        self.proxy.stop()
        if self.demonstrator is not None:
            self.demonstrator.stop(timeout=10)
        if self.vllm is not None:
            self.vllm.stop()
        log("stopped the proxy" + (" and vLLM" if self.vllm is not None else ""))
