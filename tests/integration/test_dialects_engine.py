"""Agents that speak the Responses, the Anthropic Messages or Google's Gemini API, unchanged, against real vLLM.

The official ``openai`` and ``anthropic`` SDKs, the OpenAI Agents SDK and Gemini's REST API (as
Gemini CLI and the google-genai SDKs send it) point at an episode's base URL; every call must be
stored as a chat call with exact ids (the client's own request and API beside it), a follow-up
must extend the ids vLLM sampled (the splice holds across APIs), and what each client assembled
must be what the record says vLLM sampled.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import anthropic
import httpx
import openai
import orjson
import pytest

from contract.client import Episode
from tests.support.services import (
    ProxyProcess,
    episode_record,
    grammar_masker,
    new_episode,
    sampled_ids,
    stored_calls,
)
from tests.support.tools import CALCULATOR_PARAMETERS
from trainer.data import DataStats, episode_samples

pytestmark = pytest.mark.vllm

CALCULATOR = {
    "type": "function",
    "name": "calculator",
    "description": "Compute a op b.",
    "strict": True,
    "parameters": CALCULATOR_PARAMETERS,
}
ANTHROPIC_CALCULATOR = {
    "name": "calculator",
    "description": "Compute a op b.",
    "strict": True,
    "input_schema": CALCULATOR_PARAMETERS,
}
GEMINI_CALCULATOR = {"name": "calculator", "description": "Compute a op b."}
QUESTION = "What is 37 * 48? Use the calculator."


def assert_exact(call: dict[str, Any], api: str) -> None:
    """A call of ``api`` stored like any chat call: exact ids, one logprob per sampled id."""
    assert call["api"] == api and call["kind"] == "chat" and call["status_code"] == 200
    assert call["exact_ids"] is True and call["prompt_token_ids"]
    choice = call["choices"][0]
    assert len(choice["token_ids"]) == len(choice["logprobs"]) == call["completion_tokens"] > 0


def assert_extends(first: dict[str, Any], second: dict[str, Any]) -> None:
    """The follow-up's prompt starts with the first call's prompt and sampled ids."""
    sampled = sampled_ids(first)
    assert second["prompt_token_ids"][: len(sampled)] == sampled


def assert_merges(proxy: ProxyProcess, episode_id: str, calls: int) -> None:
    """The trainer's data path merges the episode into one sample, no break."""
    stats = DataStats()
    (sample,) = episode_samples(
        Episode.model_validate(episode_record(proxy, episode_id)),
        group_id="g",
        max_seq_len=8192,
        stats=stats,
        masker=grammar_masker(),
    )
    assert (stats.merged, stats.breaks) == (calls - 1, 0)


# -- the openai SDK's Responses API ----------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
def test_responses_create_with_a_function_tool_then_previous_response_id(proxy: ProxyProcess, stream: bool) -> None:
    episode = new_episode(proxy, "responses")
    client = openai.OpenAI(base_url=episode["base_url"], api_key=episode["api_key"], max_retries=0)
    first = client.responses.create(
        model="policy",
        instructions="You are a careful assistant.",
        input=QUESTION,
        tools=[CALCULATOR],
        tool_choice={"type": "function", "name": "calculator"},
        temperature=1.0,
        max_output_tokens=64,
    )  # type: ignore[arg-type]
    (fc,) = [item for item in first.output if item.type == "function_call"]
    assert fc.name == "calculator" and json.loads(fc.arguments).keys() == {"a", "op", "b"}
    follow = {
        "model": "policy",
        "previous_response_id": first.id,
        "tools": [CALCULATOR],
        "temperature": 1.0,
        "max_output_tokens": 24,
        "instructions": "You are a careful assistant.",
        "input": [{"type": "function_call_output", "call_id": fc.call_id, "output": "1776"}],
    }
    if stream:  # the SDK's typed events; the last carries the whole response (incomplete: the length cut)
        events = list(client.responses.create(**follow, stream=True))  # type: ignore[call-overload]
        kinds = [event.type for event in events]
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] in ("response.completed", "response.incomplete")
        second = events[-1].response
        streamed_text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert streamed_text == second.output_text
    else:
        second = client.responses.create(**follow)  # type: ignore[arg-type]
    one, two = stored_calls(proxy, episode["id"])
    assert_exact(one, "responses")
    assert_exact(two, "responses")
    assert one["response_id"] == first.id and two["response_id"] == second.id
    assert one["client_request"]["input"] == QUESTION and two["client_request"]["previous_response_id"] == first.id
    assert two["stream"] is stream
    # what the clients assembled is what the record says vLLM sampled
    stored_call = one["choices"][0]["tool_calls"][0]
    assert (stored_call["id"], stored_call["function"]["arguments"]) == (fc.call_id, fc.arguments)
    assert second.output_text == (two["choices"][0]["text"] or "")
    assert second.usage is not None and second.usage.output_tokens == two["completion_tokens"]
    assert second.usage.input_tokens == len(two["prompt_token_ids"])
    assert_extends(one, two)
    assert_merges(proxy, episode["id"], 2)


