"""`make run` in miniature: the whole loop closes on the real engine in a few minutes.

The launcher runs exactly as ``make run`` does (proxy, trainer and math workflow as processes,
evaluation before and after, report and plot), but with a tiny budget, routed to the session's
vLLM instead of starting its own. The loop has closed when a published adapter served later
episodes. SmolLM2 serves it, not the plumbing model: the trainer skips groups whose rewards are all
equal, and only a model that sometimes solves the task makes groups that train.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from tests.support.services import ROOT, free_port

pytestmark = pytest.mark.vllm


WORKFLOWS = {
    "math": ["--group-size", "4", "--concurrency", "4", "--max-pending", "1", "-o", "max_tokens=24"],
    # configs/run-tools.yaml's agent: 2-3 tool calls per episode, one-step tasks keep it short here;
    # its per-call reward too, so few groups have equal rewards (those teach nothing and the trainer
    # skips them, waiting for more).
    "calc": [
        "--group-size",
        "4",
        "--concurrency",
        "4",
        "--max-pending",
        "1",
        "-o",
        "mix=one_step",
        "-o",
        "useful_call_reward=0.3",
    ],
}
OVERRIDES = {"calc": {"turn_credit": "discounted"}}


@pytest.mark.parametrize("workflow", sorted(WORKFLOWS))
def test_two_short_steps_publish_an_adapter_that_serves_later_episodes(
    smol_vllm_url: str, smol_dir: str, tmp_path: Path, workflow: str
) -> None:
    config = {
        "data_dir": str(tmp_path),
        "proxy_config": "configs/local.yaml",
        "proxy_port": free_port(),
        "engine": {"url": smol_vllm_url, "model": smol_dir},
        "seed": 3,
        "budget_minutes": 12,
        "budget_steps": 2,  # the launcher passes it to the trainer as max_steps and waits for it
        "resume": False,
        "trainer": {
            "config": "configs/trainer-local.yaml",
            "overrides": {
                "groups_per_step": 1,
                "batch_wait_s": 1,
                "learning_rate": 1e-3,
                **OVERRIDES.get(workflow, {}),
            },
        },
        "workflow": {"name": workflow, "args": WORKFLOWS[workflow]},
        "eval": {"args": ["--split", "test", "--limit", "8" if workflow == "math" else "4", "--concurrency", "8"]},
        # a probe every two steps on held-out train tasks (deploy/guard.py): one, of the last adapter
        "guard": {"probe_every": 2, "probe_args": ["--split", "val", "--limit", "4", "--concurrency", "4"]},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    env = dict(os.environ, PYTHONPATH=str(ROOT), FLYWHEEL_POLICY__ADAPTER_PREFIX=f"smoke-{uuid.uuid4().hex[:6]}-v")
    env.pop("FLYWHEEL_ADMIN_KEY", None)
    done = subprocess.run(
        [sys.executable, "-m", "deploy.local", "run", "--config", str(path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    [run_dir] = (tmp_path / "runs").iterdir()
    report = json.loads((run_dir / "report.json").read_text())
    assert report["steps"] == 2 and report["budget_steps"] == 2
    assert report["seed"] == 3 and report["model"] == "SmolLM2-135M-Instruct"
    assert 0 <= report["eval_before"] <= 1 and 0 <= report["eval_after"] <= 1
    assert report["eval_n"] == (8 if workflow == "math" else 4)
    assert (run_dir / "learning_curve.png").stat().st_size > 10_000
    guard = report["guard"]
    assert guard["action"] == "rollback" and guard["best_probe"] is not None and guard["last_probe"]["step"] == 2
    # Every second step is probed: step 2 alone.
    probes = sorted(p.name for p in run_dir.glob("eval_probe-*.json"))
    assert probes == ["eval_probe-2.json"], probes
    assert json.loads((run_dir / probes[0]).read_text())["split"] == "val"
    if guard["rolled_back_to"] is not None:  # two steps cannot show a collapse, but a fall of 0.1 on 4 tasks can
        assert guard["collapsed"] and guard["best_probe"]["version"] < guard["rolled_back_to"]
    with sqlite3.connect(run_dir / "flywheel.db") as db:
        published = [v for (v,) in db.execute("select version from policy_versions order by version")]
        served = {v for (v,) in db.execute("select distinct policy_version from calls where status_code = 200")}
        trained = db.execute("select count(*) from groups where train_status = 'trained'").fetchone()[0]
        kept = db.execute("select train_audit from episodes where train_audit is not null")
        audits = [json.loads(a) for (a,) in kept]
    assert published[:2] == [1, 2], published
    # The loop closed: some published adapter served later episodes (with 2-3 calls per episode, a
    # version can be superseded before any episode starts on it, so which one is not fixed).
    assert 0 in served and served & set(published), f"no episode was served by a published adapter: {served}"
    assert trained >= 2
    # Every trained episode carries the trainer's audit (its ack): tokens trained, the engine gap.
    assert audits and sum(a["tokens_trained"] for a in audits) > 0, audits
    assert any(a["gap_mean"] is not None for a in audits) and all(a["step"] in (1, 2) for a in audits)
    if workflow == "calc":  # named tool calls: sampled under the engine's grammar, scored under its mask
        assert sum(a["tokens_under_grammar"] for a in audits) > 0
    # The last adapter is evaluated, or after a rollback the version that republished the best probe's.
    evaluated = str(guard["rolled_back_to"] or 2)
    assert report["eval_after"] is not None and evaluated in report["policy_versions_evaluated"]
    if workflow == "calc":  # the multi-turn figures: every follow-up call extended its episode's sample
        turns = report["multi_turn"]
        assert turns["merged"] > 0 and turns["breaks"] == 0 and turns["merge_rate"] == 1.0, turns
        assert turns["calls_per_episode_trained"] >= 2 and turns["tokens_masked"] > turns["tokens_trained"] > 0
        assert report["multi_turn"]["eval_calls_per_episode"][0] >= 2
