"""The splice's shadow check (``proxy/shadow.py``): the comparison on id lists, and its record,
metrics and pages through the relay on a named fake token API (``fake_token_api``). The real engine's
case is in ``tests/integration/test_splice_engine.py``."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from proxy.shadow import Mismatch, compare, earlier_spans, shadow_note
from tests.proxy.conftest import ADMIN, fake_upstream, fake_vllm_completion, make_settings, running_app
from tests.support.records import call_record
from tests.support.services import ADMIN_KEY

CLOSING = [99, 10]  # <|im_end|> \n
PROMPT = [1, 2, 3]  # <bos> user-turn generation-prompt
TAIL = [20, 21, 3]  # a tool result and the generation prompt


def test_a_clean_splice_agrees_though_the_sampled_ids_re_render_otherwise() -> None:
    spliced = [*PROMPT, 60, 61, 99, 10, *TAIL]  # sampled 60 61 and the stop token, then the rest of the closing
    canonical = [*PROMPT, 50, 51, 52, 99, 10, *TAIL]  # the same turn re-tokenized, three ids
    assert compare(spliced, canonical, [[3, 6]], CLOSING) is None
    cut = [*PROMPT, 60, 61, 99, 10, *TAIL]  # cut at max_tokens: the splice added the whole closing
    assert compare(cut, canonical, [[3, 5]], CLOSING) is None


def test_earlier_sampled_turns_are_left_out_and_their_text_may_merge_with_the_id_before_them() -> None:
    """Two spliced turns: both re-render otherwise; the second opens with a newline, which the render
    merges with the generation prompt's last id (13 for "\\n", 14 for "\\n\\n")."""
    spliced = [1, 2, 13, 60, 99, 10, 20, 13, 61, 62, 99, 10, *TAIL]
    canonical = [1, 2, 13, 50, 99, 10, 20, 14, 51, 99, 10, *TAIL]
    assert compare(spliced, canonical, [[3, 5], [8, 11]], CLOSING) is None
    assert compare(spliced, canonical, [[8, 11]], CLOSING) == Mismatch("prefix", 3)  # without the earlier span


def test_an_earlier_part_rendered_otherwise_now_is_a_prefix_mismatch_at_its_first_id() -> None:
    canonical = [1, 7, 3, 50, 99, 10, *TAIL]  # the system block renders the time: 7 now, 2 then
    assert compare([*PROMPT, 60, 99, 10, *TAIL], canonical, [[3, 5]], CLOSING) == Mismatch("prefix", 1)
    between = [1, 2, 3, 60, 99, 10, 20, 21, 3, 61, 99, 10, *TAIL]  # a tool result between two turns
    now = [1, 2, 3, 50, 99, 10, 20, 22, 3, 51, 99, 10, *TAIL]  # renders otherwise now
    assert compare(between, now, [[3, 5], [9, 11]], CLOSING) == Mismatch("prefix", 7)


def test_other_end_of_turn_ids_are_a_closing_mismatch() -> None:
    spliced = [*PROMPT, 60, 99, 10, *TAIL]
    assert compare(spliced, [*PROMPT, 50, 98, 10, *TAIL], [[3, 5]], CLOSING) == Mismatch("closing", 4)  # none found
    wrong = [*PROMPT, 60, 99, 11, *TAIL]  # the splice put the stop token, then another id than the closing's
    assert compare(wrong, [*PROMPT, 50, 99, 10, *TAIL], [[3, 5]], CLOSING) == Mismatch("closing", 5)


def test_new_messages_rendered_otherwise_are_a_tail_mismatch() -> None:
    spliced = [*PROMPT, 60, 99, 10, *TAIL]
    assert compare(spliced, [*PROMPT, 50, 99, 10, 20, 22, 3], [[3, 5]], CLOSING) == Mismatch("tail", 7)
    assert compare(spliced, [*PROMPT, 50, 99, 10, *TAIL, 3], [[3, 5]], CLOSING) == Mismatch("tail", 9)  # longer


def test_the_spans_come_from_the_earlier_calls_note() -> None:
    def with_notes(notes: dict[str, Any] | None) -> Any:
        return call_record(notes=notes)

    assert earlier_spans(with_notes(None)) == []  # rendered the ordinary way
    assert earlier_spans(with_notes({"splice": {"skipped": "why"}})) == []
    assert earlier_spans(with_notes({"splice": {"from": 0, "spans": [[3, 5]]}})) == [[3, 5]]
    assert earlier_spans(with_notes({"splice": {"from": 0, "changed": True}})) is None  # before spans were kept
    assert earlier_spans(with_notes({"replay": {"source_ordinal": 0}})) is None  # the source's ids, not its note
    assert shadow_note([1], [1], None, CLOSING) == {
        "checked": False,
        "why": "the earlier call's sampled spans are unknown",
    }


USER = {"role": "user", "content": "Describe it."}
ANSWER = {"role": "assistant", "content": "answer 0"}  # the fake engine's answer, repeated by the agent


