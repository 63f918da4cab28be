"""Prefix-shared packing (issue 45): trained tokens/s and peak memory of a GRPO step, shared vs unshared.

One process, one model, the real ``LoraPolicy`` and ``Learner``; for each shape the same synthetic
step (a batch of samples) is taken with ``shared_prefix: false`` (every sample packed whole) and
``true`` (each micro-batch a prefix tree, ``trainer/packing.py``), the two alternating, ``--reps``
timed steps each after one warm-up step each. Shapes (token counts before a +-25% spread on each
completion and tool result):

- ``math``: 4 groups of 8 members; a 40-token system prompt shared by all, a 60-token question per
  group (a ~100-token prompt), one completion of ~60 tokens per member;
- ``calc``: 2 groups of 4 members, a 400-token prompt (300 of system prompt and tools shared by
  both groups, 100 of task), 3 turns per member of a ~50-token completion (trained) and a ~30-token
  tool result, one sample per member;
- ``openhands``: one fork group: a 6,000-token shared context (4,000 of system prompt and tools,
  2,000 replayed), 8 branches of ~500 trained tokens.

The model: SmolLM2-135M's shape (``python -m deploy.model path``: its config and tokenizer) with
``--layers`` decoder layers instead of 30 and random weights (the figures depend on the shape, not
the weights), LoRA r=8 on every projection, in ``--dtype`` (the trainer's ``auto``: bf16 on a CPU
with native bf16). ``micro_batch_tokens`` ``--micro-batch-tokens`` and ``max_seq_len`` 8,192.

Figures per shape and variant: tokens in the samples (the unshared count, what is trained on),
tokens computed (the packed rows), micro-batches, the median step time, trained tokens/s (the
unshared count over the step time, so the two variants count the same work) and the peak resident
memory of a step: the process's RSS high-water mark (``VmHWM`` from /proc, reset before each step,
``trainer/memory.py``), as the peak over the timed steps, and above the RSS right before the step.
Then the ratios shared/unshared. The LAST line is one JSON object.

``--quick``: 2 layers, 1 timed step each and the ``openhands`` shape halved (3,000 shared, 8 x 250):
about a minute on 2 cores (the defaults: about 6 minutes). ``--plan-only``: the packing's figures
alone, no model. Run from the repo root: ``python -m bench.shared_prefix [--quick]``; run it
alone on the machine (timings).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the trainer's CLI does, before torch loads
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer import memory  # noqa: E402
from trainer.config import TrainerConfig  # noqa: E402
from trainer.learner import Learner  # noqa: E402
from trainer.lora import LoraPolicy, resolve_dtype  # noqa: E402
from trainer.packing import pack  # noqa: E402
from trainer.sample import Sample  # noqa: E402

NAN = float("nan")
MAX_SEQ_LEN = 8192


def log(message: str) -> None:
    print(f"[shared_prefix {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Shape:
    groups: int
    members: int
    system: int
    """Tokens every sample of the step begins with (system prompt, tools)."""
    prompt: int
    """Then tokens the group's members share (task, replayed context)."""
    turns: int
    completion: int
    """Trained tokens per turn."""
    tool: int
    """Tool-result tokens after each turn but the last (context)."""


SHAPES = {
    "math": Shape(groups=4, members=8, system=40, prompt=60, turns=1, completion=60, tool=0),
    "calc": Shape(groups=2, members=4, system=300, prompt=100, turns=3, completion=50, tool=30),
    "openhands": Shape(groups=1, members=8, system=4000, prompt=2000, turns=1, completion=500, tool=0),
}
QUICK_OPENHANDS = Shape(groups=1, members=8, system=2000, prompt=1000, turns=1, completion=250, tool=0)


