"""Start the real services tests run against, and stop them cleanly.

vLLM is expensive (about a minute to start, plus warm-up), so one engine per model serves a whole
pytest session. Two models: the plumbing model (``deploy.model.fetch_tiny``: SmolLM2's tokenizer and
template on a two-layer random body), which every test of ids, log-probs, splicing and faults uses,
and SmolLM2-135M itself, kept for tests that need a model able to do the task (the learning smoke,
the workflows' rewards, tool calls produced freely). ``FLYWHEEL_TEST_VLLM_URL`` and
``FLYWHEEL_TEST_SMOL_VLLM_URL`` point tests at engines already running (``tests/run_suites.py``
sets both); otherwise the session starts its own with the engine venv's Python
(``FLYWHEEL_ENGINE_PYTHON``, default: this interpreter) on ``FLYWHEEL_TINY_MODEL_DIR`` and
``FLYWHEEL_MODEL_DIR`` (default: built by ``deploy.model``).
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
ADMIN_KEY = "test-admin-key-0123456789"
PG_URL = os.environ.get("FLYWHEEL_TEST_PG_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test")
TEST_DTYPE = "float32"
"""The tests' engines compute in float32 whatever the CPU: on one with native bf16 (AMD Zen 4/5,
Intel Sapphire Rapids) ``auto`` picks bfloat16, and then vLLM's kernels and transformers' round
differently (a mean log-prob gap of ~0.03 nats, up to ~0.3 on a token, measured on Zen 5), which
would hide what the fidelity tests check: the sampling rules reproduced to a hundredth of a nat."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_python() -> str:
    return os.environ.get("FLYWHEEL_ENGINE_PYTHON", sys.executable)


def model_dir() -> str:
    """The plumbing model: what the shared engine ``vllm_url`` serves."""
    if os.environ.get("FLYWHEEL_TINY_MODEL_DIR"):
        return os.environ["FLYWHEEL_TINY_MODEL_DIR"]
    from deploy.model import fetch_tiny

    return str(fetch_tiny())


def smol_model_dir() -> str:
    """SmolLM2-135M-Instruct, converted: what ``smol_vllm_url`` serves."""
    if os.environ.get("FLYWHEEL_MODEL_DIR"):
        return os.environ["FLYWHEEL_MODEL_DIR"]
    from deploy.model import fetch

    return str(fetch())


def shared_engine(log: Path, model: str | None = None) -> Any:
    """A shared vLLM of the tests (``tests/conftest.py``, ``tests/run_suites.py``): ``model`` (default:
    the plumbing model), a small KV cache and float32 as the tests pin it, and request-level chat
    templates allowed (vLLM refuses a request's ``chat_template`` without
    ``--trust-request-chat-template``), which the reasoning splice tests send.

    On a 2-core machine vLLM's ``auto`` binding puts every engine on core 0; SmolLM2's engine (the
    busier one) is bound to core 1 there, so the two engines do not take turns on one core."""
    from deploy.vllm import VLLMServer

    cores = "1" if model is not None and model != model_dir() and os.cpu_count() == 2 else None

    return VLLMServer(
        model=model or model_dir(),
        port=free_port(),
        python=engine_python(),
        log_path=log,
        cpu_kv_cache_gib=2,
        max_model_len=8192,
        dtype=TEST_DTYPE,
        extra_args=["--trust-request-chat-template"],
        cpu_cores=cores,
    )


@functools.cache
def grammar_masker() -> Any:
    """The trainer's grammar masker for the test model (``trainer/grammar.py``): constrained calls are
    trained only under the mask the engine applied, so a test of the trainer's data path on real
    tool calls needs it, as the trainer has it."""
    from transformers import AutoTokenizer

    from trainer.grammar import masks_for

    tokenizer = AutoTokenizer.from_pretrained(model_dir())
    return masks_for(Path(model_dir()), tokenizer, len(tokenizer))


def write_adapter(model: str, out: Path) -> Path:
    """A real peft LoRA adapter for ``model`` (r 8 on q and v), saved to ``out``. Its B matrices are
    drawn (seed 0) instead of peft's zeros, so serving it visibly changes the policy."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    peft_model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(0)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    peft_model.save_pretrained(str(out))
    return out


def wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes] | None = None, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log and log.exists() else ""
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered\n{tail}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not ready after {timeout}s")


@dataclass
class ProxyProcess:
    """``python -m proxy serve`` in a subprocess: what a user runs, and what kill -9 can hit."""

    upstream_url: str
    store_url: str
    workdir: Path
    port: int = field(default_factory=free_port)
    workers: int = 1
    extra_env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"proxy-{self.port}.log"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "FLYWHEEL_ADMIN_KEY": ADMIN_KEY,
                "FLYWHEEL_STORE__URL": self.store_url,
                "FLYWHEEL_PORT": str(self.port),
                "FLYWHEEL_UPSTREAMS": f'[{{"name": "vllm-0", "url": "{self.upstream_url}"}}]',
                "PYTHONPATH": str(ROOT),
            }
        )
        env.update(self.extra_env)
        return env

    def start(self, timeout: float = 60.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:  # the child has its own descriptor; ours closes here
            self.proc = subprocess.Popen(
                [engine_python(), "-m", "proxy", "serve", "--workers", str(self.workers)],
                cwd=self.workdir,
                env=self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            wait_http(f"{self.url}/openapi.json", timeout, self.proc, self.log_path)
        except BaseException:
            self.stop()  # a proxy that never answered is not left running behind the failed test
            raise

    def kill9(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@contextmanager
def serving_proxy(upstream_url: str, workdir: Path, **extra_env: str) -> Iterator[ProxyProcess]:
    """``python -m proxy serve`` on a fresh SQLite store in ``workdir``, routing to ``upstream_url``."""
    process = ProxyProcess(
        upstream_url=upstream_url,
        store_url=f"sqlite+aiosqlite:///{workdir / 'flywheel.db'}",
        workdir=workdir,
        extra_env=dict(extra_env),
    )
    process.start()
    try:
        yield process
    finally:
        process.stop()


def new_episode(proxy: ProxyProcess, task_id: str) -> dict[str, Any]:
    """A new episode (id, base_url, api_key) through the control API."""
    response = httpx.post(
        f"{proxy.url}/episodes", json={"task_id": task_id}, headers={"authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert response.status_code == 201, response.text
    return dict(response.json())


def episode_record(proxy: ProxyProcess, episode_id: str) -> dict[str, Any]:
    """The stored episode with its calls."""
    response = httpx.get(f"{proxy.url}/episodes/{episode_id}", headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert response.status_code == 200, response.text
    return dict(response.json())


def stored_calls(proxy: ProxyProcess, episode_id: str) -> list[dict[str, Any]]:
    """The episode's stored calls, in the order they were made."""
    return sorted(episode_record(proxy, episode_id)["calls"], key=lambda c: c["ordinal"])


def sampled_ids(call: dict[str, Any]) -> list[int]:
    """A stored call's prompt ids and the ids vLLM sampled for its first choice: what a follow-up
    call continuing it must start with to be trained as one sequence with it."""
    return list(call["prompt_token_ids"] + call["choices"][0]["token_ids"])
