"""What ``bench/fork_vs_flat.py`` counts from an arm's store, on a SQLite store seeded through the repository."""

from __future__ import annotations

from pathlib import Path

from bench.fork_vs_flat import store_figures
from proxy.store.db import migrate_async
from proxy.store.repository import Repository
from tests.support.records import chat_call


async def test_generated_tokens_leave_out_replayed_calls_and_the_saved_time_is_their_sources(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'flywheel.db'}"
    await migrate_async(url)
    repo = Repository(url)
    try:
        group = await repo.episodes.create_group(task_id="t", size=1, metadata={"workflow": "calc"})
        source = (group.episodes or [])[0].id
        for latency in (100.0, 300.0):
            assert await repo.calls.insert([chat_call(source, completion_tokens=10, latency_ms=latency)]) == [None]
        await repo.episodes.set_reward(source, reward=1.0, call_rewards=None, metadata=None)
        fork = await repo.forks.create(source, at=2, size=2, rule="sample", metadata={})
        first, second = [e.id for e in fork.episodes or []]
        for ordinal in (0, 1):
            replay = {"replay": {"source_episode_id": source, "source_ordinal": ordinal, "index": ordinal}}
            replayed = chat_call(first, completion_tokens=10, latency_ms=1.0, notes=replay)
            assert await repo.calls.insert([replayed]) == [None]
        assert await repo.calls.insert([chat_call(first, completion_tokens=7)]) == [None]
        failed = chat_call(second, completion_tokens=5)
        failed.status_code = 500
        assert await repo.calls.insert([failed]) == [None]
        await repo.forks.diverge(second, at=0, divergence={"fields": ["messages[1]"], "rule": "sample"})
    finally:
        await repo.close()
    figures = store_figures(tmp_path / "flywheel.db")
    assert figures == {
        "generated_tokens": 10 + 10 + 7,  # the source's two calls and the fork's own; not the replays, not a 500
        "replayed_calls": 2,
        "replayed_tokens": 10 + 10,  # answered from the record, never generated
        "engine_seconds_saved": 0.4,  # what the replayed calls took the engine in the source
        "groups": 2,
        "fork_groups": 1,
        "fork_episodes": 2,
        "fork_diverged": 1,
    }
