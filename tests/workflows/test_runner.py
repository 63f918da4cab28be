"""The runner against a real proxy and vLLM, with scripted episode functions.

Each episode of a group does one scripted thing (a real model call then a reward, an exception, a
timeout, a non-finite reward), so every path ends in exactly the state the runner promises:
rewarded with the posted reward, or abandoned with the error as its reason, never a made-up reward.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from contract.client import AsyncProxyClient, ProxyError
from tests.support.services import ADMIN_KEY, ProxyProcess
from tests.workflows.conftest import admin_get, ask
from workflows.base import Episode, Outcome, Split, Workflow
from workflows.runner import INFRASTRUCTURE, GroupResult, RunConfig, Runner, describe_error, task_order

pytestmark = pytest.mark.vllm


@dataclass(frozen=True)
class ScriptOptions:
    script: tuple[str, ...] = ("reward:1", "reward:0", "raise", "sleep")


class Scripted(Workflow[str, ScriptOptions]):
    """Episode ``i`` plays ``script[i]``; rewarded episodes make one real 2-token model call first."""

    name = "scripted"
    options_type = ScriptOptions

    def tasks(self, split: Split) -> Sequence[str]:
        return [f"{split}-a", f"{split}-b"]

    def task_id(self, task: str) -> str:
        return f"scripted/{task}"

    async def run_episode(self, task: str, episode: Episode) -> Outcome:
        action = self.options.script[episode.index]
        if action == "raise":
            raise RuntimeError("scripted agent failure")
        if action == "sleep":
            await asyncio.sleep(600)  # past any episode timeout below
        if action == "nan":
            return Outcome(reward=float("nan"))
        await ask(episode, "Say hi", max_tokens=2, temperature=1.0)
        return Outcome(reward=float(action.split(":")[1]), metadata={"script": action})


def config(proxy: ProxyProcess, **kw: Any) -> RunConfig:
    return RunConfig(proxy_url=proxy.url, admin_key=ADMIN_KEY, **kw)


async def test_each_episode_ends_rewarded_or_abandoned_with_its_error(proxy: ProxyProcess) -> None:
    client = AsyncProxyClient(proxy.url, ADMIN_KEY)
    # The timeout must outlast a rewarded episode's real 2-token call: with 3 s, a loaded 2-core
    # machine (the first call on a fresh engine) timed the rewarded episodes out too.
    runner = Runner(
        Scripted(ScriptOptions()), config(proxy, groups=1, group_size=4, concurrency=4, episode_timeout_s=20.0), client
    )
    stats = await runner.run()
    await client.aclose()
    (group,) = stats.groups
    assert group.status == "complete"  # two rewarded, two abandoned: enough to train on
    by_index = {admin_get(proxy, f"/episodes/{e.episode_id}")["metadata"]["index"]: e for e in group.episodes}
    assert [by_index[i].status for i in range(4)] == ["rewarded", "rewarded", "abandoned", "abandoned"]
    first = admin_get(proxy, f"/episodes/{by_index[0].episode_id}")
    assert (first["status"], first["reward"], first["reward_metadata"]) == ("rewarded", 1.0, {"script": "reward:1"})
    (call,) = first["calls"]
    assert call["exact_ids"] is True and call["prompt_token_ids"] and call["choices"][0]["token_ids"]
    assert admin_get(proxy, f"/episodes/{by_index[1].episode_id}")["reward"] == 0.0
    failed = admin_get(proxy, f"/episodes/{by_index[2].episode_id}")
    assert failed["status"] == "abandoned" and failed["reward"] is None
    assert failed["abandon_reason"].startswith("RuntimeError: scripted agent failure [at ")
    slow = admin_get(proxy, f"/episodes/{by_index[3].episode_id}")
    assert (slow["status"], slow["abandon_reason"]) == ("abandoned", "timeout: the episode ran past its time limit")
    assert stats.summary()["rewarded"] == 2 and stats.summary()["mean_reward"] == 0.5
    # The workflow's abandon rule travels with the group: the trainer penalizes these two abandons.
    assert admin_get(proxy, f"/groups/{group.group_id}")["metadata"]["abandoned"] == "penalize"


def test_abandons_caused_by_the_proxy_or_engine_are_marked_as_not_the_agents_doing() -> None:
    class Upstream502(Exception):
        status_code = 502

    assert describe_error(Upstream502("bad gateway")).startswith(INFRASTRUCTURE)
    assert describe_error(ConnectionError("refused")).startswith(INFRASTRUCTURE)
    assert not describe_error(RuntimeError("the agent crashed")).startswith(INFRASTRUCTURE)
    assert not describe_error(TimeoutError()).startswith(INFRASTRUCTURE)  # an agent that runs forever: its doing


async def test_a_non_finite_reward_is_not_posted(proxy: ProxyProcess) -> None:
    client = AsyncProxyClient(proxy.url, ADMIN_KEY)
    stats = await Runner(
        Scripted(ScriptOptions(script=("nan", "reward:1"))),
        config(proxy, groups=1, group_size=2, concurrency=2),
        client,
    ).run()
    await client.aclose()
    (group,) = stats.groups
    assert group.status == "failed"  # one rewarded episode is too few for GRPO
    nan = next(e for e in group.episodes if e.status == "abandoned")
    assert nan.error == "episode function returned a non-finite reward (nan)"
    assert admin_get(proxy, f"/episodes/{nan.episode_id}")["reward"] is None


async def test_loop_runs_until_stopped_and_leaves_nothing_open(proxy: ProxyProcess) -> None:
    client = AsyncProxyClient(proxy.url, ADMIN_KEY)
    seen: list[GroupResult] = []
    runner = Runner(
        Scripted(ScriptOptions(script=("reward:1", "reward:0"))),
        config(proxy, group_size=2, concurrency=2, loop=True, seed=3),
        client,
        on_group=lambda g: (seen.append(g), len(seen) >= 3 and runner.stop()),
    )
    stats = await asyncio.wait_for(runner.run(), 120)
    await client.aclose()
    assert len(stats.groups) >= 3
    assert {g.status for g in stats.groups} == {"complete"}
    assert {g.task_id for g in stats.groups} == {"scripted/train-a", "scripted/train-b"}  # cycles the tasks
    for g in stats.groups:
        assert admin_get(proxy, f"/groups/{g.group_id}")["counts"] == {"rewarded": 2}


async def test_focus_reads_the_workflows_finished_groups_back_from_the_store(proxy: ProxyProcess) -> None:
    client = AsyncProxyClient(proxy.url, ADMIN_KEY)
    scripted = Scripted(ScriptOptions(script=("reward:1", "reward:0")))
    first = await Runner(scripted, config(proxy, groups=2, group_size=2, concurrency=2, seed=4), client).run()
    assert [g.status for g in first.groups] == ["complete", "complete"]
    again = Runner(scripted, config(proxy, groups=1, group_size=2, concurrency=2, seed=4, focus=1.0), client)
    stats = await again.run()
    await client.aclose()
    # At least the two groups just run (the module's proxy keeps earlier tests' groups too), each a
    # disagreement (rewards 1 and 0) on its task: both tasks now count as likely to disagree.
    assert stats.recalled_groups >= 2 and stats.summary()["signal"]["focused_draws"] == 1
    picker = again._picker
    assert picker is not None
    for task in ("scripted/train-a", "scripted/train-b"):
        assert picker.outcomes[task].groups >= 1 and picker.outcomes[task].chance > 0.5


async def test_a_wrong_admin_key_stops_the_run(proxy: ProxyProcess) -> None:
    client = AsyncProxyClient(proxy.url, "not-the-admin-key-at-all")
    with pytest.raises(ProxyError) as info:
        await Runner(Scripted(ScriptOptions()), config(proxy, groups=2), client).run()
    await client.aclose()
    assert info.value.status == 401


def test_task_order_without_strata_is_the_seeded_shuffle_it_always_was() -> None:
    tasks = list(range(50))
    expected = list(tasks)
    __import__("random").Random(7).shuffle(expected)
    assert task_order(list(tasks), 7, lambda _: None) == expected


def test_task_order_balances_every_window_over_strata_in_proportion() -> None:
    # 40 of kind a, 20 of b, 20 of c: every window of 4 consecutive tasks holds 2 a, 1 b, 1 c
    tasks = [("a", i) for i in range(40)] + [("b", i) for i in range(20)] + [("c", i) for i in range(20)]
    order = task_order(list(tasks), 3, lambda t: t[0])
    assert sorted(order) == sorted(tasks)
    for start in range(0, len(order), 4):
        window = [kind for kind, _ in order[start : start + 4]]
        assert sorted(window) == ["a", "a", "b", "c"], (start, window)
    assert order != task_order(list(tasks), 4, lambda t: t[0])
    assert [i for k, i in order if k == "a"] != list(range(40))  # shuffled inside the stratum too
