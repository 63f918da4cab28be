"""Memory and speed of one GRPO step against sample length: Flywheel's learner vs. TRL's GRPOTrainer.

One step on one GRPO group of two samples of L tokens (one prompt of L/4 tokens, two completions of
3L/4, random token ids in the vocabulary; loss on the completions) for each length of ``--lengths``,
for each implementation:

- ``flywheel-off``: the real ``LoraPolicy`` and ``Learner`` (``trainer/``) with
  ``gradient_checkpointing: false``, one sample per packed micro-batch (``micro_batch_tokens = L``);
- ``flywheel-on``: the same with ``gradient_checkpointing: true``;
- ``trl``: TRL's ``GRPOTrainer`` with its own gradient checkpointing (``gradient_checkpointing=True``),
  the same LoRA (r=8, alpha 16, every projection), loss (dapo) and clipping, one sequence per
  micro-batch and two micro-batches a step (``num_generations=2``). Generation is replaced through
  TRL's ``rollout_func`` hook, which hands it the same prompt and completion ids (as
  ``bench.trainer_step`` does); rewards 1 and 0. Everything else, padding, log-probs, loss, backward,
  AdamW, is TRL's. Its step time runs from the callback ``on_step_begin`` to ``on_step_end``.

Each side steps on the same 2 x L tokens, and tokens/s counts exactly those. Every (implementation,
length) cell runs in its own child process, so each measures a fresh heap: load the model, one
warm-up step on a short group (``--warmup-tokens``: lazy set-up, AdamW state), then ``--reps``
timed steps (one above ``--reps-above`` tokens), tokens/s over the median.

Memory is the peak over a timed step minus the level just before it ("added", the largest over the
timed steps): on the CPU the process's resident set, freed heap handed back first
(``trainer/memory.py``'s release) and the kernel's high-water mark (``VmHWM``) reset through
``/proc/self/clear_refs`` then read after the step (a 5 ms sampling thread where that reset is
refused); on a GPU ``torch.cuda.max_memory_allocated`` minus ``memory_allocated``. Also printed:
the level after loading and the absolute peak.

Models: on the CPU SmolLM2-135M (``python -m deploy.model path``) in the trainer's dtype and
``--threads`` torch threads (1 by default: this box is shared, ``bench.trainer_step`` says why). With
a GPU, by default a randomly initialised model of Qwen2.5-7B's shape in bfloat16, built from its
config on the device, nothing downloaded (``random:qwen2.5-7b``: the numbers of Qwen/Qwen2.5-7B's
``config.json`` on Hugging Face: hidden 3584, 28 layers, 28 heads, 4 key-value heads, intermediate
18944, vocabulary 152064, rope theta 1e6), with a word-level tokenizer over its vocabulary made up
for it (nothing reads text). ``random:tiny`` is a 2-layer shape that runs the same path in seconds.

Lengths: 1k to 16k on the CPU, 8k to 32k on a GPU. ``flywheel-off`` is skipped above
``--max-off-tokens`` (4,096 on the CPU, 8,192 on a GPU: it holds every layer's activations) and
``trl`` above ``--trl-max-tokens`` when set; skipped cells say so. A child that runs out of memory
is reported as such, not as a crash.

``--mmap-threshold-kb K`` runs every cell (TRL's too) with glibc's mmap threshold fixed at K KB
(``TrainerConfig.mmap_threshold_kb``): on the CPU the resident peak is then the live tensors, not
what glibc's heap once held; compare a run with it against one without.

Printed: a table per length (added peak GB, GB per 1k tokens, tokens/s, step seconds), then the
ratios against the goals of issue 33: flywheel-on's added GB per token at the longest length over
that at the shortest (goal <= 1.5) and flywheel-on's tokens/s over TRL's at each length (goal
>= 1.0), with PASS or MISS. The last line is one JSON object.

Run from the repo root: ``python -m bench.long_context`` (not in ``make bench``). On the CPU the
8k and 16k cells take most of the time (attention grows with the square of the length);
``--trl-max-tokens 8192`` or ``--lengths 1024,2048,4096 --reps 1`` for a shorter run. With a GPU
the same command runs the 7B shape at 8k-32k.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from bench._procs import ROOT

IMPLS = ("flywheel-off", "flywheel-on", "trl")
SHAPES: dict[str, dict[str, Any]] = {
    # Qwen/Qwen2.5-7B config.json (huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json)
    "qwen2.5-7b": {
        "hidden_size": 3584,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "intermediate_size": 18944,
        "vocab_size": 152064,
        "max_position_embeddings": 131072,
        "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    },
    # a smoke-test shape: the same code path in seconds
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 4096,
        "max_position_embeddings": 131072,
        "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    },
}
GOAL_MEMORY = 1.5
"""Issue 33: added peak per token at the longest length at most this times that at the shortest."""
GOAL_SPEED = 1.0
"""Issue 33: Flywheel's tokens/s at least TRL's at every length."""
FIRST_ID = 100
"""Random ids start here: clear of the special tokens (an end-of-sequence id would cut TRL's completion)."""


# -- the group every implementation steps on ----------------------------------------------------------


def group(length: int, vocab: int, seed: int) -> tuple[list[int], list[list[int]]]:
    """(prompt ids, two completions' ids): L/4 prompt tokens, 3L/4 completion tokens each, seeded by L."""
    rng = random.Random(seed * 1_000_003 + length)
    prompt_len = max(1, length // 4)
    prompt = [rng.randrange(FIRST_ID, vocab) for _ in range(prompt_len)]
    completions = [[rng.randrange(FIRST_ID, vocab) for _ in range(length - prompt_len)] for _ in range(2)]
    return prompt, completions


# -- peak memory over a window -----------------------------------------------------------------------


def _hwm_bytes() -> int | None:
    """The kernel's peak resident set of this process (VmHWM, ``trainer/memory.py``) in bytes."""
    from trainer import memory

    peak = memory.peak_gb()
    return None if peak is None else int(peak * 1e9)


def _reset_hwm() -> bool:
    """Reset VmHWM to the current resident set; False where refused."""
    from trainer import memory

    return memory.reset_peak()


class Peak:
    """The peak memory of one window (a step), and the level at its start."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.base = 0
        self._sampled = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def level(self) -> int:
        import torch

        from trainer.memory import rss_gb

        return torch.cuda.memory_allocated() if self.cuda else int(rss_gb() * 1e9)

    def start(self) -> None:
        import torch

        from trainer import memory

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return
        memory.release()  # what a previous step freed goes back first, so the level is what is held
        self.base = self.level()
        if not _reset_hwm():
            self._sampled = self.base
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self._sampled = max(self._sampled, self.level())

    def stop(self, reported: float = 0.0) -> tuple[float, float]:
        """(absolute peak GB, peak added over the start GB). ``reported``: a peak (bytes) the step itself
        read before resetting the counter (``trainer/memory.py``'s figures at the end of a learner step:
        ``perf/cuda_max_allocated_gb``, ``perf/rss_peak_gb`` where it reports one)."""
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        elif self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            peak = max(self._sampled, self.level())
        else:
            peak = _hwm_bytes() or 0
        peak = max(peak, int(reported))
        return peak / 1e9, (peak - self.base) / 1e9


# -- the random model of a named shape -----------------------------------------------------------------


def write_random_model(shape: str, directory: Path) -> None:
    """config.json of the shape and a word-level tokenizer over its vocabulary (no weights: children
    build the model from the config, ``use_random_weights``)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast, Qwen2Config

    numbers = SHAPES[shape]
    Qwen2Config(**numbers, bos_token_id=1, eos_token_id=1, pad_token_id=0, use_sliding_window=False).save_pretrained(
        directory
    )
    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, numbers["vocab_size"])}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")  # type: ignore[no-untyped-call]
    fast.save_pretrained(directory)


