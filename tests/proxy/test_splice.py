"""Token splicing without an engine: which earlier call a request continues, and the spliced ids."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.splice import continued, end_of_turn, ended_elsewhere, render_changes, room, splice
from proxy.store.records import CallRecord
from tests.support.records import call_record

SYSTEM = {"role": "system", "content": "Use the calculator."}
USER = {"role": "user", "content": "What is 12 * 34?"}
ARGS = '{"a": 12, "op": "multiply", "b": 34}'


def tool_turn(call_id: str = "call_1", arguments: str = ARGS) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "calculator", "arguments": arguments}}],
    }


def choice(
    index: int = 0, *, call_id: str | None = "call_1", text: str = "", ids: list[int] | None = None
) -> dict[str, Any]:
    calls = [{"id": call_id, "type": "function", "function": {"name": "calculator", "arguments": ARGS}}]
    return {
        "index": index,
        "token_ids": ids if ids is not None else [7, 8, 9],
        "logprobs": [-0.1, -0.2, -0.3],
        "finish_reason": "tool_calls",
        "text": text,
        "tool_calls": calls if call_id else None,
    }


def call(messages: list[dict[str, Any]], choices: list[dict[str, Any]], **over: Any) -> CallRecord:
    fields: dict[str, Any] = {"response": None, "replica": "r", "started_at": 0.0, "completion_tokens": 3} | over
    return call_record(request={"model": "policy", "messages": messages}, choices=choices, **fields)


RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "408"}


def test_a_follow_up_continues_the_call_whose_choice_it_repeats() -> None:
    earlier = call([SYSTEM, USER], [choice()])
    found = continued([SYSTEM, USER, tool_turn(), RESULT], earlier)
    assert found is not None and found.position == 2 and found.choice["index"] == 0


def test_arguments_re_serialised_by_the_client_still_match() -> None:
    spaced = json.dumps(json.loads(ARGS), indent=2)
    assert continued([SYSTEM, USER, tool_turn(arguments=spaced), RESULT], call([SYSTEM, USER], [choice()]))


def test_n_greater_than_one_continues_the_choice_the_agent_kept() -> None:
    earlier = call([SYSTEM, USER], [choice(0, call_id="call_a", ids=[5]), choice(1, call_id="call_b", ids=[6])])
    found = continued([SYSTEM, USER, tool_turn("call_b"), RESULT], earlier)
    assert found is not None and found.choice["token_ids"] == [6]


@pytest.mark.parametrize(
    "messages",
    [
        [SYSTEM, USER, tool_turn(arguments='{"a": 12, "op": "add", "b": 34}'), RESULT],  # the agent edited the call
        [SYSTEM, USER, tool_turn("call_other"), RESULT],  # another call's id
        [SYSTEM, {"role": "user", "content": "What is 1 + 1?"}, tool_turn(), RESULT],  # history rewritten
        [SYSTEM, USER, tool_turn()],  # nothing after the turn
        [SYSTEM, USER, {"role": "user", "content": "again"}, RESULT],  # the answer was discarded
    ],
)
def test_what_is_not_a_continuation(messages: list[dict[str, Any]]) -> None:
    assert continued(messages, call([SYSTEM, USER], [choice()])) is None


def test_a_tool_call_turn_whose_text_was_blanked_or_rewritten_is_an_edited_turn() -> None:
    """The sampled text of a tool-call turn is part of what the model generated: a follow-up that drops
    or rewrites it does not repeat the sampled ids, so it is not spliced (issue 30)."""
    earlier = call([SYSTEM, USER], [choice(text="I will multiply.")])
    kept = {**tool_turn(), "content": "I will multiply."}
    assert continued([SYSTEM, USER, kept, RESULT], earlier) is not None
    assert continued([SYSTEM, USER, tool_turn(), RESULT], earlier) is None  # text dropped
    assert continued([SYSTEM, USER, {**tool_turn(), "content": "Multiplying."}, RESULT], earlier) is None
    assert continued([SYSTEM, USER, tool_turn(), RESULT], call([SYSTEM, USER], [choice()])) is not None  # none sampled


def test_fields_that_change_the_render_are_compared_absent_null_and_empty_alike() -> None:
    tools = [{"type": "function", "function": {"name": "calculator"}}]
    before = {"messages": [], "tools": tools, "chat_template_kwargs": {"enable_thinking": False}}
    assert render_changes(before, {**before, "temperature": 0.3, "tool_choice": "required"}) == []
    assert render_changes(before, {**before, "tools": tools + tools}) == ["tools"]
    assert render_changes(before, {**before, "chat_template_kwargs": {}, "reasoning_effort": "low"}) == [
        "chat_template_kwargs",
        "reasoning_effort",
    ]
    assert render_changes({"messages": []}, {"messages": [], "tools": [], "documents": None}) == []


def test_text_turns_match_on_their_content_and_failed_or_inexact_calls_never_match() -> None:
    earlier = call([USER], [choice(call_id=None, text="Let me think.")])
    follow = [USER, {"role": "assistant", "content": "Let me think."}, {"role": "user", "content": "Go on."}]
    assert continued(follow, earlier) is not None
    parts = [USER, {"role": "assistant", "content": [{"type": "text", "text": "Let me think."}]}, follow[2]]
    assert continued(parts, earlier) is not None
    assert continued([USER, {"role": "assistant", "content": "Other."}, follow[2]], earlier) is None
    assert continued(follow, call([USER], [choice(call_id=None, text="Let me think.")], exact_ids=False)) is None
    assert continued(follow, call([USER], [choice(call_id=None, text="Let me think.")], status_code=400)) is None


def test_end_of_turn_is_what_an_empty_assistant_turn_adds() -> None:
    assert end_of_turn([1, 2, 3], [1, 2, 3, 99, 10]) == [99, 10]
    with pytest.raises(ValueError, match="empty assistant turn"):
        end_of_turn([1, 2, 3], [1, 2, 4, 99])


CLOSING = [99, 10]  # <|im_end|> \n
HISTORY = [1, 2, 3, 50, 51, 52, 99, 10]  # the earlier prompt, the turn re-rendered (50 51 52), closing
TAIL = [20, 21, 22, 30]  # the tool result and the generation prompt


def test_the_splice_puts_the_sampled_ids_where_the_render_had_its_own() -> None:
    rendered = HISTORY + TAIL
    sampled = [60, 61, 99]  # the model sampled other ids for the same text, and the stop token
    assert splice([1, 2, 3], sampled, CLOSING, HISTORY, rendered) == [1, 2, 3, 60, 61, 99, 10, *TAIL]


def test_a_turn_cut_at_max_tokens_gets_the_whole_closing_and_an_exact_render_is_unchanged() -> None:
    rendered = HISTORY + TAIL
    assert splice([1, 2, 3], [60, 61], CLOSING, HISTORY, rendered) == [1, 2, 3, 60, 61, 99, 10, *TAIL]
    assert splice([1, 2, 3], [50, 51, 52, 99], CLOSING, HISTORY, rendered) == rendered


def test_templates_that_re_render_history_are_refused_with_why() -> None:
    reason = splice([1, 2, 3], [60, 99], CLOSING, HISTORY, [1, 2, 3, 50, 99, 10, *TAIL])
    assert isinstance(reason, str) and "differently" in reason
    reason = splice([1, 2, 3], [60, 99], CLOSING, [1, 2, 3, 50, 51], [1, 2, 3, 50, 51, *TAIL])
    assert isinstance(reason, str) and "end-of-turn" in reason


def test_a_turn_that_stopped_on_another_stop_token_is_not_spliced() -> None:
    """Qwen2.5 may stop on ``<|endoftext|>`` where its template ends turns with ``<|im_end|>``: spliced,
    the next prompt would hold both (issue 30)."""
    assert ended_elsewhere({"stop_reason": 151643}, [151645, 198]) == (
        "the turn ended on stop token 151643, not the template's end of turn [151645]"
    )
    assert ended_elsewhere({"stop_reason": None}, CLOSING) is None  # the end-of-sequence token: the template's
    assert ended_elsewhere({"stop_reason": 99}, CLOSING) is None
    assert ended_elsewhere({"stop_reason": "\n\n"}, CLOSING) is None  # a stop string: ``ended_on_string``'s rule


def test_without_max_tokens_the_room_is_the_engines_own_for_the_spliced_prompt() -> None:
    """vLLM's render set max_tokens by its rule for its own prompt's length; the spliced prompt is
    another length, and the engine's rule for it (``Splicer.room_for``) replaces the render's. The
    old arithmetic (the render's value plus the length difference) was wrong under a generation
    config's ``max_new_tokens``: 2048 there and a spliced prompt 100 tokens longer gave 1948 (issue 42)."""
    params = {"max_tokens": 2048, "temperature": 1.0}
    assert room({"messages": []}, params, 2048) == {"max_tokens": 2048, "temperature": 1.0}
    assert room({"messages": []}, {"max_tokens": 100}, 97) == {"max_tokens": 97}
    assert room({"max_tokens": 50}, {"max_tokens": 50}, None) == {"max_tokens": 50}  # the client's own


def test_a_render_without_max_tokens_rendered_the_default_16() -> None:
    """vLLM 0.32's render omits ``max_tokens`` at ``SamplingParams``' default (16); its generate route
    would take the absent field as the whole rest of the context."""
    assert room({"max_tokens": 16}, {"temperature": 1.0}, None) == {"temperature": 1.0, "max_tokens": 16}
    assert room({"messages": []}, {"temperature": 1.0}, 26) == {"temperature": 1.0, "max_tokens": 26}


def test_keep_reasoning_splices_past_a_template_that_drops_it() -> None:
    """Qwen3-style templates drop an earlier turn's reasoning once a new user turn follows: the full
    render no longer starts with the history render. ``strip`` gives up (a break per turn); ``keep``
    puts the sampled ids (reasoning included) back and takes the tail after that turn's end."""
    prompt = [1, 2, 3]
    sampled = [70, 71, 72, 60, 61, 99]  # <think> ... </think> answer <|im_end|>
    history = [*prompt, 70, 71, 72, 60, 61, *CLOSING]  # the last turn keeps its reasoning
    rendered = [*prompt, 60, 61, *CLOSING, *TAIL]  # once a user turn follows, it is dropped
    assert "differently" in str(splice(prompt, sampled, CLOSING, history, rendered))
    assert splice(prompt, sampled, CLOSING, history, rendered, keep_reasoning=True) == [
        *prompt,
        *sampled,
        10,
        *TAIL,
    ]
    rewritten = [1, 2, 4, 60, 61, *CLOSING, *TAIL]  # an earlier part changed as well: still no splice
    assert "before the continued one" in str(splice(prompt, sampled, CLOSING, history, rewritten, keep_reasoning=True))
