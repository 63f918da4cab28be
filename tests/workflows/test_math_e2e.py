"""The math workflow end to end: ``python -m workflows run math`` and ``eval math`` (agents venv)
against a real proxy in front of the real vLLM."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.support.services import ProxyProcess
from tests.workflows.conftest import admin_get, episode_count, groups_of, run_workflow
from workflows.__main__ import cli
from workflows.math.reward import check


@pytest.mark.vllm
def test_run_records_exact_calls_and_posts_the_checked_reward(proxy: ProxyProcess) -> None:
    summary = run_workflow(
        proxy,
        "run",
        "math",
        groups=2,
        group_size=3,
        concurrency=6,
        seed=7,
        options={"max_tokens": 48, "format_weight": 0.2},
    )
    assert (summary["groups"], summary["episodes"], summary["rewarded"], summary["abandoned"]) == (2, 6, 6, 0)
    math_groups = groups_of(proxy, "math")
    assert len(math_groups) == 2 and {g["status"] for g in math_groups} == {"complete"}
    for group in math_groups:
        gold = group["metadata"]["task"]["answer"]
        episodes = admin_get(proxy, "/episodes", group_id=group["id"])["data"]
        assert sorted(e["metadata"]["index"] for e in episodes) == [0, 1, 2]
        for listed in episodes:
            episode = admin_get(proxy, f"/episodes/{listed['id']}")
            (call,) = episode["calls"]
            assert call["exact_ids"] is True and call["status_code"] == 200
            assert call["prompt_token_ids"] and call["choices"][0]["token_ids"]
            assert len(call["choices"][0]["token_ids"]) <= 48
            assert call["request"]["model"] == "policy" and call["policy_version"] == 0
            reply = call["response"]["choices"][0]["message"]["content"]
            assert episode["reward"] == pytest.approx(check(reply, gold).reward(0.2))
            assert episode["reward_metadata"]["gold"] == gold


@pytest.mark.vllm
def test_eval_reports_accuracy_and_format_without_recording(proxy: ProxyProcess) -> None:
    before = episode_count(proxy)
    report = run_workflow(proxy, "eval", "math", split="test", limit=6, options={"max_tokens": 32})
    assert (report["n"], report["split"], report["policy_versions"], report["max_tokens"]) == (6, "test", ["0"], 32)
    assert sum(k["n"] for k in report["by_kind"].values()) == 6
    assert report["accuracy"] in {i / 6 for i in range(7)} and report["format_rate"] in {i / 6 for i in range(7)}
    assert episode_count(proxy) == before


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-o", "mix=nope"], "mix must be one of ['basic', 'hard']"),
        (["-o", "colour=red"], "unknown option 'colour'"),
        (["-o", "max_tokens=many"], "option max_tokens='many': expected int"),
        (["--split", "dev"], "split must be train, val or test"),
        (["--group-size", "0"], "group_size must be >= 1"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(args: list[str], message: str) -> None:
    result = CliRunner().invoke(
        cli, ["run", "math", "--proxy", "http://127.0.0.1:9", *args], env={"FLYWHEEL_ADMIN_KEY": "k" * 20}
    )
    assert result.exit_code == 2
    assert message in " ".join(result.output.replace("│", " ").split())


def test_a_missing_admin_key_is_explained(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli,
        ["run", "math", "--proxy", "http://127.0.0.1:9", "--admin-key-file", str(tmp_path / "none.key")],
        env={"FLYWHEEL_ADMIN_KEY": ""},
    )
    assert result.exit_code == 2
    assert "no admin key: set FLYWHEEL_ADMIN_KEY" in " ".join(result.output.replace("│", " ").split())
