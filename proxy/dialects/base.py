"""What a dialect gives the chat route: the chat body, and the answer and stream events in its API.

A translation is built from the client's validated request (``InvalidRequest`` for anything the
dialect refuses, before anything reaches vLLM). ``ModelCall`` (``proxy/relay.py``) then sends ``chat`` upstream exactly
as it would a client's chat request, and hands the dialect the upstream's full answer (with
``prompt_token_ids``, per-choice ``token_ids`` and ``logprobs``, ``usage``) or, streamed, every
chunk in order. The terminal event (``done``) is sent only after the call's record committed, as
``data: [DONE]`` is for chat; ``error`` replaces it when the call failed mid-stream.
"""

from __future__ import annotations

from typing import Any, Protocol

from contract.vocabulary import CallApi
from proxy.errors import FlywheelError


class EventStream(Protocol):
    """Chat completion chunks in, the dialect's server-sent events out (bytes, ready to send)."""

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        """Events for one upstream chunk (``b""`` if none); the first chunk carries ``prompt_token_ids``."""
        ...

    def done(self) -> bytes:
        """The closing events, after the stream ended and the record committed."""
        ...

    def error(self, error: FlywheelError) -> bytes:
        """The dialect's error event, ending a stream that failed."""
        ...


class Translation(Protocol):
    """One client request in another API, as the chat request the proxy executes."""

    api: CallApi
    """The API the client spoke: ``responses`` or ``messages`` (stored with the call)."""
    client_request: dict[str, Any]
    """The client's request as it came (stored with the call)."""
    chat: dict[str, Any]
    """The chat completions request body (``model``, ``messages``, ``tools``, sampling, ``stream``)."""
    response_id: str
    """The id the client sees (``resp_...``, ``msg_...``), stored with the call."""
    compat: dict[str, Any] | None
    """What ``proxy/compat.py`` accepted without effect, mapped or dropped: the call's ``notes.compat``."""

    def response(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The client's answer from the upstream's non-streamed chat completion."""
        ...

    def stream(self) -> EventStream:
        """A fresh translator for this request's streamed answer."""
        ...