def samples_for(shape: Shape, seed: int) -> list[Sample]:
    """One step's samples: members sharing their group's prompt, groups sharing the system prompt."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 49_000) for _ in range(n)]

    def spread(n: int) -> int:
        return max(1, round(n * rng.uniform(0.75, 1.25))) if n else 0

    system = tokens(shape.system)
    out: list[Sample] = []
    for g in range(shape.groups):
        prompt = system + tokens(shape.prompt)
        for m in range(shape.members):
            ids, loss = list(prompt), [0] * len(prompt)
            for turn in range(shape.turns):
                n = spread(shape.completion)
                ids += tokens(n)
                loss += [1] * n
                if turn < shape.turns - 1 and shape.tool:
                    n = spread(shape.tool)
                    ids += tokens(n)
                    loss += [0] * n
            out.append(
                Sample(
                    group_id=f"g{g}",
                    episode_id=f"e{g}-{m}",
                    member=f"e{g}-{m}",
                    input_ids=ids,
                    loss_mask=loss,
                    behaviour_logprobs=[-rng.uniform(8.0, 12.0) if t else NAN for t in loss],
                    temperatures=[1.0] * len(ids),
                    advantage=1.0 if m % 2 else -1.0,
                )
            )
    return out


def build_model(source: Path, layers: int, out: Path) -> None:
    """``source``'s config and tokenizer with ``layers`` decoder layers and random weights, at ``out``."""
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(source)
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)  # type: ignore[no-untyped-call]
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, out / name)


def plan_only(samples: list[Sample], budget: int) -> dict[str, int]:
    """The packing alone (no model): tokens computed and micro-batches of each variant."""
    whole, tree = pack(samples, budget), pack(samples, budget, shared=True)
    return {
        "tokens": sum(len(s) for s in samples),
        "unshared_computed": sum(mb.num_tokens for mb in whole),
        "shared_computed": sum(mb.num_tokens for mb in tree),
        "unshared_micro_batches": len(whole),
        "shared_micro_batches": len(tree),
    }


def measure(learner: Learner, samples: list[Sample]) -> dict[str, float]:
    """One step: its seconds, trained and computed tokens, micro-batches and peak RSS."""
    memory.release()
    before = memory.rss_gb()
    memory.reset_peak()
    stats = learner.step(samples)
    peak = stats.memory.get("perf/rss_peak_gb", NAN)
    return {
        "step_s": stats.seconds,
        "tokens": stats.tokens,
        "computed": stats.tokens_computed,
        "micro_batches": stats.micro_batches,
        "peak_gb": peak,
        "added_peak_gb": peak - before,
    }


