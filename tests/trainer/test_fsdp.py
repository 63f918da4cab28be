"""FSDP2 under torchrun (gloo on the CPU, SmolLM2 in float32): the sharded steps are one process's steps.

Run as a script under torchrun (``main`` below; not collected), every rank trains the same three
steps on fixed samples, writes what it holds, and the test compares one process on the plain data
path with two FSDP ranks under gradient checkpointing; both with a KL term (a reference forward in
every pass). The base is frozen and sharded, the LoRA weights sharded and trained; three
micro-batches over two ranks make one rank run a zero-weight padding pass. Steps 2 and 3 re-score
samples served by older versions (the base model, a remembered adapter), which under FSDP every
rank runs in lockstep. The adapter rank 0 saves is the whole one (PEFT's names, full shapes), and a
checkpoint loaded back into the sharded model (every rank cutting its shards from it) retakes step 2
exactly. Then the real CLI under ``torchrun --nproc-per-node 2 -m trainer run ... parallelism=fsdp``:
vLLM loads what rank 0 publishes, and a resumed run hands the checkpoint to the follower's shards.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.support.services import ADMIN_KEY, ROOT
from tests.support.torchrun import torchrun
from tests.trainer.conftest import TrainerProxy
from tests.trainer.ddp_step import QUESTIONS
from tests.trainer.samples import chat_sample
from trainer.checkpoint import Checkpoints, CheckpointState
from trainer.config import TrainerConfig
from trainer.distributed import World, init_world
from trainer.learner import Learner, StepStats
from trainer.lora import LoraPolicy
from trainer.packing import pack
from trainer.sample import Sample


def served(samples: list[Sample], versions: list[int]) -> list[Sample]:
    """``samples`` as if ``versions[i]`` served sample i, the engine's log-prob -2 on every sampled token."""
    return [
        dataclasses.replace(
            s,
            versions=[v if m else -1 for m in s.loss_mask],
            modes=[0 if m else -1 for m in s.loss_mask],
            behaviour_logprobs=[-2.0 if m else float("nan") for m in s.loss_mask],
        )
        for s, v in zip(samples, versions, strict=True)
    ]


def figures(stats: StepStats) -> dict[str, Any]:
    keys = {"loss": stats.loss, "grad_norm": stats.grad_norm, "entropy": stats.entropy, "tokens": stats.loss_tokens}
    return keys | stats.engine


def sharding(policy: LoraPolicy) -> dict[str, Any]:
    """What this rank holds of the model: local and whole element counts, frozen and trained."""
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {"dtensors": 0, "trained_names": []}
    for name, param in policy.model.named_parameters():
        kind = "trained" if param.requires_grad else "frozen"
        local = param.to_local() if isinstance(param, DTensor) else param
        out["dtensors"] += isinstance(param, DTensor)
        out[f"{kind}_local"] = out.get(f"{kind}_local", 0) + local.numel()
        out[f"{kind}_whole"] = out.get(f"{kind}_whole", 0) + param.numel()
        if param.requires_grad:
            out["trained_names"].append(name)
    out["parameters"] = len(list(policy.model.parameters()))
    return out


