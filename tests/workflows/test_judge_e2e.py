"""The judge on real recorded episodes: math groups run through a real proxy and vLLM, then judged.

One real judgement goes through the proxy's unrecorded ``/passthrough/v1`` to the same vLLM
(SmolLM2 as the judge, with guided decoding of the JSON schema). The abandon path uses a fake judge:
a tiny local HTTP server that answers every request with malformed JSON, named as such.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from contract.client import AsyncProxyClient
from tests.support.services import ADMIN_KEY, ProxyProcess
from tests.workflows.conftest import admin_get, ask
from workflows.base import Endpoint, Episode, Outcome, Split, Workflow
from workflows.judge import JUDGE_FAILED, Judge, JudgeConfig
from workflows.judge.prompt import SCORE_MAX, SCORE_MIN
from workflows.math.reward import check
from workflows.math.run import MathOptions, MathWorkflow
from workflows.runner import RunConfig, Runner

pytestmark = pytest.mark.vllm


def garbage(_: dict[str, Any]) -> str:
    return '{"trajectory_1": {"re'


class FakeJudge:
    """A fake judge endpoint: a local OpenAI-style server answering each request with ``answer(request)``
    (by default malformed JSON)."""

    def __init__(self, answer: Callable[[dict[str, Any]], str] = garbage, statuses: Sequence[int] = ()) -> None:
        self.requests: list[dict[str, Any]] = []
        self.statuses = list(statuses)
        """HTTP status of the first requests (then 200); an error status answers an error body."""
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server hook's name
                request = json.loads(self.rfile.read(int(self.headers["content-length"])))
                fake.requests.append({**request, "_authorization": self.headers.get("authorization")})
                body = {
                    "choices": [{"index": 0, "finish_reason": "stop", "message": {"content": answer(request)}}],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 5},
                }
                status = fake.statuses.pop(0) if fake.statuses else 200
                if status != 200:
                    body = {"error": {"message": "fake judge error", "type": "server_error"}}
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self) -> FakeJudge:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_judge() -> Iterator[FakeJudge]:
    with FakeJudge() as judge:
        yield judge


def math_runner(proxy: ProxyProcess, client: AsyncProxyClient, judge: Judge, **config: Any) -> Runner:
    workflow = MathWorkflow(MathOptions(max_tokens=24, format_weight=0.2))
    run = RunConfig(proxy_url=proxy.url, admin_key=ADMIN_KEY, groups=1, group_size=3, concurrency=3, seed=3, **config)
    return Runner(workflow, run, client, judge=judge)


async def test_a_real_judgement_through_passthrough_mixes_with_the_verifier(proxy: ProxyProcess) -> None:
    passthrough = Endpoint(f"{proxy.url}/passthrough/v1", ADMIN_KEY)
    # The default token allowance (160 per trajectory): with 96 the group failed once on a CI machine,
    # which left no reason behind; a greedy judge that pads its JSON with whitespace can run out of
    # tokens on every attempt. The episodes' errors go into the failure message. Five attempts, not
    # three: each shows the trajectories in another order (another greedy answer), and the 135M judge
    # failed all three once on a 2-core AVX2 EPYC; what this test checks is the path of an answer.
    judge = Judge(JudgeConfig.from_env(passthrough, {}, attempts=5))
    async with AsyncProxyClient(proxy.url, ADMIN_KEY) as client:
        stats = await math_runner(proxy, client, judge, reward="mix", judge_weight=0.5).run()
    await judge.aclose()
    (group,) = stats.groups
    errors = [e.error for e in group.episodes]
    assert group.status == "complete" and group.judge_attempts is not None, (group.status, errors)
    assert [e.status for e in group.episodes] == ["rewarded"] * 3, [e.error for e in group.episodes]
    gold = admin_get(proxy, f"/groups/{group.group_id}")["metadata"]["task"]["answer"]
    scores: dict[str, float] = {}
    for result in group.episodes:
        episode = admin_get(proxy, f"/episodes/{result.episode_id}")
        (call,) = episode["calls"]  # the judge's request went through passthrough: not recorded here
        reply = call["response"]["choices"][0]["message"]["content"]
        meta = episode["reward_metadata"]
        verdict = meta["judge"]
        assert meta["reward_mode"] == "mix" and meta["verifier_reward"] == pytest.approx(check(reply, gold).reward(0.2))
        assert SCORE_MIN <= verdict["score"] <= SCORE_MAX and isinstance(verdict["reason"], str)
        assert episode["reward"] == pytest.approx(0.5 * meta["verifier_reward"] + 0.5 * verdict["score"])
        assert verdict["model"] == "policy-base" and verdict["latency_s"] > 0 and verdict["usage"]["prompt_tokens"] > 0
        assert verdict["attempts"] == group.judge_attempts and len(verdict["failures"]) == verdict["attempts"] - 1
        prompt = verdict["prompt"][1]["content"]
        assert "# Task" in prompt and f"## {verdict['label']}\n" in prompt and reply.strip()[:40] in prompt
        assert json.loads(verdict["answer"])[verdict["label"]]["score"] is not None
        if reply in scores:  # identical trajectories: one label, one score
            assert verdict["score"] == scores[reply]
        scores[reply] = verdict["score"]
    assert stats.judge is not None and stats.judge.judged == 1 and stats.judge.failed == 0
    assert stats.summary()["judge"]["requests"] == group.judge_attempts


async def test_a_judge_answering_garbage_gets_its_episodes_abandoned(
    proxy: ProxyProcess, fake_judge: FakeJudge
) -> None:
    judge = Judge(JudgeConfig(base_url=fake_judge.url, api_key="sk-fake-judge", model="judge-model", attempts=2))
    async with AsyncProxyClient(proxy.url, ADMIN_KEY) as client:
        stats = await math_runner(proxy, client, judge, reward="judge").run()
    await judge.aclose()
    (group,) = stats.groups
    assert len(fake_judge.requests) == 2 and group.judge_attempts == 2
    for request in fake_judge.requests:
        assert request["model"] == "judge-model" and request["_authorization"] == "Bearer sk-fake-judge"
        assert request["response_format"]["type"] == "json_schema"
    assert [e.status for e in group.episodes] == ["abandoned"] * 3 and group.status == "failed"
    for result in group.episodes:
        episode = admin_get(proxy, f"/episodes/{result.episode_id}")
        assert episode["status"] == "abandoned" and episode["reward"] is None
        reason = episode["abandon_reason"]
        assert reason.startswith(JUDGE_FAILED + "no valid judgement after 2 attempt(s): attempt 1: malformed answer")
        assert "sk-fake-judge" not in reason
    summary = stats.summary()
    assert summary["abandoned"] == 3 and summary["rewarded"] == 0
    assert {k: summary["judge"][k] for k in ("judged", "failed", "requests", "retries", "malformed")} == {
        "judged": 0,
        "failed": 1,
        "requests": 2,
        "retries": 1,
        "malformed": 2,
    }


@dataclass(frozen=True)
class TwinOptions:
    reward: float | None = 1.0


class Twins(Workflow[str, TwinOptions]):
    """Episodes 0 and 2 ask the same greedy one-token question, episode 1 another: two distinct views."""

    name = "twins"
    options_type = TwinOptions

    def tasks(self, split: Split) -> Sequence[str]:
        return ["twins"]

    def task_id(self, task: str) -> str:
        return "judge/twins"

    async def run_episode(self, task: str, episode: Episode) -> Outcome:
        if self.options.reward is not None:
            return Outcome(reward=self.options.reward)
        question = "Say yes." if episode.index != 1 else "Say no."
        await ask(episode, question, max_tokens=1, temperature=0.0)
        return Outcome(reward=None, metadata={"question": question})


def by_label(request: dict[str, Any]) -> str:
    """A valid answer: trajectory_1 gets 0.25, every other one 1.5 (clipped to 1.0)."""
    labels = request["response_format"]["json_schema"]["schema"]["required"]
    return json.dumps({name: {"reason": "fake", "score": 0.25 if i == 0 else 1.5} for i, name in enumerate(labels)})


async def test_identical_trajectories_share_one_label_and_score(proxy: ProxyProcess) -> None:
    with FakeJudge(by_label) as fake:
        judge = Judge(JudgeConfig(base_url=fake.url, api_key="k", model="judge-model"))
        config = RunConfig(proxy_url=proxy.url, admin_key=ADMIN_KEY, group_size=3, concurrency=3, reward="judge")
        async with AsyncProxyClient(proxy.url, ADMIN_KEY) as client:
            stats = await Runner(Twins(TwinOptions(reward=None)), config, client, judge=judge).run()
        await judge.aclose()
    (group,) = stats.groups
    (request,) = fake.requests
    assert request["response_format"]["json_schema"]["schema"]["required"] == ["trajectory_1", "trajectory_2"]
    rewards = {admin_get(proxy, f"/episodes/{e.episode_id}")["metadata"]["index"]: e for e in group.episodes}
    assert [rewards[i].status for i in range(3)] == ["rewarded"] * 3 and group.status == "complete"
    assert rewards[0].reward == rewards[2].reward != rewards[1].reward
    for result in group.episodes:
        verdict = result.metadata["judge"]
        assert result.reward == (0.25 if verdict["label"] == "trajectory_1" else 1.0)
        assert verdict["clipped"] == (verdict["label"] == "trajectory_2")
        assert result.metadata["verifier_reward"] is None and result.metadata["reward_mode"] == "judge"
    assert stats.judge is not None and (stats.judge.duplicates, stats.judge.clipped) == (1, 1)


async def test_no_verifier_reward_without_the_judge_is_abandoned_saying_so(proxy: ProxyProcess) -> None:
    config = RunConfig(proxy_url=proxy.url, admin_key=ADMIN_KEY, group_size=2, concurrency=2)
    async with AsyncProxyClient(proxy.url, ADMIN_KEY) as client:
        stats = await Runner(Twins(TwinOptions(reward=None)), config, client).run()
    (group,) = stats.groups
    for result in group.episodes:
        assert result.status == "abandoned" and result.reward is None
        assert (
            result.error == "the workflow has no verifier reward for this task; run with --reward judge, not verifier"
        )
    with pytest.raises(ValueError, match="reward 'judge' needs a judge"):
        async with AsyncProxyClient(proxy.url, ADMIN_KEY) as client:
            Runner(Twins(TwinOptions()), RunConfig(proxy_url=proxy.url, admin_key=ADMIN_KEY, reward="judge"), client)


@pytest.mark.parametrize(("statuses", "requests", "outcome"), [([503], 2, "rewarded"), ([401], 1, "abandoned")])
async def test_a_failed_judge_request_is_retried_unless_it_cannot_help(
    proxy: ProxyProcess, statuses: list[int], requests: int, outcome: str
) -> None:
    with FakeJudge(by_label, statuses) as fake:
        judge = Judge(JudgeConfig(base_url=fake.url, api_key="k", retry_wait_s=0.1))
        config = RunConfig(proxy_url=proxy.url, admin_key=ADMIN_KEY, group_size=2, concurrency=2, reward="mix")
        async with AsyncProxyClient(proxy.url, ADMIN_KEY) as client:
            stats = await Runner(Twins(TwinOptions(reward=0.5)), config, client, judge=judge).run()
        await judge.aclose()
    (group,) = stats.groups
    assert len(fake.requests) == requests == group.judge_attempts
    assert [e.status for e in group.episodes] == [outcome] * 2
    if outcome == "rewarded":  # one trajectory (no model calls, identical views): 0.25 from the judge
        verdict = group.episodes[0].metadata["judge"]
        assert verdict["failures"] == [f"attempt 1: judge endpoint answered 503: {fake_error()}"]
        assert [e.reward for e in group.episodes] == [0.5 * 0.5 + 0.5 * 0.25] * 2
    else:
        assert group.episodes[0].error == JUDGE_FAILED + (
            f"no valid judgement after 1 attempt(s): attempt 1: judge endpoint answered 401: {fake_error()}"
        )


def fake_error() -> str:
    return json.dumps({"error": {"message": "fake judge error", "type": "server_error"}})
