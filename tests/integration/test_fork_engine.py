"""Forking an unchanged agent's episode at turn k, on the real engine (``proxy/replay.py``).

The agent is a plain tool loop over HTTP, deterministic given the model's answers: it asks for a
calculator call (a named tool: the grammar forces the call), computes it, and asks for the final
answer. A fork of its rewarded episode at call k must answer calls 0..k-1 with the bytes the source
was sent (plain) or the same assembled answer (streamed), without the engine, and sample call k
from the engine; a changed request is a divergence, recorded where it happened; the trainer keeps
the replayed calls as context only.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from contract.client import Episode
from tests.support.services import (
    ADMIN_KEY,
    ProxyProcess,
    episode_record,
    grammar_masker,
    new_episode,
    serving_proxy,
    stored_calls,
)
from tests.support.tools import CALCULATOR_PARAMETERS, CALCULATOR_TOOL
from trainer.data import DataStats, episode_samples

pytestmark = pytest.mark.vllm
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
TOOLS = [CALCULATOR_TOOL]
NAMED = {"type": "function", "function": {"name": "calculator"}}
QUESTION = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 37 * 48?"}]


@pytest.fixture(scope="module")
def proxy(vllm_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    with serving_proxy(vllm_url, tmp_path_factory.mktemp("fork")) as process:
        yield process


def compute(arguments: str) -> str:
    """The environment: the calculator's answer to whatever arguments the model sampled."""
    try:
        args = json.loads(arguments)
        a, b, op = float(args.get("a", 0)), float(args.get("b", 0)), str(args.get("op", "add"))
    except (ValueError, TypeError, AttributeError):
        return "error: bad arguments"
    return str({"add": a + b, "subtract": a - b, "multiply": a * b}.get(op, a / b if b else "error"))


