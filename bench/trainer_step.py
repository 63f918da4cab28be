"""Tokens/s of one GRPO step on SmolLM2-135M (CPU), against TRL and a plain padded baseline; publish time.

All three run in the trainer's dtype (``dtype: auto``: bf16 on CPUs with native bf16, else float32;
emulated bf16 would handicap whichever side used it).

What is measured, all in this run, on the same recorded batch and the same model:

1. A batch is recorded through the real proxy from the real vLLM: ``--groups`` groups of
   ``--group-size`` episodes, one sampled chat call each (arithmetic questions with the math
   workflow's system prompt, ``--max-tokens`` tokens at temperature 1.0). Rewards alternate 1/0
   within each group (throughput does not depend on their values; they only need to differ so no
   group is skipped). The trainer claims the groups and builds its samples from the exact token ids.
2. **flywheel**: ``trainer.learner.Learner.step`` with the local config (LoRA r=8 on all
   projections, dapo, token-level truncated importance sampling against vLLM's log-probs): packed
   micro-batches of ``--micro-batch-tokens`` tokens, log-probs of the sampled tokens only.
3. **trl**: TRL's ``GRPOTrainer`` on the same model (same weights and dtype, same LoRA config, same loss
   settings), ``per_device_train_batch_size`` sequences per micro-batch, gradient accumulation over
   the batch. Honest injection: TRL cannot take a recorded batch, so generation is replaced through
   TRL's own ``rollout_func`` hook, which returns the recorded prompt ids, completion ids and vLLM
   log-probs; a reward function returns the recorded rewards. Everything else is TRL's: rewards to
   advantages, padding, its fused chunked LM head, loss, backward, clipping, AdamW. Without
   ``use_vllm`` TRL skips its importance-sampling correction and the extra no-grad forward it
   adds for it, so TRL does one forward/backward per micro-batch, like flywheel. TRL's default
   gradient checkpointing is turned off (flywheel does not use it; it would slow TRL down).
   The time is TRL's whole optimizer step (callback ``on_step_begin`` to ``on_step_end``).
4. **naive**: the plain implementation: right-padded micro-batches of the same size as TRL's,
   ``model(...).logits`` for every position, full-vocabulary ``log_softmax``, gather, the same loss.

Each implementation warms up (TRL: one full step, as its step count is all it takes; the others:
a step on a few samples). Then ``--reps`` rounds, each one timed step of TRL, flywheel and naive
on the whole batch, back to back (flywheel and naive run from TRL's ``on_step_end`` callback), so
all three see the same background load. tokens/s is the batch's token count (prompt +
completion, no padding) over the median step time. ``publish_s`` is the
median of ``--publishes`` calls of the trainer's publish: save the adapter, ``POST /policy/publish``
(vLLM loads it under a new name, routing switches), measured end to end.

Threads: ``--threads`` (default 1) for all three. On this shared 2-core box two OpenMP threads
collapse (several times slower, erratically) whenever another process holds a core, which makes
two-thread figures noise; one thread gives comparable numbers. Use ``--threads 2`` on an idle machine.

vLLM: ``FLYWHEEL_BENCH_VLLM_URL`` reuses a running engine (adapters are published under a bench
prefix and unloaded afterwards); otherwise one is started (about a minute and a half).
The LAST printed line is one JSON object: flywheel_tok_s, trl_tok_s, naive_tok_s, publish_s, ...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the trainer's CLI does, before torch loads
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench._procs import ProxyUnderTest, exit_on_sigterm, load_average  # noqa: E402
from bench._trl import TRAIN_ONLY  # noqa: E402
from contract.client import ProxyClient  # noqa: E402
from trainer.config import TrainerConfig, load_config  # noqa: E402
from trainer.data import Sample, build_batch  # noqa: E402
from trainer.learner import Learner  # noqa: E402
from trainer.lora import LoraPolicy, resolve_dtype  # noqa: E402
from trainer.loss import Totals, grpo_loss  # noqa: E402
from trainer.publish import Publisher  # noqa: E402

SYSTEM = "Solve the problem. End your reply with a line 'Answer: <number>'."


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- setup: engine, proxy, the recorded batch --------------------------------------------------------


def start_engine(workdir: Path, model: str) -> tuple[str, Callable[[], None]]:
    if os.environ.get("FLYWHEEL_BENCH_VLLM_URL"):
        return os.environ["FLYWHEEL_BENCH_VLLM_URL"].rstrip("/"), lambda: None
    from bench._procs import free_port
    from deploy.vllm import VLLMServer

    server = VLLMServer(model=model, port=free_port(), log_path=workdir / "vllm.log", cpu_kv_cache_gib=2)
    log("starting vLLM (about 90 s)")
    server.start()
    server.wait_healthy(timeout=900)
    return server.url, server.stop


def record(proxy: ProxyUnderTest, *, groups: int, size: int, max_tokens: int) -> None:
    """All episodes at once (vLLM batches them), then the rewards."""
    from concurrent.futures import ThreadPoolExecutor

    admin = {"authorization": f"Bearer {proxy.admin_key}"}
    jobs = []
    for g in range(groups):
        question = f"What is {17 + 7 * g} + {26 + 5 * g}? Then multiply the result by {g + 2}."
        jobs += [(i, key, question) for i, key in enumerate(proxy.create_group(size, task_id=f"bench-{g}"))]

    def episode(job: tuple[int, dict[str, str], str]) -> None:
        i, key, question = job
        reply = httpx.post(
            f"{key['base_url']}/chat/completions",
            headers={"authorization": f"Bearer {key['api_key']}"},
            json={
                "model": "policy",
                "max_tokens": max_tokens,
                "temperature": 1.0,
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            },
            timeout=900,
        )
        reply.raise_for_status()
        httpx.post(
            f"{proxy.url}/episodes/{key['id']}/reward", headers=admin, json={"reward": float(i % 2)}, timeout=60
        ).raise_for_status()

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        list(pool.map(episode, jobs))


def claim_samples(client: ProxyClient, groups: int) -> list[Sample]:
    claim = client.claim(trainer_id="bench", max_groups=groups, lease_s=3600, max_staleness=None)
    batch = build_batch(claim.groups, max_seq_len=4096, scale_rewards="group")
    if len(batch.trained) != groups or batch.stats.breaks:
        raise RuntimeError(f"expected {groups} single-call groups, got {batch.trained} ({batch.stats})")
    return batch.samples


def split(sample: Sample) -> tuple[list[int], list[int], list[float]]:
    """(prompt ids, completion ids, engine log-probs) of a one-call sample."""
    start = sample.loss_mask.index(1)
    return sample.input_ids[:start], sample.input_ids[start:], sample.behaviour_logprobs[start:]


# -- the three implementations -------------------------------------------------------------------------


class FlywheelStep:
    """The trainer's own step (``Learner.step``); the constructor warms it up on a few samples."""

    def __init__(self, config: TrainerConfig, samples: list[Sample]) -> None:
        self.policy = LoraPolicy(config)
        self.learner = Learner(self.policy, config)
        self.samples = samples
        self.learner.weights_version = 0  # the zero adapter is the base model that served the recorded batch
        # mean |trainer - vLLM| log-prob under the serving version, before training (None: nothing to compare)
        self.mismatch = self.learner.step(samples[:4]).engine["policy/engine_logp_diff_mean"]

    def __call__(self) -> float:
        return self.learner.step(self.samples).seconds


