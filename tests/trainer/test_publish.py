"""A trained step published through the proxy into the real vLLM changes what the policy serves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from tests.support.services import ADMIN_KEY
from tests.trainer.conftest import ADMIN, TrainerProxy
from trainer.client import ProxyClient
from trainer.config import TrainerConfig
from trainer.loop import Trainer
from trainer.lora import Policy
from trainer.report import Reporter

FIXED = {"model": "policy", "messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 6,
         "temperature": 0.0, "logprobs": True}


def served(url: str) -> tuple[str | None, list[float]]:
    reply = httpx.post(f"{url}/passthrough/v1/chat/completions", headers=ADMIN, json=FIXED, timeout=300)
    assert reply.status_code == 200, reply.text
    content = reply.json()["choices"][0]["logprobs"]["content"]
    return reply.headers.get("x-policy-version"), [item["logprob"] for item in content]


def test_publish_loads_the_adapter_on_vllm_and_switches_the_policy(trainer_proxy: TrainerProxy, tmp_path: Path,
                                                                   vllm_model_dir: str) -> None:
    version, base_logprobs = served(trainer_proxy.url)
    assert version == "0"
    group_id = trainer_proxy.record_group([1.0, 0.0])

    config = TrainerConfig(model=vllm_model_dir, proxy_url=trainer_proxy.url, output_dir=str(tmp_path / "run"),
                           groups_per_step=1, batch_wait_s=0, max_steps=1, learning_rate=2e-2, progress=False)
    client = ProxyClient(config.proxy_url, ADMIN_KEY)
    reporter = Reporter(config.out, tensorboard=True, progress=False, max_steps=1, start_step=0)
    trainer = Trainer(config, client, Policy(config), reporter)
    trainer.resume()
    assert trainer.run() == 1
    reporter.close()

    policy = trainer_proxy.get("/policy")
    adapter_dir = config.out / "adapters" / "v1"
    assert (policy["version"], policy["name"], policy["adapter_path"]) == (
        1, f"{trainer_proxy.prefix}1", str(adapter_dir))
    assert (adapter_dir / "adapter_model.safetensors").is_file() and (adapter_dir / "adapter_config.json").is_file()

    version, trained_logprobs = served(trainer_proxy.url)
    assert version == "1"
    assert max(abs(a - b) for a, b in zip(base_logprobs, trained_logprobs, strict=False)) > 1e-3, (
        base_logprobs, trained_logprobs)

    # a recorded call now carries the new version, in its header and in its record
    episode: dict[str, Any] = httpx.post(f"{trainer_proxy.url}/episodes", headers=ADMIN, json={}, timeout=60).json()
    auth = {"authorization": f"Bearer {episode['api_key']}"}
    reply = httpx.post(f"{episode['base_url']}/chat/completions", headers=auth,
                       json={**FIXED, "logprobs": False}, timeout=300)
    assert reply.status_code == 200 and reply.headers["x-policy-version"] == "1"
    (call,) = trainer_proxy.get(f"/episodes/{episode['id']}")["calls"]
    assert call["policy_version"] == 1 and call["model_served"] == f"{trainer_proxy.prefix}1"

    group = trainer_proxy.get(f"/groups/{group_id}")
    assert (group["train_status"], group["trained_step"]) == ("trained", 1)
    (step,) = trainer_proxy.get("/trainer/steps")["data"]
    metrics = step["metrics"]
    assert step["step"] == 1 and metrics["proxy/published_version"] == 1 and metrics["data/groups_trained"] == 1
    assert metrics["reward/mean"] == 0.5 and metrics["data/samples"] == 2 and metrics["perf/publish_s"] > 0
    assert all(key in metrics for key in ("loss/total", "policy/entropy", "policy/clip_fraction", "policy/grad_norm",
                                          "policy/is_weight_mean", "staleness/mean", "perf/tokens_per_s"))
    assert list((config.out / "tensorboard").glob("events.out.tfevents.*"))
