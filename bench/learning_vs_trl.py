"""Held-out math accuracy after the same training wall-clock: Flywheel's loop vs. TRL's GRPOTrainer.

One question, both answers measured in one run on this machine: with the same model
(SmolLM2-135M-Instruct as ``python -m deploy.model path`` converts it), the same task (the math
workflow's train split, single turn), the same reward and the same minutes of training, which
policy scores higher on the held-out test split?

Everything both sides share comes from the files ``make run`` reads, not from copies here:
``configs/run-local.yaml`` (the workflow's ``--group-size`` and ``-o`` options: temperature,
max_tokens; the trainer config and its overrides; the evaluation's arguments) and the trainer
config it names (LoRA r/alpha/dropout/targets, learning rate, AdamW betas and weight decay, grad
clipping, ``loss_type``, ``epsilon``/``epsilon_high``, ``beta``, ``scale_rewards``, groups per step,
dtype). Prompts, tasks and reward are the math workflow's own (``MathWorkflow.messages``,
``tasks("train")``, ``check(...).reward(format_weight)`` with the workflow's format weight).

1. **trl** trains first, alone on the machine (nothing else runs, so it has both cores):
   ``GRPOTrainer`` with TRL's own generation (``use_vllm=False``: transformers ``generate`` on the
   CPU), ``num_generations`` = the group size, ``groups_per_step`` groups per optimizer step (one
   generation batch per step, so it is on-policy), micro-batches of 16 sequences, the sampling the
   proxy gives Flywheel's episodes (the workflow's temperature; top_p/top_k/min_p from the model's
   ``generation_config.json`` where it sets them, else neutral, as vLLM does), the chat template vLLM
   serves, constant learning rate (the trainer has no schedule), gradient checkpointing off (as in
   ``bench/trainer_step.py``; the trainer does not use it). A callback stops it at the first step
   end after ``--minutes`` of training (TRL's clock starts at ``on_train_begin``, after the model is
   loaded; Flywheel's includes its trainer's start-up, so the budget favours TRL slightly). Its
   LoRA adapter is saved in PEFT's format.
2. **flywheel**: the launcher's own pieces (``deploy.stack.Stack``, ``deploy.loop``'s ``_evaluate``, ``_train``)
   with a run config derived from ``configs/run-local.yaml`` (its data_dir in a temp directory,
   ``resume: false``, free ports for vLLM and the proxy, the seed): vLLM and the proxy start, the
   base model is evaluated, then the trainer and the math workflow run side by side for
   ``--minutes`` (the trainer, signalled at the deadline, finishes its step and publishes, as TRL's
   last step also finishes), and the last published adapter is evaluated. The pieces rather than
   ``run`` because the deadline must be exact (``run`` derives it from the budget minus measured
   evaluation times) and because the TRL adapter is evaluated on the same stack.
3. **evaluation, the same for both**: one evaluator, one engine. After Flywheel's evaluation, TRL's
   adapter is published through the proxy (``POST /policy/publish``, as the trainer publishes) and
   ``workflows eval`` runs again, the same command: greedy, the 210 held-out problems, the same
   ``max_tokens``, vLLM serving a LoRA adapter either way, so neither side gains from a different
   decoder, dtype or answer parser. The served version is checked to be TRL's adapter. The base
   model's accuracy (``before``, the same for both) is measured in this run, not remembered.

Threads: the Flywheel side runs as ``make run`` does (vLLM, and the trainer on 1 thread beside it).
TRL gets ``--trl-threads`` (default 2) because it trains alone and two threads were faster here:
82.4 s per step against 105.5 s with one (two steps each, same seed, same rewards, idle machine).
One thread wins only next to another busy process, where two OpenMP threads spin-wait for a shared
core (``bench/trainer_step.py``); nothing else runs while TRL trains.

Prints progress to stderr, then a table and, as the LAST line, one JSON object: for each side
accuracy before/after, format compliance, steps, training minutes, completions generated.
Time: twice ``--minutes`` (plus each side's last step, which ends past the deadline) and about 5
minutes besides, mostly evaluation (measured on 2 AVX2 cores: vLLM start 1 min, the base model 1.6
min, each adapter 1-2 min with ``deploy/vllm_cpu_lora.py``). Hence the default ``--minutes 8``:
about 21 minutes on 2 cores. The work directory (logs, adapters, the store, the evaluation reports) is
removed at the end unless ``--keep`` or the run failed. ``--flywheel-override KEY=VALUE`` changes
one trainer setting on Flywheel's side only (TRL keeps the shared one), to measure a difference
apart: ``--flywheel-override mode=sync`` trains each group on the policy that sampled it, as TRL does;
``--trl-override KEY=VALUE`` does the same on TRL's side (e.g. each side at the learning rate that
suits its step count). ``--skip-trl`` runs Flywheel's side alone (about 12 minutes), to tune it
before a full run; its JSON then has ``"trl": null``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the trainer's CLI does, before torch loads
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench._procs import load_average  # noqa: E402
from bench._runs import isolated  # noqa: E402
from bench._trl import TRAIN_ONLY, peft_lora  # noqa: E402
from deploy.guard import Guard  # noqa: E402
from deploy.loop import _evaluate, _steps, _train  # noqa: E402
from deploy.run_config import RunConfig, load_run_config  # noqa: E402
from deploy.stack import Stack  # noqa: E402
from deploy.vllm import DEFAULT_TEMPLATE  # noqa: E402
from trainer.config import TrainerConfig, load_config  # noqa: E402
from trainer.lora import resolve_dtype  # noqa: E402
from workflows.math.reward import check  # noqa: E402
from workflows.math.run import MathOptions, MathWorkflow  # noqa: E402
from workflows.options import parse_options  # noqa: E402
from workflows.runner import task_order  # noqa: E402

RUN_CONFIG = ROOT / "configs" / "run-local.yaml"
TRL_MICRO_BATCH = 16
"""Sequences per TRL forward/backward: ~1,600 tokens, near the trainer's 2,048-token packed passes."""


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- what both sides share -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Shared:
    """The task, sampling and learner settings both sides use, read from the run config."""

    run_config: RunConfig
    options: MathOptions
    group_size: int
    trainer: TrainerConfig
    model: str