def naive_step(config: TrainerConfig, samples: list[Sample], micro: int) -> Callable[[], float]:
    """The plain padded full-vocabulary step, warmed up; returns a function that times one step."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(
        str(config.model_dir), dtype=resolve_dtype(config.dtype, "cpu"), attn_implementation="sdpa"
    )
    model = get_peft_model(
        base,
        LoraConfig(
            r=config.lora_r,
            lora_alpha=config.lora_alpha,
            lora_dropout=0.0,
            target_modules=list(config.lora_target_modules),
            task_type="CAUSAL_LM",
        ),
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.learning_rate)
    tokens = sum(s.num_loss_tokens for s in samples)
    totals = Totals(
        sequences=len(samples),
        tokens=tokens,
        micro_batches=-(-len(samples) // micro),
        max_completion_length=config.max_completion_length,
    )

    def step(samples: list[Sample] = samples) -> float:
        started = time.perf_counter()
        for i in range(0, len(samples), micro):
            chunk = samples[i : i + micro]
            width = max(len(s) for s in chunk)
            ids = torch.tensor([s.input_ids + [0] * (width - len(s)) for s in chunk])
            attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in chunk])
            mask = torch.tensor([s.loss_mask[1:] + [0] * (width - len(s)) for s in chunk], dtype=torch.float32)
            behaviour = torch.tensor([s.behaviour_logprobs[1:] + [float("nan")] * (width - len(s)) for s in chunk])
            logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()  # (B, T, V)
            logps = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            out = grpo_loss(
                logps,
                logps.detach(),
                torch.tensor([s.advantage for s in chunk]),
                mask,
                totals=totals,
                loss_type=config.loss_type,
                epsilon=config.epsilon,
                epsilon_high=config.epsilon_upper,
                behaviour_logps=behaviour,
                is_cap=config.vllm_importance_sampling_cap,
                is_mode=config.vllm_importance_sampling_mode,
            )
            out.loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], config.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    step(samples[: micro // 2])  # warm-up
    return step


def time_trl(
    config: TrainerConfig,
    samples: list[Sample],
    reps: int,
    micro: int,
    group_size: int,
    workdir: Path,
    between: Callable[[float], None],
) -> list[float]:
    """TRL's step times (after its warm-up step); ``between`` runs after each timed TRL step, so the
    other implementations are timed in the same rounds, under the same load."""
    from datasets import Dataset  # type: ignore[import-untyped]
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer  # type: ignore[attr-defined]

    by_group: dict[str, list[Sample]] = {}
    for sample in samples:
        by_group.setdefault(sample.group_id, []).append(sample)
    rewards = {tuple(split(s)[1]): (1.0 if s.advantage > 0 else 0.0) for s in samples}
    handed: dict[str, int] = {}

    def rollout(prompts: list[str], _trainer: Any) -> dict[str, list[Any]]:
        """The recorded completions, in place of generation (TRL's rollout_func hook)."""
        out: dict[str, list[Any]] = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for prompt in prompts:
            index = handed.get(prompt, 0)
            handed[prompt] = index + 1
            prompt_ids, completion_ids, logprobs = split(by_group[prompt][index % group_size])
            out["prompt_ids"].append(prompt_ids)
            out["completion_ids"].append(completion_ids)
            out["logprobs"].append(logprobs)
        return out

    def recorded_reward(completion_ids: list[list[int]], **_: Any) -> list[float | None]:
        return [rewards[tuple(ids)] for ids in completion_ids]

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.started = 0.0

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            self.started = time.perf_counter()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            self.times.append(time.perf_counter() - self.started)
            if len(self.times) > 1:  # the first step was TRL's warm-up
                between(self.times[-1])

    args = GRPOConfig(
        output_dir=str(workdir / "trl"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=len(samples) // micro,
        num_generations=group_size,
        max_completion_length=max(len(split(s)[1]) for s in samples),
        learning_rate=config.learning_rate,
        beta=0.0,
        loss_type=config.loss_type,
        epsilon=config.epsilon,
        epsilon_high=config.epsilon_upper,
        scale_rewards=config.scale_rewards,
        max_grad_norm=config.max_grad_norm,
        temperature=1.0,
        max_steps=1 + reps,
        seed=0,
        **TRAIN_ONLY,
    )
    model = AutoModelForCausalLM.from_pretrained(
        str(config.model_dir), dtype=resolve_dtype(config.dtype, "cpu"), attn_implementation="sdpa"
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=recorded_reward,
        args=args,
        train_dataset=Dataset.from_list([{"prompt": g} for g in by_group]),
        processing_class=AutoTokenizer.from_pretrained(str(config.model_dir)),
        peft_config=LoraConfig(
            r=config.lora_r,
            lora_alpha=config.lora_alpha,
            lora_dropout=0.0,
            target_modules=list(config.lora_target_modules),
            task_type="CAUSAL_LM",
        ),
        rollout_func=rollout,
        callbacks=[timer],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    if len(timer.times) != 1 + reps:
        raise RuntimeError(f"TRL ran {len(timer.times)} steps, expected {1 + reps}")
    return timer.times[1:]


def unload(vllm_url: str, prefix: str) -> None:
    try:
        for model in httpx.get(f"{vllm_url}/v1/models", timeout=30).json()["data"]:
            if model["id"].startswith(prefix):
                httpx.post(f"{vllm_url}/v1/unload_lora_adapter", json={"lora_name": model["id"]}, timeout=30)
    except httpx.HTTPError as exc:
        log(f"could not unload the bench adapters from {vllm_url}: {exc!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per TRL / naive micro-batch")
    parser.add_argument("--micro-batch-tokens", type=int, default=2048, help="flywheel's packed token budget")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--publishes", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for all three implementations")
    opts = parser.parse_args()
    exit_on_sigterm()  # SIGTERM runs the finally blocks that stop vLLM and the proxy
    torch.set_num_threads(opts.threads)
    from deploy.model import fetch

    model = os.environ.get("FLYWHEEL_MODEL_DIR") or str(fetch())
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        workdir = Path(tmp)
        vllm_url, stop_engine = start_engine(workdir, model)
        prefix = f"benchtrainer{uuid.uuid4().hex[:6]}-v"
        proxy = ProxyUnderTest.start(
            vllm_url,
            workdir,
            extra_env={
                "FLYWHEEL_UPSTREAMS": f'[{{"name": "vllm-0", "url": "{vllm_url}"}}]',
                "FLYWHEEL_POLICY__ADAPTER_PREFIX": prefix,
            },
        )
        try:
            result = run(opts, model, workdir, proxy)
        except BaseException:
            log(f"failed; proxy log tail:\n{proxy.log_path.read_text()[-4000:]}")
            raise
        finally:
            proxy.stop()
            unload(vllm_url, prefix)
            stop_engine()
    print(json.dumps(result))


def run(opts: argparse.Namespace, model: str, workdir: Path, proxy: ProxyUnderTest) -> dict[str, Any]:
    log(f"recording {opts.groups} x {opts.group_size} episodes ({opts.max_tokens} tokens max) through the proxy")
    record(proxy, groups=opts.groups, size=opts.group_size, max_tokens=opts.max_tokens)
    client = ProxyClient(proxy.url, proxy.admin_key)
    samples = claim_samples(client, opts.groups)
    tokens = sum(len(s) for s in samples)
    lengths = [len(split(s)[1]) for s in samples]
    log(
        f"batch: {len(samples)} samples, {tokens} tokens, completions {min(lengths)}..{max(lengths)} tokens; "
        f"load {load_average()}"
    )
    config = load_config(
        ROOT / "configs" / "trainer-local.yaml",
        [
            f"model={model}",
            f"micro_batch_tokens={opts.micro_batch_tokens}",
            "max_seq_len=2048",
            f"threads={opts.threads}",
            f"output_dir={workdir / 'flywheel'}",
        ],
    )

    flywheel = FlywheelStep(config, samples)
    naive_run = naive_step(config, samples, opts.micro_batch)
    fly_times: list[float] = []
    naive_times: list[float] = []

    def round_of_others(trl_seconds: float) -> None:
        fly_times.append(flywheel())
        naive_times.append(naive_run())
        log(
            f"round {len(fly_times)}: trl {trl_seconds:.2f} s, flywheel {fly_times[-1]:.2f} s, "
            f"naive {naive_times[-1]:.2f} s; load {load_average()}"
        )

    trl_times = time_trl(config, samples, opts.reps, opts.micro_batch, opts.group_size, workdir, round_of_others)
    log(
        f"steps (s): flywheel {[round(t, 2) for t in fly_times]}, trl {[round(t, 2) for t in trl_times]}, "
        f"naive {[round(t, 2) for t in naive_times]}"
    )
    policy, mismatch = flywheel.policy, flywheel.mismatch

    publisher = Publisher(client, config.out, keep=opts.publishes + 1)
    publish_times = [publisher.publish(policy, version, {"bench": True})[1] for version in range(1, opts.publishes + 1)]
    served = httpx.post(
        f"{proxy.url}/passthrough/v1/chat/completions",
        headers={"authorization": f"Bearer {proxy.admin_key}"},
        timeout=300,
        json={"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    )
    log(f"publish: {[round(t, 3) for t in publish_times]} s; now serving v{served.headers.get('x-policy-version')}")

    fly, trl, naive = (tokens / statistics.median(times) for times in (fly_times, trl_times, naive_times))
    return {
        "flywheel_tok_s": round(fly, 1),
        "trl_tok_s": round(trl, 1),
        "naive_tok_s": round(naive, 1),
        "speedup_vs_trl": round(fly / trl, 2),
        "speedup_vs_naive": round(fly / naive, 2),
        "publish_s": round(statistics.median(publish_times), 3),
        "batch_tokens": tokens,
        "batch_samples": len(samples),
        "completion_tokens": sum(lengths),
        "dtype": str(policy.dtype).split(".")[-1],
        "step_s": {"flywheel": fly_times, "trl": trl_times, "naive": naive_times},
        "publish_all_s": publish_times,
        "threads": opts.threads,
        "load_average": load_average(),
        "served_version": served.headers.get("x-policy-version"),
        "logprob_mismatch_vs_vllm": None if mismatch is None else round(mismatch, 6),
    }


if __name__ == "__main__":
    main()