def main(model_dir: str, out: Path, parallelism: str) -> None:
    world = init_world(600)
    config = TrainerConfig(
        model=model_dir,
        dtype="float32",
        learning_rate=1e-3,
        beta=0.04,  # a reference forward (adapter off, no grad) inside every pass
        max_seq_len=128,
        micro_batch_tokens=128,
        threads=1,
        parallelism=parallelism,  # type: ignore[arg-type]
        gradient_checkpointing=parallelism == "fsdp",
    )
    policy = LoraPolicy(config)
    learner = Learner(policy, config, world)
    samples = [chat_sample(policy, *q) for q in QUESTIONS]
    tag = f"{parallelism}-rank{world.rank}-of-{world.size}"
    record: dict[str, Any] = {"sharding": sharding(policy), "steps": [], "adapters": []}
    passes = world.passes(pack(samples, config.micro_batch_tokens), lockstep=policy.sharded)
    record["passes"] = [counted for _, counted in passes]

    def step(batch: list[Sample]) -> None:
        record["steps"].append(figures(learner.step(batch)))
        record["adapters"].append({k: v.clone() for k, v in policy.adapter_state().items()})  # one process: live

    checkpoints = Checkpoints(out / f"run-{tag}", keep=2)
    step(samples)
    if world.leader:  # what the loop does after the step: checkpoint, publish, remember the version
        state = CheckpointState(step=1, version_base=0, leases=[])
        checkpoints.save(adapter=policy.adapter_state(), optimizer=learner.optimizer_state(), state=state)
        policy.save_adapter(out / f"adapter-{tag}")
        learner.remember(1)
    second = served(samples[1:] + samples[:1], [1, 0, 1, 0, 1, 0])  # v1: fresh; v0: re-scored under the base
    step(second)
    if world.leader:
        learner.remember(2)
    step(served(samples[2:] + samples[:2], [1, 2, 1, 2, 0, 2]))  # v1: re-scored under its kept adapter
    resume(world, policy, learner, checkpoints)
    step(second)  # step 2 again, from step 1's checkpoint
    torch.save(record, out / f"{tag}.pt")
    world.close()


def resume(world: World, policy: LoraPolicy, learner: Learner, checkpoints: Checkpoints) -> None:
    """Load step 1's checkpoint on every rank as a resumed run does (``Restore`` and ``follow``)."""
    latest = checkpoints.latest() if world.leader else None
    adapter, optimizer = world.broadcast(Checkpoints.load_tensors(latest[0]) if latest else None)
    policy.load_adapter_state(adapter)
    learner.load_optimizer_state(optimizer)
    if world.leader:  # the resumed weights are version 1 (the loop remembers it as it finishes the step)
        learner.remember(1, adapter)


