"""The fake upstream's scripted mode: an engine that drives an agent harness through one task.

``python -m bench.fake_upstream --script 'printf hello > hello.txt'`` answers every chat
completion as a model would that runs one shell command and then reports: while the conversation
holds no tool result, a call of the offered shell tool (the first whose required arguments
include a ``command`` or ``cmd`` string: Claude Code's ``Bash``, Codex's ``exec_command``) with
that command; after the result, a short final answer. Not a model: real harnesses' system prompts
and tools (10-17k tokens) do not fit SmolLM2's context, so their end-to-end tests script the
engine and check the proxy (on a GPU deployment they run on vLLM).

What vLLM would send, from toy parts: prompt ids from the fake's chat template (``Template``),
sampled ids from its tokenizer (``pieces``), a log-prob per id; streamed one token per event
(tool-call arguments as deltas, a usage chunk last) or whole. Token ids and log-probs are returned
only when asked (``return_token_ids``, ``logprobs``), as vLLM does. Every answer is appended to a
JSON Lines log (``--answer-log``), so a test compares the proxy's record with what was sampled.
"""

from __future__ import annotations

import itertools
import zlib
from pathlib import Path
from typing import Any

import orjson

from bench.fake_upstream import PIECES, WORD_IDS, Template

FINAL = "Done: the command ran."
SHELL_ARGUMENTS = ("command", "cmd")


def pieces(text: str) -> list[tuple[int, str]]:
    """The toy tokenizer with each token's text: canned pieces longest first, else one per word."""
    out, i = [], 0
    while i < len(text):
        for piece, tid in PIECES:
            if text.startswith(piece, i):
                out.append((tid, piece))
                i += len(piece)
                break
        else:
            end = text.find(" ", i + 1)
            end = len(text) if end < 0 else end
            out.append((WORD_IDS + zlib.crc32(text[i:end].encode()) % 100_000, text[i:end]))
            i = end
    return out


def _text(message: dict[str, Any]) -> str:
    """A chat message as the template renders it: its text parts, then its tool calls."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    calls = message.get("tool_calls") or []
    rendered = [f"{(c.get('function') or {}).get('name')} {(c.get('function') or {}).get('arguments')}" for c in calls]
    return "\n".join([content if isinstance(content, str) else "", *rendered])


def shell_tool(tools: Any) -> tuple[str, str] | None:
    """(tool name, argument name) of the first offered tool that takes a shell command."""
    for tool in tools if isinstance(tools, list) else ():
        function = tool.get("function") if isinstance(tool, dict) else None
        parameters = (function or {}).get("parameters") or {}
        required = parameters.get("required") or []
        for name in SHELL_ARGUMENTS:
            if name in required and (parameters.get("properties") or {}).get(name, {}).get("type") == "string":
                return str(function["name"]), name  # type: ignore[index]
    return None


def _logprob(position: int) -> float:
    return -0.05 * (1 + position % 9)


class Script:
    """Answers chat completions as the task's script says, and logs each answer."""

    def __init__(self, command: str, log: Path | None) -> None:
        self.command = command
        self.log = log
        self.template = Template()
        self.ids = itertools.count(1)

    def answer(self, body: dict[str, Any]) -> bytes | list[bytes]:
        """The whole JSON answer, or a stream's server-sent events in order (without ``[DONE]``)."""
        raw = body.get("messages")
        messages: list[dict[str, Any]] = [m for m in raw if isinstance(m, dict)] if isinstance(raw, list) else []
        prompt = self.template.prompt([{"role": m.get("role"), "content": _text(m)} for m in messages])
        shell = shell_tool(body.get("tools"))
        done = any(m.get("role") == "tool" for m in messages)
        call = None
        if shell is not None and not done:
            arguments = orjson.dumps({shell[1]: self.command}).decode()
            call = {"id": f"chatcmpl-tool-{next(self.ids):08x}", "name": shell[0], "arguments": arguments}
            opening = f'<tool_call>{{"name": "{shell[0]}", "arguments": '
            parts = [pieces(opening), pieces(arguments), pieces("}</tool_call>")]
        else:
            parts = [pieces(FINAL)]
        tokens = [(tid, text, _logprob(i)) for i, (tid, text) in enumerate(p for part in parts for p in part)]
        self._log(body, prompt, tokens, call)
        answer = _Answer(body, prompt, tokens, call, [len(p) for p in parts], f"chatcmpl-{next(self.ids):016x}")
        return answer.events() if body.get("stream") else answer.whole()

    def _log(self, body: dict[str, Any], prompt: list[int], tokens: list[Any], call: dict[str, Any] | None) -> None:
        if self.log is None:
            return
        line = {
            "model": body.get("model"),
            "stream": bool(body.get("stream")),
            "prompt_token_ids": prompt,
            "token_ids": [t[0] for t in tokens],
            "logprobs": [t[2] for t in tokens],
            "tool_call": call,
            "content": None if call else FINAL,
        }
        with self.log.open("ab") as out:
            out.write(orjson.dumps(line) + b"\n")


