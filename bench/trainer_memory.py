"""Does the trainer's memory stay flat over hundreds of steps? RSS per step, with and without the release.

Each variant runs in a fresh process (so one does not inherit the other's heap): the real
``LoraPolicy`` and ``Learner`` on SmolLM2-135M (``python -m deploy.model path``, the trainer's dtype,
one torch thread) take ``--steps`` optimizer steps on synthetic samples whose lengths vary from step
to step as a real run's do (``--samples`` per step, ``--min-tokens`` to ``--max-tokens`` each, a
third of them completion). After every step the child prints its RSS (and CUDA peaks where a GPU
is present). Variants:

- ``release``: the trainer as shipped (``trainer/memory.py``: collect, then ``malloc_trim(0)``
  after each step);
- ``none``: the same steps with that release turned into a no-op, the baseline it is measured
  against in the same run (``--baseline-steps`` of them: its growth shows within tens of steps).

For each variant: RSS after the first step, at the end, the peak, and the slope of a least-squares
line through the steps after ``--warmup`` (MB per step; flat means ~0), then the footprint the
process accounts for (weights, LoRA parameters, AdamW state) and what is left (activations freed
and kept by the allocator, the interpreter, libraries). The last line is one JSON object.

Run from the repo root: ``python -m bench.trainer_memory`` (200 steps shipped, 60 baseline; 2-7 s a
step on 2 CPU cores with the defaults, slower while other work shares the cores).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from typing import Any

from bench._procs import ROOT


def _child(args: argparse.Namespace) -> None:
    """One variant's steps, a JSON line each."""
    import torch

    from trainer import memory
    from trainer.config import TrainerConfig
    from trainer.learner import Learner
    from trainer.lora import LoraPolicy
    from trainer.sample import Sample

    torch.set_num_threads(1)
    if args.child == "none":
        memory.release = lambda: None  # the baseline: the same steps, the heap kept
    config = TrainerConfig(model=args.model, micro_batch_tokens=2048, max_seq_len=args.max_tokens)
    policy = LoraPolicy(config)
    learner = Learner(policy, config)
    memory.freeze_resident()  # as the trainer's process does once its model is loaded
    rng = random.Random(args.seed)
    weights = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    lora = sum(p.numel() * p.element_size() for p in policy.parameters())
    print(json.dumps({"loaded_gb": memory.rss_gb(), "weights_gb": weights / 1e9, "lora_gb": lora / 1e9}), flush=True)
    for step in range(1, args.steps + 1):
        samples = []
        for i in range(args.samples):
            n = rng.randint(args.min_tokens, args.max_tokens)
            completion = max(1, n // 3)
            prompt = n - completion
            samples.append(
                Sample(
                    group_id=f"g{step}",
                    episode_id=f"e{step}-{i}",
                    member=f"e{step}-{i}",
                    input_ids=[rng.randint(10, 40_000) for _ in range(n)],
                    loss_mask=[0] * prompt + [1] * completion,
                    behaviour_logprobs=[float("nan")] * prompt + [-2 * rng.random() for _ in range(completion)],
                    temperatures=[1.0] * n,
                    advantage=1.0 if i % 2 else -1.0,
                )
            )
        started = time.perf_counter()
        stats = learner.step(samples)
        line: dict[str, Any] = {"step": step, "step_s": time.perf_counter() - started, "rss_gb": memory.rss_gb()}
        line.update({k.removeprefix("perf/"): v for k, v in stats.memory.items() if k != "perf/rss_gb"})
        if step == 1:
            state = learner.optimizer.state_dict()["state"]
            line["adamw_gb"] = sum(t.numel() * t.element_size() for s in state.values() for t in s.values()) / 1e9
        print(json.dumps(line), flush=True)


def _fit(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys on xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def _variant(args: argparse.Namespace, name: str) -> dict[str, Any]:
    steps_arg = ["--steps", str(args.baseline_steps if name == "none" else args.steps)]
    cmd = [sys.executable, "-m", "bench.trainer_memory", *sys.argv[1:], *steps_arg, "--child", name]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    head: dict[str, Any] = {}
    steps: list[dict[str, Any]] = []
    for raw in proc.stdout:
        line = json.loads(raw)
        if "step" not in line:
            head = line
            continue
        steps.append(line)
        if line["step"] % 10 == 0 or line["step"] == 1:
            peak = line.get("rss_peak_gb", float("nan"))
            print(
                f"  {name} step {line['step']}: RSS {line['rss_gb']:.2f} GB, "
                f"peak in step {peak:.2f} GB ({line['step_s']:.1f} s)",
                flush=True,
            )
    if proc.wait() != 0 or not steps:
        raise SystemExit(f"the {name} variant failed (exit {proc.returncode})")
    late = [s for s in steps if s["step"] > args.warmup] or steps
    slope_mb = 1000 * _fit([s["step"] for s in late], [s["rss_gb"] for s in late])
    first = steps[0]
    accounted = head["weights_gb"] + head["lora_gb"] * 2 + first.get("adamw_gb", 0.0)  # + LoRA grads
    return {
        "variant": name,
        "steps": len(steps),
        "loaded_gb": round(head["loaded_gb"], 3),
        "weights_gb": round(head["weights_gb"], 3),
        "lora_params_and_grads_gb": round(head["lora_gb"] * 2, 4),
        "adamw_gb": round(first.get("adamw_gb", 0.0), 4),
        "rss_first_gb": round(first["rss_gb"], 3),
        "rss_last_gb": round(steps[-1]["rss_gb"], 3),
        "rss_max_after_step_gb": round(max(s["rss_gb"] for s in steps), 3),
        "peak_in_step_median_gb": round(sorted(s.get("rss_peak_gb", 0.0) for s in steps)[len(steps) // 2], 3),
        "peak_in_step_max_gb": round(max(s.get("rss_peak_gb", 0.0) for s in steps), 3),
        "slope_mb_per_step_after_warmup": round(slope_mb, 2),
        "unaccounted_last_gb": round(steps[-1]["rss_gb"] - accounted, 3),
        "median_step_s": round(sorted(s["step_s"] for s in steps)[len(steps) // 2], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--baseline-steps", type=int, default=60, help="steps of the `none` variant")
    parser.add_argument("--warmup", type=int, default=20, help="steps left out of the slope's fit")
    parser.add_argument("--samples", type=int, default=4, help="samples per step")
    parser.add_argument("--min-tokens", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=600)
    parser.add_argument("--variants", type=lambda s: s.split(","), default=["release", "none"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="default: python -m deploy.model path")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        from deploy.model import model_dir

        args.model = str(model_dir())
    if args.child is not None:
        _child(args)
        return
    results = [_variant(args, name) for name in args.variants]
    keys = [k for k in results[0] if k != "variant"]
    print(f"\n{'':<34}" + "".join(f"{r['variant']:>12}" for r in results))
    for key in keys:
        print(f"{key:<34}" + "".join(f"{r[key]:>12}" for r in results))
    print(json.dumps({"variants": results, "steps": args.steps, "warmup": args.warmup, "samples": args.samples}))


if __name__ == "__main__":
    main()