def workflow_settings(args: list[str]) -> tuple[MathOptions, int]:
    """The math options (``-o k=v``) and ``--group-size`` from the run config's workflow arguments."""
    pairs: list[str] = []
    group_size = 4  # the workflows CLI's default
    items = [str(a) for a in args]
    for i, item in enumerate(items):
        name, eq, value = item.partition("=")
        if name in ("-o", "--option"):
            pairs.append(value if eq else items[i + 1])
        elif name == "--group-size":
            group_size = int(value if eq else items[i + 1])
    return parse_options(MathOptions, pairs), group_size


def shared_settings(seed: int, model: str, extra: dict[str, str] | None = None) -> Shared:
    """The run config's settings; ``extra`` trainer fields on top (one side's overrides)."""
    config = load_run_config(RUN_CONFIG)
    options, group_size = workflow_settings(list(config.workflow.args))
    overrides = [f"{k}={v}" for k, v in {**config.trainer.overrides, **(extra or {})}.items()]
    trainer = load_config(config.trainer_config_path, [f"model={model}", f"seed={seed}", *overrides])
    return Shared(config, options, group_size, trainer, model)


def sampling_defaults(model: str) -> dict[str, Any]:
    """top_p/top_k/min_p as the proxy fills them for Flywheel's episodes: the model's
    ``generation_config.json`` where it sets them, else the engine's neutral values."""
    path = Path(model) / "generation_config.json"
    generation = json.loads(path.read_text()) if path.is_file() else {}
    return {
        "top_p": float(generation.get("top_p", 1.0)),
        "top_k": int(generation.get("top_k", 0)),
        "min_p": generation.get("min_p"),
    }


# -- TRL ---------------------------------------------------------------------------------------------


@dataclass
class TrlResult:
    adapter: Path
    steps: int = 0
    train_seconds: float = 0.0
    completions: int = 0
    step_rewards: list[float] = field(default_factory=list)
    batches: list[dict[str, float]] = field(default_factory=list)
    """Per generation batch: groups, groups with equal rewards, mean completion tokens, truncated share."""


