"""Token in, token out on the real engine: a follow-up call's prompt holds the ids vLLM sampled.

vLLM renders an earlier tool call from its parsed arguments (the template's own JSON spacing), so
its render repeats the sampled call only when the model happened to sample that spacing; the
agent here also re-serialises the arguments (``indent=2``, as some frameworks do). Where the
render differs, without the splice the follow-up would be a break. The proxy's answer must still
be the standard chat response.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from typing import Any

import httpx
import openai
import pytest

from contract.client import Episode
from proxy.store.db import sqlite_file
from tests.support.services import (
    ADMIN_KEY,
    ROOT,
    ProxyProcess,
    episode_record,
    grammar_masker,
    new_episode,
    sampled_ids,
    serving_proxy,
    stored_calls,
)
from tests.support.tools import CALCULATOR_TOOL
from trainer.data import DataStats, episode_samples

pytestmark = pytest.mark.vllm
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
TOOLS = [CALCULATOR_TOOL]
QUESTION = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 37 * 48?"}]
NAMED = {"type": "function", "function": {"name": "calculator"}}


def ask(client: openai.OpenAI, messages: list[dict[str, Any]], tools: list[Any] = TOOLS, **extra: Any) -> Any:
    """A chat call that names the calculator, sampled at temperature 1 as an agent's would be."""
    return client.chat.completions.create(
        model="policy", messages=messages, tools=tools, tool_choice=NAMED, temperature=1.0, max_tokens=64, **extra
    )


def first_turn(proxy: ProxyProcess) -> tuple[dict[str, Any], openai.OpenAI, Any]:
    """A new episode, its agent's client, and the answer to its first call."""
    episode = new_episode(proxy, "splice")
    client = openai.OpenAI(base_url=episode["base_url"], api_key=episode["api_key"], max_retries=0)
    return episode, client, ask(client, QUESTION)


def follow_up(first: Any) -> list[dict[str, Any]]:
    """The conversation after the first call, arguments re-serialised by the agent."""
    (call,) = first.choices[0].message.tool_calls
    spaced = json.dumps(json.loads(call.function.arguments), indent=2)
    return [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": "calculator", "arguments": spaced}}
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "1776"},
    ]


def stored_layout(proxy: ProxyProcess, episode_id: str) -> list[tuple[Any, ...]]:
    """How the store holds the episode's calls (``proxy/store/delta.py``), straight from the rows."""
    path = sqlite_file(proxy.store_url)
    assert path is not None
    with contextlib.closing(sqlite3.connect(path)) as db:
        return db.execute(
            "SELECT ordinal, encoding, base_ordinal, prompt_choice, messages_from, substr(choice_logprobs, 1, 1) "
            "FROM calls WHERE episode_id = ? ORDER BY ordinal",
            (episode_id,),
        ).fetchall()


def rendered(vllm_url: str, messages: list[dict[str, Any]]) -> list[int]:
    response = httpx.post(
        f"{vllm_url}/tokenize",
        json={"model": "policy-base", "messages": messages, "tools": TOOLS, "add_generation_prompt": True},
    )
    assert response.status_code == 200, response.text
    return list(response.json()["tokens"])


