"""The grammar a call is sampled under is the engine's answer, recorded with the call.

On the named fake upstream (``fake_upstream``): it isolates the proxy's rule (which render answer
makes which record, the cache, a replica without the render route). The real engine's answers are
checked in ``tests/integration/test_fidelity.py``.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.proxy.conftest import ADMIN, fake_upstream, make_settings, running_app

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
TAG = '{"type": "structural_tag", "format": {"type": "triggered_tags"}}'


def render_answer(structured: dict[str, Any] | None) -> httpx.Response:
    """A vLLM 0.32 render answer: a GenerateRequest whose sampling_params carry the engine's grammar."""
    outputs = None if structured is None else {"json": None, "structural_tag": None, "_backend": None, **structured}
    return httpx.Response(
        200,
        json={"token_ids": [1, 2, 3], "sampling_params": {"temperature": 1.0, "structured_outputs": outputs}},
    )


async def record(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    created = await client.post("/episodes", json={"task_id": "grammar"}, headers=ADMIN)
    episode = created.json()["id"]
    reply = await client.post(
        f"/episodes/{episode}/v1/chat/completions",
        headers=ADMIN,
        json={"model": "policy", "messages": [{"role": "user", "content": "2+3?"}], **body},
    )
    assert reply.status_code == 200, reply.text
    stored = await client.get(f"/episodes/{episode}", params={"calls": "true"}, headers=ADMIN)
    sampling: dict[str, Any] = stored.json()["calls"][0]["notes"]["sampling"]
    return sampling


async def test_the_engines_grammar_decides_and_is_recorded(sqlite_url: str) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    answers = {"required": {"json": {"type": "array"}}, "auto": {"structural_tag": TAG}, "none": None}

    def respond(request: httpx.Request, body: dict[str, Any]) -> httpx.Response | None:
        if request.url.path == "/v1/chat/completions/render":
            choice = body.get("tool_choice")
            return render_answer(answers["required" if isinstance(choice, dict) else choice])
        return None

    async with running_app(make_settings(sqlite_url), fake_upstream(seen, respond)) as client:
        named = await record(client, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}})
        assert named["mode"] == "constrained" and named["constraint"] == "tool_choice=function:add"
        assert named["grammar"] == {"json": {"type": "array"}}  # the engine's spec, nulls and private fields out
        # auto with a tool: nothing in the request says "constrained", the engine does (vLLM 0.32, strict tools)
        auto = await record(client, {"tools": TOOLS, "tool_choice": "auto"})
        assert (auto["mode"], auto["constraint"], auto["grammar"]) == (
            "constrained",
            "engine:structural_tag",
            {"structural_tag": TAG},
        )
        # the request says required, the engine samples it free (a parser that extracts calls itself)
        answers["required"] = None
        free = await record(client, {"tools": TOOLS, "tool_choice": "required", "temperature": 0.5})
        assert free["mode"] == "sampled" and free["constraint_ignored"] == "tool_choice=required"
        assert "grammar" not in free and "constrained" not in free
        plain = await record(client, {})  # no tools, no format: the engine is not asked
        assert plain["mode"] == "sampled" and "grammar" not in plain
        # one render per distinct set of shaping fields: the same tools again are not asked twice
        await record(client, {"tools": TOOLS, "tool_choice": "auto"})
    renders = [b for path, b in seen if path.endswith("/render")]
    assert [r.get("tool_choice") for r in renders] == [
        {"type": "function", "function": {"name": "add"}},
        "auto",
        "required",
    ]
    assert all("stream" not in r for r in renders)


async def test_a_replica_without_the_render_route_keeps_the_request_rule(sqlite_url: str) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    async with running_app(make_settings(sqlite_url), fake_upstream(seen)) as client:  # render: 404
        named = await record(client, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}})
        assert named["mode"] == "constrained" and named["grammar"] is None  # constrained, mask unknown
        auto = await record(client, {"tools": TOOLS, "tool_choice": "auto"})
        assert auto["mode"] == "sampled" and "grammar" not in auto
        # auto with a strict tool: vLLM 0.32 applies its structural tag, so constrained, mask unknown
        strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
        tagged = await record(client, {"tools": strict, "tool_choice": "auto"})
        assert (tagged["mode"], tagged["constraint"], tagged["grammar"]) == ("constrained", "tools=strict", None)
    assert sum(path.endswith("/render") for path, _ in seen) == 1  # asked once, then known to be absent


async def test_constrained_reject_refuses_what_the_engine_would_constrain(sqlite_url: str) -> None:
    def respond(request: httpx.Request, body: dict[str, Any]) -> httpx.Response | None:
        if request.url.path == "/v1/chat/completions/render":
            return render_answer({"structural_tag": TAG})
        return None

    settings = make_settings(sqlite_url, sampling={"constrained": "reject"})
    async with running_app(settings, fake_upstream(None, respond)) as client:
        created = await client.post("/episodes", json={"task_id": "grammar"}, headers=ADMIN)
        reply = await client.post(
            f"/episodes/{created.json()['id']}/v1/chat/completions",
            headers=ADMIN,
            json={"model": "policy", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS},
        )
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "unsupported_sampling", "tools")
    assert error["message"].startswith("engine:structural_tag samples under a grammar mask")


@pytest.mark.parametrize("body", [{"response_format": {"type": "text"}}, {"tools": TOOLS, "tool_choice": "none"}])
async def test_requests_that_cannot_be_constrained_ask_nothing(sqlite_url: str, body: dict[str, Any]) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    async with running_app(make_settings(sqlite_url), fake_upstream(seen)) as client:
        assert (await record(client, body))["mode"] == "sampled"
    assert not [p for p, _ in seen if p.endswith("/render")]
