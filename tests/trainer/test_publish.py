"""A trained step published through the proxy into the real vLLM changes what the policy serves."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from contract.client import ProxyClient
from tests.support.services import ADMIN_KEY
from tests.trainer.conftest import ADMIN, TrainerProxy
from trainer.config import TrainerConfig
from trainer.loop import Trainer
from trainer.lora import LoraPolicy
from trainer.report import Reporter

FIXED = {
    "model": "policy",
    "messages": [{"role": "user", "content": "Tell me about the sea."}],
    "max_tokens": 6,
    "temperature": 0.0,
    "logprobs": True,
}

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def policy(vllm_model_dir: str) -> Iterator[LoraPolicy]:
    yield LoraPolicy(TrainerConfig(model=vllm_model_dir))


def train(config: TrainerConfig, policy: LoraPolicy) -> int:
    """``python -m trainer run`` in-process (resume, then steps until max_steps)."""
    reporter = Reporter(
        config.out, tensorboard=config.tensorboard, progress=False, max_steps=config.max_steps, start_step=0
    )
    with ProxyClient(config.proxy_url, ADMIN_KEY) as client:
        trainer = Trainer(config, client, policy, reporter)
        trainer.resume()
        last = trainer.run()
    reporter.close()
    return last


def served(url: str) -> tuple[str | None, list[float]]:
    reply = httpx.post(f"{url}/passthrough/v1/chat/completions", headers=ADMIN, json=FIXED, timeout=300)
    assert reply.status_code == 200, reply.text
    content = reply.json()["choices"][0]["logprobs"]["content"]
    return reply.headers.get("x-policy-version"), [item["logprob"] for item in content]


def test_publish_loads_the_adapter_on_vllm_and_switches_the_policy(
    trainer_proxy: TrainerProxy, tmp_path: Path, policy: LoraPolicy, vllm_model_dir: str
) -> None:
    version, base_logprobs = served(trainer_proxy.url)
    assert version == "0"
    group_id = trainer_proxy.record_group([1.0, 0.0])

    config = trainer_proxy.one_step_config(
        vllm_model_dir, tmp_path / "run", groups_per_step=1, learning_rate=2e-2, progress=False
    )
    assert train(config, policy) == 1
    demand = trainer_proxy.get("/trainer/admission")["trainers"]["trainer"]  # stated with its claims
    assert (demand["groups_per_step"], demand["max_staleness"], demand["mode"]) == (1, 1, "async")

    policy = trainer_proxy.get("/policy")
    adapter_dir = config.out / "adapters" / "v1"
    assert (policy["version"], policy["name"], policy["adapter_path"]) == (
        1,
        f"{trainer_proxy.prefix}1",
        str(adapter_dir),
    )
    assert (adapter_dir / "adapter_model.safetensors").is_file() and (adapter_dir / "adapter_config.json").is_file()

    version, trained_logprobs = served(trainer_proxy.url)
    assert version == "1"
    assert max(abs(a - b) for a, b in zip(base_logprobs, trained_logprobs, strict=False)) > 1e-3, (
        base_logprobs,
        trained_logprobs,
    )

    # a recorded call now carries the new version, in its header and in its record
    episode: dict[str, Any] = httpx.post(f"{trainer_proxy.url}/episodes", headers=ADMIN, json={}, timeout=60).json()
    auth = {"authorization": f"Bearer {episode['api_key']}"}
    reply = httpx.post(
        f"{episode['base_url']}/chat/completions", headers=auth, json={**FIXED, "logprobs": False}, timeout=300
    )
    assert reply.status_code == 200 and reply.headers["x-policy-version"] == "1"
    (call,) = trainer_proxy.get(f"/episodes/{episode['id']}")["calls"]
    assert call["policy_version"] == 1 and call["model_served"] == f"{trainer_proxy.prefix}1"

    group = trainer_proxy.get(f"/groups/{group_id}")
    assert (group["train_status"], group["trained_step"]) == ("trained", 1)
    (step,) = trainer_proxy.get("/trainer/steps")["data"]
    metrics = step["metrics"]
    assert step["step"] == 1 and metrics["proxy/published_version"] == 1 and metrics["data/groups_trained"] == 1
    assert metrics["reward/mean"] == 0.5 and metrics["data/samples"] == 2 and metrics["perf/publish_s"] > 0
    assert all(
        key in metrics
        for key in (
            "loss/total",
            "policy/entropy",
            "policy/clip_fraction",
            "policy/grad_norm",
            "policy/is_weight_mean",
            "staleness/mean",
            "perf/tokens_per_s",
        )
    )
    assert list((config.out / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.parametrize("trainer_proxy", [False], indirect=True)  # stale on purpose: admission control off
def test_sync_mode_drops_stale_groups_and_acks_equal_rewards_as_skipped(
    trainer_proxy: TrainerProxy, tmp_path: Path, policy: LoraPolicy, vllm_model_dir: str
) -> None:
    first = trainer_proxy.record_group([1.0, 0.0], question="What is 5+5?")
    behind = trainer_proxy.record_group([0.0, 1.0], question="What is 6+6?")
    config = trainer_proxy.one_step_config(
        vllm_model_dir, tmp_path / "run", mode="sync", groups_per_step=1, tensorboard=False
    )
    assert train(config, policy) == 1  # trains the oldest group, publishes v1: `behind` is now a version old

    fresh = trainer_proxy.record_group([1.0, 0.0], question="What is 7+7?")
    equal = trainer_proxy.record_group([0.5, 0.5], question="What is 8+8?")
    assert train(dataclasses.replace(config, max_steps=2, groups_per_step=2), policy) == 2

    states = {
        name: trainer_proxy.get(f"/groups/{gid}")
        for name, gid in (("first", first), ("behind", behind), ("fresh", fresh), ("equal", equal))
    }
    assert {name: (g["train_status"], g["trained_step"]) for name, g in states.items()} == {
        "first": ("trained", 1),
        "behind": ("stale", None),
        "fresh": ("trained", 2),
        "equal": ("skipped", 2),
    }
    assert "equal" in (states["equal"]["train_note"] or "")
    step2 = trainer_proxy.get("/trainer/steps", since_step=1)["data"][0]["metrics"]
    assert (step2["proxy/stale_groups"], step2["data/groups_trained"], step2["data/groups_skipped_equal"]) == (1, 1, 1)
    assert (step2["proxy/policy_version"], step2["staleness/max"]) == (1, 0)
    assert trainer_proxy.get("/policy")["version"] == 2


def test_a_version_another_trainer_published_is_never_taken_for_this_trainers(
    trainer_proxy: TrainerProxy, tmp_path: Path, policy: LoraPolicy, vllm_model_dir: str
) -> None:
    """Two trainers on one proxy (issue 30): the version this trainer was about to publish is already
    another's. It must not label its own weights with that version (engine mismatch and stale
    re-scoring would compare the other adapter's tokens with these weights); the step says so."""
    other = tmp_path / "other" / "adapter"
    policy.save_adapter(other)
    config = TrainerConfig(model=vllm_model_dir, proxy_url=trainer_proxy.url, output_dir=str(tmp_path / "run"))
    reporter = Reporter(config.out, tensorboard=False, progress=False, max_steps=None, start_step=0)
    with ProxyClient(trainer_proxy.url, ADMIN_KEY) as client:
        current = client.policy().version
        client.publish(adapter_path=str(other), version=current + 1, metadata={"by": "another trainer"})
        trainer = Trainer(config, client, policy, reporter)
        trainer.version_base = current
        assert trainer._publish(1) == {"proxy/publish_conflicts": 1}
        assert trainer.learner.weights_version is None
    reporter.close()