def test_previous_response_of_another_episode_is_refused(proxy: ProxyProcess) -> None:
    mine, other = new_episode(proxy, "responses"), new_episode(proxy, "responses")
    client = openai.OpenAI(base_url=mine["base_url"], api_key=mine["api_key"], max_retries=0)
    first = client.responses.create(model="policy", input="Say hi.", max_output_tokens=4, temperature=0)
    thief = openai.OpenAI(base_url=other["base_url"], api_key=other["api_key"], max_retries=0)
    with pytest.raises(openai.PermissionDeniedError) as err:
        thief.responses.create(model="policy", input="and?", previous_response_id=first.id, max_output_tokens=4)
    assert "another episode" in err.value.message
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="policy", input="and?", previous_response_id="resp_missing", max_output_tokens=4)
    (refused,) = stored_calls(proxy, other["id"])  # the refusal, on the episode that made it: nothing was sent
    assert (refused["status_code"], refused["notes"], refused["choices"]) == (
        403,
        {"refused": "previous_response_of_another_episode"},
        [],
    )


# -- the anthropic SDK's Messages API --------------------------------------------------------


def test_anthropic_messages_create_and_stream_with_a_tool_round_trip(proxy: ProxyProcess) -> None:
    episode = new_episode(proxy, "messages")
    root = episode["base_url"].removesuffix("/v1")  # the Anthropic SDK appends /v1/messages itself
    client = anthropic.Anthropic(base_url=root, api_key=episode["api_key"], max_retries=0)
    question = [{"role": "user", "content": QUESTION}]
    counted = client.messages.count_tokens(
        model="policy",
        system="Use tools.",
        messages=question,  # type: ignore[arg-type]
        tools=[ANTHROPIC_CALCULATOR],
    )  # type: ignore[list-item]
    first = client.messages.create(
        model="policy",
        system="Use tools.",
        messages=question,  # type: ignore[arg-type]
        tools=[ANTHROPIC_CALCULATOR],
        tool_choice={"type": "tool", "name": "calculator"},  # type: ignore[list-item]
        max_tokens=64,
        extra_body={"temperature": 1.0},
    )
    assert first.stop_reason == "tool_use"
    (use,) = [block for block in first.content if block.type == "tool_use"]
    assert use.name == "calculator" and set(use.input) == {"a", "op", "b"}  # type: ignore[arg-type]
    follow = [
        *question,
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "1776"}]},
    ]
    with client.messages.stream(
        model="policy",
        system="Use tools.",
        messages=follow,  # type: ignore[arg-type]
        tools=[ANTHROPIC_CALCULATOR],
        max_tokens=24,
        extra_body={"temperature": 1.0},
    ) as stream:  # type: ignore[list-item]
        kinds = [event.type for event in stream]
        second = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    one, two = stored_calls(proxy, episode["id"])
    assert_exact(one, "messages")
    assert_exact(two, "messages")
    assert counted.input_tokens == len(one["prompt_token_ids"])  # the same render vLLM sampled from
    assert (one["response_id"], two["response_id"]) == (first.id, second.id)
    assert one["client_request"]["tool_choice"] == {"type": "tool", "name": "calculator"}
    assert json.loads(one["choices"][0]["tool_calls"][0]["function"]["arguments"]) == use.input
    text = "".join(block.text for block in second.content if block.type == "text")
    assert text == (two["choices"][0]["text"] or "") and second.usage.output_tokens == two["completion_tokens"]
    assert_extends(one, two)
    assert_merges(proxy, episode["id"], 2)


