"""Prefix-shared packing (issue 45): trained tokens/s and peak memory of a GRPO step, shared vs unshared vs TRL.

One process, one model, the real ``LoraPolicy`` and ``Learner``; for each shape the same synthetic
step (a batch of samples) is taken with ``shared_prefix: false`` (every sample packed whole) and
``true`` (each micro-batch a prefix tree, ``trainer/packing.py``), the two alternating, ``--reps``
timed steps each after one warm-up step each. Then, unless ``--skip-trl``, the third arm: TRL's
``GRPOTrainer`` on the same samples (below). Shapes (token counts before a +-25% spread on each
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
Then the ratios shared/unshared, and shared/TRL and unshared/TRL. The LAST line is one JSON object.

The ``trl`` arm: TRL's ``GRPOTrainer`` on the same model files, dtype and thread count, the same LoRA
(rank, alpha, targets, no dropout), loss type, clipping, learning rate and gradient clipping, one
warm-up step then ``--reps`` timed steps, with no generation: TRL's ``rollout_func`` hook hands it
each sample's ids (as ``bench.trainer_step`` does), rewards fixed (1 where the sample's advantage is
positive, else 0). TRL takes a sample as one prompt and one completion, so each is split at its
first trained token: the prompt is every token before it (the shared prefix and the task), the
completion the rest. Multi-turn samples (``calc``) keep their tool results inside the completion,
excluded from the loss through ``rollout_func``'s ``env_mask`` (TRL's mask for tokens the model did
not generate), so TRL trains the same tokens as Flywheel on every shape; what differs is that TRL
pads: a micro-batch is ``per_device_train_batch_size`` sequences (the most that divide the step's
sample count with that many times the longest sample within ``--micro-batch-tokens``), the prompts
left-padded and the completions right-padded to the longest in it, and TRL shuffles the step's
samples before splitting them into micro-batches. ``computed`` for TRL is the positions its forward
passes took, padding included (counted at the input embedding). TRL's step time runs from its
callback ``on_step_begin`` to ``on_step_end`` (it includes the rollout hook and reward, both trivial
here); its peak is read the same way (RSS reset before the step, ``VmHWM`` after). TRL runs in a
child process per shape (a fresh heap; an out-of-memory kill or a failure is reported in the table,
the bench goes on), after that shape's Flywheel steps, not interleaved with them. Its absolute peak
holds one model and one optimizer, Flywheel's holds the model and both variants' optimizers, so
compare the ``added`` figures. Without vLLM TRL skips its importance-sampling correction, which
Flywheel's learner applies against the samples' behaviour log-probs (per trained token, no extra
forward pass).

``--quick``: 2 layers, 1 timed step each and the ``openhands`` shape halved (3,000 shared, 8 x 250):
about a minute on 2 cores without TRL (the defaults: about 6 minutes). ``--plan-only``: the packing's
figures alone, no model. Run from the repo root: ``python -m bench.shared_prefix [--quick]
[--skip-trl]``; run it alone on the machine (timings).

Measured 2026-11-28, ``--quick --threads 1`` on a 2-core AMD EPYC (AVX-512 with bf16: bfloat16),
the machine loaded by other jobs (load average about 9), one timed step per arm, so the timings are
noisy; trained tokens/s unshared / shared / TRL: math 318 / 673 / 97, calc 456 / 884 / 113,
openhands (halved) 949 / 3,418 / 131; added peak GB 1.06 / 0.73 / 4.88, 1.15 / 0.84 / 4.91,
2.19 / 1.54 / 6.10 (TRL: 32, 8 and 4 sequences per micro-batch). 868 s in all, most of it TRL's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the trainer's CLI does, before torch loads
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer import memory  # noqa: E402
from trainer.config import DType, TrainerConfig  # noqa: E402
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


def trainer_config(
    model: str, dtype: DType, micro_batch_tokens: int, checkpointing: bool, threads: int
) -> TrainerConfig:
    """The one config both Flywheel arms and the TRL arm read (LoRA, loss, optimizer settings)."""
    return TrainerConfig(
        model=model,
        dtype=dtype,
        micro_batch_tokens=micro_batch_tokens,
        max_seq_len=MAX_SEQ_LEN,
        gradient_checkpointing=checkpointing,
        threads=threads,
    )


# -- the TRL arm -------------------------------------------------------------------------------------------


def trl_rollout(sample: Sample) -> tuple[list[int], list[int], list[int], list[float]]:
    """A sample as TRL can take it: (prompt ids, completion ids, env mask, log-probs), split at its
    first trained token; tool results inside the completion get env mask 0 (not trained), so TRL
    trains exactly the sample's loss-masked tokens. Log-probs 0.0 where none was sampled (TRL's own
    tool loop does the same); without vLLM TRL does not read them."""
    start = sample.loss_mask.index(1)
    completion = sample.input_ids[start:]
    mask = sample.loss_mask[start:]
    logprobs = [lp if trained else 0.0 for lp, trained in zip(sample.behaviour_logprobs[start:], mask, strict=True)]
    return sample.input_ids[:start], completion, mask, logprobs


def trl_micro_batch(samples: list[Sample], budget: int) -> int:
    """TRL's ``per_device_train_batch_size``: the most sequences that divide the step's samples (every
    micro-batch full) with that many times the longest sample (TRL pads to it) within ``budget``
    tokens; at least 1."""
    longest = max(len(s) for s in samples)
    fits = [k for k in range(1, len(samples) + 1) if len(samples) % k == 0 and k * longest <= budget]
    return max(fits, default=1)


def trl_step(spec: dict[str, Any]) -> dict[str, Any]:
    """TRL's ``GRPOTrainer`` on the shape's samples, in this (child) process: per-step seconds, peak
    and added RSS, positions computed; ``{"error": ...}`` when it runs out of memory."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset  # type: ignore[import-untyped]
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer  # type: ignore[attr-defined]

    from bench._trl import TRAIN_ONLY, peft_lora

    torch.set_num_threads(spec["threads"])
    config = trainer_config(
        spec["model"], spec["dtype"], spec["micro_batch_tokens"], spec["checkpointing"], spec["threads"]
    )
    shape = Shape(**spec["shape"])
    samples = samples_for(shape, seed=spec["seed"])
    by_group: dict[str, list[Sample]] = {}
    for sample in samples:
        by_group.setdefault(sample.group_id, []).append(sample)
    rewards = {tuple(trl_rollout(s)[1]): 1.0 if s.advantage > 0 else 0.0 for s in samples}
    handed: dict[str, int] = {}

    def rollout(prompts: list[str], _trainer: Any) -> dict[str, list[Any]]:
        """The samples' ids in place of generation: the k-th request for a group gets its k-th member."""
        out: dict[str, list[Any]] = {"prompt_ids": [], "completion_ids": [], "env_mask": [], "logprobs": []}
        for prompt in prompts:
            index = handed.get(prompt, 0)
            handed[prompt] = index + 1
            ids, completion, mask, logprobs = trl_rollout(by_group[prompt][index % shape.members])
            out["prompt_ids"].append(ids)
            out["completion_ids"].append(completion)
            out["env_mask"].append(mask)
            out["logprobs"].append(logprobs)
        return out

    def reward(completion_ids: list[list[int]], **_: Any) -> list[float | None]:
        return [rewards[tuple(ids)] for ids in completion_ids]

    computed = [0]  # positions through the input embedding, padding included

    class StepMeter(TrainerCallback):
        """Times and measures each step after the first (the warm-up), as ``measure`` does Flywheel's."""

        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []
            self.seen = 0
            self.before = 0.0
            self.started = 0.0

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            memory.release()
            self.before = memory.rss_gb()
            memory.reset_peak()
            computed[0] = 0
            self.started = time.perf_counter()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            seconds = time.perf_counter() - self.started
            peak = memory.peak_gb()
            self.seen += 1
            if self.seen == 1:
                return
            peak = NAN if peak is None else peak
            self.steps.append({"step_s": seconds, "peak_gb": peak, "added_peak_gb": peak - self.before})
            log(f"{spec['name']}: trl step {len(self.steps)}/{spec['reps']}: {seconds:.2f} s")
            self.steps[-1]["computed"] = computed[0]

    micro = trl_micro_batch(samples, config.micro_batch_tokens)
    train_only = dict(TRAIN_ONLY, gradient_checkpointing=config.gradient_checkpointing)
    args = GRPOConfig(
        output_dir=str(Path(spec["workdir"]) / "trl"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=len(samples) // micro,
        num_generations=shape.members,
        max_completion_length=max(len(trl_rollout(s)[1]) for s in samples),
        learning_rate=config.learning_rate,
        beta=0.0,
        loss_type=config.loss_type,
        epsilon=config.epsilon,
        epsilon_high=config.epsilon_upper,
        scale_rewards=config.scale_rewards,
        max_grad_norm=config.max_grad_norm,
        temperature=1.0,
        max_steps=1 + spec["reps"],
        seed=0,
        **train_only,
    )
    model = AutoModelForCausalLM.from_pretrained(
        spec["model"], dtype=resolve_dtype(config.dtype, "cpu"), attn_implementation="sdpa"
    )
    model.get_input_embeddings().register_forward_pre_hook(
        lambda _module, inputs: computed.__setitem__(0, computed[0] + inputs[0].numel())
    )
    meter = StepMeter()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_list([{"prompt": g} for g in by_group]),
        processing_class=AutoTokenizer.from_pretrained(spec["model"]),
        peft_config=peft_lora(config, dropout=0.0),
        rollout_func=rollout,
        callbacks=[meter],
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
    except torch.OutOfMemoryError as exc:
        return {"error": "out of memory", "detail": str(exc).split("\n")[0][:200]}
    if len(meter.steps) != spec["reps"]:
        raise RuntimeError(f"TRL timed {len(meter.steps)} steps, expected {spec['reps']}")
    return {
        "tokens": sum(len(s) for s in samples),
        "micro_batches": len(samples) // micro,
        "sequences_per_micro_batch": micro,
        "steps": meter.steps,
    }


def run_trl(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """The TRL arm of one shape in a child process: its figures, or ``{"error": why}``, never an exception."""
    cmd = [sys.executable, "-m", "bench.shared_prefix", "--trl-child", json.dumps(spec)]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false")
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        why = "killed (out of memory?)" if proc.returncode == -9 else f"failed (exit {proc.returncode})"
        log(f"{spec['name']}: trl {why}; its stderr ends:\n{proc.stderr[-3000:]}")
        return {"error": why}
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    if "error" in result:
        return result
    steps: list[dict[str, float]] = result["steps"]
    seconds = statistics.median(s["step_s"] for s in steps)
    return {
        "tokens": result["tokens"],
        "tokens_computed": int(steps[0]["computed"]),
        "micro_batches": result["micro_batches"],
        "sequences_per_micro_batch": result["sequences_per_micro_batch"],
        "step_s": round(seconds, 3),
        "trained_tok_s": round(result["tokens"] / seconds, 1),
        "peak_rss_gb": round(max(s["peak_gb"] for s in steps), 3),
        "added_peak_gb": round(max(s["added_peak_gb"] for s in steps), 3),
    }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


# -- the Flywheel arms and the run -------------------------------------------------------------------------


def run_shape(
    policy: LoraPolicy, config: TrainerConfig, name: str, shape: Shape, reps: int, trl: dict[str, Any] | None
) -> dict[str, Any]:
    """Both Flywheel variants of one shape, then (``trl``: the child's spec, None to skip) TRL's arm."""
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
    out["added_peak_ratio"] = _ratio(tree["added_peak_gb"], whole["added_peak_gb"])
    if trl is None:
        out["trl"] = {"skipped": "--skip-trl"}
        return out
    log(f"{name}: trl (a child process: load, warm-up, {reps} step(s))")
    out["trl"] = run_trl({**trl, "name": name, "shape": dataclasses.asdict(shape), "seed": len(name)}, trl["timeout_s"])
    if "error" not in out["trl"]:
        theirs = out["trl"]
        out["shared_vs_trl"] = _ratio(tree["trained_tok_s"], theirs["trained_tok_s"])
        out["unshared_vs_trl"] = _ratio(whole["trained_tok_s"], theirs["trained_tok_s"])
        out["shared_added_peak_vs_trl"] = _ratio(tree["added_peak_gb"], theirs["added_peak_gb"])
        out["unshared_added_peak_vs_trl"] = _ratio(whole["added_peak_gb"], theirs["added_peak_gb"])
    return out


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        f"{'shape':<10} {'variant':<9} {'tokens':>7} {'computed':>8} {'mbs':>4} {'step s':>8} "
        f"{'trained tok/s':>13} {'peak RSS GB':>11} {'added GB':>9}"
    ]
    for r in results:
        for variant in ("unshared", "shared", "trl"):
            v = r[variant]
            if "skipped" in v or "error" in v:
                why = f"skipped ({v['skipped']})" if "skipped" in v else f"failed: {v['error']}"
                lines.append(f"{r['shape']:<10} {variant:<9} {why}")
                continue
            lines.append(
                f"{r['shape']:<10} {variant:<9} {v['tokens']:>7} {v['tokens_computed']:>8} {v['micro_batches']:>4} "
                f"{v['step_s']:>8.2f} {v['trained_tok_s']:>13.0f} {v['peak_rss_gb']:>11.2f} {v['added_peak_gb']:>9.2f}"
            )
        lines.append(
            f"{r['shape']:<10} shared/unshared: tokens computed {1 - r['shared_share']:.3f}x, trained tokens/s "
            f"{r['speedup']:.2f}x, added peak memory {r['added_peak_ratio']}x"
        )
        if "shared_vs_trl" in r:
            lines.append(
                f"{r['shape']:<10} vs trl: trained tokens/s shared {r['shared_vs_trl']}x, unshared "
                f"{r['unshared_vs_trl']}x; added peak memory shared {r['shared_added_peak_vs_trl']}x, unshared "
                f"{r['unshared_added_peak_vs_trl']}x"
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
    parser.add_argument("--skip-trl", action="store_true", help="no TRL arm")
    parser.add_argument("--trl-timeout", type=float, default=1800.0, help="seconds for one shape's TRL child")
    parser.add_argument("--trl-child", default=None, help=argparse.SUPPRESS)  # internal: one TRL arm
    args = parser.parse_args()
    if args.trl_child is not None:
        print("RESULT " + json.dumps(trl_step(json.loads(args.trl_child))), flush=True)
        return
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
        config = trainer_config(workdir, args.dtype, args.micro_batch_tokens, args.checkpointing, args.threads)
        trl = None
        if not args.skip_trl:
            trl = {
                "model": workdir,
                "workdir": workdir,
                "dtype": args.dtype,
                "micro_batch_tokens": args.micro_batch_tokens,
                "checkpointing": args.checkpointing,
                "threads": args.threads,
                "reps": args.reps,
                "timeout_s": args.trl_timeout,
            }
        policy = LoraPolicy(config)
        results = [run_shape(policy, config, name, shape, args.reps, trl) for name, shape in shapes.items()]
    print(
        f"SmolLM2-135M shape, {args.layers} layers, random weights, "
        f"{str(resolve_dtype(args.dtype, 'cpu')).removeprefix('torch.')}, {args.threads} threads, "
        f"micro_batch_tokens {args.micro_batch_tokens}, checkpointing {'on' if args.checkpointing else 'off'}, "
        f"median of {args.reps} step(s); peak = RSS high-water mark (VmHWM) of a step; "
        f"trl: {'skipped' if args.skip_trl else 'GRPOTrainer in a child process per shape, padded micro-batches'}"
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
        "skip_trl": args.skip_trl,
        "seconds": round(time.monotonic() - started, 1),
        "shapes": results,
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