def run_shape(policy: LoraPolicy, config: TrainerConfig, name: str, shape: Shape, reps: int) -> dict[str, Any]:
    samples = samples_for(shape, seed=len(name))
    learners = {
        variant: Learner(policy, dataclasses.replace(config, shared_prefix=variant == "shared"))
        for variant in ("unshared", "shared")
    }
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in learners}
    for variant, learner in learners.items():  # warm-up: one step each (allocator, kernels)
        log(f"{name}: warm-up, {variant}")
        measure(learner, samples)
    names = list(learners)
    for rep in range(reps):
        for variant in names if rep % 2 == 0 else names[::-1]:  # alternating: neither always runs first
            runs[variant].append(measure(learners[variant], samples))
            log(f"{name}: {variant} step {rep + 1}/{reps}: {runs[variant][-1]['step_s']:.2f} s")
    out: dict[str, Any] = {"shape": name, **dataclasses.asdict(shape), "samples": len(samples)}
    for variant, steps in runs.items():
        seconds = statistics.median(s["step_s"] for s in steps)
        out[variant] = {
            "tokens": int(steps[0]["tokens"]),
            "tokens_computed": int(steps[0]["computed"]),
            "micro_batches": int(steps[0]["micro_batches"]),
            "step_s": round(seconds, 3),
            "trained_tok_s": round(steps[0]["tokens"] / seconds, 1),
            "peak_rss_gb": round(max(s["peak_gb"] for s in steps), 3),
            "added_peak_gb": round(max(s["added_peak_gb"] for s in steps), 3),
        }
    whole, tree = out["unshared"], out["shared"]
    out["shared_share"] = round(1 - tree["tokens_computed"] / tree["tokens"], 4)
    out["speedup"] = round(tree["trained_tok_s"] / whole["trained_tok_s"], 3)
    out["added_peak_ratio"] = (
        round(tree["added_peak_gb"] / whole["added_peak_gb"], 3) if whole["added_peak_gb"] > 0 else None
    )
    return out


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        f"{'shape':<10} {'variant':<9} {'tokens':>7} {'computed':>8} {'mbs':>4} {'step s':>8} "
        f"{'trained tok/s':>13} {'peak RSS GB':>11} {'added GB':>9}"
    ]
    for r in results:
        for variant in ("unshared", "shared"):
            v = r[variant]
            lines.append(
                f"{r['shape']:<10} {variant:<9} {v['tokens']:>7} {v['tokens_computed']:>8} {v['micro_batches']:>4} "
                f"{v['step_s']:>8.2f} {v['trained_tok_s']:>13.0f} {v['peak_rss_gb']:>11.2f} {v['added_peak_gb']:>9.2f}"
            )
        lines.append(
            f"{r['shape']:<10} shared/unshared: tokens computed {1 - r['shared_share']:.3f}x, trained tokens/s "
            f"{r['speedup']:.2f}x, added peak memory {r['added_peak_ratio']}x"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, 1 timed step, the openhands shape halved")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the SmolLM2-shaped model")
    parser.add_argument("--reps", type=int, default=3, help="timed steps per variant and shape")
    parser.add_argument("--shapes", type=lambda s: s.split(","), default=list(SHAPES))
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--checkpointing", action="store_true", help="gradient_checkpointing: true")
    parser.add_argument("--model", default=None, help="the shape's source (default: python -m deploy.model path)")
    parser.add_argument("--plan-only", action="store_true", help="the packing's figures only (no model, no step)")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.reps = 2, 1
    shapes = {name: SHAPES[name] for name in args.shapes}
    if args.quick and "openhands" in shapes:
        shapes["openhands"] = QUICK_OPENHANDS
    if args.plan_only:
        plans = {
            name: plan_only(samples_for(shape, seed=len(name)), args.micro_batch_tokens)
            for name, shape in shapes.items()
        }
        for name, figures in plans.items():
            print(f"{name:<10} " + ", ".join(f"{k} {v}" for k, v in figures.items()))
        print(json.dumps({"micro_batch_tokens": args.micro_batch_tokens, "plans": plans}), flush=True)
        return
    if args.model is None:
        from deploy.model import model_dir

        args.model = str(model_dir())
    torch.set_num_threads(args.threads)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="flywheel-shared-prefix-") as workdir:
        build_model(Path(args.model), args.layers, Path(workdir))
        config = TrainerConfig(
            model=workdir,
            dtype=args.dtype,
            micro_batch_tokens=args.micro_batch_tokens,
            max_seq_len=MAX_SEQ_LEN,
            gradient_checkpointing=args.checkpointing,
            threads=args.threads,
        )
        policy = LoraPolicy(config)
        results = [run_shape(policy, config, name, shape, args.reps) for name, shape in shapes.items()]
    print(
        f"SmolLM2-135M shape, {args.layers} layers, random weights, "
        f"{str(resolve_dtype(args.dtype, 'cpu')).removeprefix('torch.')}, {args.threads} threads, "
        f"micro_batch_tokens {args.micro_batch_tokens}, checkpointing {'on' if args.checkpointing else 'off'}, "
        f"median of {args.reps} step(s); peak = RSS high-water mark (VmHWM) of a step"
    )
    print(table(results))
    summary = {
        "layers": args.layers,
        "dtype": str(resolve_dtype(args.dtype, "cpu")).removeprefix("torch."),
        "threads": args.threads,
        "reps": args.reps,
        "micro_batch_tokens": args.micro_batch_tokens,
        "checkpointing": args.checkpointing,
        "quick": args.quick,
        "seconds": round(time.monotonic() - started, 1),
        "shapes": results,
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
