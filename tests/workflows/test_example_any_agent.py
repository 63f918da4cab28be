"""examples/any_agent.py works as its docstring says, against a real proxy and vLLM."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.services import ADMIN_KEY, ROOT, ProxyProcess
from tests.workflows.conftest import admin_get


@pytest.mark.vllm
def test_an_unmodified_openai_agent_becomes_a_data_source(proxy: ProxyProcess) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "any_agent.py"), "--proxy", proxy.url],
        env={**os.environ, "FLYWHEEL_ADMIN_KEY": ADMIN_KEY, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )  # PYTHONPATH: it imports contract.client
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1].endswith(" is complete")
    (group,) = [g for g in admin_get(proxy, "/groups", limit=100)["data"] if g["task_id"] == "capital-of-france"]
    for listed in admin_get(proxy, "/episodes", group_id=group["id"])["data"]:
        episode = admin_get(proxy, f"/episodes/{listed['id']}")
        (call,) = episode["calls"]
        assert call["exact_ids"] is True and call["prompt_token_ids"]
        text = call["response"]["choices"][0]["message"]["content"]
        assert episode["reward"] == float("paris" in text.lower())


@pytest.mark.vllm
def test_the_same_agent_rewarded_by_the_judge(proxy: ProxyProcess) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "any_agent.py"), "--proxy", proxy.url, "--reward", "judge"],
        env={**os.environ, "FLYWHEEL_ADMIN_KEY": ADMIN_KEY, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    group_id = lines[-1].split()[1]
    episodes = admin_get(proxy, "/episodes", group_id=group_id)["data"]
    assert len(episodes) == 2
    if lines[-1].endswith(" is complete"):  # the judge answered: both rewarded with its score
        for listed in episodes:
            episode = admin_get(proxy, f"/episodes/{listed['id']}")
            verdict = episode["reward_metadata"]["judge"]
            assert episode["reward"] == verdict["score"] and episode["reward_metadata"]["reward_mode"] == "judge"
            assert "What is the capital of France?" in verdict["prompt"][1]["content"]
    else:  # SmolLM2 never produced a valid answer in 3 attempts: abandoned with the reason, no reward
        assert lines[-1].endswith(" is failed")
        assert all(e["abandon_reason"].startswith("infrastructure: judge: ") for e in episodes)
