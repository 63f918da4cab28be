"""`make run RUN_CONFIG=configs/run-openhands.yaml` in miniature: every phase on the real engine.

The launcher runs as ``make run`` does, routed to the session's vLLM, on the bundled TAC tasks (four
train, two test) with tiny limits: evaluation of the base policy, demonstrations recorded by the real
OpenHands agent through the scripted demonstrator the stack starts (the proxy's teacher), one
warm-start step on them, its evaluation, GRPO with the agent choosing its own tool calls, and the
final evaluation. SmolLM2 serves it, not the plumbing model: the demonstrations are recorded in the
student's token space by rendering the teacher's tool calls with the engine's chat template (the
hermes tool format SmolLM2's template has and the plumbing model's lacks), and OpenHands needs an
engine that parses tool calls out of what the model writes.

GRPO's first step is not fixed: a group whose runs all score the same teaches nothing and the
trainer skips it (``train_reason`` says why) and waits for more. So training runs for a fixed time
(``min_train_minutes``) rather than a step count, and the test asserts that the trainer acted on
GRPO groups after the warm start: a step trained, or groups skipped with a trainer's typed reason.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path
from typing import get_args

import pytest
import yaml

from contract.vocabulary import TrainerSkip
from tests.support.services import ROOT, free_port

pytestmark = pytest.mark.vllm

AGENT = ["-o", "system_prompt=short", "-o", "max_iterations=3", "-o", "max_output_tokens=128"]


def test_base_warm_start_and_grpo_are_each_evaluated(smol_vllm_url: str, smol_dir: str, tmp_path: Path) -> None:
    config = {
        "data_dir": str(tmp_path),
        "proxy_config": "configs/local.yaml",
        "proxy_port": free_port(),
        "engine": {"url": smol_vllm_url, "model": smol_dir},
        "seed": 5,
        # A tiny budget: training gets min_train_minutes, whatever the evaluations took.
        "budget_minutes": 0.1,
        "min_train_minutes": 1.5,
        "eval_after_slowdown": 0,
        "resume": False,
        "trainer": {
            "config": "configs/trainer-local.yaml",
            "overrides": {
                "groups_per_step": 1,
                "batch_wait_s": 1,
                "max_seq_len": 8192,
                "micro_batch_tokens": 8192,
                "shared_prefix": True,
            },
        },
        "workflow": {
            "name": "tac",
            "args": ["--group-size", "2", "--concurrency", "2", "--max-pending", "1", *AGENT],
        },
        "eval": {"args": ["--split", "test", "--limit", "1", "--concurrency", "1", *AGENT]},
        "guard": {"action": "warn", "probe_every": 0},
        # the four bundled train tasks, one demonstration each; one step of two (a step of four took
        # ~2 min on 2 cores: each demonstration is ~3.5k tokens)
        "warm_start": {"groups": 4, "concurrency": 2, "steps": 1, "episodes_per_step": 2, "learning_rate": 1e-4},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    env = dict(os.environ, PYTHONPATH=str(ROOT), FLYWHEEL_POLICY__ADAPTER_PREFIX=f"oh-{uuid.uuid4().hex[:6]}-v")
    env.pop("FLYWHEEL_ADMIN_KEY", None)
    done = subprocess.run(
        [sys.executable, "-m", "deploy.local", "run", "--config", str(path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    [run_dir] = (tmp_path / "runs").iterdir()
    assert done.returncode == 0, done.stderr[-4000:] + _tail(run_dir / "logs")
    report = json.loads((run_dir / "report.json").read_text())

    # Three evaluations of the same held-out task, each with success and mean checkpoint score.
    evals = [json.loads((run_dir / f"eval_{p}.json").read_text()) for p in ("before", "warm", "after")]
    assert [e["split"] for e in evals] == ["test"] * 3 and [e["n"] for e in evals] == [1, 1, 1]
    for phase, result in zip(("before", "warm", "after"), evals, strict=True):
        assert report[f"eval_{phase}"] == result["accuracy"] and report[f"score_{phase}"] == result["mean_score"]
        assert 0 <= result["mean_score"] <= 1 and result["accuracy"] in (0.0, 1.0)
        assert result["accuracy"] == 0.0 or result["mean_score"] == 1.0  # success: every checkpoint
    assert set(report["by_kind"]) == {"-"} and set(report["by_kind"]["-"]) == {"before", "warm", "after"}
    assert "held-out accuracy" in done.stderr and "(warm start, 1 steps)" in done.stderr

    warm = report["warm_start"]
    assert warm["steps"] == 1 and warm["last_step"] == 1 and warm["published_version"] >= 1
    assert warm["demonstrations"]["episodes"] == 4 and warm["demonstrations"]["selected"] >= 1
    with sqlite3.connect(run_dir / "flywheel.db") as db:
        demos = db.execute(
            "select reward, json_extract(metadata, '$.source') from episodes where json_extract(metadata, '$.source') "
            "= 'teacher:demo'"
        ).fetchall()
        teacher_groups = db.execute(
            "select train_status, train_reason from groups where json_extract(metadata, '$.source') = 'teacher:demo'"
        ).fetchall()
        published = [v for (v,) in db.execute("select version from policy_versions order by version")]
        grpo_groups = db.execute(
            "select train_status, train_reason from groups where coalesce(json_extract(metadata, '$.source'), '') "
            "!= 'teacher:demo' and train_status is not null and train_status != 'pending'"
        ).fetchall()
    # Demonstrations: recorded through the teacher, graded by each task's evaluator.
    assert len(demos) == 4 and all(r is not None for r, _ in demos) and max(r for r, _ in demos) == 1.0
    # GRPO never trains a teacher's group: its claim marks them skipped.
    assert teacher_groups and all(row == ("skipped", "teacher") for row in teacher_groups), teacher_groups
    # The warm start's step, journalled with its phase, and its adapter published.
    journal = [json.loads(line) for line in (run_dir / "trainer" / "steps.jsonl").read_text().splitlines()]
    assert journal[0]["step"] == 1 and journal[0]["phase"] == "warm_start", journal[0]
    assert warm["published_version"] in published
    # The warm evaluation scored the warm start's adapter; the final one that or a later version.
    assert evals[1]["policy_serving"] == warm["published_version"] and evals[0]["policy_serving"] == 0
    assert int(report["policy_versions_evaluated"][0]) >= warm["published_version"]
    # GRPO after it: a step trained (step 2 on), or its groups skipped with the trainer's typed reason.
    grpo_steps = [j for j in journal if j.get("phase") != "warm_start"]
    skipped = [reason for status, reason in grpo_groups if status == "skipped" and reason in get_args(TrainerSkip)]
    assert (grpo_steps and grpo_steps[0]["step"] == 2) or skipped, (journal, grpo_groups)
    assert report["steps"] == len(grpo_steps) and (run_dir / "learning_curve.png").stat().st_size > 10_000


def _tail(logs: Path) -> str:
    return "".join(f"\n--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(logs.glob("*.log")))
