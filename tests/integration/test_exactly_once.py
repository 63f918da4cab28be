"""Exactly once across processes: two trainers and two proxies on one PostgreSQL store, real vLLM.

Two ``python -m trainer run`` processes, each behind its own proxy replica, train the same stream
of groups with leases shorter than their steps (a test hook holds every step past its lease):
renewals keep each group with the trainer that claimed it, so every group is trained once, by one
of them. And a reward that another replica commits while a call is still streaming makes that
call's record be refused inside its transaction: the client gets an error event instead of
``[DONE]``, and the completed group never gains a call.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.store.db import is_sqlite
from tests.support.services import ADMIN_KEY, ROOT, ProxyProcess, engine_python
from tests.trainer.conftest import ADMIN, TrainerProxy

pytestmark = pytest.mark.vllm


@pytest.fixture
def proxies(store_url: str, vllm_url: str, tmp_path: Path) -> Iterator[tuple[TrainerProxy, TrainerProxy]]:
    """Two proxy replicas on one store (started one after the other: each migrates at start)."""
    prefix = f"exactlyonce{uuid.uuid4().hex[:6]}-v"
    started: list[ProxyProcess] = []
    try:
        for name in ("a", "b"):
            process = ProxyProcess(
                upstream_url=vllm_url,
                store_url=store_url,
                workdir=tmp_path / f"proxy-{name}",
                extra_env={"FLYWHEEL_POLICY__ADAPTER_PREFIX": prefix},
            )
            process.start()
            started.append(process)
        a, b = (TrainerProxy(url=p.url, prefix=prefix, process=p) for p in started)
        yield a, b
    finally:
        for process in started:
            process.stop()


def start_trainer(proxy: TrainerProxy, out: Path, model: str, name: str) -> subprocess.Popen[str]:
    env = dict(
        os.environ,
        FLYWHEEL_ADMIN_KEY=ADMIN_KEY,
        PYTHONPATH=str(ROOT),
        FLYWHEEL_MODEL_DIR=model,
        FLYWHEEL_TRAINER_SLOW_STEP_S="3",
    )  # every step outlasts its 1.5 s lease
    env.pop("FLYWHEEL_TRAINER_FAULT", None)
    args = [
        f"proxy_url={proxy.url}",
        f"output_dir={out}",
        f"trainer_id={name}",
        "groups_per_step=1",
        "batch_wait_s=0",
        "poll_interval_s=0.2",
        "tensorboard=false",
        "progress=false",
        "lease_s=1.5",
        "max_staleness=5",
        "publish_every=1000",
    ]  # no publishing: two runs would both number v1, v2, ...
    python = engine_python() if os.path.exists(engine_python()) else sys.executable
    out.mkdir(parents=True)
    with open(out / "stderr.log", "w") as stderr:  # the child has its own descriptor; ours closes here
        return subprocess.Popen(
            [python, "-m", "trainer", "run", "--config", str(ROOT / "configs/trainer-local.yaml"), *args],
            cwd=ROOT,
            env=env,
            text=True,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )


def wait_until(what: str, check: Any, timeout: float, procs: list[subprocess.Popen[str]]) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        for proc in procs:
            assert proc.poll() is None, f"a trainer exited with {proc.returncode} while waiting for {what}"
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.5)


def journal(out: Path) -> list[dict[str, Any]]:
    path = out / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def test_two_trainers_on_one_store_train_each_group_exactly_once(
    proxies: tuple[TrainerProxy, TrainerProxy], store_url: str, tmp_path: Path, vllm_model_dir: str
) -> None:
    if is_sqlite(store_url):
        pytest.skip("the several-trainer deployment is PostgreSQL's")
    a, b = proxies
    outs = [tmp_path / "trainer-1", tmp_path / "trainer-2"]
    procs = [
        start_trainer(a, outs[0], vllm_model_dir, "trainer-1"),
        start_trainer(b, outs[1], vllm_model_dir, "trainer-2"),
    ]
    try:
        wait_until(
            "both trainers polling",
            lambda: all("fresh start" in (o / "stderr.log").read_text() for o in outs),
            300,
            procs,
        )
        groups = [a.record_group([1.0, 0.0], question=f"What is {i}+{i + 1}?") for i in range(6)]
        wait_until(
            "every group trained",
            lambda: all(a.get(f"/groups/{g}")["train_status"] == "trained" for g in groups),
            600,
            procs,
        )
        wait_until(
            "every trained group journalled",
            lambda: {g for o in outs for r in journal(o) for g in r["trained"]} >= set(groups),
            60,
            procs,
        )
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # no final publish: both would claim the same version
            proc.wait()
    trained_by: dict[str, tuple[int, int]] = {}
    for i, out in enumerate(outs):
        for record in journal(out):
            for group_id in record["trained"]:
                assert group_id not in trained_by, f"group {group_id} trained twice: {trained_by[group_id]}, {i}"
                trained_by[group_id] = (i, record["step"])
    assert sorted(trained_by) == sorted(groups)
    assert {i for i, _ in trained_by.values()} == {0, 1}, trained_by  # both trained: they competed
    for group_id, (_, step) in trained_by.items():
        assert a.get(f"/groups/{group_id}")["trained_step"] == step
    for out in outs:
        log = (out / "stderr.log").read_text()
        assert "[warning]" not in log, log[-3000:]  # no refused ack, no lost or failed renewal, no rollback


def test_a_reward_committed_by_one_replica_refuses_a_call_still_streaming_on_another(
    proxies: tuple[TrainerProxy, TrainerProxy],
) -> None:
    a, b = proxies
    created = httpx.post(f"{a.url}/groups", headers=ADMIN, json={"task_id": "race", "size": 2}, timeout=60)
    assert created.status_code == 201, created.text
    first, racing = created.json()["episode_keys"]
    question = {
        "model": "policy",
        "messages": [{"role": "user", "content": "Count from 1 to 100."}],
        "temperature": 1.0,
    }
    done = httpx.post(
        f"{first['base_url']}/chat/completions",
        json={**question, "max_tokens": 4},
        timeout=300,
        headers={"authorization": f"Bearer {first['api_key']}"},
    )
    assert done.status_code == 200, done.text
    assert (
        httpx.post(
            f"{a.url}/episodes/{first['id']}/reward", headers=ADMIN, json={"reward": 0.0}, timeout=60
        ).status_code
        == 200
    )

    auth = {"authorization": f"Bearer {racing['api_key']}"}
    on_b = f"{b.url}/episodes/{racing['id']}/v1/chat/completions"
    # 6,000 tokens: still streaming while a rewards the episode, even on the fast plumbing model and a
    # loaded machine (at 1,024 the stream once ended before the reward committed); cut at the reward
    body = {**question, "max_tokens": 6000, "ignore_eos": True, "stream": True}
    events: list[bytes] = []
    with httpx.stream("POST", on_b, json=body, headers=auth, timeout=300) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                events.append(line.encode())
                break
        # b passed its gate check and the call is generating: a rewards the episode, completing the group
        rewarded = httpx.post(
            f"{a.url}/episodes/{racing['id']}/reward", headers=ADMIN, json={"reward": 1.0}, timeout=60
        )
        assert rewarded.status_code == 200, rewarded.text
        assert a.get(f"/groups/{created.json()['id']}")["status"] == "complete"
        late = httpx.post(on_b, json={**question, "max_tokens": 4}, headers=auth, timeout=300)
        events += [line.encode() for line in lines if line]
    assert late.status_code == 409, late.text
    assert (late.json()["error"]["type"], late.json()["error"]["code"]) == ("conflict_error", "episode_closed")
    assert b"data: [DONE]" not in events
    error = json.loads(events[-1].removeprefix(b"data: "))["error"]
    assert (error["type"], error["code"]) == ("conflict_error", "episode_closed"), error
    assert a.get(f"/episodes/{racing['id']}")["calls"] == []  # nothing stored after the group completed
    claim = httpx.post(f"{b.url}/trainer/claim", headers=ADMIN, json={"max_groups": 1}, timeout=60).json()
    [group] = claim["groups"]
    assert {e["id"]: len(e["calls"]) for e in group["episodes"]} == {first["id"]: 1, racing["id"]: 0}
