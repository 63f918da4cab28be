"""The Anthropic Messages API (``POST /v1/messages``) served as chat completions.

An agent on the ``anthropic`` SDK (``messages.create`` / ``messages.stream``) sends Messages
requests; they are validated, translated to one chat completions body for vLLM, and the chat
answer (or its chunks) is translated back into a Messages ``Message`` (or its server-sent events).

    system (str | text blocks)        -> a leading system message (blocks joined with "\\n")
    user text / image blocks          -> a user message (one string unless images are present)
    user tool_result blocks           -> tool messages, placed before the user's own text
    assistant text / tool_use         -> content (joined with "\\n") / tool_calls
    assistant thinking                -> reasoning_content (what vLLM's chat templates read)
    tools / tool_choice               -> function tools / "auto", "required", a named function, "none"
    stop_sequences, sampling, stream  -> stop, temperature / top_p / top_k, stream + include_usage

Choices this package makes where the Messages API and chat completions differ:

- Tool-use ``input`` and arguments text convert both ways in ``arguments.py`` (orjson; arguments
  that are not a JSON object travel as ``input: {"_raw_arguments": <text>}`` and back unchanged).
- A ``tool_result`` with ``is_error: true`` has its text prefixed with ``"Error: "``: a chat tool
  message has no error flag, and the model should still be told that the tool failed.
- Every field the translation does not use (``metadata``, ``cache_control``, ``thinking``,
  ``context_management``, ``output_config``, a ``system`` message inside ``messages``, deferred
  and hosted tools, and any field unknown here) gets its rule from ``proxy/compat.py``: accepted
  without effect, served another way, or refused with a 400 naming it; ``tool_choice: {"type":
  "none"}`` without tools is dropped (nothing to choose from).
- Streamed tool calls are sent whole once the choice finishes (``stream.py``).

Modules, in the order a call meets them: ``schema.py`` (request shapes, 400s), ``request.py`` (the
chat body), ``arguments.py`` (tool arguments both ways), ``translation.py`` (``MessagesTranslation``
and the answer), ``stream.py`` (the events), ``errors.py`` (the error shape).
"""

from __future__ import annotations

from proxy.dialects.messages.arguments import RAW_ARGUMENTS
from proxy.dialects.messages.errors import error_body, error_type
from proxy.dialects.messages.request import count_tokens_chat
from proxy.dialects.messages.stream import MessagesStream
from proxy.dialects.messages.translation import MessagesTranslation

__all__ = ["RAW_ARGUMENTS", "MessagesStream", "MessagesTranslation", "count_tokens_chat", "error_body", "error_type"]
