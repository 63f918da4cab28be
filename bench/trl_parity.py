"""One batch, one optimizer step, two trainers: where Flywheel's GRPO step and TRL's GRPOTrainer step differ.

``bench.learning_vs_trl`` measured TRL gaining about twice as many held-out points per optimizer
step as Flywheel with the same settings. This takes the learning apart from everything else: one
fixed batch goes through both trainers' real code from the same LoRA weights, and every quantity
of the step is compared.

The batch: ``--groups`` math problems of the train split (the first ones, in a seeded order, whose
group has unequal rewards: a group of equal rewards carries no gradient in either trainer),
rendered with the chat template vLLM serves, ``--group-size`` completions each sampled once from
the base model with transformers at the run config's temperature and ``max_tokens`` (no top-k or
top-p, as the proxy samples for SmolLM2), each cut after its first EOS as vLLM returns it, scored
with the math workflow's reward. The engine log-probs a real run records are the base model's
processed log-probs at that temperature; here they are computed with the base model, so the
importance weights are 1 up to rounding, as measured on real runs (``engine_logp_diff`` ~5e-6).

Flywheel's path: the completions become recorded groups (``contract.client`` models, as the trainer
claims them: prompt ids, completion ids and log-probs, ``notes.sampling``), then
``trainer.data.build_batch`` (advantages), ``trainer.packing`` and ``trainer.learner.Learner.step``
with the trainer config ``configs/run-local.yaml`` names. TRL's path: ``GRPOTrainer`` built with
``bench.learning_vs_trl.trl_args`` (the same ``GRPOConfig`` as the comparison), its generation
replaced by a lookup of the same completions (by TRL's own prompt ids, so a prompt it rendered
differently would fail), then ``_generate_and_score_completions`` (masks, rewards, advantages) and
one ``train()`` step (its micro-batches, loss scaling, clipping, AdamW). Both start from the same
adapter: Flywheel's initial LoRA weights are copied into TRL's model.

Printed: prompt and loss-token agreement (EOS, first completion token, padding), advantages,
per-token log-probs (max abs diff), the loss, each LoRA parameter's gradient before clipping
(cosine, norm ratio), the pre-clip grad norms and the one-step update (cosine, norm ratio). Last
line: one JSON object. Deterministic (fixed seeds); about 2 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench.learning_vs_trl import Shared, shared_settings, trl_args, trl_lora, trl_tokenizer  # noqa: E402
from contract.client import Call, Episode, Group  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.data import build_batch  # noqa: E402
from trainer.learner import Learner  # noqa: E402
from trainer.loop import data_rules  # noqa: E402
from trainer.lora import LoraPolicy, resolve_dtype  # noqa: E402
from trainer.packing import pack  # noqa: E402
from workflows.math.reward import check  # noqa: E402
from workflows.math.run import MathWorkflow  # noqa: E402

Tensor = torch.Tensor
MAX_TRIES = 60
"""Problems tried at most to find ``--groups`` groups with unequal rewards."""


def log(message: str) -> None:
    print(f"[parity {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- the fixed batch -----------------------------------------------------------------------------------


@dataclass
class Rollout:
    ids: list[int]
    """Completion ids as vLLM returns them: up to and including the first EOS, or max_tokens long."""
    logps: list[float]
    """The base model's log-prob of each id at the sampling temperature (what vLLM records)."""
    reward: float


@dataclass
class FixedGroup:
    task_id: str
    messages: list[dict[str, str]]
    answer: str
    prompt_ids: list[int]
    rollouts: list[Rollout]


def _processed_logps(model: Any, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature  # (C, V)
    picked: list[float] = logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None]).squeeze(1).tolist()
    return picked


