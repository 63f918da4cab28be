"""The calc workflow end to end: ``python -m workflows run calc`` and ``eval calc`` (agents venv)
against a real proxy in front of the real vLLM (shipped chat template, hermes tool parser)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.services import ProxyProcess, grammar_masker
from tests.workflows.conftest import admin_get, episode_count, groups_of, run_workflow
from workflows.calc.env import CALCULATOR, SUBMIT


def tool_choice_name(call: dict[str, Any]) -> str:
    return str(call["request"]["tool_choice"]["function"]["name"])


@pytest.mark.vllm
def test_a_real_episode_calls_tools_and_merges_into_one_sample(proxy: ProxyProcess, vllm_model_dir: str) -> None:
    # Engine-venv imports, here: the agents venv collects this module too (and deselects it).
    from transformers import AutoTokenizer

    from contract.client import Episode
    from trainer.data import DataStats, episode_samples

    # Temperature 1.0: sampled ids the template would not re-render (odd spellings, spacing) are
    # spliced into the follow-up prompts by the proxy, so the calls still merge.
    summary = run_workflow(
        proxy,
        "run",
        "calc",
        groups=1,
        group_size=2,
        concurrency=2,
        seed=5,
        options={"mix": "two_step", "temperature": 1.0, "top_p": 1.0},
    )
    assert (summary["episodes"], summary["rewarded"], summary["abandoned"]) == (2, 2, 0)
    (group,) = groups_of(proxy, "calc")
    assert group["status"] == "complete" and group["metadata"]["abandoned"] == "penalize"
    tokenizer = AutoTokenizer.from_pretrained(vllm_model_dir)
    for listed in admin_get(proxy, "/episodes", group_id=group["id"])["data"]:
        raw = admin_get(proxy, f"/episodes/{listed['id']}", calls="true")
        calls = sorted(raw["calls"], key=lambda c: c["ordinal"])
        # Two steps: calculator, calculator, submit_answer, each a real tool call named by the workflow.
        assert [tool_choice_name(c) for c in calls] == [CALCULATOR, CALCULATOR, SUBMIT]
        for call in calls:
            assert call["exact_ids"] is True and call["status_code"] == 200
            assert call["notes"]["sampling"]["mode"] == "constrained"
            (tool_call,) = call["response"]["choices"][0]["message"]["tool_calls"]
            assert tool_call["function"]["name"] == tool_choice_name(call)
        # Each tool result goes back as a role: tool message answering the call's id.
        for before, after in zip(calls, calls[1:], strict=False):
            sent = after["request"]["messages"][-1]
            answered = before["response"]["choices"][0]["message"]["tool_calls"][0]["id"]
            assert sent["role"] == "tool" and sent["tool_call_id"] == answered
        metadata = raw["reward_metadata"]
        assert raw["reward"] == float(metadata["success"]) and metadata["calls"] == 3
        # Validity is the model's: at temperature 1.0 it can sample a number past the checker's bound
        # (seen once: "answer is too large"); the count must agree with the errors it reported.
        assert metadata["valid_calls"] == 3 - len(metadata["errors"])
        assert metadata["all_valid"] is (metadata["valid_calls"] == 3)

        stats = DataStats()
        (sample,) = episode_samples(
            Episode.model_validate(raw), group_id=group["id"], max_seq_len=8192, stats=stats, masker=grammar_masker()
        )
        assert (stats.merged, stats.breaks, stats.calls_constrained) == (2, 0, 3)
        assert sample.input_ids[: len(calls[-1]["prompt_token_ids"])] == calls[-1]["prompt_token_ids"]
        # Trained tokens are the model's own decisions: inside a completion, exactly the tokens the
        # engine did not force (log-prob 0: the grammar, or top_p, left no alternative).
        for call in calls:
            start = len(call["prompt_token_ids"])
            logprobs = call["choices"][0]["logprobs"]
            assert len(logprobs) == len(call["choices"][0]["token_ids"])
            assert sample.loss_mask[start : start + len(logprobs)] == [int(lp != 0.0) for lp in logprobs]
        assert sum(sample.loss_mask) == sum(lp != 0.0 for c in calls for lp in c["choices"][0]["logprobs"])
        # Between two calls lies the tool result (and template glue): in the sample, masked out.
        for before, after in zip(calls, calls[1:], strict=False):
            start = len(before["prompt_token_ids"]) + len(before["choices"][0]["token_ids"])
            gap = range(start, len(after["prompt_token_ids"]))
            result = after["request"]["messages"][-1]["content"]
            text = tokenizer.decode(sample.input_ids[gap.start : gap.stop])
            assert f"<tool_response>\n{result}\n</tool_response>" in text
            assert not any(sample.loss_mask[j] for j in gap)


@pytest.mark.vllm
def test_eval_reports_success_and_validity_apart_without_recording(proxy: ProxyProcess) -> None:
    before = episode_count(proxy)
    report = run_workflow(proxy, "eval", "calc", split="test", limit=5)
    assert (report["n"], report["split"], report["policy_versions"]) == (5, "test", ["0"])
    assert sum(k["n"] for k in report["by_kind"].values()) == 5
    assert report["accuracy"] in {i / 5 for i in range(6)} and report["format_rate"] in {i / 5 for i in range(6)}
    assert 0.0 <= report["call_validity"] <= 1.0 and report["calls_per_episode"] >= 2.0
    assert episode_count(proxy) == before


@pytest.mark.vllm
def test_fork_mode_replays_calc_episodes_to_their_fork_point(proxy: ProxyProcess) -> None:
    """``--fork-share``: after each plain group, one rewarded episode is forked (uniform point) and
    the same calc agent runs the fork group; calc's environment is deterministic given the model's
    answers, so every fork episode reaches its fork point (the replayed calls are the source's)."""
    summary = run_workflow(
        proxy,
        "run",
        "calc",
        groups=2,
        group_size=2,
        concurrency=2,
        seed=11,
        fork_share=0.5,
        fork_rule="uniform",
        options={"mix": "two_step", "temperature": 1.0, "top_p": 1.0},
    )
    forks = summary["forks"]
    assert forks["groups"] >= 1 and forks["episodes"] == 2 * forks["groups"]
    assert (forks["diverged"], forks["reached_fork_point"]) == (0, 1.0)
    fork_groups = [g for g in groups_of(proxy, "calc") if "fork" in g["metadata"]]
    assert len(fork_groups) == forks["groups"]
    for group in fork_groups:
        at, source = group["metadata"]["fork"]["at"], group["metadata"]["fork"]["source_episode_id"]
        source_calls = sorted(
            admin_get(proxy, f"/episodes/{source}", calls="true")["calls"], key=lambda c: c["ordinal"]
        )
        for listed in admin_get(proxy, "/episodes", group_id=group["id"])["data"]:
            raw = admin_get(proxy, f"/episodes/{listed['id']}", calls="true")
            assert (raw["fork_of"], raw["fork_at"], raw["diverged_at"]) == (source, at, None)
            calls = sorted(raw["calls"], key=lambda c: c["ordinal"])
            replayed = [c for c in calls if "replay" in (c["notes"] or {})]
            assert [c["notes"]["replay"]["source_ordinal"] for c in replayed] == list(range(at))
            for mine, theirs in zip(replayed, source_calls, strict=False):
                assert mine["choices"][0]["token_ids"] == theirs["choices"][0]["token_ids"]
            assert len(calls) > at  # it sampled on from the fork point