def use_random_weights(model_dir: str, device: str) -> None:
    """``AutoModelForCausalLM.from_pretrained(model_dir)`` builds the model from its config, randomly
    initialised on ``device``, in this process (the trainer and TRL load through it unchanged)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained

    def build(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path) != model_dir:
            return original(path, *args, **kwargs)
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device(device):
            return AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                config, dtype=kwargs.get("dtype"), attn_implementation=kwargs.get("attn_implementation")
            )

    setattr(AutoModelForCausalLM, "from_pretrained", build)  # noqa: B010


# -- one cell, in a child process --------------------------------------------------------------------------


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from trainer.config import TrainerConfig

    torch.set_num_threads(spec["threads"])
    cuda = torch.cuda.is_available()
    if spec["mmap_threshold_kb"] is not None and not spec["impl"].startswith("flywheel"):
        from trainer import memory  # Flywheel's cells set it through their config, as a user would

        memory.fix_mmap_threshold(spec["mmap_threshold_kb"])
    if spec["random"]:
        use_random_weights(spec["model"], "cuda" if cuda else "cpu")
    length = spec["length"]
    config = TrainerConfig(
        model=spec["model"],
        micro_batch_tokens=length,
        max_seq_len=length,
        gradient_checkpointing=spec["impl"] == "flywheel-on",
        mmap_threshold_kb=spec["mmap_threshold_kb"],
        threads=spec["threads"],
        seed=spec["seed"],
    )
    from transformers import AutoConfig, AutoTokenizer

    vocab = min(AutoConfig.from_pretrained(spec["model"]).vocab_size, len(AutoTokenizer.from_pretrained(spec["model"])))
    long = group(length, vocab, spec["seed"])
    short = group(min(length, spec["warmup_tokens"]), vocab, spec["seed"])
    run = _flywheel if spec["impl"].startswith("flywheel") else _trl
    try:
        return run(config, spec, long, short, cuda)
    except torch.OutOfMemoryError as exc:
        return {"error": "out of memory", "detail": str(exc).split("\n")[0][:200]}


def _synchronize(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def _flywheel(
    config: Any, spec: dict[str, Any], long: tuple[list[int], list[list[int]]], short: Any, cuda: bool
) -> dict[str, Any]:
    from trainer import memory
    from trainer.learner import Learner
    from trainer.lora import LoraPolicy
    from trainer.sample import Sample

    def samples(ids: tuple[list[int], list[list[int]]]) -> list[Sample]:
        prompt, completions = ids
        rng = random.Random(len(prompt))
        out = []
        for i, completion in enumerate(completions):
            n = len(prompt) + len(completion)
            out.append(
                Sample(
                    group_id="g",
                    episode_id=f"e{i}",
                    member=f"e{i}",
                    input_ids=prompt + completion,
                    loss_mask=[0] * len(prompt) + [1] * len(completion),
                    behaviour_logprobs=[math.nan] * len(prompt) + [-2 * rng.random() for _ in completion],
                    temperatures=[1.0] * n,
                    advantage=1.0 if i == 0 else -1.0,
                )
            )
        return out

    peak = Peak(cuda)
    policy = LoraPolicy(config)
    learner = Learner(policy, config)
    memory.freeze_resident()  # as the trainer's process does once its model is loaded
    loaded = peak.level() / 1e9
    learner.step(samples(short))  # warm-up
    batch = samples(long)
    times: list[float] = []
    added: list[float] = []
    peaks: list[float] = []
    tokens = 0
    for _ in range(spec["reps"]):
        peak.start()
        started = time.perf_counter()
        stats = learner.step(batch)
        _synchronize(cuda)
        times.append(time.perf_counter() - started)
        reported = stats.memory.get("perf/cuda_max_allocated_gb" if cuda else "perf/rss_peak_gb", 0.0)
        top, extra = peak.stop(reported * 1e9)
        peaks.append(top)
        added.append(extra)
        tokens = stats.tokens
    return {"tokens": tokens, "step_s": times, "added_gb": max(added), "peak_gb": max(peaks), "loaded_gb": loaded}


def _trl(
    config: Any,
    spec: dict[str, Any],
    long: tuple[list[int], list[list[int]]],
    short: tuple[list[int], list[list[int]]],
    cuda: bool,
) -> dict[str, Any]:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset  # type: ignore[import-untyped]
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer  # type: ignore[attr-defined]

    from bench._trl import TRAIN_ONLY, peft_lora
    from trainer.lora import resolve_dtype

    handed: list[int] = []  # tokens handed to TRL per rollout (one rollout per optimizer step)

    def rollout(prompts: list[str], _trainer: Any) -> dict[str, list[Any]]:
        """The group's ids in place of generation: the short group for the warm-up step, then the long one."""
        prompt, completions = short if not handed else long
        if len(prompts) != len(completions):
            raise RuntimeError(f"TRL asked for {len(prompts)} completions, expected {len(completions)}")
        handed.append(sum(len(prompt) + len(c) for c in completions))
        return {
            "prompt_ids": [prompt] * len(completions),
            "completion_ids": completions,
            "logprobs": [[-1.0] * len(c) for c in completions],
        }

    def reward(completion_ids: list[list[int]], **_: Any) -> list[float | None]:
        return [1.0 if i % 2 == 0 else 0.0 for i in range(len(completion_ids))]

    peak = Peak(cuda)

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.added: list[float] = []
            self.peaks: list[float] = []
            self.started = 0.0

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            if self.times or self.started:  # the first step is the warm-up: not measured
                peak.start()
            self.started = time.perf_counter()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            _synchronize(cuda)
            elapsed = time.perf_counter() - self.started
            if len(handed) > 1:
                top, extra = peak.stop()
                self.times.append(elapsed)
                self.peaks.append(top)
                self.added.append(extra)

    train_only = dict(TRAIN_ONLY, use_cpu=not cuda, bf16=cuda)  # on a GPU: TRL's own bf16 mixed precision
    train_only["gradient_checkpointing"] = True  # TRL's own checkpointing
    args = GRPOConfig(
        output_dir=str(Path(spec["workdir"]) / "trl"),
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        num_generations=2,
        max_completion_length=len(long[1][0]),
        learning_rate=config.learning_rate,
        beta=0.0,
        loss_type=config.loss_type,
        epsilon=config.epsilon,
        epsilon_high=config.epsilon_upper,
        scale_rewards=config.scale_rewards,
        max_grad_norm=config.max_grad_norm,
        temperature=1.0,
        max_steps=1 + spec["reps"],
        seed=spec["seed"],
        **train_only,
    )
    device = "cuda" if cuda else "cpu"
    model = AutoModelForCausalLM.from_pretrained(
        spec["model"], dtype=resolve_dtype(config.dtype, device), attn_implementation="sdpa"
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "p"}]),
        processing_class=AutoTokenizer.from_pretrained(spec["model"]),
        peft_config=peft_lora(config, dropout=0.0),
        rollout_func=rollout,
        callbacks=[timer],
    )
    loaded = peak.level() / 1e9
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    if len(timer.times) != spec["reps"]:
        raise RuntimeError(f"TRL timed {len(timer.times)} steps, expected {spec['reps']}")
    return {
        "tokens": handed[-1],
        "step_s": timer.times,
        "added_gb": max(timer.added),
        "peak_gb": max(timer.peaks),
        "loaded_gb": loaded,
    }


