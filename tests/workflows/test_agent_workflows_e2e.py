"""tau2 and OpenHands-on-TAC end to end: ``python -m workflows run`` in the agents venv, a real proxy,
the real vLLM with SmolLM2. The tiny model fails these tasks; the plumbing must not: every episode
recorded with exact token ids, rewarded by the task's own grader, and its group complete."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.support.services import ProxyProcess
from tests.workflows.conftest import admin_get, groups_of, run_workflow
from workflows.tac.scoring import Checkpoint, score
from workflows.tac.task import BUNDLED

pytestmark = pytest.mark.vllm


def episodes_of(proxy: ProxyProcess, group: dict[str, Any]) -> list[dict[str, Any]]:
    listed = admin_get(proxy, "/episodes", group_id=group["id"])["data"]
    return [admin_get(proxy, f"/episodes/{e['id']}") for e in listed]


def assert_recorded(episode: dict[str, Any], tools: set[str]) -> None:
    assert episode["calls"], f"episode {episode['id']} recorded no model call"
    for call in episode["calls"]:
        assert call["status_code"] == 200 and call["exact_ids"] is True
        assert call["prompt_token_ids"] and call["choices"][0]["token_ids"]
        assert not call["request"].get("stream")
        if (call["notes"] or {}).get("side"):
            # tau2's user simulator, through /passthrough/v1 beside the episode: no policy version,
            # so never trained; recorded so that the episode page shows it and a fork replays it.
            assert call["policy_version"] is None and call["request"]["model"] == "policy-base"
            continue
        assert call["request"]["model"] == "policy"
        assert {t["function"]["name"] for t in call["request"]["tools"]} >= tools
    assert [c["ordinal"] for c in episode["calls"]] == list(range(len(episode["calls"])))


def one_group_of_two(
    proxy: ProxyProcess, workflow: str, options: dict[str, object]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``workflow`` run for one group of two episodes, both rewarded; the group and its episodes as stored."""
    summary = run_workflow(proxy, "run", workflow, groups=1, group_size=2, concurrency=2, options=options, timeout=600)
    assert (summary["episodes"], summary["rewarded"]) == (2, 2), summary
    (group,) = groups_of(proxy, workflow)
    return group, episodes_of(proxy, group)


def test_tau2_airline_episodes_are_graded_and_forks_replay_the_agent_and_the_user_simulator(
    smol_proxy: ProxyProcess,
) -> None:
    """One airline group graded by tau2, then fork mode on it: a fork replays the agent's calls and the
    simulated customer's (side calls) up to the fork point; the run reports how many forks reached it
    (tau2's determinism, measured). One run for both: each tau2 group costs about a minute here. On
    SmolLM2: tau2's agent and customer write free-form tool calls, which the plumbing model never
    produces, so no episode would reach its grading."""
    proxy = smol_proxy
    options = {"domain": "airline", "max_steps": 6, "max_tokens": 48}
    summary = run_workflow(
        proxy,
        "run",
        "tau2",
        groups=1,
        group_size=2,
        concurrency=2,
        fork_share=0.5,
        fork_rule="uniform",
        options=options,
        timeout=900,
    )
    (group,) = [g for g in groups_of(proxy, "tau2") if "fork" not in g["metadata"]]
    assert group["status"] == "complete" and group["task_id"].startswith("tau2/airline/")
    episodes = episodes_of(proxy, group)
    assert [e["status"] for e in episodes] == ["rewarded"] * 2, summary
    for episode in episodes:
        assert_recorded(episode, {"get_user_details", "book_reservation"})
        meta = episode["reward_metadata"]
        assert episode["reward"] in (0.0, 1.0) and meta["termination_reason"] in {
            "max_steps",
            "user_stop",
            "agent_stop",
            "too_many_errors",
        }
        if meta["termination_reason"] == "max_steps":
            assert episode["reward"] == 0.0  # tau2 grades a run cut short as a failure
    forks = summary["forks"]
    print("FIGURES tau2 forks", forks)
    if forks["groups"] == 0:  # no agent call sampled after an episode's first call: nowhere to fork
        assert forks["skipped"] == {"no rewarded episode with a sampled agent call after its first answered call": 1}
        return
    (fork_group,) = [g for g in groups_of(proxy, "tau2") if "fork" in g["metadata"]]
    assert fork_group["metadata"]["fork"]["source_episode_id"] in {e["id"] for e in episodes}
    at = fork_group["metadata"]["fork"]["at"]
    source = admin_get(proxy, f"/episodes/{fork_group['metadata']['fork']['source_episode_id']}")
    sides = [(c["notes"] or {}).get("side", False) for c in sorted(source["calls"], key=lambda c: c["ordinal"])]
    diverged = 0
    for episode in episodes_of(proxy, fork_group):
        replayed = [c for c in episode["calls"] if "replay" in (c["notes"] or {})]
        if episode["diverged_at"] is None:
            assert len(replayed) == at
            # The replay covers the customer's turns too, in the order the source made them.
            assert [(c["notes"] or {}).get("side", False) for c in replayed] == sides[:at]
        else:
            diverged += 1
            assert len(replayed) == episode["diverged_at"] and episode["divergence"]["fields"]
    assert diverged == forks["diverged"]


def test_openhands_on_a_local_tac_task(proxy: ProxyProcess) -> None:
    options: dict[str, object] = {"tasks": "hello-file", "max_iterations": 2, "max_output_tokens": 96}
    group, episodes = one_group_of_two(proxy, "tac", options)
    assert (group["status"], group["task_id"]) == ("complete", "tac/hello-file")
    for episode in episodes:
        assert_recorded(episode, {"terminal", "file_editor"})
        assert len(episode["calls"]) <= 2  # max_iterations
        meta = episode["reward_metadata"]
        assert meta["ending"] in {"finished", "stuck", "MaxIterationsReached"}
        result, total = meta["final_score"]
        assert total == 2 and episode["reward"] == score(Checkpoint(total, result))


def test_openhands_on_a_tac_task_without_checkpoints_is_rewarded_by_the_judge(
    proxy: ProxyProcess, tmp_path: Path
) -> None:
    task_dir = tmp_path / "tasks" / "hello-open"
    shutil.copytree(BUNDLED / "hello-file", task_dir)
    (task_dir / "evaluator.py").unlink()  # no checkpoints: only the judge can reward it
    summary = run_workflow(
        proxy,
        "run",
        "tac",
        group_size=2,
        concurrency=2,
        reward="judge",
        options={
            "tasks_dir": task_dir.parent,
            "max_iterations": 2,
            "max_output_tokens": 96,
            "system_prompt": "short",
        },
        timeout=900,
    )
    assert summary["episodes"] == 2 and summary["judge"]["requests"] >= 1, summary
    (group,) = [g for g in groups_of(proxy, "tac") if g["task_id"] == "tac/hello-open"]
    episodes = episodes_of(proxy, group)
    if summary["rewarded"] == 2:  # the judge answered: its score is the reward, the instruction its task
        assert group["status"] == "complete"
        for episode in episodes:
            verdict = episode["reward_metadata"]["judge"]
            assert episode["reward"] == verdict["score"] and episode["reward_metadata"]["checkpoints"] is None
            assert (task_dir / "task.md").read_text().strip()[:60] in verdict["prompt"][1]["content"]
    else:  # the 135M judge failed its attempts: abandoned as not the agent's doing, never rewarded
        assert summary["judge"]["failed"] == 1
        assert all(e["abandon_reason"].startswith("infrastructure: judge: ") for e in episodes)
