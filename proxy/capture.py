"""Capture exactly what the engine saw and sampled, and give the client a standard response.

Upstream, every recorded request asks vLLM for ``return_token_ids`` (prompt ids, and per choice the
sampled ids) and for logprobs of the sampled tokens (``--logprobs-mode processed_logprobs``: the
behaviour policy's). The client sees those fields only if it asked for them itself; otherwise they
are reset to what vLLM answers without them (``null``), so clients get standard responses.

A streamed recorded call also asks for ``stream_options.include_usage``: the usage chunk that ends
the stream carries ``completion_tokens``, the number of tokens the engine sampled, against which
the streamed ids are counted. A stream can lose ids without any other sign: vLLM before 0.13.0
sends no chunk at all for tokens its streaming tool parser holds back (vLLM issue #27482, fixed by
PR #29074), and with ``include_reasoning: false`` it sends no ids or logprobs on any chunk. A call
whose counts disagree is recorded as inexact, with the counts and why (``Captured.inexact``).

Pure functions and small accumulators: no I/O, so they are tested on recorded vLLM payloads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from contract.vocabulary import CallKind
from proxy.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class Wants:
    """What the client asked for itself, so the proxy's additions can be removed again."""

    token_ids: bool
    logprobs: bool
    usage: bool = True  # False: a stream whose usage chunk only the proxy asked for


def prepare(body: dict[str, Any], kind: CallKind) -> tuple[dict[str, Any], Wants]:
    """The upstream body (a shallow copy with token ids, sampled-token logprobs and, on a stream,
    the final usage chunk requested)."""
    upstream = dict(body)
    usage = True
    if body.get("stream") is True:
        options = body.get("stream_options")
        if options is None or isinstance(options, dict):  # anything else: vLLM's 400 stays the client's
            usage = isinstance(options, dict) and _true(options.get("include_usage"))
            if not usage:
                # continuous_usage_stats only counts with include_usage: it stays off, as it was for vLLM
                upstream["stream_options"] = {
                    **{k: v for k, v in (options or {}).items() if k != "continuous_usage_stats"},
                    "include_usage": True,
                }
    wants = Wants(token_ids=body.get("return_token_ids") is True, logprobs=_asked_logprobs(body, kind), usage=usage)
    upstream["return_token_ids"] = True
    if not wants.logprobs:
        upstream["logprobs"] = True if kind == "chat" else 0
    return upstream, wants


def single_prompt(body: dict[str, Any]) -> None:
    """Refuse a recorded ``/v1/completions`` call with several prompts (``["p1", "p2"]`` or a list of
    id lists): vLLM answers every prompt's choices in one response, and a record holds one prompt
    per call, so choice 1 would be trained after p1 (issue 30). One prompt per call, or the
    unrecorded ``/passthrough/v1``."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise InvalidRequest(
            f"'prompt' holds {len(prompt)} prompts; a recorded completions call takes one (send one call per "
            "prompt, or use /passthrough/v1 for unrecorded batches)",
            param="prompt",
            code="multiple_prompts",
        )


def _true(value: Any) -> bool:
    """A boolean field as vLLM's pydantic models read it (lax mode: 1, "true", "yes", ... are True)."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "t", "yes", "y", "on")
    return value is True or (type(value) is int and value == 1)


def _asked_logprobs(body: dict[str, Any], kind: CallKind) -> bool:
    value = body.get("logprobs")
    if kind == "chat":
        return value is True
    return value is not None and value is not False  # completions: an int, 0 meaning "sampled token only"


def sampled(body: dict[str, Any]) -> bool:
    """True unless the request is explicitly greedy (vLLM's default temperature is 1.0)."""
    temperature = body.get("temperature")
    return temperature is None or (isinstance(temperature, int | float) and temperature > 0)


def usage_only(data: dict[str, Any], wants: Wants) -> bool:
    """True for the usage chunk that ends a stream when only the proxy asked for it: the client
    must not receive it (vLLM sends it, with ``choices: []``, only on ``include_usage``)."""
    return not wants.usage and not data.get("choices") and data.get("usage") is not None


def strip_for_client(data: dict[str, Any], wants: Wants, kind: CallKind) -> bool:
    """Reset the fields the proxy added; True if ``data`` changed (then it must be re-serialised)."""
    changed = False
    if not wants.usage and data.get("usage") is not None:
        del data["usage"]
        changed = True
    if not wants.token_ids and data.get("prompt_token_ids") is not None:
        data["prompt_token_ids"] = None
        changed = True
    for choice in data.get("choices") or ():
        if not wants.token_ids:
            for key in ("token_ids", "prompt_token_ids"):
                if choice.get(key) is not None:
                    choice[key] = None
                    changed = True
        if not wants.logprobs and choice.get("logprobs") is not None:
            choice["logprobs"] = None
            changed = True
    return changed


def _sampled_logprobs(logprobs: dict[str, Any] | None, kind: CallKind) -> list[float]:
    if not logprobs:
        return []
    if kind == "chat":
        return [float(item["logprob"]) for item in logprobs.get("content") or ()]
    return [float(x) for x in logprobs.get("token_logprobs") or () if x is not None]