@pytest.fixture(scope="module")
def runs(vllm_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    for nproc, parallelism in ((1, "data"), (2, "fsdp")):
        done = torchrun(nproc, str(ROOT / "tests/trainer/test_fsdp.py"), vllm_model_dir, str(out), parallelism)
        assert done.returncode == 0, done.stderr[-4000:]
    return out


def load(out: Path, tag: str) -> dict[str, Any]:
    record = torch.load(out / f"{tag}.pt", weights_only=False)
    assert isinstance(record, dict)
    return record


def test_the_base_is_frozen_and_sharded_and_lora_is_trained(runs: Path) -> None:
    one = load(runs, "data-rank0-of-1")["sharding"]
    ranks = [load(runs, f"fsdp-rank{r}-of-2")["sharding"] for r in (0, 1)]
    assert one["dtensors"] == 0
    for held in ranks:
        assert held["dtensors"] == held["parameters"]  # every weight is sharded, the frozen base too
        assert held["trained_names"] == one["trained_names"] and all("lora_" in n for n in held["trained_names"])
        assert held["frozen_whole"] == one["frozen_whole"] and held["trained_whole"] == one["trained_whole"]
        for kind in ("frozen", "trained"):
            assert held[f"{kind}_local"] <= 0.51 * held[f"{kind}_whole"], kind  # about half on each rank
    assert sum(r["frozen_local"] for r in ranks) == one["frozen_whole"]
    passes = [load(runs, f"fsdp-rank{r}-of-2")["passes"] for r in (0, 1)]
    assert [len(p) for p in passes] == [2, 2] and sorted(sum(p) for p in passes) == [1, 2]  # one padding pass


def test_sharded_steps_equal_one_process_steps(runs: Path) -> None:
    one = load(runs, "data-rank0-of-1")
    lead, follower = load(runs, "fsdp-rank0-of-2"), load(runs, "fsdp-rank1-of-2")
    assert len(one["steps"]) == len(lead["steps"]) == 4
    for step, (expected, got) in enumerate(zip(one["steps"], lead["steps"], strict=True)):
        assert follower["steps"][step] == got  # whole-step figures, the same on every rank
        for key, value in expected.items():
            if value is None or got[key] is None:
                assert value is got[key], (step, key)  # unknown on both
            else:
                assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (step, key)
    assert lead["steps"][0]["policy/engine_logp_tokens"] == 0  # nothing served the first step's samples
    for later in lead["steps"][1:3]:  # every sampled token compared: fresh, or re-scored under its version
        assert later["policy/engine_logp_tokens"] == later["tokens"] and later["policy/stale_logp_tokens"] > 0
    for step, expected in enumerate(one["adapters"]):
        for name, tensor in expected.items():
            assert torch.equal(lead["adapters"][step][name], follower["adapters"][step][name]), name
            # float32 summation order differs (shards, reduce-scatter); Adam magnifies it on near-zero
            # gradient elements, hence a relative norm, as tests/trainer/test_distributed.py
            assert float((lead["adapters"][step][name] - tensor).norm() / tensor.norm()) < 5e-4, (step, name)
    moved = max(float(t.abs().max()) for n, t in one["adapters"][0].items() if "lora_B" in n)
    assert moved > 1e-4  # lora_B starts at zero: the first step moved it


def test_saved_adapter_is_whole_and_a_checkpoint_resumes_into_the_shards(runs: Path) -> None:
    one, lead = load(runs, "data-rank0-of-1"), load(runs, "fsdp-rank0-of-2")
    saved = load_file(str(runs / "adapter-fsdp-rank0-of-2" / "adapter_model.safetensors"))
    reference = load_file(str(runs / "adapter-data-rank0-of-1" / "adapter_model.safetensors"))
    assert saved.keys() == reference.keys() and all(saved[k].shape == reference[k].shape for k in saved)
    assert all(torch.equal(saved[k], lead["adapters"][0][k]) for k in saved)  # the gathered step-1 adapter
    config = json.loads((runs / "adapter-fsdp-rank0-of-2" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["peft_type"] == "LORA"
    assert not (runs / "adapter-fsdp-rank1-of-2").exists()  # rank 0 alone writes
    for name, tensor in lead["adapters"][1].items():  # step 2 retaken from step 1's checkpoint: the same
        assert torch.equal(lead["adapters"][3][name], tensor), name
    assert lead["steps"][3] == lead["steps"][1] and one["steps"][3] == one["steps"][1]


@pytest.mark.vllm
def test_torchrun_cli_trains_sharded_publishes_and_resumes(
    trainer_proxy: TrainerProxy, tmp_path: Path, vllm_model_dir: str
) -> None:
    out = tmp_path / "run"
    args = ["-m", "trainer", "run", "--config", str(ROOT / "configs/trainer-local.yaml"), "parallelism=fsdp"]
    args += [f"proxy_url={trainer_proxy.url}", f"output_dir={out}", "groups_per_step=1", "batch_wait_s=0"]
    args += ["poll_interval_s=0.2", "tensorboard=false", "progress=false", "max_staleness=5", "threads=1"]
    env = {"FLYWHEEL_ADMIN_KEY": ADMIN_KEY, "FLYWHEEL_MODEL_DIR": vllm_model_dir}
    groups = []
    for steps, question in ((1, "What is 5+6?"), (2, "What is 2+9?")):
        groups.append(trainer_proxy.record_group([1.0, 0.0], question=question))
        done = torchrun(2, *args, f"max_steps={steps}", env=env)
        assert done.returncode == 0, done.stderr[-4000:]
        outputs = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        assert {"rank": 1, "steps": 1} in outputs
        assert {"last_step": steps, "output_dir": str(out), "ranks": 2} in outputs
    assert "resumed from step-00000001" in done.stderr
    assert [trainer_proxy.get(f"/groups/{g}")["trained_step"] for g in groups] == [1, 2]
    assert trainer_proxy.get("/policy")["version"] == 2  # vLLM loaded both adapters rank 0 published
    adapter = load_file(str(out / "adapters" / "v2" / "adapter_model.safetensors"))  # whole: (r, H), (H, r)
    r = json.loads((out / "adapters" / "v2" / "adapter_config.json").read_text())["r"]
    hidden = json.loads((Path(vllm_model_dir) / "config.json").read_text())["hidden_size"]
    q_proj = "base_model.model.model.layers.0.self_attn.q_proj"
    assert adapter[f"{q_proj}.lora_A.weight"].shape == (r, hidden)
    assert adapter[f"{q_proj}.lora_B.weight"].shape == (hidden, r)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3])
