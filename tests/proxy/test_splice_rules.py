"""When the proxy does not splice a follow-up, and what the record says: the rules decided before any
token API call, on the named fake upstream (``fake_upstream``, no token API). The splice itself runs
on the real engine in ``tests/integration/test_splice_engine.py``."""

from __future__ import annotations

from typing import Any

import httpx

from tests.proxy.conftest import ADMIN, fake_upstream, fake_vllm_completion, make_settings, running_app

USER = {"role": "user", "content": "Describe it."}


async def _episode_calls(client: httpx.AsyncClient, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    created = await client.post("/episodes", json={"task_id": "splice"}, headers=ADMIN)
    episode = created.json()["id"]
    for body in bodies:
        reply = await client.post(f"/episodes/{episode}/v1/chat/completions", headers=ADMIN, json=body)
        assert reply.status_code == 200, reply.text
    stored = await client.get(f"/episodes/{episode}", params={"calls": "true"}, headers=ADMIN)
    return sorted(stored.json()["calls"], key=lambda c: c["ordinal"])


async def test_a_follow_up_with_an_image_is_not_spliced(sqlite_url: str) -> None:
    """vLLM places image placeholders by the rendered prompt's offsets and does not check them: a
    spliced prompt of another length would put them elsewhere (issue 30), so such a call is rendered
    from its own messages, and the record says why."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    first = {"model": "policy", "messages": [USER]}
    follow = {
        "model": "policy",
        "messages": [
            USER,
            {"role": "assistant", "content": "answer 0"},  # the fake engine's first answer, repeated
            {"role": "user", "content": [{"type": "text", "text": "And this one?"}, image]},
        ],
    }
    async with running_app(make_settings(sqlite_url), fake_upstream()) as client:
        _, second = await _episode_calls(client, [first, follow])
        text_only = {**follow, "messages": [*follow["messages"][:2], {"role": "user", "content": "And?"}]}
        _, plain = await _episode_calls(client, [first, text_only])
    assert second["notes"]["splice"]["skipped"].startswith("the conversation carries image_url content")
    assert "no token API" in plain["notes"]["splice"]["skipped"]  # text alone would have been spliced


async def test_a_follow_up_to_a_single_tool_call_request_without_a_grammar_is_not_spliced(sqlite_url: str) -> None:
    """``parallel_tool_calls: false``: vLLM's parser returns the first tool call, but without a grammar
    limiting the model to one the sampled ids may hold more, and the splice would put calls the agent
    never ran into the next prompt (issue 30). With the engine's grammar (vLLM 0.32 limits its
    structural tag to one call) the ids hold one call, and the splice stays."""
    first = {"model": "policy", "messages": [USER], "parallel_tool_calls": False}
    follow = {
        **first,
        "messages": [USER, {"role": "assistant", "content": "answer 0"}, {"role": "user", "content": "And?"}],
    }
    async with running_app(make_settings(sqlite_url), fake_upstream()) as client:
        _, second = await _episode_calls(client, [first, follow])
    assert second["notes"]["splice"]["skipped"].startswith("call 0 asked for one tool call (parallel_tool_calls false)")


async def test_a_follow_up_to_a_turn_cut_at_a_stop_string_is_not_spliced(sqlite_url: str) -> None:
    """vLLM cuts a matched stop string from the text but keeps its tokens in the sampled ids: the agent
    sends back the cut text, and a splice would put ``Action: add\\nObservation:`` and the end of turn
    into the next prompt, a context the agent never sent (issue 42)."""

    def stopped(request: httpx.Request, body: dict[str, Any]) -> httpx.Response | None:
        if request.url.path != "/v1/chat/completions":
            return None
        data = fake_vllm_completion(body)
        data["choices"][0]["message"]["content"] = "Action: add"
        data["choices"][0]["stop_reason"] = "\nObservation:"
        return httpx.Response(200, json=data)

    first = {"model": "policy", "messages": [USER], "stop": ["\nObservation:"]}
    follow = {
        **first,
        "messages": [USER, {"role": "assistant", "content": "Action: add"}, {"role": "user", "content": "5"}],
    }
    async with running_app(make_settings(sqlite_url), fake_upstream(respond=stopped)) as client:
        _, second = await _episode_calls(client, [first, follow])
    assert second["notes"]["splice"]["skipped"].startswith("call 0's turn ended on the stop string '\\nObservation:'")