@dataclass(slots=True)
class ChoiceCapture:
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    reasoning: list[str] = field(default_factory=list)
    reasoning_key: str = "reasoning"
    """The field vLLM streams reasoning in (``reasoning``; older vLLM: ``reasoning_content``), kept
    as the message's, where a non-streamed answer has it."""
    finish_reason: str | None = None
    stop_reason: Any = None
    prompt_token_ids: list[int] | None = None
    ids_missing: bool = False

    def record(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "token_ids": self.token_ids,
            "logprobs": self.logprobs,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "text": "".join(self.text),
            "tool_calls": [self.tool_calls[i] for i in sorted(self.tool_calls)] or None,
            **({"prompt_token_ids": self.prompt_token_ids} if self.prompt_token_ids is not None else {}),
        }


@dataclass(slots=True)
class Captured:
    """Everything the recorder stores about a response."""

    prompt_token_ids: list[int] | None
    choices: list[dict[str, Any]]
    response: dict[str, Any]
    exact_ids: bool
    prompt_tokens: int | None
    completion_tokens: int | None
    inexact: dict[str, Any] | None = None  # why the ids are not exact, with the counts (the call's notes)


def _inexact(
    prompt_ids: list[int] | None, choices: list[ChoiceCapture], usage: dict[str, Any] | None
) -> dict[str, Any] | None:
    """Why these ids are not an exact record of what was sampled, or None when they are.

    Per choice, one logprob per sampled id; over the call, as many ids as the engine's
    ``usage.completion_tokens`` where usage came. A finished choice without ids (a tool call or
    text whose ids a parser dropped or hid) is inexact unless usage says nothing was sampled.
    """
    reported = usage.get("completion_tokens") if usage else None
    completion = reported if type(reported) is int else None
    why: list[str] = []
    if prompt_ids is None:
        why.append("no prompt token ids")
    if not choices:
        why.append("no choices")
    for c in choices:
        ids, logprobs = len(c.token_ids), len(c.logprobs)
        if c.ids_missing:
            why.append(f"choice {c.index}: no token ids")
        elif ids != logprobs:
            why.append(f"choice {c.index}: {ids} token ids but {logprobs} logprobs")
        elif ids == 0 and c.finish_reason is not None and completion != 0:
            why.append(f"choice {c.index}: finished ({c.finish_reason}) without token ids")
    total = sum(len(c.token_ids) for c in choices)
    if completion is not None and total != completion:
        why.append(f"{total} token ids but usage.completion_tokens is {completion}")
    if not why:
        return None
    return {
        "why": why,
        "token_ids": [len(c.token_ids) for c in choices],
        "logprobs": [len(c.logprobs) for c in choices],
        "completion_tokens": completion,
    }


def _usage(
    usage: dict[str, Any] | None, prompt_ids: list[int] | None, choices: list[ChoiceCapture]
) -> tuple[int | None, int | None]:
    if usage:
        return usage.get("prompt_tokens"), usage.get("completion_tokens")
    prompt = len(prompt_ids) if prompt_ids is not None else None
    completion = sum(len(c.token_ids) for c in choices) if not any(c.ids_missing for c in choices) else None
    return prompt, completion


_HEAVY_CHOICE_KEYS = ("logprobs", "token_ids", "prompt_token_ids", "prompt_logprobs")


def capture_response(data: dict[str, Any], kind: CallKind) -> Captured:
    """Capture a non-streamed response. ``data`` is left as the upstream sent it."""
    prompt_ids = data.get("prompt_token_ids")
    captures: list[ChoiceCapture] = []
    slim_choices = []
    for raw in data.get("choices") or ():
        choice = ChoiceCapture(
            index=raw.get("index", len(captures)),
            finish_reason=raw.get("finish_reason"),
            stop_reason=raw.get("stop_reason"),
        )
        ids = raw.get("token_ids")
        choice.ids_missing = ids is None
        choice.token_ids = list(ids or ())
        choice.logprobs = _sampled_logprobs(raw.get("logprobs"), kind)
        if kind == "chat":
            message = raw.get("message") or {}
            choice.text.append(message.get("content") or "")
            for i, call in enumerate(message.get("tool_calls") or ()):
                choice.tool_calls[i] = call
        else:
            choice.text.append(raw.get("text") or "")
            choice.prompt_token_ids = raw.get("prompt_token_ids")
            if prompt_ids is None:
                prompt_ids = choice.prompt_token_ids
        captures.append(choice)
        slim_choices.append({k: None if k in _HEAVY_CHOICE_KEYS else v for k, v in raw.items()})
    # The heavy fields are kept apart (``choices``, ``prompt_token_ids``); their keys stay, empty, so a
    # replay (``proxy/replay.py``) rebuilds the answer with every field where the engine put it.
    response = {k: None if k in ("prompt_token_ids", "prompt_logprobs") else v for k, v in data.items()}
    response["choices"] = slim_choices
    prompt_tokens, completion_tokens = _usage(data.get("usage"), prompt_ids, captures)
    return _captured(prompt_ids, captures, response, data.get("usage"), prompt_tokens, completion_tokens)


