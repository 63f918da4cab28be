"""kill -9 at the two dangerous instants, then resume: the step counter continues, no group is acked twice or lost.

``python -m trainer run`` kills itself with SIGKILL (``FLYWHEEL_TRAINER_FAULT``) first right after
step 2's checkpoint, before its groups are acked or its adapter published; then, in the second
run, right after claiming step 3's group. The third run must finish step 2's bookkeeping from the
checkpoint, train step 3's group under the lease it already holds, and stop at max_steps. And a
lease that lapses while the trainer is down is renewed by the restart before it acks (the proxy
refuses acks from expired leases), unless another trainer claimed the group meanwhile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.services import ADMIN_KEY, ROOT, engine_python
from tests.trainer.conftest import ADMIN, TrainerProxy

pytestmark = pytest.mark.vllm


def run_trainer(
    proxy: TrainerProxy, out: Path, model: str, fault: str | None, *overrides: str
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, FLYWHEEL_ADMIN_KEY=ADMIN_KEY, PYTHONPATH=str(ROOT), FLYWHEEL_MODEL_DIR=model)
    env.pop("FLYWHEEL_TRAINER_FAULT", None)
    if fault:
        env["FLYWHEEL_TRAINER_FAULT"] = fault
    args = [
        f"proxy_url={proxy.url}",
        f"output_dir={out}",
        "groups_per_step=1",
        "max_steps=3",
        "batch_wait_s=0",
        "poll_interval_s=0.2",
        "tensorboard=false",
        "progress=false",
        "lease_s=600",
        "max_staleness=5",
        *overrides,
    ]  # groups recorded at v0 stay trainable while v1, v2 are published
    python = engine_python() if os.path.exists(engine_python()) else sys.executable
    return subprocess.run(
        [python, "-m", "trainer", "run", "--config", str(ROOT / "configs/trainer-local.yaml"), *args],
        cwd=ROOT,
        env=env,
        text=True,
        capture_output=True,
        timeout=300,
    )


def trained_steps(proxy: TrainerProxy, groups: list[str]) -> dict[str, int | None]:
    return {g: proxy.get(f"/groups/{g}")["trained_step"] for g in groups}


def test_kill_9_then_resume_continues_steps_and_trains_each_group_once(
    trainer_proxy: TrainerProxy, tmp_path: Path, vllm_model_dir: str
) -> None:
    groups = [trainer_proxy.record_group([1.0, 0.0], question=f"What is {i}+{i}?") for i in range(3)]
    out = tmp_path / "run"

    first = run_trainer(trainer_proxy, out, vllm_model_dir, fault="after_checkpoint:2")
    assert first.returncode == -9, first.stderr[-3000:]
    assert list(trained_steps(trainer_proxy, groups).values()) == [1, None, None]  # step 2 checkpointed, not acked
    assert [s["step"] for s in trainer_proxy.get("/trainer/steps")["data"]] == [1]
    assert trainer_proxy.get("/policy")["version"] == 1

    second = run_trainer(trainer_proxy, out, vllm_model_dir, fault="after_claim:3")
    assert second.returncode == -9, second.stderr[-3000:]
    assert "resumed from step-00000002" in second.stderr
    assert list(trained_steps(trainer_proxy, groups).values()) == [1, 2, None]  # step 2 finished from its checkpoint
    assert trainer_proxy.get("/policy")["version"] == 2
    pending = json.loads((out / "pending.json").read_text())
    assert [lease["group_ids"] for lease in pending] == [[groups[2]]]

    third = run_trainer(trainer_proxy, out, vllm_model_dir, fault=None)
    assert third.returncode == 0, third.stderr[-3000:]
    assert json.loads(third.stdout.strip().splitlines()[-1])["last_step"] == 3
    assert "resuming 1 groups claimed before the restart" in third.stderr
    assert list(trained_steps(trainer_proxy, groups).values()) == [1, 2, 3]
    assert [s["step"] for s in trainer_proxy.get("/trainer/steps")["data"]] == [1, 2, 3]
    assert trainer_proxy.get("/policy")["version"] == 3
    assert not (out / "pending.json").exists()

    journal = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [(r["step"], r["trained"]) for r in journal] == [(1, [groups[0]]), (2, [groups[1]]), (3, [groups[2]])]
    for run in (first, second, third):
        assert "[warning]" not in run.stderr  # no refused ack (a double ack would be a 409) and no failed publish
    # the lease held when the second run died is the one step 3 acked under: nobody waited for it to expire
    assert journal[2]["leases"] == [pending[0]["lease_id"]]


def test_a_lease_that_lapsed_while_down_is_renewed_before_the_restart_acks(
    trainer_proxy: TrainerProxy, tmp_path: Path, vllm_model_dir: str
) -> None:
    """Checkpointed, killed before the ack, and the 1 s lease expires before the restart: nobody
    claimed the groups meanwhile, so the restart renews the lease and acks its checkpoint's step;
    the group that another trainer did claim meanwhile is reported, not acked under its lease."""
    taken, kept = (trainer_proxy.record_group([1.0, 0.0], question=f"What is {i}+2?") for i in range(2))
    out = tmp_path / "run"
    first = run_trainer(
        trainer_proxy, out, vllm_model_dir, "after_checkpoint:1", "groups_per_step=2", "lease_s=1", "max_steps=1"
    )
    assert first.returncode == -9, first.stderr[-3000:]
    [lease] = json.loads((out / "checkpoints" / "step-00000001" / "state.json").read_text())["leases"]
    assert sorted(lease["trained"]) == sorted([kept, taken])
    time.sleep(1.5)  # the lease (renewed up to the kill, 1 s at a time) has expired
    refused = httpx.post(
        f"{trainer_proxy.url}/trainer/ack",
        headers=ADMIN,
        timeout=60,
        json={"lease_id": lease["lease_id"], "group_ids": [kept], "step": 1},
    )
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "lease_expired"
    other = httpx.post(
        f"{trainer_proxy.url}/trainer/claim",
        headers=ADMIN,
        timeout=60,
        json={"trainer_id": "other", "max_groups": 1, "lease_s": 600},
    ).json()
    assert [g["id"] for g in other["groups"]] == [taken]  # the oldest of the lapsed lease's groups

    second = run_trainer(trainer_proxy, out, vllm_model_dir, None, "groups_per_step=2", "lease_s=1", "max_steps=1")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from step-00000001" in second.stderr
    assert trained_steps(trainer_proxy, [kept, taken]) == {kept: 1, taken: None}
    assert f"[warning] ack of group {taken} (trained) for step 1 refused" in second.stderr