def fake_token_api(clock: list[int]) -> httpx.MockTransport:
    """A named fake vLLM with the token API: a "template" that renders <bos> [clock] then per message
    user 2, tool 20, assistant 3 (its header) 50 (its text, when any) 99 10 (its end), and the
    generation prompt 3; generate and derender answer as the fake chat route. ``clock``, when set,
    is an id the template renders after <bos> (a template that renders the time)."""

    def render(body: dict[str, Any]) -> list[int]:
        ids = [1, *clock]
        for m in body["messages"]:
            ids += {"user": [2], "tool": [20]}.get(m["role"], [3, *([50] if m.get("content") else []), 99, 10])
        return ids + ([3] if body.get("add_generation_prompt", True) else [])

    def respond(request: httpx.Request, body: dict[str, Any]) -> httpx.Response | None:
        if request.url.path == "/v1/chat/completions/render":
            return httpx.Response(200, json={"token_ids": render(body), "sampling_params": {"max_tokens": 5}})
        if request.url.path == "/inference/v1/generate":
            return httpx.Response(200, json={"choices": []})
        if request.url.path == "/v1/chat/completions/derender":
            return httpx.Response(200, json=fake_vllm_completion(body["chat_request"]))
        return None

    return fake_upstream(respond=respond)


async def _episode(
    client: httpx.AsyncClient, bodies: list[dict[str, Any]], clock: list[int] | None = None
) -> tuple[str, list[dict[str, Any]]]:
    """The episode's id and stored calls; ``clock`` is set to [7] after its first call."""
    episode = (await client.post("/episodes", json={"task_id": "shadow"}, headers=ADMIN)).json()["id"]
    for n, body in enumerate(bodies):
        reply = await client.post(f"/episodes/{episode}/v1/chat/completions", headers=ADMIN, json=body)
        assert reply.status_code == 200, reply.text
        if n == 0 and clock is not None:
            clock[:] = [7]
    stored = await client.get(f"/episodes/{episode}", params={"calls": "true"}, headers=ADMIN)
    return episode, sorted(stored.json()["calls"], key=lambda c: c["ordinal"])


def _bodies(turns: int) -> list[dict[str, Any]]:
    """An episode of ``turns`` calls, each repeating the answers before it and adding a user turn."""
    messages, out = [USER], []
    for n in range(turns):
        out.append({"model": "policy", "messages": list(messages), "max_tokens": 5})
        messages += [ANSWER, {"role": "user", "content": f"And {n}?"}]
    return out


def _shadow_counts(metrics: str) -> dict[str, float]:
    prefix = "flywheel_splice_shadow_total{result="
    return {
        line[len(prefix) + 1 : line.index('"}')]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith(prefix)
    }


async def test_every_spliced_call_is_checked_and_earlier_spliced_turns_are_left_out(sqlite_url: str) -> None:
    """Three calls: the third's prompt holds two sampled turns (42 100, the fake engine's ids), the
    first inherited from the second call's note; both agree with the render outside them."""
    async with running_app(make_settings(sqlite_url), fake_token_api([])) as client:
        _, (_, second, third) = await _episode(client, _bodies(3))
        counts = _shadow_counts((await client.get("/metrics")).text)
    assert second["prompt_token_ids"] == [1, 2, 3, 42, 100, 99, 10, 2, 3]
    assert second["notes"]["splice"]["spans"] == [[3, 5]]
    assert third["notes"]["splice"]["spans"] == [[3, 5], [9, 11]]
    for call in (second, third):
        assert call["notes"]["splice"]["shadow"] == {"checked": True, "mismatch": None, "at": None}
    assert counts == {"agree": 2.0}


async def test_a_prefix_that_renders_otherwise_now_is_caught_counted_and_shown(sqlite_url: str) -> None:
    """The template renders a clock id after the first call: the recorded prompt [1, 2, 3] is no longer
    the render of the same history ([1, 7, 2, 3]), though the render of the follow-up extends the
    render of its history, so the splice goes ahead; the shadow check finds where."""
    clock: list[int] = []
    async with running_app(make_settings(sqlite_url), fake_token_api(clock)) as client:
        episode, (first, second) = await _episode(client, _bodies(2), clock)
        counts = _shadow_counts((await client.get("/metrics")).text)
        login = f"key={ADMIN_KEY}&next=/ui/"
        await client.post("/ui/login", content=login, headers={"content-type": "application/x-www-form-urlencoded"})
        page = (await client.get(f"/ui/episodes/{episode}")).text
    assert first["prompt_token_ids"] == [1, 2, 3]  # the fake chat route's prompt, rendered before the clock
    assert second["notes"]["splice"]["shadow"] == {"checked": True, "mismatch": "prefix", "at": 1}
    assert counts == {"prefix": 1.0}
    assert "1 spliced prompt compared with vLLM's render outside the sampled ids" in page
    assert "1 differs in the prefix" in page
    assert "in the prefix (from prompt id 1)" in page


@pytest.mark.parametrize("share", [0.0, 1.0])
async def test_the_share_checked_is_a_setting(sqlite_url: str, share: float) -> None:
    settings = make_settings(sqlite_url, splice={"shadow_share": share})
    async with running_app(settings, fake_token_api([])) as client:
        _, (_, second) = await _episode(client, _bodies(2))
        counts = _shadow_counts((await client.get("/metrics")).text)
    expected = (
        {"checked": True, "mismatch": None, "at": None}
        if share
        else {"checked": False, "why": "not drawn (splice.shadow_share)"}
    )
    assert second["notes"]["splice"]["shadow"] == expected
    assert counts == {"agree" if share else "unchecked": 1.0}