class Agent:
    """Three calls: two named calculator calls, then the answer; ``stream``: each call streamed.
    ``tampered``: the third request carries a note the source's did not (an agent that changed)."""

    def __init__(self, episode: dict[str, Any], *, stream: bool = False, tampered: bool = False) -> None:
        self.url = episode["base_url"] + "/chat/completions"
        self.headers = {"authorization": f"Bearer {episode['api_key']}"}
        self.client = openai.OpenAI(base_url=episode["base_url"], api_key=episode["api_key"], max_retries=0)
        self.stream = stream
        self.tampered = tampered
        self.messages = list(QUESTION)
        self.turn = 0
        self.status = 0
        self.seen: list[Any] = []
        """What the agent got per call: the raw body (plain) or the assembled message (streamed)."""

    def step(self) -> bool:
        """One call and its tool results; False when the proxy refused it."""
        messages = self.messages
        if self.tampered and self.turn == 2:
            messages = [*messages, {"role": "user", "content": "Be brief."}]
        body: dict[str, Any] = {"model": "policy", "messages": messages, "temperature": 1.0, "max_tokens": 48}
        if self.turn < 2:
            body |= {"tools": TOOLS, "tool_choice": NAMED}
        message = self.ask(body)
        if message is None:
            return False
        self.messages = [*self.messages, message]
        for call in message.get("tool_calls") or ():
            result = compute(call["function"]["arguments"])
            self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        self.turn += 1
        return True

    def run(self) -> int:
        """Run the rest of the episode; the status of the last call (200, or the proxy's refusal)."""
        while self.turn < 3:
            if not self.step():
                break
        return self.status

    def ask(self, body: dict[str, Any]) -> dict[str, Any] | None:
        if not self.stream:
            response = httpx.post(self.url, json=body, headers=self.headers, timeout=120)
            self.status = response.status_code
            if response.status_code != 200:
                self.seen.append(response.json())
                return None
            self.seen.append(response.content)
            message = response.json()["choices"][0]["message"]
            return {k: message[k] for k in ("role", "content", "tool_calls") if message.get(k) is not None}
        chunks = list(self.client.chat.completions.create(stream=True, **body))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls: dict[int, dict[str, Any]] = {}
        for c in chunks:
            for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                call = calls.setdefault(
                    tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                )
                call["id"] += tc.id or ""
                call["function"]["name"] += (tc.function.name or "") if tc.function else ""
                call["function"]["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices and c.choices[0].finish_reason)
        message = {
            "role": "assistant",
            "content": content or None,
            "tool_calls": [calls[i] for i in sorted(calls)] or None,
        }
        self.seen.append({**message, "id": chunks[0].id, "finish_reason": finish})
        self.status = 200
        return {k: v for k, v in message.items() if v is not None}


def rewarded_source(proxy: ProxyProcess, *, stream: bool) -> tuple[dict[str, Any], Agent]:
    episode = new_episode(proxy, "fork-calc")
    agent = Agent(episode, stream=stream)
    assert agent.run() == 200
    reply = httpx.post(f"{proxy.url}/episodes/{episode['id']}/reward", json={"reward": 1.0}, headers=ADMIN)
    assert reply.status_code == 200, reply.text
    return episode, agent


def fork(proxy: ProxyProcess, episode_id: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{proxy.url}/episodes/{episode_id}/fork", json=body, headers=ADMIN)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_fork_replays_the_first_calls_exactly_and_samples_from_there(proxy: ProxyProcess, stream: bool) -> None:
    source, original = rewarded_source(proxy, stream=stream)
    reply = fork(proxy, source["id"], at=2, size=2)
    assert reply.status_code == 201, reply.text
    group = reply.json()
    assert group["metadata"]["fork"] == {
        "source_episode_id": source["id"],
        "source_group_id": None,
        "at": 2,
        "rule": "sample",
    }
    source_calls = stored_calls(proxy, source["id"])
    for key in group["episode_keys"]:
        agent = Agent(key, stream=stream)
        assert agent.run() == 200
        assert agent.seen[:2] == original.seen[:2]  # plain: the very bytes; streamed: the same answer
        calls = stored_calls(proxy, key["id"])
        assert [c["status_code"] for c in calls] == [200, 200, 200]
        for mine, theirs in zip(calls[:2], source_calls[:2], strict=True):
            assert mine["notes"]["replay"] == {
                "source_episode_id": source["id"],
                "source_ordinal": theirs["ordinal"],
                "index": theirs["ordinal"],
            }
            assert mine["prompt_token_ids"] == theirs["prompt_token_ids"]
            assert [c["token_ids"] for c in mine["choices"]] == [c["token_ids"] for c in theirs["choices"]]
            assert [c["logprobs"] for c in mine["choices"]] == [c["logprobs"] for c in theirs["choices"]]
            assert mine["policy_version"] == theirs["policy_version"]
            assert mine["replica"] is None  # never sent to the engine
        assert "replay" not in (calls[2]["notes"] or {})
        assert calls[2]["replica"] == "vllm-0"
        record = episode_record(proxy, key["id"])
        assert (record["fork_of"], record["fork_at"], record["diverged_at"]) == (source["id"], 2, None)

        # The trainer: one merged sequence, only the sampled call's tokens trained.
        httpx.post(f"{proxy.url}/episodes/{key['id']}/reward", json={"reward": 0.0}, headers=ADMIN)
        stats = DataStats()
        (sample,) = episode_samples(
            Episode.model_validate(episode_record(proxy, key["id"])),
            group_id="g",
            max_seq_len=8192,
            stats=stats,
            masker=grammar_masker(),
        )
        assert stats.calls_replayed == 2
        assert sample.num_loss_tokens == len(calls[2]["choices"][0]["token_ids"])
        assert sample.input_ids[-sample.num_loss_tokens :] == calls[2]["choices"][0]["token_ids"]


def test_a_changed_request_ends_the_replay_where_it_changed(proxy: ProxyProcess) -> None:
    source, _ = rewarded_source(proxy, stream=False)
    (key,) = fork(proxy, source["id"], at=3, size=1).json()["episode_keys"]
    agent = Agent(key, tampered=True)  # the third request differs
    assert agent.run() == 200
    record = episode_record(proxy, key["id"])
    assert record["diverged_at"] == 2
    sent_before = len(stored_calls(proxy, source["id"])[2]["request"]["messages"])
    assert record["divergence"] == {"fields": [f"messages[{sent_before}]"], "rule": "sample"}
    calls = sorted(record["calls"], key=lambda c: c["ordinal"])
    assert ["replay" in (c["notes"] or {}) for c in calls] == [True, True, False]
    assert calls[2]["replica"] == "vllm-0"  # sampled from the engine instead
    metrics = httpx.get(f"{proxy.url}/metrics").text
    assert 'flywheel_fork_calls_total{outcome="diverged"}' in metrics


def test_on_divergence_abandon_refuses_the_call_and_ends_the_episode(proxy: ProxyProcess) -> None:
    source, _ = rewarded_source(proxy, stream=False)
    (key,) = fork(proxy, source["id"], at=3, size=1, on_divergence="abandon").json()["episode_keys"]
    agent = Agent(key, tampered=True)
    assert agent.run() == 409
    assert agent.seen[-1]["error"]["code"] == "fork_diverged"
    record = episode_record(proxy, key["id"])
    assert (record["status"], record["abandon_cause"], record["diverged_at"]) == ("abandoned", "diverged", 2)
    assert len([c for c in record["calls"] if c["status_code"] == 200]) == 2


def test_fork_refusals(proxy: ProxyProcess) -> None:
    running = new_episode(proxy, "fork-calc")
    assert Agent(running).run() == 200
    reply = fork(proxy, running["id"], at=1, size=2)
    assert (reply.status_code, reply.json()["error"]["code"]) == (409, "episode_open")
    abandoned = new_episode(proxy, "fork-calc")
    httpx.post(f"{proxy.url}/episodes/{abandoned['id']}/abandon", json={"reason": "x"}, headers=ADMIN)
    assert fork(proxy, abandoned["id"], at=0, size=2).status_code == 409
    httpx.post(f"{proxy.url}/episodes/{running['id']}/reward", json={"reward": 1.0}, headers=ADMIN)
    reply = fork(proxy, running["id"], at=4, size=2)
    assert (reply.status_code, reply.json()["error"]["param"]) == (400, "at")
    for body in ({"at": -1, "size": 2}, {"at": 1, "size": 0}, {"at": 1, "size": 2, "on_divergence": "retry"}):
        assert fork(proxy, running["id"], **body).status_code == 400, body
    missing = httpx.post(
        f"{proxy.url}/episodes/00000000-0000-0000-0000-000000000000/fork", json={"at": 0, "size": 1}, headers=ADMIN
    )
    assert missing.status_code == 404
    # Admin only: an agent must not make episodes, and its own key is not the admin's.
    agent = {"authorization": f"Bearer {running['api_key']}"}
    url = f"{proxy.url}/episodes/{running['id']}/fork"
    assert httpx.post(url, json={"at": 1, "size": 1}, headers=agent).status_code in (401, 403)
    assert httpx.post(url, json={"at": 1, "size": 1}).status_code == 401


def test_a_fork_resumes_its_replay_after_a_proxy_restart(vllm_url: str, tmp_path: Path) -> None:
    with serving_proxy(vllm_url, tmp_path) as proxy:
        source, original = rewarded_source(proxy, stream=False)
        (key,) = fork(proxy, source["id"], at=2, size=1).json()["episode_keys"]
        agent = Agent(key)
        assert agent.step()  # call 0, replayed
        proxy.stop()
        proxy.start()  # a new process: the replay position comes from the store
        assert agent.run() == 200
        assert agent.seen[:2] == original.seen[:2]
        calls = stored_calls(proxy, key["id"])
        assert [(c["notes"] or {}).get("replay", {}).get("index") for c in calls] == [0, 1, None]
        assert episode_record(proxy, key["id"])["diverged_at"] is None


RESPONSES_TOOL = {
    "type": "function",
    "name": "calculator",
    "description": "Compute a op b.",
    "strict": True,
    "parameters": CALCULATOR_PARAMETERS,
}
MESSAGES_TOOL = {
    "name": "calculator",
    "description": "Compute a op b.",
    "strict": True,
    "input_schema": CALCULATOR_PARAMETERS,
}


def dialect_agent(episode: dict[str, Any], api: str) -> list[dict[str, Any]]:
    """Two calls in ``api``: a calculator call, then the answer after its result; the bodies received."""
    url = episode["base_url"] + ("/responses" if api == "responses" else "/messages")
    headers = {"authorization": f"Bearer {episode['api_key']}"}
    seen = []
    if api == "responses":
        first = {"model": "policy", "input": "What is 37 * 48?", "tools": [RESPONSES_TOOL], "temperature": 1.0}
        first |= {"tool_choice": {"type": "function", "name": "calculator"}, "max_output_tokens": 128}
        answer = httpx.post(url, json=first, headers=headers, timeout=120).json()
        seen.append(answer)
        calls = [item for item in answer["output"] if item["type"] == "function_call"]
        assert len(calls) == 1, answer
        (call,) = calls
        result = {"type": "function_call_output", "call_id": call["call_id"], "output": compute(call["arguments"])}
        second = {"model": "policy", "previous_response_id": answer["id"], "input": [result], "max_output_tokens": 48}
    else:
        question = [{"role": "user", "content": "What is 37 * 48?"}]
        first = {"model": "policy", "messages": question, "tools": [MESSAGES_TOOL], "temperature": 1.0}
        first |= {"tool_choice": {"type": "tool", "name": "calculator"}, "max_tokens": 128}
        answer = httpx.post(url, json=first, headers=headers, timeout=120).json()
        seen.append(answer)
        (use,) = [block for block in answer["content"] if block["type"] == "tool_use"]
        result = {"type": "tool_result", "tool_use_id": use["id"], "content": compute(json.dumps(use["input"]))}
        messages = [
            *question,
            {"role": "assistant", "content": answer["content"]},
            {"role": "user", "content": [result]},
        ]
        second = {"model": "policy", "messages": messages, "max_tokens": 48, "temperature": 1.0}
    reply = httpx.post(url, json=second | {"temperature": 1.0}, headers=headers, timeout=120)
    assert reply.status_code == 200, reply.text
    seen.append(reply.json())
    return seen


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_a_fork_replays_responses_and_messages_answers_with_their_ids(proxy: ProxyProcess, api: str) -> None:
    source = new_episode(proxy, "fork-calc")
    original = dialect_agent(source, api)
    httpx.post(f"{proxy.url}/episodes/{source['id']}/reward", json={"reward": 1.0}, headers=ADMIN)
    (key,) = fork(proxy, source["id"], at=1, size=1).json()["episode_keys"]
    seen = dialect_agent(key, api)
    # The same answer, ids included (the response's, its items', the tool call's), so the agent's
    # next request (previous_response_id, tool_use_id) is the source's; only the clock moves on.
    mine, theirs = dict(seen[0]), dict(original[0])
    if api == "responses":
        assert mine.pop("completed_at") >= theirs.pop("completed_at")
    assert mine == theirs
    calls = stored_calls(proxy, key["id"])
    assert [c["api"] for c in calls] == [api, api]
    assert [(c["notes"] or {}).get("replay", {}).get("index") for c in calls] == [0, None]
    assert calls[1]["replica"] == "vllm-0"  # sampled: the replayed history resolved in the fork's own episode
    assert episode_record(proxy, key["id"])["diverged_at"] is None


def test_a_fork_replays_across_worker_processes(vllm_url: str, tmp_path: Path) -> None:
    """With several workers each call may reach another process: the position is the store's."""
    proxy = ProxyProcess(
        upstream_url=vllm_url, store_url=f"sqlite+aiosqlite:///{tmp_path / 'flywheel.db'}", workdir=tmp_path, workers=2
    )
    proxy.start()
    try:
        source, original = rewarded_source(proxy, stream=False)
        for key in fork(proxy, source["id"], at=3, size=2).json()["episode_keys"]:
            agent = Agent(key)
            assert agent.run() == 200
            assert agent.seen == original.seen
            record = episode_record(proxy, key["id"])
            assert record["diverged_at"] is None
            assert all("replay" in (c["notes"] or {}) for c in record["calls"])
    finally:
        proxy.stop()
