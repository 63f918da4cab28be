"""Dataset export (``proxy/export.py``): ``python -m proxy export`` and the dashboard's download, on
real SQLite and PostgreSQL stores seeded through the repository, loaded back with Hugging Face
``datasets``. Episodes recorded from the real engine are exported in
tests/integration/test_dashboard_real.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from proxy.store.db import migrate_async
from proxy.store.records import NewCall
from proxy.store.repository import Repository
from tests.proxy.conftest import ADMIN, fake_upstream, make_settings, running_app
from tests.support.records import chat_call
from tests.support.services import ROOT

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

TOOL = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+2"}'}}


def _call(
    episode_id: str, messages: list[dict[str, Any]], ids: list[int], logprobs: list[float], sampling: dict[str, Any]
) -> NewCall:
    return chat_call(
        episode_id,
        request={"model": "policy", "messages": messages, "tools": [{"type": "function", "function": {"name": "c"}}]},
        response={"id": "x", "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]},
        prompt_token_ids=[1, 2, 3, len(messages)],
        choices=[
            {
                "index": 0,
                "token_ids": ids,
                "logprobs": logprobs,
                "finish_reason": "stop",
                "text": "four" if len(messages) > 2 else "",
                "tool_calls": None if len(messages) > 2 else [TOOL],
            }
        ],
        model_served="policy-v2",
        policy_version=2,
        latency_ms=10.0,
        prompt_tokens=4,
        completion_tokens=len(ids),
        notes={"sampling": sampling},
    )


async def _seed(repo: Repository, groups: int) -> list[str]:
    """``groups`` groups of 3: two tool-calling episodes rewarded (0.0 and 1.0), one abandoned."""
    rewarded = []
    for g in range(groups):
        group = await repo.episodes.create_group(
            task_id=f"calc-{g}" if g % 2 == 0 else f"math-{g}", size=3, metadata={}
        )
        first, second, third = [e.id for e in group.episodes or []]
        for eid, reward in ((first, 1.0), (second, 0.0)):
            system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
            follow = [
                *system,
                {"role": "assistant", "content": None, "tool_calls": [TOOL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "4"},
            ]
            await repo.calls.insert(
                [_call(eid, system, [7, 8, 9], [-0.5, 0.0, -1.0], {"mode": "constrained", "grammar": {"json": "{}"}})]
            )
            await repo.calls.insert([_call(eid, follow, [10, 11], [-0.25, -2.0], {"mode": "sampled"})])
            await repo.episodes.set_reward(eid, reward=reward, call_rewards={"0": 0.3}, metadata={"g": g})
            rewarded.append(eid)
        await repo.calls.insert([_call(third, [{"role": "user", "content": "hi"}], [5], [-0.1], {"mode": "greedy"})])
        await repo.episodes.abandon(third, reason="gave up")
    return rewarded


@pytest.fixture
async def seeded(store_url: str) -> tuple[str, list[str]]:
    await migrate_async(store_url)
    repo = Repository(store_url)
    try:
        rewarded = await _seed(repo, groups=5)
    finally:
        await repo.close()
    return store_url, rewarded


def _export(url: str, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FLYWHEEL_STORE__URL": url, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "proxy", "export", "--out", str(out), *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _load(path: Path, cache: Path) -> Any:
    from datasets import load_dataset

    builder = "parquet" if path.suffix == ".parquet" else "json"
    return load_dataset(builder, data_files=str(path), split="train", cache_dir=str(cache))


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
async def test_cli_export_loads_in_datasets_with_messages_tokens_masks_and_rewards(
    seeded: tuple[str, list[str]], tmp_path: Path, fmt: str
) -> None:
    url, rewarded = seeded
    out = tmp_path / f"episodes.{fmt}"
    done = _export(url, out, "--format", fmt, "--status", "rewarded", "--page", "3")
    assert done.returncode == 0, done.stderr
    assert "10 episodes written" in done.stderr
    if fmt == "parquet":
        assert pq.ParquetFile(out).num_row_groups == 4  # pages of 3: streamed, one row group per page
    data = _load(out, tmp_path / "hf")
    assert data.num_rows == 10
    assert sorted(data["episode_id"]) == sorted(rewarded)
    assert data["created_at"] == sorted(data["created_at"])  # oldest first
    row = data[0]
    assert row["status"] == "rewarded" and row["reward"] in (0.0, 1.0)
    assert row["advantage"] == (1.0 if row["reward"] == 1.0 else -1.0)  # two members, rewards 1 and 0
    assert row["policy_versions"] == [2]
    assert json.loads(row["metadata"]) == {} and json.loads(row["reward_metadata"])["g"] in range(5)
    # The conversation as the last call saw it, plus its answer: ready for a chat template.
    assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert row["messages"][2]["tool_calls"][0]["function"] == TOOL["function"]
    assert row["messages"][3]["tool_call_id"] == "call_1" and row["messages"][3]["content"] == "4"
    assert row["messages"][4]["content"] == "four"
    assert json.loads(row["tools"])[0]["function"]["name"] == "c"
    first, second = row["calls"]
    assert (first["ordinal"], second["ordinal"]) == (0, 1)
    assert first["prompt_token_ids"] == [1, 2, 3, 2] and second["prompt_token_ids"] == [1, 2, 3, 4]
    (choice,) = first["choices"]
    assert choice["token_ids"] == [7, 8, 9] and choice["logprobs"] == [-0.5, 0.0, -1.0]
    # Constrained: the token the grammar forced (log-prob exactly 0) is not trained.
    assert first["sampling_mode"] == "constrained" and first["trained"] is True
    assert choice["loss_mask"] == [1, 0, 1]
    assert choice["tool_calls"][0]["function"]["name"] == "calculator"
    assert choice["reward"] == 0.3  # call_rewards {"0": 0.3}
    assert second["choices"][0]["loss_mask"] == [1, 1] and second["choices"][0]["reward"] is None
    assert second["policy_version"] == 2 and second["exact_ids"] is True


async def test_cli_filters_and_greedy_calls_are_not_trained(seeded: tuple[str, list[str]], tmp_path: Path) -> None:
    url, _ = seeded
    out = tmp_path / "abandoned.jsonl"
    assert _export(url, out, "--status", "abandoned", "--task", "calc-").returncode == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 and {r["task_id"] for r in rows} == {"calc-0", "calc-2", "calc-4"}
    (call,) = rows[0]["calls"]
    assert call["sampling_mode"] == "greedy" and call["trained"] is False
    assert call["choices"][0]["loss_mask"] == [0] and rows[0]["advantage"] is None
    assert rows[0]["abandon_reason"] == "gave up"

    future = tmp_path / "future.parquet"
    done = _export(url, future, "--format", "parquet", "--since", "2999-01-01")
    assert done.returncode == 0 and pq.read_table(future).num_rows == 0  # an empty export is a valid file

    for bad in (["--format", "csv"], ["--status", "done"], ["--since", "yesterday"]):
        done = _export(url, tmp_path / "bad.jsonl", *bad)
        assert done.returncode == 2 and bad[0] in done.stderr, bad
        assert not (tmp_path / "bad.jsonl").exists()


async def test_dashboard_download_streams_the_same_export_behind_the_admin_key(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'flywheel.db'}"
    await migrate_async(url)
    async with running_app(make_settings(url), transport=fake_upstream()) as client:
        rewarded = await _seed(client.app.state.services.repo, groups=2)  # type: ignore[attr-defined]
        anonymous = await client.get("/ui/export", params={"format": "parquet"})
        assert anonymous.status_code == 303 and anonymous.headers["location"].startswith("/ui/login")
        page = await client.get("/ui/groups", headers=ADMIN)
        assert 'action="/ui/export"' in page.text and 'id="download"' in page.text
        response = await client.get("/ui/export", params={"format": "parquet", "status": "rewarded"}, headers=ADMIN)
        assert response.status_code == 200, response.text
        assert response.headers["content-type"] == "application/vnd.apache.parquet"
        assert 'filename="flywheel-episodes-rewarded.parquet"' in response.headers["content-disposition"]
        path = tmp_path / "download.parquet"
        path.write_bytes(response.content)
        data = _load(path, tmp_path / "hf")
        assert sorted(data["episode_id"]) == sorted(rewarded)
        anything = await client.get("/ui/export", params={"format": "jsonl", "status": ""}, headers=ADMIN)
        assert anything.status_code == 200 and len(anything.text.splitlines()) == 6
        for params in ({"format": "csv"}, {"since": "yesterday"}, {"status": "done"}):
            bad = await client.get("/ui/export", params=params, headers=ADMIN)
            assert bad.status_code == 400, (params, bad.text)
            assert bad.json()["error"]["type"] == "invalid_request_error"


async def test_a_fork_episode_exports_its_source_and_its_replayed_calls_untrained(
    store_url: str, tmp_path: Path
) -> None:
    await migrate_async(store_url)
    repo = Repository(store_url)
    try:
        source = (await _seed(repo, groups=1))[0]
        fork = await repo.forks.create(source, at=1, size=2, rule="sample", metadata={})
        child = (fork.episodes or [])[0].id
        replayed = _call(child, [{"role": "user", "content": "2+2?"}], [7, 8], [-0.5, -1.0], {"mode": "sampled"})
        replayed.notes = {**(replayed.notes or {}), "replay": {"source_episode_id": source, "source_ordinal": 0}}
        follow = _call(child, [{"role": "user", "content": "2+2?"}] * 3, [10], [-0.25], {"mode": "sampled"})
        assert await repo.calls.insert([replayed]) == [None]
        assert await repo.calls.insert([follow]) == [None]
        await repo.forks.diverge((fork.episodes or [])[1].id, at=0, divergence={"fields": ["tools"], "rule": "sample"})
        await repo.episodes.set_reward(child, reward=1.0, call_rewards=None, metadata=None)
    finally:
        await repo.close()
    done = _export(store_url, tmp_path / "out.jsonl")
    assert done.returncode == 0, done.stderr
    rows = {r["episode_id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    row = rows[child]
    assert (row["fork_of"], row["fork_at"], row["diverged_at"]) == (source, 1, None)
    assert [c["trained"] for c in row["calls"]] == [False, True]  # the replayed call was trained in its source
    assert row["calls"][0]["choices"][0]["loss_mask"] == [0, 0]
    assert json.loads(row["fidelity"])["replayed"] == 1
    assert rows[source]["fork_of"] is None