# -- the parent: cells, table, ratios ----------------------------------------------------------------------


def run_cell(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """One cell in a fresh process; its result, or what went wrong."""
    cmd = [sys.executable, "-m", "bench.long_context", "--child", json.dumps(spec)]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)  # keep what the caller added
    env = dict(os.environ, PYTHONPATH=path, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false")
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    wall = time.perf_counter() - started
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        why = "killed (out of memory?)" if proc.returncode == -9 else f"failed (exit {proc.returncode})"
        print(f"{spec['impl']} at {spec['length']} tokens {why}; its stderr ends:\n{proc.stderr[-3000:]}", flush=True)
        return {"error": why}
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    result["cell_wall_s"] = round(wall, 1)
    return result


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--lengths", default=None, help="tokens per sample, comma-separated (default: CPU 1k-16k, GPU 8k-32k)"
    )
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"a subset of {','.join(IMPLS)}")
    parser.add_argument("--reps", type=int, default=2, help="timed steps per cell (after one warm-up step)")
    parser.add_argument(
        "--reps-above", type=int, default=None, help="longer samples take one timed step (default: CPU 4096, GPU none)"
    )
    parser.add_argument(
        "--max-off-tokens", type=int, default=None, help="skip flywheel-off above this (default: CPU 4096, GPU 8192)"
    )
    parser.add_argument("--trl-max-tokens", type=int, default=None, help="skip trl above this (default: none)")
    parser.add_argument("--warmup-tokens", type=int, default=256, help="sample length of the warm-up step")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads in every cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--mmap-threshold-kb",
        type=int,
        default=None,
        help="every cell with glibc's mmap threshold fixed here (TrainerConfig.mmap_threshold_kb); default glibc's",
    )
    parser.add_argument("--cell-timeout-s", type=float, default=4 * 3600)
    parser.add_argument(
        "--model",
        default=None,
        help="a model directory, or random:<shape> (shapes: "
        + ", ".join(SHAPES)
        + "); default: CPU SmolLM2-135M, GPU random:qwen2.5-7b",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print("RESULT " + json.dumps(_child(json.loads(args.child))), flush=True)
        return

    import torch

    cuda = torch.cuda.is_available()
    lengths = [
        int(x) for x in (args.lengths or ("8192,16384,32768" if cuda else "1024,2048,4096,8192,16384")).split(",")
    ]
    impls = [i for i in args.impls.split(",") if i]
    unknown = set(impls) - set(IMPLS)
    if unknown:
        raise SystemExit(f"unknown implementations {sorted(unknown)}; choose from {IMPLS}")
    reps_above = args.reps_above if args.reps_above is not None else (None if cuda else 4096)
    max_off = args.max_off_tokens if args.max_off_tokens is not None else (8192 if cuda else 4096)
    model: str | None = args.model or ("random:qwen2.5-7b" if cuda else None)
    device = torch.cuda.get_device_name() if cuda else f"CPU, {args.threads} torch thread(s)"

    with tempfile.TemporaryDirectory(prefix="bench-long-") as tmp:
        random_weights = model is not None and model.startswith("random:")
        if model is not None and random_weights:
            shape = model.removeprefix("random:")
            if shape not in SHAPES:
                raise SystemExit(f"unknown shape {shape!r}; choose from {list(SHAPES)}")
            model_path = str(Path(tmp) / "model")
            write_random_model(shape, Path(model_path))
        elif model is None:
            from deploy.model import model_dir

            model_path = str(model_dir())
        else:
            model_path = model
        print(f"model {model or model_path} on {device}; lengths {lengths}; implementations {impls}", flush=True)

        cells: dict[tuple[int, str], dict[str, Any]] = {}
        for length in lengths:
            for impl in impls:
                if impl == "flywheel-off" and length > max_off:
                    cells[length, impl] = {"skipped": f"above --max-off-tokens {max_off}"}
                elif impl == "trl" and args.trl_max_tokens is not None and length > args.trl_max_tokens:
                    cells[length, impl] = {"skipped": f"above --trl-max-tokens {args.trl_max_tokens}"}
                else:
                    spec = {
                        "impl": impl,
                        "length": length,
                        "reps": 1 if reps_above is not None and length > reps_above else args.reps,
                        "model": model_path,
                        "random": random_weights,
                        "threads": args.threads,
                        "seed": args.seed,
                        "warmup_tokens": args.warmup_tokens,
                        "mmap_threshold_kb": args.mmap_threshold_kb,
                        "workdir": tmp,
                    }
                    cells[length, impl] = cell = run_cell(spec, args.cell_timeout_s)
                    if "step_s" in cell:
                        cell["tok_s"] = cell["tokens"] / statistics.median(cell["step_s"])
                        cell["gb_per_1k"] = cell["added_gb"] / cell["tokens"] * 1000
                print(f"  {length:>6} {impl:<13} {_describe(cells[length, impl])}", flush=True)

    print(
        f"\n{'length':>7} {'impl':<13} {'tokens':>7} {'loaded GB':>10} {'peak GB':>8} {'added GB':>9} "
        f"{'GB/1k tok':>10} {'tok/s':>8} {'step s':>8}"
    )
    for length in lengths:
        for impl in impls:
            c = cells[length, impl]
            if "tok_s" not in c:
                print(f"{length:>7} {impl:<13} {c.get('skipped') or c.get('error')}")
                continue
            step_s = statistics.median(c["step_s"])
            print(
                f"{length:>7} {impl:<13} {c['tokens']:>7} {c['loaded_gb']:>10.2f} {c['peak_gb']:>8.2f} "
                f"{c['added_gb']:>9.3f} {c['gb_per_1k']:>10.4f} {c['tok_s']:>8.1f} {step_s:>8.2f}"
            )

    summary = ratios(cells, lengths)
    print("\nratios (measured in this run):")
    for line in summary.pop("lines"):
        print("  " + line)
    print(
        json.dumps(
            {
                "device": device,
                "model": model or model_path,
                "lengths": lengths,
                "cells": {f"{impl}@{length}": cells[length, impl] for length in lengths for impl in impls},
                **summary,
            }
        )
    )


def _describe(cell: dict[str, Any]) -> str:
    if "tok_s" not in cell:
        return str(cell.get("skipped") or cell.get("error"))
    return (
        f"{cell['tok_s']:.1f} tok/s, added {cell['added_gb']:.3f} GB ({cell['gb_per_1k']:.4f} GB per 1k tokens), "
        f"cell {cell['cell_wall_s']} s"
    )


def ratios(cells: dict[tuple[int, str], dict[str, Any]], lengths: list[int]) -> dict[str, Any]:
    """The per-length speed ratios and the memory-growth ratio, against the goals."""
    lines: list[str] = []

    def tok_s(length: int, impl: str) -> float | None:
        value = cells.get((length, impl), {}).get("tok_s")
        return None if value is None else float(value)

    speed: dict[str, float | None] = {}
    speed_off: dict[str, float | None] = {}
    for length in lengths:
        on, off, trl = tok_s(length, "flywheel-on"), tok_s(length, "flywheel-off"), tok_s(length, "trl")
        speed[str(length)] = None if on is None or trl is None else on / trl
        speed_off[str(length)] = None if off is None or trl is None else off / trl
        lines.append(
            f"{length:>6} tokens: flywheel-on / trl tokens/s {_fmt(speed[str(length)], '.2f')}, "
            f"flywheel-off / trl {_fmt(speed_off[str(length)], '.2f')}"
        )
    measured = [v for v in speed.values() if v is not None]
    missing = [k for k, v in speed.items() if v is None]
    speed_verdict = "MISS" if any(v < GOAL_SPEED for v in measured) else ("PASS" if measured else "not measured")
    lines.append(
        f"speed goal (flywheel-on >= trl at every length): {speed_verdict}"
        + (f" (not measured at {', '.join(missing)})" if missing and measured else "")
    )

    per_token = {L: cells.get((L, "flywheel-on"), {}).get("gb_per_1k") for L in lengths}
    have = [L for L in lengths if per_token[L] is not None]
    growth = None
    if len(have) >= 2 and per_token[have[0]]:
        low, high = have[0], have[-1]
        growth = float(per_token[high]) / float(per_token[low])  # type: ignore[arg-type]
        verdict = "PASS" if growth <= GOAL_MEMORY else "MISS"
        lines.append(
            f"memory goal (flywheel-on added GB per token at {high} <= {GOAL_MEMORY}x that at {low}): "
            f"{growth:.2f}x, {verdict}"
        )
    else:
        verdict = "not measured"
        lines.append("memory goal: not measured (flywheel-on needs two lengths)")
    return {
        "lines": lines,
        "speed_on_vs_trl": speed,
        "speed_off_vs_trl": speed_off,
        "speed_goal": speed_verdict,
        "memory_growth_on": growth,
        "memory_goal": verdict,
    }


if __name__ == "__main__":
    main()