def make_math_reward(
    format_weight: float,
    rewards: list[float],
    *,
    group_size: int = 1,
    max_tokens: int = 0,
    batches: list[Any] | None = None,
) -> Callable[..., list[float | None]]:
    """The math workflow's episode reward for TRL's completions; appends each batch's mean to
    ``rewards`` and, with ``batches``, what the batch held (TRL repeats each prompt ``group_size``
    times in a row, so consecutive completions form a group)."""

    def math_reward(
        completions: list[Any], answer: list[str], completion_ids: list[list[int]] | None = None, **_: Any
    ) -> list[float | None]:
        scores = []
        for completion, gold in zip(completions, answer, strict=True):
            text = completion[-1]["content"] if isinstance(completion, list) else str(completion)
            scores.append(check(text or "", gold).reward(format_weight))
        rewards.append(sum(scores) / len(scores))
        if batches is not None:
            groups = [scores[i : i + group_size] for i in range(0, len(scores), group_size)]
            lengths = [len(ids) for ids in completion_ids or []]
            batches.append(
                {
                    "groups": len(groups),
                    "equal_groups": sum(len(set(g)) == 1 for g in groups),
                    "reward": sum(scores) / len(scores),
                    "completion_tokens": sum(lengths) / len(lengths) if lengths else float("nan"),
                    "truncated": sum(n >= max_tokens for n in lengths) / len(lengths) if lengths else float("nan"),
                }
            )
        return list(scores)

    return math_reward


def trl_dataset(options: MathOptions, seed: int) -> Any:
    """The train split as TRL conversational prompts (the workflow's system prompt + problem), in
    the order Flywheel's runner draws them with the same seed (``workflows.runner.task_order``):
    with ``shuffle_dataset=False`` both sides meet the same problems in the same order, so a
    difference after a few steps is not which problems each happened to draw."""
    from datasets import Dataset  # type: ignore[import-untyped]

    workflow = MathWorkflow(options)
    ordered = task_order(list(workflow.tasks("train")), seed, workflow.stratum)
    return Dataset.from_list([{"prompt": workflow.messages(task), "answer": task.answer} for task in ordered])


def trl_tokenizer(model: str) -> Any:
    """The model's tokenizer with the chat template vLLM renders Flywheel's prompts with."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = DEFAULT_TEMPLATE.read_text()
    return tokenizer


def trl_lora(config: TrainerConfig) -> Any:
    """The trainer config's LoRA settings as a PEFT ``LoraConfig`` for GRPOTrainer."""
    return peft_lora(config)


def trl_args(shared: Shared, output_dir: Path, *, seed: int, max_steps: int = 1_000_000) -> Any:
    """TRL's ``GRPOConfig`` with the run config's sampling and learner settings (see the module docstring);
    ``bench.trl_parity`` takes one step with the same one."""
    from trl import GRPOConfig  # type: ignore[attr-defined]

    config, options = shared.trainer, shared.options
    per_step = config.groups_per_step * shared.group_size
    micro = TRL_MICRO_BATCH if per_step % TRL_MICRO_BATCH == 0 else shared.group_size
    return GRPOConfig(
        output_dir=str(output_dir),
        use_vllm=False,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=per_step // micro,
        num_generations=shared.group_size,
        max_completion_length=options.max_tokens,
        temperature=options.temperature,
        **sampling_defaults(shared.model),
        repetition_penalty=1.0,
        learning_rate=config.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=config.adam_beta1,
        adam_beta2=config.adam_beta2,
        weight_decay=config.weight_decay,
        max_grad_norm=config.max_grad_norm,
        beta=config.beta,
        loss_type=config.loss_type,
        epsilon=config.epsilon,
        epsilon_high=config.epsilon_upper,
        scale_rewards=config.scale_rewards,
        importance_sampling_level=config.importance_sampling_level,
        num_iterations=config.num_iterations,
        max_steps=max_steps,
        seed=seed,
        data_seed=seed,
        **TRAIN_ONLY,  # unshuffled: the dataset comes in Flywheel's runner order (trl_dataset)
    )