class _Answer:
    """One scripted answer in vLLM's two shapes."""

    def __init__(
        self,
        body: dict[str, Any],
        prompt: list[int],
        tokens: list[tuple[int, str, float]],
        call: dict[str, Any] | None,
        parts: list[int],
        ident: str,
        final: str | None = FINAL,
    ) -> None:
        self.model = body.get("model")
        self.ids = body.get("return_token_ids") is True
        self.logprobs = body.get("logprobs") is True
        self.prompt, self.tokens, self.call, self.parts, self.ident = prompt, tokens, call, parts, ident
        self.finish = "tool_calls" if call else "stop"
        self.final = final
        """The final answer's text (``bench/fake_tokens.py`` scripts its own)."""

    def _logprobs(self, tokens: list[tuple[int, str, float]]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        content = [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []} for _, t, lp in tokens]
        return {"content": content}

    def _usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": len(self.prompt),
            "completion_tokens": len(self.tokens),
            "total_tokens": len(self.prompt) + len(self.tokens),
        }

    def whole(self) -> bytes:
        message: dict[str, Any] = {"role": "assistant", "content": None if self.call else self.final, "reasoning": None}
        if self.call:
            function = {"name": self.call["name"], "arguments": self.call["arguments"]}
            message["tool_calls"] = [{"id": self.call["id"], "type": "function", "function": function}]
        choice = {
            "index": 0,
            "message": message,
            "logprobs": self._logprobs(self.tokens),
            "finish_reason": self.finish,
            "stop_reason": None,
            "token_ids": [t[0] for t in self.tokens] if self.ids else None,
        }
        return orjson.dumps(
            {
                "id": self.ident,
                "object": "chat.completion",
                "created": 0,
                "model": self.model,
                "choices": [choice],
                "usage": self._usage(),
                "prompt_token_ids": self.prompt if self.ids else None,
            }
        )

    def _chunk(self, delta: dict[str, Any], tokens: list[tuple[int, str, float]], last: bool) -> bytes:
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": self._logprobs(tokens),
            "finish_reason": self.finish if last else None,
            "token_ids": [t[0] for t in tokens] if self.ids else None,
        }
        if last:
            choice["stop_reason"] = None
        chunk = {"id": self.ident, "object": "chat.completion.chunk", "created": 0, "model": self.model}
        return b"data: " + orjson.dumps({**chunk, "choices": [choice]}) + b"\n\n"

    def events(self) -> list[bytes]:
        head = {"id": self.ident, "object": "chat.completion.chunk", "created": 0, "model": self.model}
        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        role = {**head, "choices": [first], "prompt_token_ids": self.prompt if self.ids else None}
        out = [b"data: " + orjson.dumps(role) + b"\n\n"]
        tokens, last = self.tokens, len(self.tokens) - 1
        if self.call is None:
            out += [self._chunk({"content": t[1]}, [t], i == last) for i, t in enumerate(tokens)]
        else:
            header, arguments = self.parts[0], self.parts[1]
            function = {"name": self.call["name"], "arguments": ""}
            opening = {"index": 0, "id": self.call["id"], "type": "function", "function": function}
            out.append(self._chunk({"tool_calls": [opening]}, tokens[:header], False))
            for t in tokens[header : header + arguments]:
                out.append(self._chunk({"tool_calls": [{"index": 0, "function": {"arguments": t[1]}}]}, [t], False))
            out.append(self._chunk({}, tokens[header + arguments :], True))
        out.append(b"data: " + orjson.dumps({**head, "choices": [], "usage": self._usage()}) + b"\n\n")
        return out