@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
def test_follow_up_prompts_extend_the_sampled_ids(proxy: ProxyProcess, vllm_url: str, stream: bool) -> None:
    for _ in range(8):  # until the model samples arguments whose re-render differs (most of the time)
        episode, client, first = first_turn(proxy)
        messages = follow_up(first)
        (recorded,) = episode_record(proxy, episode["id"])["calls"]
        sampled = sampled_ids(recorded)
        if rendered(vllm_url, messages)[: len(sampled)] != sampled:
            break
    else:
        pytest.fail("8 sampled calls all re-rendered as sampled: nothing here needs the splice")
    if stream:
        pieces = list(ask(client, messages, stream=True))
        deltas = [tc for p in pieces if p.choices for tc in p.choices[0].delta.tool_calls or []]
        fragments = [tc.function.arguments or "" for tc in deltas]
        names = [tc.function.name for tc in deltas if tc.function.name]
        assert names == ["calculator"] and json.loads("".join(fragments)).keys() == {"a", "op", "b"}
    else:
        second = ask(client, messages)
        (tool_call,) = second.choices[0].message.tool_calls
        assert tool_call.function.name == "calculator" and json.loads(tool_call.function.arguments)
        assert second.model_dump().get("prompt_token_ids") is None  # the client did not ask: standard response

    raw = episode_record(proxy, episode["id"])
    one, two = sorted(raw["calls"], key=lambda c: c["ordinal"])
    sampled = sampled_ids(one)
    assert two["prompt_token_ids"][: len(sampled)] == sampled
    assert two["exact_ids"] is True and two["stream"] is stream
    assert len(two["choices"][0]["token_ids"]) == len(two["choices"][0]["logprobs"]) > 0
    note = two["notes"]["splice"]
    assert note["from"] == 0 and note["changed"] is True and note["prompt_tokens"] == len(two["prompt_token_ids"])
    # vLLM's own render of the same messages does not extend the sample: the splice made the difference.
    canonical = rendered(vllm_url, messages)
    assert canonical[: len(sampled)] != sampled and note["rendered_tokens"] == len(canonical)
    stats = DataStats()
    (sample,) = episode_samples(
        Episode.model_validate(raw), group_id="g", max_seq_len=8192, stats=stats, masker=grammar_masker()
    )
    assert (stats.merged, stats.breaks) == (1, 0)
    # The trainer merges them, so the store keeps the second as a delta on the first: its new prompt
    # ids after the first's prompt and choice 0, its two new messages after the first's two. vLLM's
    # log-probs are float32 values (its sampler computes them in float32), stored in 4 bytes (tag f).
    assert stored_layout(proxy, episode["id"]) == [(0, 1, None, None, None, b"f"), (1, 1, 0, 0, 2, b"f")]


def test_a_turn_the_agent_edited_goes_the_ordinary_way_and_says_why(proxy: ProxyProcess) -> None:
    episode, client, first = first_turn(proxy)
    messages = follow_up(first)
    messages[2]["tool_calls"][0]["function"]["arguments"] = '{"a": 1, "op": "add", "b": 2}'
    ask(client, messages)
    one, two = stored_calls(proxy, episode["id"])
    assert "continued" in two["notes"]["splice"]["skipped"]
    sampled = sampled_ids(one)
    assert two["prompt_token_ids"][: len(sampled)] != sampled  # what the agent sent is what vLLM saw
    metrics = httpx.get(f"{proxy.url}/metrics", headers=ADMIN).text
    assert 'flywheel_splices_total{outcome="skipped"}' in metrics


def test_a_follow_up_that_offers_other_tools_is_rendered_from_its_own_request(proxy: ProxyProcess) -> None:
    """Call 2 repeats call 1 and its tool call, but offers one more tool: the template renders the
    tools into the system block, so call 1's prompt ids are not what this request renders as. Spliced,
    vLLM would generate from a system block the agent never sent (issue 30); it goes the ordinary way,
    and the record says why."""
    episode, client, first = first_turn(proxy)
    more = [*TOOLS, {"type": "function", "function": {"name": "submit_answer", "parameters": {"type": "object"}}}]
    ask(client, follow_up(first), tools=more)
    one, two = stored_calls(proxy, episode["id"])
    assert two["notes"]["splice"]["skipped"].startswith(
        "the request changes what the template renders since call 0 (tools)"
    )
    sampled = sampled_ids(one)
    assert two["prompt_token_ids"][: len(one["prompt_token_ids"])] != one["prompt_token_ids"]  # another system block
    assert two["prompt_token_ids"][: len(sampled)] != sampled


THINKING = (ROOT / "tests" / "support" / "templates" / "chatml_strips_thinking.jinja").read_text()
TOOLS_TEMPLATE = (ROOT / "configs" / "templates" / "smollm2_tools.jinja").read_text()
SYSTEM_OPENS = "{{ '<|im_start|>system\\n' }}"
CLOCKED = TOOLS_TEMPLATE.replace(
    SYSTEM_OPENS,
    SYSTEM_OPENS + "{% if messages[0]['role'] == 'system' %}{{ strftime_now('%S')[-1] + '\\n' }}{% endif %}",
)
"""The engine's template, its system block (rendered so with tools) opened by the clock's last
seconds digit: Llama 3.1's template renders the date there ("Today Date"), so its prompts change at
midnight; this one, every second. (Only under a system message: the splice's end-of-turn probe
has none.)"""