def _captured(
    prompt_ids: list[int] | None,
    captures: list[ChoiceCapture],
    response: dict[str, Any],
    usage: dict[str, Any] | None,
    prompt_tokens: int | None,
    completion_tokens: int | None,
) -> Captured:
    """The call's capture, plain or streamed alike: exact only when nothing in ``_inexact`` objects."""
    inexact = _inexact(prompt_ids, captures, usage)
    return Captured(
        prompt_token_ids=prompt_ids,
        choices=[c.record() for c in captures],
        response=response,
        exact_ids=inexact is None,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        inexact=inexact,
    )


REASONING = ("reasoning_content", "reasoning")
"""Where vLLM streams a reasoning model's thinking (the dialects read it in the same order)."""


class StreamCapture:
    """Accumulate SSE chunks of one streamed response into the record a non-streamed call gets: its
    reasoning deltas too, joined into the message as a non-streamed answer carries it (a fork's
    replay streams it back, ``replay.stream``)."""

    def __init__(self, kind: CallKind) -> None:
        self.kind = kind
        self.prompt_token_ids: list[int] | None = None
        self.choices: dict[int, ChoiceCapture] = {}
        self.header: dict[str, Any] = {}
        self.usage: dict[str, Any] | None = None

    def feed(self, chunk: dict[str, Any]) -> bool:
        """Add one chunk; True if it carried generated content (for time to first token)."""
        if not self.header:
            self.header = {k: chunk.get(k) for k in ("id", "created", "model", "system_fingerprint")}
        if self.prompt_token_ids is None and chunk.get("prompt_token_ids") is not None:
            self.prompt_token_ids = chunk["prompt_token_ids"]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if chunk.get("system_fingerprint"):
            self.header["system_fingerprint"] = chunk["system_fingerprint"]
        content = False
        for raw in chunk.get("choices") or ():
            index = raw.get("index", 0)
            choice = self.choices.get(index)
            if choice is None:
                choice = self.choices[index] = ChoiceCapture(index=index)
            ids = raw.get("token_ids")
            if ids:
                choice.token_ids.extend(ids)
                content = True
            choice.logprobs.extend(_sampled_logprobs(raw.get("logprobs"), self.kind))
            if self.kind == "chat":
                delta = raw.get("delta") or {}
                if delta.get("content"):
                    choice.text.append(delta["content"])
                    content = True
                key = next((k for k in REASONING if delta.get(k)), None)
                if key is not None:
                    choice.reasoning.append(delta[key])
                    choice.reasoning_key = key
                    content = True
                for call in delta.get("tool_calls") or ():
                    self._merge_tool_call(choice, call)
                    content = True
            else:
                if raw.get("text"):
                    choice.text.append(raw["text"])
                    content = True
                if choice.prompt_token_ids is None and raw.get("prompt_token_ids") is not None:
                    choice.prompt_token_ids = raw["prompt_token_ids"]
                    if self.prompt_token_ids is None:
                        self.prompt_token_ids = choice.prompt_token_ids
            if raw.get("finish_reason") is not None:
                choice.finish_reason = raw["finish_reason"]
                choice.stop_reason = raw.get("stop_reason")
        return content

    @staticmethod
    def _merge_tool_call(choice: ChoiceCapture, fragment: dict[str, Any]) -> None:
        """Streamed tool calls arrive in pieces: id/type/name once, arguments as string fragments."""
        index = fragment.get("index", 0)
        call = choice.tool_calls.setdefault(
            index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
        )
        if fragment.get("id"):
            call["id"] = fragment["id"]
        if fragment.get("type"):
            call["type"] = fragment["type"]
        function = fragment.get("function") or {}
        if function.get("name"):
            call["function"]["name"] += function["name"]
        if function.get("arguments"):
            call["function"]["arguments"] += function["arguments"]

    def result(self) -> Captured:
        captures = [self.choices[i] for i in sorted(self.choices)]
        for choice in captures:
            choice.ids_missing = choice.ids_missing or (not choice.token_ids and bool(choice.text or choice.reasoning))
        prompt_tokens, completion_tokens = _usage(self.usage, self.prompt_token_ids, captures)
        if self.kind == "chat":
            body_choices = [
                {
                    "index": c.index,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    "message": {
                        "role": "assistant",
                        "content": "".join(c.text) or None,
                        "tool_calls": [c.tool_calls[i] for i in sorted(c.tool_calls)] or None,
                        # the message's reasoning, where a non-streamed answer keeps it (``replay.stream``)
                        **({c.reasoning_key: "".join(c.reasoning)} if c.reasoning else {}),
                    },
                }
                for c in captures
            ]
            obj = "chat.completion"
        else:
            body_choices = [
                {
                    "index": c.index,
                    "text": "".join(c.text),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for c in captures
            ]
            obj = "text_completion"
        response = {
            **self.header,
            "object": obj,
            "choices": body_choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": (prompt_tokens or 0) + (completion_tokens or 0),
            },
        }
        return _captured(self.prompt_token_ids, captures, response, self.usage, prompt_tokens, completion_tokens)