def sample_batch(shared: Shared, tokenizer: Any, *, groups: int, seed: int) -> list[FixedGroup]:
    """``groups`` groups with unequal rewards, sampled once from the base model (seeded)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    options = shared.options
    workflow = MathWorkflow(options)
    tasks = list(workflow.tasks("train"))
    random.Random(seed).shuffle(tasks)
    model: Any = AutoModelForCausalLM.from_pretrained(
        shared.model, dtype=resolve_dtype(shared.trainer.dtype, "cpu"), attn_implementation="sdpa"
    )
    model.eval()
    eos = int(tokenizer.eos_token_id)
    generation = GenerationConfig(  # type: ignore[no-untyped-call]
        do_sample=True,
        temperature=options.temperature,
        top_p=1.0,
        top_k=0,
        max_new_tokens=options.max_tokens,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    out: list[FixedGroup] = []
    for n, task in enumerate(tasks[:MAX_TRIES]):
        messages = workflow.messages(task)
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompt = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
        torch.manual_seed(seed * 1000 + n)
        with torch.no_grad():
            sequences = model.generate(
                input_ids=torch.tensor([prompt] * shared.group_size),
                attention_mask=torch.ones(shared.group_size, len(prompt), dtype=torch.long),
                generation_config=generation,
            )
        rollouts = []
        for row in sequences[:, len(prompt) :].tolist():
            ids = row[: row.index(eos) + 1] if eos in row else row
            text = tokenizer.decode(ids, skip_special_tokens=True)
            reward = check(text, task.answer).reward(options.format_weight)
            rollouts.append(Rollout(ids, _processed_logps(model, prompt, ids, options.temperature), reward))
        if len({r.reward for r in rollouts}) > 1:
            out.append(FixedGroup(task.id, messages, task.answer, prompt, rollouts))
            log(f"group {len(out)}: {task.id} rewards {[r.reward for r in rollouts]}")
            if len(out) == groups:
                return out
    raise RuntimeError(f"only {len(out)} of {groups} groups with unequal rewards in {MAX_TRIES} problems")


def load_batch(path: Path) -> list[FixedGroup]:
    """A batch ``--batch`` saved (sampling it is most of the run's time on a busy machine)."""
    return [
        FixedGroup(**{**g, "rollouts": [Rollout(**r) for r in g["rollouts"]]}) for g in json.loads(path.read_text())
    ]


def recorded_groups(batch: list[FixedGroup], temperature: float) -> list[Group]:
    """The batch as the trainer claims it from the store: one exact-ids chat call per episode."""
    sampling = {"temperature": temperature, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "mode": "sampled"}
    groups = []
    for g, fixed in enumerate(batch):
        episodes = [
            Episode(
                id=f"g{g}-e{e}",
                group_id=f"g{g}",
                status="rewarded",
                reward=rollout.reward,
                calls=[
                    Call(
                        ordinal=0,
                        request={"messages": fixed.messages, "temperature": temperature},
                        prompt_token_ids=fixed.prompt_ids,
                        choices=[{"index": 0, "token_ids": rollout.ids, "logprobs": rollout.logps}],
                        exact_ids=True,
                        policy_version=0,
                        notes={"sampling": sampling},
                    )
                ],
            )
            for e, rollout in enumerate(fixed.rollouts)
        ]
        groups.append(
            Group(
                id=f"g{g}", task_id=fixed.task_id, status="complete", metadata={"abandoned": "skip"}, episodes=episodes
            )
        )
    return groups


# -- the two steps -------------------------------------------------------------------------------------


@dataclass
class Side:
    loss_tokens: dict[tuple[int, int], list[int]]
    """(group, rollout) -> completion positions in the loss."""
    advantages: dict[tuple[int, int], float]
    logps: dict[tuple[int, int], list[float]]
    """Log-probs of the completion positions in the loss, before the step."""
    loss: float
    grad_norm: float
    """Before clipping."""
    grads: dict[str, Tensor]
    """Each LoRA parameter's gradient before clipping."""
    before: dict[str, Tensor]
    after: dict[str, Tensor]


def _lora_grads(model: torch.nn.Module) -> dict[str, Tensor]:
    return {
        n.replace(".default", ""): p.grad.detach().clone()
        for n, p in model.named_parameters()
        if p.requires_grad and p.grad is not None
    }


def _lora_weights(model: torch.nn.Module) -> dict[str, Tensor]:
    return {n.replace(".default", ""): p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def flywheel_step(shared: Shared, batch: list[FixedGroup], overrides: list[str]) -> tuple[Side, dict[str, Tensor]]:
    """One Learner step on the batch through trainer.data and trainer.packing; the initial adapter too."""
    config = shared.trainer
    if overrides:
        loaded = load_config(shared.run_config.trainer_config_path, [*config_overrides(shared), *overrides])
        config = dataclasses.replace(
            loaded, threads=config.threads, groups_per_step=config.groups_per_step, dtype=config.dtype
        )
    built = build_batch(recorded_groups(batch, shared.options.temperature), rules=data_rules(config))
    if len(built.trained) != len(batch):
        raise RuntimeError(f"trainer.data skipped groups: {built.skipped}")
    policy = LoraPolicy(config)
    learner = Learner(policy, config)
    initial = {k: v.detach().clone() for k, v in policy.adapter_state().items()}  # the live tensors step below
    index = {f"g{g}-e{e}": (g, e) for g in range(len(batch)) for e in range(len(batch[g].rollouts))}
    side = Side({}, {}, {}, 0.0, 0.0, {}, _lora_weights(policy.model), {})
    with torch.no_grad():
        for mb in pack(built.samples, config.micro_batch_tokens):
            logps = mb.table(policy.logprobs(mb).logps)  # (B, T)
            for b, sample in enumerate(mb.samples):
                key = index[sample.episode_id]
                start = next(j for j, m in enumerate(sample.loss_mask) if m)  # the first completion token
                prompt_len = len(batch[key[0]].prompt_ids)
                positions = [j - prompt_len for j in range(start, len(sample)) if sample.loss_mask[j]]
                side.loss_tokens[key] = positions
                side.advantages[key] = sample.advantage
                side.logps[key] = logps[b, : len(positions)].tolist()
    apply = learner._apply

    def apply_and_keep() -> float:
        side.grads = _lora_grads(policy.model)
        return apply()

    learner._apply = apply_and_keep  # type: ignore[method-assign]
    stats = learner.step(built.samples)
    side.loss, side.grad_norm = stats.loss, stats.grad_norm
    side.after = _lora_weights(policy.model)
    return side, initial


def config_overrides(shared: Shared) -> list[str]:
    trainer = shared.trainer
    overrides = [f"{k}={v}" for k, v in shared.run_config.trainer.overrides.items()]
    return [f"model={trainer.model}", f"seed={trainer.seed}", *overrides]


def trl_step(shared: Shared, batch: list[FixedGroup], initial: dict[str, Tensor], workdir: Path, seed: int) -> Side:
    """One GRPOTrainer step on the batch (its generation replaced by the batch), from ``initial``."""
    from datasets import Dataset  # type: ignore[import-untyped]
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOTrainer  # type: ignore[attr-defined]

    from bench.learning_vs_trl import make_math_reward

    config, options = shared.trainer, shared.options
    if config.groups_per_step != len(batch):
        raise ValueError(f"--groups must equal groups_per_step ({config.groups_per_step}): one TRL step")
    tokenizer = trl_tokenizer(shared.model)
    args = trl_args(shared, workdir, seed=seed, max_steps=1)
    model = AutoModelForCausalLM.from_pretrained(
        shared.model, dtype=resolve_dtype(config.dtype, "cpu"), attn_implementation="sdpa"
    )
    rewards: list[float] = []
    rows = [{"prompt": g.messages, "answer": g.answer} for g in batch]
    trainer: Any = GRPOTrainer(  # patched below: typed as Any
        model=model,
        reward_funcs=make_math_reward(options.format_weight, rewards),
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        peft_config=trl_lora(config),
    )
    trainer.remove_callback(PrinterCallback)
    by_prompt = {tuple(g.prompt_ids): g for g in batch}
    served: dict[tuple[int, ...], int] = {}
    owner: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    """TRL's (prompt ids + completion ids) -> the (group, rollout) pairs served it, in order: a group
    often samples the same short answer more than once."""

    def replay(prompt_ids: list[list[int]], *_: Any, **__: Any) -> tuple[list[list[int]], None]:
        completions = []
        for ids in prompt_ids:
            fixed = by_prompt[tuple(ids)]  # KeyError: TRL rendered a prompt differently from vLLM's template
            n = served.get(tuple(ids), 0)
            served[tuple(ids)] = n + 1
            rollout = fixed.rollouts[n % len(fixed.rollouts)]
            owner.setdefault((*ids, *rollout.ids), []).append((batch.index(fixed), n % len(fixed.rollouts)))
            completions.append(list(rollout.ids))
        return completions, None

    trainer._generate_single_turn = replay
    missing = set(get_peft_model_state_dict(trainer.model)) ^ set(initial)
    if missing:
        raise RuntimeError(f"adapter keys differ between the trainers: {sorted(missing)[:3]}")
    set_peft_model_state_dict(trainer.model, initial)
    side = Side({}, {}, {}, 0.0, 0.0, {}, _lora_weights(trainer.model), {})
    trainer.model.train()
    inputs = trainer._generate_and_score_completions([row for row in rows for _ in range(shared.group_size)])
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([prompt_ids, completion_ids], dim=1),
            torch.cat([prompt_mask, completion_mask], dim=1),
            completion_ids.size(1),
        )
    for b in range(completion_ids.size(0)):
        prompt = prompt_ids[b][prompt_mask[b].bool()].tolist()
        mask = completion_mask[b].bool()
        completion = completion_ids[b][: int(mask.sum())].tolist()
        key = owner[(*prompt, *completion)].pop(0)
        side.loss_tokens[key] = mask.nonzero().squeeze(1).tolist()
        side.advantages[key] = float(inputs["advantages"][b])
        side.logps[key] = logps[b][mask].tolist()
    served.clear()
    losses: list[float] = []
    compute_loss = trainer.compute_loss

    def compute_and_keep(*a: Any, **k: Any) -> Tensor:
        loss: Tensor = compute_loss(*a, **k)
        losses.append(float(loss.detach()))
        return loss

    clip = trainer._clip_grad_norm

    def clip_and_keep(model: torch.nn.Module) -> Any:
        side.grads = _lora_grads(model)
        return clip(model)

    trainer.compute_loss = compute_and_keep
    trainer._clip_grad_norm = clip_and_keep
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    side.loss = sum(losses)
    side.grad_norm = float(torch.stack([g.double().norm() for g in side.grads.values()]).norm())
    side.after = _lora_weights(trainer.model)
    return side


# -- comparison ----------------------------------------------------------------------------------------


def _cos(a: Tensor, b: Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    denominator = float(a.norm() * b.norm())
    return float(a @ b) / denominator if denominator else float("nan")


def _ratio(a: Tensor, b: Tensor) -> float:
    """|b| / |a| (TRL over Flywheel)."""
    norm = float(a.double().norm())
    return float(b.double().norm()) / norm if norm else float("nan")


def _flat(tensors: dict[str, Tensor], names: list[str]) -> Tensor:
    return torch.cat([tensors[n].double().flatten() for n in names])


def compare(fly: Side, trl: Side, batch: list[FixedGroup], eos: int) -> dict[str, Any]:
    keys = sorted(fly.loss_tokens)
    if sorted(trl.loss_tokens) != keys:
        raise RuntimeError("the trainers trained different completions")
    eos_trained = {"flywheel": 0, "trl": 0}
    first_trained = {"flywheel": 0, "trl": 0}
    beyond = {"flywheel": 0, "trl": 0}
    same_tokens = 0
    diffs: list[float] = []
    for g, e in keys:
        ids = batch[g].rollouts[e].ids
        for name, side in (("flywheel", fly), ("trl", trl)):
            positions = side.loss_tokens[(g, e)]
            eos_trained[name] += ids[-1] == eos and len(ids) - 1 in positions
            first_trained[name] += 0 in positions
            beyond[name] += sum(p >= len(ids) for p in positions)
        same_tokens += fly.loss_tokens[(g, e)] == trl.loss_tokens[(g, e)]
        if fly.loss_tokens[(g, e)] == trl.loss_tokens[(g, e)]:
            diffs += [abs(a - b) for a, b in zip(fly.logps[(g, e)], trl.logps[(g, e)], strict=True)]
    names = sorted(fly.grads)
    if sorted(trl.grads) != names:
        raise RuntimeError("the trainers' LoRA parameters differ")
    # LoRA's B starts at zero, so every A has a zero gradient on the first step (both trainers): the
    # per-parameter figures are over the parameters with a gradient on either side.
    live = [n for n in names if float(fly.grads[n].norm()) > 0 or float(trl.grads[n].norm()) > 0]
    param_cos = [_cos(fly.grads[n], trl.grads[n]) for n in live]
    param_ratio = sorted(_ratio(fly.grads[n], trl.grads[n]) for n in live)
    update_fly = {n: fly.after[n] - fly.before[n] for n in names}
    update_trl = {n: trl.after[n] - trl.before[n] for n in names}
    update_cos = [_cos(update_fly[n], update_trl[n]) for n in live]
    return {
        "completions": len(keys),
        "loss_tokens": {
            "flywheel": sum(map(len, fly.loss_tokens.values())),
            "trl": sum(map(len, trl.loss_tokens.values())),
        },
        "same_loss_positions": same_tokens,
        "eos_trained": eos_trained,
        "eos_sampled": sum(batch[g].rollouts[e].ids[-1] == eos for g, e in keys),
        "first_token_trained": first_trained,
        "padding_trained": beyond,
        "advantage_max_abs_diff": max(abs(fly.advantages[k] - trl.advantages[k]) for k in keys),
        "logp_max_abs_diff": max(diffs) if diffs else None,
        "logp_mean_abs_diff": sum(diffs) / len(diffs) if diffs else None,
        "loss": {"flywheel": fly.loss, "trl": trl.loss},
        "grad_norm_before_clip": {"flywheel": fly.grad_norm, "trl": trl.grad_norm},
        "grad_cosine": _cos(_flat(fly.grads, names), _flat(trl.grads, names)),
        "grad_cosine_min_param": min(param_cos),
        "grad_norm_ratio_trl_over_flywheel": _ratio(_flat(fly.grads, names), _flat(trl.grads, names)),
        "grad_norm_ratio_per_param_range": [param_ratio[0], param_ratio[-1]],
        "update_cosine": _cos(_flat(update_fly, names), _flat(update_trl, names)),
        "update_cosine_min_param": min(update_cos),
        "update_norm_ratio_trl_over_flywheel": _ratio(_flat(update_fly, names), _flat(update_trl, names)),
        "update_norm": {
            "flywheel": float(_flat(update_fly, names).norm()),
            "trl": float(_flat(update_trl, names).norm()),
        },
        "lora_parameters": len(names),
        "lora_parameters_with_gradient": len(live),
    }


def table(result: dict[str, Any]) -> str:
    def pair(key: str, fmt: str = "{}") -> str:
        value = result[key]
        return f"flywheel {fmt.format(value['flywheel'])}  trl {fmt.format(value['trl'])}"

    return "\n".join(
        [
            f"one step on one batch: {result['completions']} completions ({result['groups']} groups), "
            f"seed {result['seed']}, {result['dtype']}",
            f"loss tokens           {pair('loss_tokens')}  "
            f"(same positions in {result['same_loss_positions']} completions)",
            f"EOS trained           {pair('eos_trained')}  of {result['eos_sampled']} sampled",
            f"first token trained   {pair('first_token_trained')}",
            f"padding trained       {pair('padding_trained')}",
            f"advantages            max |diff| {result['advantage_max_abs_diff']:.2e}",
            f"log-probs             max |diff| {result['logp_max_abs_diff']:.2e}  "
            f"mean {result['logp_mean_abs_diff']:.2e}",
            f"loss                  {pair('loss', '{:+.6f}')}",
            f"grad norm (pre-clip)  {pair('grad_norm_before_clip', '{:.4f}')}",
            f"gradient              cosine {result['grad_cosine']:.6f} (min per parameter "
            f"{result['grad_cosine_min_param']:.6f}), norm ratio trl/flywheel "
            f"{result['grad_norm_ratio_trl_over_flywheel']:.4f}",
            f"update after AdamW    cosine {result['update_cosine']:.6f} (min per parameter "
            f"{result['update_cosine_min_param']:.6f}), norm ratio trl/flywheel "
            f"{result['update_norm_ratio_trl_over_flywheel']:.4f}",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=None, help="default: configs/run-local.yaml's seed")
    parser.add_argument("--groups", type=int, default=None, help="default: the trainer's groups_per_step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--dtype", default=None, help="both trainers' dtype (default: the trainer config's; auto is bf16 on a bf16 CPU)"
    )
    parser.add_argument(
        "--batch", default=None, help="a JSON file: read the batch from it if it exists, else save the sampled one"
    )
    parser.add_argument(
        "--flywheel-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a trainer setting for Flywheel's side only, to measure one difference apart",
    )
    opts = parser.parse_args()
    from bench.learning_vs_trl import RUN_CONFIG
    from deploy.model import fetch
    from deploy.run_config import load_run_config

    torch.set_num_threads(opts.threads)
    model = os.environ.get("FLYWHEEL_MODEL_DIR") or str(fetch())
    seed = opts.seed if opts.seed is not None else load_run_config(RUN_CONFIG).seed
    shared = shared_settings(seed, model)
    dtype = opts.dtype or shared.trainer.dtype
    shared = dataclasses.replace(shared, trainer=dataclasses.replace(shared.trainer, threads=opts.threads, dtype=dtype))
    groups = opts.groups or shared.trainer.groups_per_step
    if groups != shared.trainer.groups_per_step:
        shared = dataclasses.replace(shared, trainer=dataclasses.replace(shared.trainer, groups_per_step=groups))
    started = time.monotonic()
    tokenizer = trl_tokenizer(model)
    saved = Path(opts.batch) if opts.batch else None
    if saved is not None and saved.is_file():
        batch = load_batch(saved)
        log(f"batch read from {saved}")
    else:
        batch = sample_batch(shared, tokenizer, groups=groups, seed=seed)
        if saved is not None:
            saved.write_text(json.dumps([dataclasses.asdict(g) for g in batch]))
    log("flywheel step")
    fly, initial = flywheel_step(shared, batch, opts.flywheel_override)
    log("trl step")
    with tempfile.TemporaryDirectory(prefix="flywheel-trl-parity-") as workdir:
        trl = trl_step(shared, batch, initial, Path(workdir), seed)
    result = {
        "seed": seed,
        "groups": groups,
        "group_size": shared.group_size,
        "temperature": shared.options.temperature,
        "loss_type": shared.trainer.loss_type,
        "dtype": str(resolve_dtype(shared.trainer.dtype, "cpu")).removeprefix("torch."),
        "flywheel_overrides": opts.flywheel_override,
        **compare(fly, trl, batch, int(tokenizer.eos_token_id)),
        "seconds": round(time.monotonic() - started, 1),
    }
    print(table(result))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