WORDS = {"regex": "[a-z]{2,8}( [a-z]{2,8}){1,3}"}
"""A few words: the plumbing engine's random weights never end a free answer on their own, and under
a grammar the sampler picks spellings the tokenizer would not (the render re-tokenizes them)."""


def say(episode: dict[str, Any], messages: list[dict[str, Any]], **extra: Any) -> list[dict[str, Any]]:
    """One sampled call of ``episode``; the conversation after its answer and one more user turn."""
    response = httpx.post(
        f"{episode['base_url']}/chat/completions",
        headers={"authorization": f"Bearer {episode['api_key']}"},
        timeout=300,
        json={
            "model": "policy",
            "messages": messages,
            "temperature": 1.0,
            "max_tokens": 16,
            "structured_outputs": WORDS,
        }
        | extra,
    )
    assert response.status_code == 200, response.text
    answer = response.json()["choices"][0]["message"]["content"]
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]


def shadow_count(proxy: ProxyProcess, result: str) -> float:
    """``flywheel_splice_shadow_total{result}`` now (0 before the first)."""
    line = f'flywheel_splice_shadow_total{{result="{result}"}} '
    metrics = httpx.get(f"{proxy.url}/metrics", headers=ADMIN).text
    return next((float(x[len(line) :]) for x in metrics.splitlines() if x.startswith(line)), 0.0)


def test_every_spliced_prompt_agrees_with_the_render_outside_the_sampled_ids(proxy: ProxyProcess) -> None:
    """Three calls on the engine's template: the second's and third's prompts are checked against
    vLLM's own render of the same request; the third leaves out both sampled turns (the first's
    inherited from the second call's note), which the render re-tokenizes from their text."""
    agreed = shadow_count(proxy, "agree")
    episode = new_episode(proxy, "shadow")
    say(episode, say(episode, say(episode, QUESTION)))
    one, two, three = stored_calls(proxy, episode["id"])
    spans = [[len(one["prompt_token_ids"]), len(sampled_ids(one))]]
    assert two["notes"]["splice"]["spans"] == spans
    assert three["notes"]["splice"]["spans"] == [*spans, [len(two["prompt_token_ids"]), len(sampled_ids(two))]]
    for call in (two, three):
        assert call["notes"]["splice"]["shadow"] == {"checked": True, "mismatch": None, "at": None}
    assert shadow_count(proxy, "agree") == agreed + 2


def test_a_template_that_renders_the_time_is_caught_in_the_prefix(proxy: ProxyProcess, vllm_url: str) -> None:
    """The request's template renders the clock into the system block: a second later the earlier
    prompt is no longer the render of the same history, though the follow-up's render still extends
    its history's render, so every rule of the splice passes and the model generates from the old
    clock. The shadow check finds it, at the clock's id, and the trainer counts it."""
    opens = httpx.post(
        f"{vllm_url}/tokenize",
        json={"model": "policy-base", "prompt": "<|im_start|>system\n", "add_special_tokens": False},
    )
    clock_at = len(opens.json()["tokens"])  # the digit follows the system block's opening ids
    assert CLOCKED.count("strftime_now") == 1
    caught = shadow_count(proxy, "prefix")
    for _ in range(3):  # until the follow-up's two renders fall within one second (nearly always)
        episode = new_episode(proxy, "clock")
        messages = say(episode, QUESTION, chat_template=CLOCKED, tools=TOOLS)
        time.sleep(1.05 - time.time() % 1)  # just past the next second: the clock's digit has moved on
        say(episode, messages, chat_template=CLOCKED, tools=TOOLS)
        one, two = stored_calls(proxy, episode["id"])
        if "differently" not in two["notes"]["splice"].get("skipped", ""):
            break
    assert two["notes"]["splice"]["changed"] is True  # spliced: the splice's own rules saw nothing wrong
    assert two["prompt_token_ids"][: len(one["prompt_token_ids"])] == one["prompt_token_ids"]
    assert two["notes"]["splice"]["shadow"] == {"checked": True, "mismatch": "prefix", "at": clock_at}
    assert shadow_count(proxy, "prefix") == caught + 1
    stats = DataStats()
    raw = {"id": episode["id"], "status": "rewarded", "reward": 1.0, "calls": [one, two]}
    episode_samples(Episode.model_validate(raw), group_id="g", max_seq_len=8192, stats=stats, masker=grammar_masker())
    assert (stats.splice_shadow_prefix, stats.merged) == (1, 1)  # counted, and trained as sampled


