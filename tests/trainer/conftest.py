"""Trainer test helpers: a real proxy in front of the session's vLLM, and recorded groups.

Adapters are published under a per-test name prefix (``policy.adapter_prefix``), never the
``policy-v*`` names a shared development engine may be serving, and unloaded again at teardown.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.services import ADMIN_KEY, ProxyProcess
from trainer.config import TrainerConfig

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}

# Before torch loads (the test modules import it after this conftest): idle OpenMP threads sleep
# instead of spinning, which otherwise slows steps several times when vLLM shares the cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@dataclass
class TrainerProxy:
    url: str
    prefix: str
    process: ProxyProcess

    def get(self, path: str, **params: Any) -> Any:
        response = httpx.get(f"{self.url}{path}", headers=ADMIN, params=params, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()

    def record_group(
        self,
        rewards: Sequence[float | None],
        *,
        question: str = "What is 3+4?",
        max_tokens: int = 4,
        temperature: float | None = 1.0,
    ) -> str:
        """A group of len(rewards) episodes, one real sampled chat call each (temperature None: the
        engine's default), then rewarded (reward None: abandoned)."""
        created = httpx.post(
            f"{self.url}/groups",
            headers=ADMIN,
            timeout=60,
            json={"task_id": f"t-{uuid.uuid4().hex[:6]}", "size": len(rewards)},
        )
        assert created.status_code == 201, created.text
        group = created.json()
        body: dict[str, Any] = {"model": "policy", "messages": [{"role": "user", "content": question}]}
        body |= {"max_tokens": max_tokens} | ({} if temperature is None else {"temperature": temperature})
        for key, reward in zip(group["episode_keys"], rewards, strict=True):
            reply = httpx.post(
                f"{key['base_url']}/chat/completions",
                timeout=300,
                headers={"authorization": f"Bearer {key['api_key']}"},
                json=body,
            )
            assert reply.status_code == 200, reply.text
            path, outcome = (
                (f"/episodes/{key['id']}/abandon", {"reason": "scripted"})
                if reward is None
                else (f"/episodes/{key['id']}/reward", {"reward": reward})
            )
            finished = httpx.post(f"{self.url}{path}", headers=ADMIN, json=outcome, timeout=60)
            assert finished.status_code == 200, finished.text
        return str(group["id"])

    def one_step_config(self, model: str, out: Path, **fields: Any) -> TrainerConfig:
        """A trainer on this proxy's groups that takes one step without waiting for a batch to
        fill, writing under ``out``; ``fields`` set the rest (``groups_per_step`` at least)."""
        return TrainerConfig(
            model=model, proxy_url=self.url, output_dir=str(out), batch_wait_s=0, max_steps=1, **fields
        )


def _unload(vllm_url: str, prefix: str) -> None:
    models = httpx.get(f"{vllm_url}/v1/models", timeout=30).json()["data"]
    for model in models:
        if model["id"].startswith(prefix):
            httpx.post(f"{vllm_url}/v1/unload_lora_adapter", json={"lora_name": model["id"]}, timeout=30)


@pytest.fixture
def trainer_proxy(vllm_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[TrainerProxy]:
    """A proxy for one test. Parametrized indirectly with ``False``, its admission control is off
    (for a test that makes stale groups on purpose, which admission control exists to prevent)."""
    prefix = f"trainertest{uuid.uuid4().hex[:6]}-v"
    admission = "true" if getattr(request, "param", True) else "false"
    process = ProxyProcess(
        upstream_url=vllm_url,
        store_url=f"sqlite+aiosqlite:///{tmp_path / 'flywheel.db'}",
        workdir=tmp_path / "proxy",
        extra_env={"FLYWHEEL_POLICY__ADAPTER_PREFIX": prefix, "FLYWHEEL_ADMISSION__ENABLED": admission},
    )
    process.start()
    try:
        yield TrainerProxy(url=process.url, prefix=prefix, process=process)
    finally:
        process.stop()
        _unload(vllm_url, prefix)