def test_anthropic_errors_come_in_anthropic_shape(proxy: ProxyProcess) -> None:
    episode = new_episode(proxy, "messages")
    client = anthropic.Anthropic(
        base_url=episode["base_url"].removesuffix("/v1"), api_key=episode["api_key"], max_retries=0
    )
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as err:  # SmolLM2 takes no images: vLLM refuses, clearly
        client.messages.create(
            model="policy",
            max_tokens=8,
            messages=[  # type: ignore[list-item]
                {"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}
            ],
        )
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(
            base_url=episode["base_url"].removesuffix("/v1"), api_key="wrong", max_retries=0
        ).messages.create(model="policy", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    calls = stored_calls(proxy, episode["id"])
    assert [c["status_code"] for c in calls] == [400] and calls[0]["api"] == "messages"


# -- Google's Gemini API ---------------------------------------------------------------------


def _gemini_chunks(response: httpx.Response) -> list[dict[str, Any]]:
    """A ``streamGenerateContent?alt=sse`` answer's chunks, as Google's clients read them."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    return [orjson.loads(line[6:]) for line in response.text.split("\r\n") if line.startswith("data: ")]


def _chosen(candidates: list[dict[str, Any]]) -> tuple[list[int], list[float]]:
    """The sampled ids and log-probs a client reads from ``logprobsResult`` (every chunk's, in order)."""
    chosen = [
        c for candidate in candidates for c in (candidate.get("logprobsResult") or {}).get("chosenCandidates", [])
    ]
    return [c["tokenId"] for c in chosen], [c["logProbability"] for c in chosen]


def test_gemini_generate_content_and_stream_with_a_function_round_trip(proxy: ProxyProcess) -> None:
    """A function call (``generateContent``), its result passed back and the answer streamed
    (``streamGenerateContent?alt=sse``): both stored as chat calls with exact ids, and the ids and
    log-probs the client was given (``responseLogprobs``) are the ones the record says vLLM sampled."""
    episode = new_episode(proxy, "gemini")
    root = episode["base_url"].removesuffix("/v1") + "/v1beta/models/policy"  # Gemini CLI adds /v1beta/models/<m>
    key = {"x-goog-api-key": episode["api_key"]}
    system = {"parts": [{"text": "Use tools."}]}
    tools = [{"functionDeclarations": [{**GEMINI_CALCULATOR, "parametersJsonSchema": CALCULATOR_PARAMETERS}]}]
    question = [{"role": "user", "parts": [{"text": QUESTION}]}]
    config = {"temperature": 1.0, "responseLogprobs": True}
    request = {
        "contents": question,
        "systemInstruction": system,
        "tools": tools,
        # ANY: a call of one of the declared functions, held to its schema (vLLM's strict function)
        "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["calculator"]}},
        "generationConfig": {**config, "maxOutputTokens": 64},
    }
    counted = httpx.post(f"{root}:countTokens", json={"generateContentRequest": request}, headers=key)
    assert counted.status_code == 200, counted.text
    first = httpx.post(f"{root}:generateContent", json=request, headers=key, timeout=120)
    assert first.status_code == 200, first.text
    (candidate,) = first.json()["candidates"]
    (call,) = [p["functionCall"] for p in candidate["content"]["parts"] if "functionCall" in p]
    assert call["name"] == "calculator" and set(call["args"]) == {"a", "op", "b"}
    follow = [
        *question,
        candidate["content"],
        {
            "role": "user",
            "parts": [{"functionResponse": {"id": call["id"], "name": "calculator", "response": {"output": "1776"}}}],
        },
    ]
    streamed = httpx.post(
        f"{root}:streamGenerateContent",
        params={"alt": "sse"},
        json={
            "contents": follow,
            "systemInstruction": system,
            "tools": tools,  # VALIDATED: the model may answer or call, calls held to the schema as before
            "toolConfig": {"functionCallingConfig": {"mode": "VALIDATED"}},
            "generationConfig": {**config, "maxOutputTokens": 24},
        },
        headers=key,
        timeout=120,
    )
    chunks = _gemini_chunks(streamed)
    assert chunks[-1]["candidates"][0]["finishReason"] in ("STOP", "MAX_TOKENS")
    one, two = stored_calls(proxy, episode["id"])
    assert_exact(one, "gemini")
    assert_exact(two, "gemini")
    assert (one["stream"], two["stream"]) == (False, True)
    assert (one["response_id"], two["response_id"]) == (first.json()["responseId"], chunks[-1]["responseId"])
    assert counted.json()["totalTokens"] == len(one["prompt_token_ids"])  # the same render vLLM sampled from
    stored_call = one["choices"][0]["tool_calls"][0]
    assert stored_call["id"] == call["id"] and json.loads(stored_call["function"]["arguments"]) == call["args"]
    assert two["request"]["messages"][-1] == {"role": "tool", "tool_call_id": call["id"], "content": "1776"}
    # what the client was given is what the record says vLLM sampled: ids, log-probs, text, counts
    assert _chosen([candidate]) == (one["choices"][0]["token_ids"], one["choices"][0]["logprobs"])
    streamed_candidates = [c for chunk in chunks for c in chunk["candidates"]]
    assert _chosen(streamed_candidates) == (two["choices"][0]["token_ids"], two["choices"][0]["logprobs"])
    text = "".join(
        p.get("text", "") for c in streamed_candidates for p in c["content"]["parts"] if not p.get("thought")
    )
    assert text == (two["choices"][0]["text"] or "")
    usage = chunks[-1]["usageMetadata"]
    assert (usage["promptTokenCount"], usage["candidatesTokenCount"]) == (
        len(two["prompt_token_ids"]),
        two["completion_tokens"],
    )
    assert_extends(one, two)
    assert_merges(proxy, episode["id"], 2)


# -- a real agent framework on the Responses API ---------------------------------------------


async def test_openai_agents_sdk_two_tool_agent_is_recorded_and_merged(smol_proxy: ProxyProcess) -> None:
    """Every turn a forced tool call (``required``: the model picks the tool, vLLM's grammar the
    shape), until the agent submits or runs out of turns; either way every turn is recorded. On
    SmolLM2: the model decides which tool, and the plumbing model's choice hardly depends on the
    conversation (three episodes of it all submitted at once in one run), so two tool turns need a
    model that reads the instructions.

    Sampled at temperature 1, a 135M model may submit at once or run a call's arguments to the
    token limit (the SDK then raises on the ``incomplete`` answer): up to three episodes are played
    and the first with two tool turns is checked; every episode's turns are checked as recorded."""
    from agents import (
        Agent,
        MaxTurnsExceeded,
        ModelBehaviorError,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        StopAtTools,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    proxy = smol_proxy

    async def play() -> tuple[str, list[tuple[str, Any]], bool]:
        seen: list[tuple[str, Any]] = []

        @function_tool
        def calculator(a: int, op: Literal["add", "multiply"], b: int) -> str:
            """Compute a op b."""
            seen.append(("calculator", (a, op, b)))
            return str(a * b if op == "multiply" else a + b)

        @function_tool
        def submit_answer(answer: int) -> str:  # a number: a free string may run to max_output_tokens
            """Submit the final answer."""
            seen.append(("submit_answer", answer))
            return "submitted"

        episode = new_episode(proxy, "agents-sdk")
        client = openai.AsyncOpenAI(base_url=episode["base_url"], api_key=episode["api_key"], max_retries=0)
        agent = Agent(
            name="calc",
            instructions="Use the calculator, then submit the answer.",
            tools=[calculator, submit_answer],
            reset_tool_choice=False,
            tool_use_behavior=StopAtTools(stop_at_tool_names=["submit_answer"]),
            model=OpenAIResponsesModel(model="policy", openai_client=client),
            model_settings=ModelSettings(
                tool_choice="required", temperature=1.0, max_tokens=128, parallel_tool_calls=False
            ),
        )
        cut = False
        try:
            await Runner.run(agent, QUESTION, max_turns=3)
        except MaxTurnsExceeded:
            pass  # a 135M model may never submit: the turns it took are what is checked
        except ModelBehaviorError as exc:
            assert "incomplete" in str(exc)  # anything else the SDK refused is a failure
            cut = True
        return episode["id"], seen, cut

    for _ in range(3):
        episode_id, seen, cut = await play()
        calls = stored_calls(proxy, episode_id)
        # one tool run per recorded turn; a turn cut at the token limit is recorded but never run
        assert len(calls) == len(seen) + (1 if cut else 0)
        for call in calls:
            assert_exact(call, "responses")
            assert call["client_request"]["tool_choice"] == "required" and len(call["client_request"]["tools"]) == 2
        # what the agent ran is what the record says vLLM sampled, turn by turn
        for call, (tool, args) in zip(calls, seen, strict=False):
            (made,) = call["choices"][0]["tool_calls"]
            assert made["function"]["name"] == tool
            sampled = json.loads(made["function"]["arguments"])
            ran = (sampled["a"], sampled["op"], sampled["b"]) if tool == "calculator" else sampled["answer"]
            assert ran == args
        for before, after in zip(calls, calls[1:], strict=False):
            assert_extends(before, after)
        if len(seen) >= 2:
            break
    else:
        pytest.fail("no episode of three took two tool turns")
    assert_merges(proxy, episode_id, len(calls))
