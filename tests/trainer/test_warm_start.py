"""The warm start (``trainer/warmstart.py``): selection over HTTP on both stores, supervised samples and
masks, the SFT loss, a real supervised step on the plumbing model, and the CLI end to end."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from contract.client import Call, Episode, ProxyClient
from proxy.store.repository import Repository
from tests.support.records import chat_call
from tests.support.services import ADMIN_KEY, ROOT, ProxyProcess, engine_python, free_port
from tests.trainer.conftest import TrainerProxy
from trainer.config import TrainerConfig
from trainer.learner import Learner
from trainer.lora import LoraPolicy
from trainer.loss import Totals, sft_loss
from trainer.packing import pack
from trainer.sample import MODES
from trainer.turns import member_turns
from trainer.warmstart import EmptySelection, Selection, schedule, select_episodes, supervised_samples

TEACHER = {"teacher": {"name": "big", "model": "big-model", "rendered": "student_template"}}


def call(ordinal: int, prompt: list[int], completion: list[int], **fields: Any) -> Call:
    """An answered exact call of the policy (version 0) sampling ``completion`` with engine log-probs."""
    choice = {"index": 0, "token_ids": completion, "logprobs": [-0.5] * len(completion), "text": "x"}
    values: dict[str, Any] = {"ordinal": ordinal, "prompt_token_ids": prompt, "choices": [choice], "exact_ids": True}
    values |= {"policy_version": 0, "notes": {"sampling": {"mode": "sampled", "temperature": 1.0}}}
    return Call.model_validate(values | fields)


# -- the loss --------------------------------------------------------------------------------------


def test_sft_loss_is_the_mean_nll_over_the_steps_trained_tokens() -> None:
    logps = torch.tensor([[-1.0, -2.0, -4.0], [-0.5, -8.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    totals = Totals(sequences=2, tokens=5, micro_batches=2, max_completion_length=1)  # 2 more in another micro-batch
    loss = sft_loss(logps, mask, totals=totals)
    assert loss.item() == pytest.approx((1.0 + 2.0 + 0.5) / 5)
    loss.backward()  # type: ignore[no-untyped-call]
    assert logps.grad is not None
    expected = torch.tensor([[-0.2, -0.2, 0.0], [-0.2, 0.0, 0.0]])  # every trained token weighs the same
    assert torch.allclose(logps.grad, expected)


# -- samples and masks -----------------------------------------------------------------------------


def teacher_episode() -> Episode:
    """A greedy call of the policy, a teacher's call continuing it (no log-probs, no version), then a
    call of a model that is neither, and an inexact call of the policy."""
    calls = [
        call(0, [1, 2, 3], [4, 5], notes={"sampling": {"mode": "greedy", "temperature": 0.0}}),
        call(1, [1, 2, 3, 4, 5, 6, 7], [8, 9], policy_version=None, notes=TEACHER),
        call(2, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11], policy_version=None, notes={}),
        call(3, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [12], exact_ids=False),
    ]
    calls[1].choices[0]["logprobs"] = []
    return Episode(id="e1", status="rewarded", reward=1.0, calls=calls)


def test_supervised_samples_train_only_answered_assistant_tokens_and_count_every_drop() -> None:
    episode = teacher_episode()
    data = supervised_samples([episode], max_seq_len=64)
    (sample,) = data.samples["e1"]
    assert sample.input_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert sample.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 1]  # prompt and tool tokens never trained
    assert sample.rerendered and sample.advantage == 1.0
    assert set(sample.temperatures) == {1.0} and not sample.allowed  # the plain distribution
    counted = {k: v for k, v in data.stats["e1"].as_dict().items() if v}
    assert counted == {
        "calls": 4,
        "calls_teacher": 1,
        "calls_foreign": 1,  # not a teacher: its ids may be another tokenizer's
        "calls_dropped_inexact": 1,  # retokenize_inexact off
        "merged": 1,
        "samples_built": 1,
    }
    # GRPO's rules for the same calls: the greedy call is context, the teacher's call foreign.
    grpo = member_turns(episode)
    assert [(t.ordinal, t.mode) for t in grpo] == [(0, -1)]
    supervised = member_turns(episode, supervised=True)
    assert [(t.ordinal, t.mode, t.rerendered) for t in supervised] == [(0, 0, False), (1, 0, True)]
    (mb,) = pack(data.samples["e1"], 64, shared=False)
    assert mb.mask.sum().item() == 4 and mb.targets.tolist() == [4, 5, 8, 9]
    assert mb.advantages[mb.mask.bool()].tolist() == [1.0] * 4
    assert MODES[0] == "sampled"


def test_a_replayed_call_stays_context_and_a_failed_one_is_dropped() -> None:
    episode = Episode(
        id="e2",
        status="rewarded",
        reward=1.0,
        calls=[
            call(0, [1, 2], [3], notes={"replay": {"source": "x"}, "sampling": {"mode": "sampled"}}),
            call(1, [1, 2, 3, 4], [5]),
            call(2, [1, 2, 3, 4, 5, 6], [7], status_code=500, choices=[]),
        ],
    )
    data = supervised_samples([episode], max_seq_len=64)
    assert data.samples["e2"][0].loss_mask == [0, 0, 0, 0, 1]
    assert data.stats["e2"].calls_replayed == 1 and data.stats["e2"].calls_failed == 1


def test_schedule_goes_through_the_selection_epoch_by_epoch() -> None:
    plan = schedule(["a", "b", "c", "d", "e"], steps=4, per_step=3, seed=0)
    assert all(len(step) == len(set(step)) == 3 for step in plan)
    first_epoch = [e for step in plan for e in step][:5]
    assert sorted(first_epoch) == ["a", "b", "c", "d", "e"]
    assert schedule(["a"], steps=2, per_step=8, seed=0) == [["a"], ["a"]]


# -- a real supervised step ------------------------------------------------------------------------


@pytest.mark.parametrize(("shared", "checkpointing"), [(False, False), (True, True)])
def test_sft_steps_raise_the_likelihood_of_the_selected_tokens(
    vllm_model_dir: str, shared: bool, checkpointing: bool
) -> None:
    cfg = TrainerConfig(
        model=vllm_model_dir,
        dtype="float32",
        learning_rate=2e-3,
        threads=1,
        shared_prefix=shared,
        gradient_checkpointing=checkpointing,
    )
    policy = LoraPolicy(cfg)
    tok = policy.tokenizer
    system = "You are a careful assistant who answers arithmetic questions with one number only."
    episodes = []
    for i, (question, answer) in enumerate([("What is 3+4?", "7"), ("What is 2+2?", "4")]):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
        completion = tok.encode(f"The answer is {answer}.", add_special_tokens=False) + [tok.eos_token_id]
        episodes.append(Episode(id=f"e{i}", status="rewarded", reward=1.0, calls=[call(0, prompt, completion)]))
    data = supervised_samples(episodes, max_seq_len=cfg.max_seq_len)
    samples = [s for ss in data.samples.values() for s in ss]
    if shared:  # the two samples share the system prompt: packed once as a prefix tree
        assert pack(samples, cfg.micro_batch_tokens, shared=True)[0].parents is not None
    with torch.no_grad():
        (mb,) = pack(samples, cfg.micro_batch_tokens, shared=False)
        before = -float(policy.logprobs(mb).logps.mean())
    learner = Learner(policy, cfg)
    losses = [learner.step(samples, objective="sft").loss for _ in range(4)]
    assert losses[0] == pytest.approx(before, rel=1e-4)  # the loss is the NLL of exactly those tokens
    assert losses[-1] < losses[0] - 0.05, losses
    with torch.no_grad():
        after = -float(policy.logprobs(mb).logps.mean())
    assert after < losses[-1]  # the last update lowered it again


# -- selection over HTTP, on both stores -----------------------------------------------------------


async def _store(url: str) -> dict[str, str]:
    """Episodes of a scripted demonstrator, a teacher and the agent itself; returns name -> id."""
    repo = Repository(url, min_rewarded=1)
    made: dict[str, str] = {}
    try:
        for name, task, reward, source in [
            ("demo_good", "t1", 1.0, "demo:scripted"),
            ("demo_poor", "t1", 0.0, "demo:scripted"),
            ("self_good", "t2", 1.0, None),
            ("self_other_task", "t9", 1.0, None),
        ]:
            episode = await repo.episodes.create_episode(task_id=task, metadata={"source": source} if source else {})
            await repo.calls.insert([chat_call(episode.id)])
            await repo.episodes.set_reward(episode.id, reward=reward, call_rewards=None, metadata=None)
            made[name] = episode.id
    finally:
        await repo.close()
    return made


def run_cli(command: str, *args: str, model: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, FLYWHEEL_ADMIN_KEY=ADMIN_KEY, PYTHONPATH=str(ROOT), FLYWHEEL_MODEL_DIR=model)
    python = engine_python() if os.path.exists(engine_python()) else sys.executable
    config = ["--config", str(ROOT / "configs/trainer-local.yaml"), "tensorboard=false", "progress=false"]
    return subprocess.run(
        [python, "-m", "trainer", command, *config, *args],
        cwd=ROOT,
        env=env,
        text=True,
        capture_output=True,
        timeout=300,
    )


async def test_selection_over_http_and_a_filter_that_selects_nothing(
    store_url: str, tmp_path: Path, vllm_model_dir: str
) -> None:
    made = await _store(store_url)
    process = ProxyProcess(
        upstream_url=f"http://127.0.0.1:{free_port()}", store_url=store_url, workdir=tmp_path / "proxy"
    )
    process.start()
    try:
        with ProxyClient(process.url, ADMIN_KEY) as client:
            chosen = select_episodes(client, Selection(min_reward=1.0, source="demo:scripted"), 100)
            assert [e.id for e in chosen] == [made["demo_good"]]
            assert chosen[0].calls and chosen[0].calls[0].prompt_token_ids == [1, 2, 3]  # with its calls
            mine = select_episodes(client, Selection(min_reward=0.5, tasks=("t1", "t2")), 100)
            assert {e.id for e in mine} == {made["demo_good"], made["self_good"]}
            assert len(select_episodes(client, Selection(), 2)) == 2  # the newest warm_start_max_episodes
            with pytest.raises(EmptySelection) as empty:
                select_episodes(client, Selection(min_reward=2.0, tasks=("t1",), source="teacher:big"), 100)
            for named in ("reward >= 2", "tasks t1", "source 'teacher:big'"):
                assert named in str(empty.value)
        out = tmp_path / "run"
        refused = run_cli(
            "warmstart",
            f"proxy_url={process.url}",
            f"output_dir={out}",
            "warm_start_steps=3",
            "warm_start_min_reward=2.0",
            "warm_start_tasks=[t1]",
            model=vllm_model_dir,
        )
        assert refused.returncode == 2, refused.stderr[-2000:]
        assert "selected no episode" in refused.stderr and "reward >= 2" in refused.stderr
        assert "Traceback" not in refused.stderr
        assert not (out / "checkpoints").exists() and not (out / "adapters").exists()  # no step, nothing published
        no_steps = run_cli("warmstart", f"proxy_url={process.url}", f"output_dir={out}", model=vllm_model_dir)
        assert no_steps.returncode == 2 and "warm_start_steps >= 1" in no_steps.stderr
    finally:
        process.stop()


# -- the CLI end to end, on the real engine --------------------------------------------------------


@pytest.mark.vllm
def test_warmstart_cli_trains_publishes_and_run_resumes_without_repeating_it(
    trainer_proxy: TrainerProxy, tmp_path: Path, vllm_model_dir: str
) -> None:
    groups = [trainer_proxy.record_group([1.0, 0.0], question=f"What is {i}+{i}?") for i in range(2)]
    out = tmp_path / "run"
    common = [f"proxy_url={trainer_proxy.url}", f"output_dir={out}", "warm_start_steps=2", "threads=1"]
    warm = run_cli(
        "warmstart", *common, "warm_start_min_reward=1.0", "warm_start_episodes_per_step=2", model=vllm_model_dir
    )
    assert warm.returncode == 0, warm.stderr[-3000:]
    assert json.loads(warm.stdout.strip().splitlines()[-1])["last_step"] == 2
    journal = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [(r["step"], r["phase"], len(r["episodes"]), r["trained"]) for r in journal] == [
        (1, "warm_start", 2, []),
        (2, "warm_start", 2, []),
    ]
    reported = trainer_proxy.get("/trainer/steps")["data"]
    assert [s["step"] for s in reported] == [1, 2]
    assert all(s["metrics"]["phase"] == "warm_start" and s["metrics"]["sft/tokens_trained"] > 0 for s in reported)
    assert all(math.isfinite(s["metrics"]["sft/loss"]) for s in reported)
    assert trainer_proxy.get("/policy")["version"] == 2  # published: the engine serves the warm adapter
    # Read, never claimed or acked: GRPO's queue still holds both groups.
    assert [trainer_proxy.get(f"/groups/{g}")["train_status"] for g in groups] == ["pending", "pending"]

    resumed = run_cli("run", *common, "max_steps=2", model=vllm_model_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["last_step"] == 2
    assert "resumed from step-00000002" in resumed.stderr and "warm start:" not in resumed.stderr  # not repeated
    assert len((out / "steps.jsonl").read_text().splitlines()) == 2
    assert [s["step"] for s in trainer_proxy.get("/trainer/steps")["data"]] == [1, 2]