def _thinking_episode(proxy: ProxyProcess) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two turns of a 'thinking' model: the first answer is forced (a regex grammar) to open with a
    <think> block, the second call repeats it and adds a user turn, both rendered with a template
    that then drops the block; returns both stored calls."""
    episode = new_episode(proxy, "thinking")
    auth = {"authorization": f"Bearer {episode['api_key']}"}
    question = [{"role": "user", "content": "Is the sea blue? Think first."}]
    common = {"model": "policy", "chat_template": THINKING, "temperature": 1.0}
    first = httpx.post(
        f"{episode['base_url']}/chat/completions",
        headers=auth,
        timeout=300,
        json={
            **common,
            "messages": question,
            "max_tokens": 40,
            "structured_outputs": {"regex": "<think>[a-z ]{4,24}</think>[A-Za-z ]{2,16}"},
        },
    )
    assert first.status_code == 200, first.text
    answer = first.json()["choices"][0]["message"]["content"]
    assert answer.startswith("<think>") and "</think>" in answer
    follow = [*question, {"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
    second = httpx.post(
        f"{episode['base_url']}/chat/completions",
        headers=auth,
        timeout=300,
        json={**common, "messages": follow, "max_tokens": 8},
    )
    assert second.status_code == 200, second.text
    one, two = stored_calls(proxy, episode["id"])
    return one, two


def test_a_thinking_models_episode_stays_one_sequence_with_reasoning_kept(
    vllm_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Issue 30: a template that drops earlier reasoning re-renders every earlier turn, so with
    ``splice.reasoning: strip`` each turn is a sample of its own (the trainer recomputes the prefix
    per turn); ``keep`` puts the sampled reasoning back and the episode is one sequence."""
    figures = {}
    for mode in ("strip", "keep"):
        with serving_proxy(
            vllm_url, tmp_path_factory.mktemp(f"think-{mode}"), FLYWHEEL_SPLICE__REASONING=mode
        ) as proxy:
            one, two = _thinking_episode(proxy)
        sampled = sampled_ids(one)
        stats = DataStats()
        calls = Episode.model_validate({"id": "e", "status": "rewarded", "reward": 1.0, "calls": [one, two]})
        samples = episode_samples(calls, group_id="g", max_seq_len=8192, stats=stats, masker=grammar_masker())
        figures[mode] = (len(samples), sum(s.num_loss_tokens for s in samples), sum(len(s) for s in samples))
        if mode == "strip":
            assert "differently" in two["notes"]["splice"]["skipped"]
            assert two["prompt_token_ids"][: len(sampled)] != sampled  # vLLM's render, reasoning dropped
            assert (stats.merged, stats.breaks) == (0, 1)
        else:
            assert two["notes"]["splice"]["kept_reasoning"] is True
            assert two["prompt_token_ids"][: len(sampled)] == sampled  # what the model sampled, reasoning included
            assert (stats.merged, stats.breaks) == (1, 0)
    print(
        "thinking episode (2 turns): samples, trained tokens, tokens the trainer reads: "
        f"strip {figures['strip']}, keep {figures['keep']}"
    )
    assert figures["keep"][0] == 1 and figures["strip"][0] == 2
    assert figures["keep"][2] < figures["strip"][2]  # one pass over the prefix, not one per turn