def train_trl(shared: Shared, workdir: Path, *, minutes: float, seed: int, threads: int, stop: list[bool]) -> TrlResult:
    """TRL's GRPOTrainer with its own CPU generation for ``minutes`` of training; saves the adapter."""
    from transformers import AutoModelForCausalLM, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOTrainer  # type: ignore[attr-defined]

    torch.set_num_threads(threads)
    config, options = shared.trainer, shared.options
    per_step = config.groups_per_step * shared.group_size
    result = TrlResult(adapter=workdir / "trl" / "adapter")
    budget_s = minutes * 60

    class Budget(TrainerCallback):
        """Stops training at the first step end past the budget (or on Ctrl-C); logs each step."""

        started = 0.0

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.started = time.monotonic()
            log(f"trl: training on {torch.get_num_threads()} torch thread(s)")

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            elapsed = time.monotonic() - self.started
            result.steps, result.train_seconds = int(state.global_step), elapsed
            reward = result.step_rewards[-1] if result.step_rewards else float("nan")
            log(f"trl step {result.steps:>3}  reward {reward:.3f}  {elapsed / 60:5.1f} min  load {load_average()}")
            if elapsed >= budget_s or stop[0]:
                control.should_training_stop = True

    tokenizer = trl_tokenizer(shared.model)
    args = trl_args(shared, workdir / "trl", seed=seed)
    model = AutoModelForCausalLM.from_pretrained(
        shared.model, dtype=resolve_dtype(config.dtype, "cpu"), attn_implementation="sdpa"
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=make_math_reward(
            options.format_weight,
            result.step_rewards,
            group_size=shared.group_size,
            max_tokens=options.max_tokens,
            batches=result.batches,
        ),
        args=args,
        train_dataset=trl_dataset(options, seed),
        processing_class=tokenizer,
        peft_config=trl_lora(config),
        callbacks=[Budget()],
    )
    trainer.remove_callback(PrinterCallback)  # stdout carries only the table and the JSON line
    log(
        f"trl: {per_step} completions per step ({per_step // shared.group_size} groups of {shared.group_size}), "
        f"micro-batches of {args.per_device_train_batch_size}, {threads} thread(s), "
        f"{args.max_completion_length} tokens at temperature {args.temperature}; training {minutes:g} min"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    result.completions = per_step * result.steps
    peft_model: Any = trainer.model
    peft_model.save_pretrained(str(result.adapter))  # adapter_config.json + adapter_model.safetensors, as vLLM loads
    log(f"trl: {result.steps} steps in {result.train_seconds / 60:.1f} min; adapter {result.adapter}")
    del trainer, model
    return result


# -- Flywheel and the shared evaluation ------------------------------------------------------------


def derived_run_config(
    shared: Shared, workdir: Path, *, minutes: float, seed: int, overrides: dict[str, str]
) -> RunConfig:
    """``run-local.yaml`` made private to this run (``bench/_runs.py``), with ``overrides`` on
    Flywheel's trainer only (an ablation, e.g. ``mode=sync``)."""
    return isolated(
        shared.run_config, workdir, minutes=minutes, seed=seed, model=shared.model, trainer_overrides=overrides
    )


def count_episodes(stack: Stack) -> dict[str, int]:
    """Episodes the workflow finished in the store, by status (each rewarded one is a scored completion)."""
    counts = {}
    for status in ("rewarded", "abandoned"):
        total, offset = 0, 0
        while True:
            page = httpx.get(
                f"{stack.proxy_url}/episodes",
                params={"status": status, "limit": 1000, "offset": offset},
                headers={"authorization": f"Bearer {stack.key}"},
                timeout=60,
            )
            page.raise_for_status()
            rows = len(page.json()["data"])
            total, offset = total + rows, offset + rows
            if rows < 1000:
                break
        counts[status] = total
    return counts


def publish(stack: Stack, adapter: Path) -> int:
    """Serve ``adapter`` as the next policy version, as the trainer publishes its own."""
    response = httpx.post(
        f"{stack.proxy_url}/policy/publish",
        json={"adapter_path": str(adapter.resolve()), "metadata": {"source": "trl"}},
        headers={"authorization": f"Bearer {stack.key}"},
        timeout=600,
    )
    if response.status_code != 201:
        raise RuntimeError(f"publishing the TRL adapter: {response.status_code} {response.text}")
    return int(response.json()["version"])


def flywheel_and_evaluations(
    config: RunConfig, run_dir: Path, trl: TrlResult | None, *, minutes: float, stop: list[bool]
) -> dict[str, Any]:
    """Base evaluation, Flywheel's training and evaluation, then TRL's adapter (if any) on the same evaluator."""
    stack = Stack(config, data_dir=run_dir)
    try:
        stack.start()
        before = _evaluate(stack, config, run_dir, "before")
        started = time.monotonic()
        _train(stack, config, run_dir, time.time() + minutes * 60, stop, Guard(config.guard))
        train_seconds = time.monotonic() - started
        steps = _steps(stack, -1)
        after = _evaluate(stack, config, run_dir, "after")
        episodes = count_episodes(stack)
        trl_after = None
        if trl is not None:
            version = publish(stack, trl.adapter)
            log(f"published TRL's adapter as policy v{version}")
            trl_after = _evaluate(stack, config, run_dir, "after_trl")
            if trl_after.get("policy_versions") != [str(version)]:
                raise RuntimeError(f"TRL's evaluation was served by {trl_after.get('policy_versions')}, not v{version}")
        return {
            "before": before,
            "after": after,
            "trl_after": trl_after,
            "steps": steps,
            "train_seconds": train_seconds,
            "episodes": episodes,
            "restarts": stack.restarts,
        }
    finally:
        stack.stop()


# -- report -------------------------------------------------------------------------------------------


def summary(
    before: dict[str, Any],
    after: dict[str, Any],
    *,
    steps: int,
    train_seconds: float,
    completions: int,
    rewards: list[float],
    **extra: Any,
) -> dict[str, Any]:
    def mean(xs: list[float]) -> float | None:
        return round(sum(xs) / len(xs), 4) if xs else None

    return {
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "format_before": before["format_rate"],
        "format_after": after["format_rate"],
        "gain_points": round(100 * (after["accuracy"] - before["accuracy"]), 1),
        "steps": steps,
        "train_minutes": round(train_seconds / 60, 2),
        "completions_generated": completions,
        "train_reward_first3": mean(rewards[:3]),
        "train_reward_last3": mean(rewards[-3:]),
        "rewards": [round(r, 4) for r in rewards],
        "by_kind_after": {k: round(v["accuracy"], 3) for k, v in after.get("by_kind", {}).items()},
        "eval_policy_versions": after.get("policy_versions"),
        **extra,
    }


def flywheel_data(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """What Flywheel's steps trained on, from the trainer's step metrics (``GET /trainer/steps``)."""
    metrics = [s["metrics"] for s in steps]
    trained = sum(int(m.get("data/groups_trained") or 0) for m in metrics)
    equal = sum(int(m.get("data/groups_skipped_equal") or 0) for m in metrics)
    samples = sum(int(m.get("data/samples") or 0) for m in metrics)
    loss_tokens = sum(int(m.get("data/loss_tokens") or 0) for m in metrics)
    return {
        "groups": trained + equal,
        "equal_groups": equal,
        "equal_share": round(equal / (trained + equal), 3) if trained + equal else None,
        "completion_tokens_trained": round(loss_tokens / samples, 1) if samples else None,
        "stale_groups": int(sum(m.get("proxy/stale_groups") or 0 for m in metrics)),
        "per_step": [
            {
                "trained": int(m.get("data/groups_trained") or 0),
                "equal": int(m.get("data/groups_skipped_equal") or 0),
                "reward": m.get("reward/mean"),
            }
            for m in metrics
        ],
    }


def trl_data(batches: list[dict[str, float]]) -> dict[str, Any]:
    """What TRL's steps trained on (each generation batch is one step here: ``num_iterations`` 1)."""
    groups = sum(int(b["groups"]) for b in batches)
    equal = sum(int(b["equal_groups"]) for b in batches)
    return {
        "groups": groups,
        "equal_groups": equal,
        "equal_share": round(equal / groups, 3) if groups else None,
        "completion_tokens": round(sum(b["completion_tokens"] for b in batches) / len(batches), 1) if batches else None,
        "truncated": round(sum(b["truncated"] for b in batches) / len(batches), 3) if batches else None,
        "per_step": batches,
    }


def table(result: dict[str, Any]) -> str:
    rows = [
        f"held-out math accuracy (greedy, n={result['eval_n']}) after {result['minutes']:g} min of training, "
        f"seed {result['seed']}",
        f"{'side':<10} {'before -> after':<17} {'gain':>7} {'format':<13} {'steps':>5} {'train min':>9} "
        f"{'completions':>11}",
    ]
    sides = [side for side in ("flywheel", "trl") if result[side] is not None]
    for side in sides:
        r = result[side]
        rows.append(
            f"{side:<10} {r['accuracy_before']:.3f} -> {r['accuracy_after']:.3f}   "
            f"{r['gain_points']:+6.1f}  {r['format_before']:.2f} -> {r['format_after']:.2f}  "
            f"{r['steps']:>5} {r['train_minutes']:>9.1f} {r['completions_generated']:>11}"
        )
    for side in sides:
        d = result[side].get("data") or {}
        rows.append(
            f"{side:<10} data: {d.get('groups')} groups trained on or skipped, {d.get('equal_groups')} with equal "
            f"rewards ({d.get('equal_share')}); rewards per step {[round(x, 2) for x in result[side]['rewards']]}"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=8.0, help="training wall-clock per side")
    parser.add_argument("--seed", type=int, default=None, help="default: configs/run-local.yaml's seed")
    parser.add_argument("--trl-threads", type=int, default=2, help="torch threads for TRL (see the docstring)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, adapters, store)")
    parser.add_argument(
        "--flywheel-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a trainer setting for Flywheel's side only, to take one difference apart (e.g. mode=sync)",
    )
    parser.add_argument(
        "--trl-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a trainer setting for TRL's side only (e.g. learning_rate=5e-4)",
    )
    parser.add_argument("--skip-trl", action="store_true", help="Flywheel's side alone, to tune it (no TRL run)")
    opts = parser.parse_args()
    flywheel_overrides = dict(item.split("=", 1) for item in opts.flywheel_override)
    trl_overrides = dict(item.split("=", 1) for item in opts.trl_override)
    from deploy.model import fetch

    model = os.environ.get("FLYWHEEL_MODEL_DIR") or str(fetch())
    seed = opts.seed if opts.seed is not None else load_run_config(RUN_CONFIG).seed
    shared = shared_settings(seed, model)
    trl_shared = shared_settings(seed, model, trl_overrides)
    # Flywheel's trainer config as its side will load it: a bad override fails now, not after TRL's minutes.
    flywheel_trainer = shared_settings(seed, model, flywheel_overrides).trainer
    stop = [False]

    def interrupt(*_: Any) -> None:
        if stop[0]:
            raise KeyboardInterrupt
        stop[0] = True
        log("stopping training early; the evaluations still run (again to stop at once)")

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    workdir = Path(tempfile.mkdtemp(prefix="flywheel-learning-vs-trl-"))
    log(f"work directory {workdir}; {opts.minutes:g} min of training per side, seed {seed}")
    started = time.monotonic()
    try:
        trl = (
            None
            if opts.skip_trl
            else train_trl(trl_shared, workdir, minutes=opts.minutes, seed=seed, threads=opts.trl_threads, stop=stop)
        )
        stop[0] = False  # a Ctrl-C during TRL's training cut that short, not Flywheel's
        config = derived_run_config(shared, workdir, minutes=opts.minutes, seed=seed, overrides=flywheel_overrides)
        fly = flywheel_and_evaluations(config, workdir / "flywheel", trl, minutes=opts.minutes, stop=stop)
    except BaseException:
        log(f"failed; logs kept in {workdir}")
        raise
    steps = fly["steps"]
    result = {
        "model": config.model_name,
        "seed": seed,
        "minutes": opts.minutes,
        "eval_n": fly["after"]["n"],
        "flywheel": summary(
            fly["before"],
            fly["after"],
            steps=len(steps),
            train_seconds=fly["train_seconds"],
            completions=fly["episodes"]["rewarded"],
            rewards=[float(s["metrics"].get("reward/mean", float("nan"))) for s in steps],
            completions_trained=int(sum(s["metrics"].get("data/members") or 0 for s in steps)),
            episodes_abandoned=fly["episodes"]["abandoned"],
            engine_restarts=len(fly["restarts"]),
            data=flywheel_data(steps),
        ),
        "trl": None
        if trl is None
        else summary(
            fly["before"],
            fly["trl_after"],
            steps=trl.steps,
            train_seconds=trl.train_seconds,
            completions=trl.completions,
            rewards=trl.step_rewards,
            threads=opts.trl_threads,
            data=trl_data(trl.batches),
        ),
        "flywheel_overrides": flywheel_overrides,
        "trl_overrides": trl_overrides,
        "learning_rate": {"flywheel": flywheel_trainer.learning_rate, "trl": trl_shared.trainer.learning_rate},
        "group_size": shared.group_size,
        "completions_per_step": shared.trainer.groups_per_step * shared.group_size,
        "max_tokens": shared.options.max_tokens,
        "temperature": shared.options.temperature,
        "format_weight": shared.options.format_weight,
        "total_minutes": round((time.monotonic() - started) / 60, 1),
        "load_average": load_average(),
    }
    if trl is not None:
        gap = result["flywheel"]["accuracy_after"] - result["trl"]["accuracy_after"]
        result["higher_after"] = "flywheel" if gap > 0 else "trl" if gap < 0 else "tie"
    if opts.keep:
        log(f"kept {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    print(table(result))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
