"""The OpenAI Responses API (``POST /v1/responses``) as chat completions.

Request: ``instructions`` become the leading system message; ``input`` (a string, or items:
messages, ``function_call``, ``function_call_output``, ``reasoning``) becomes chat messages, a
run of ``function_call`` items one assistant turn with ``tool_calls`` (so a turn passed back
repeats the recorded choice and the proxy splices its sampled ids, ``proxy/splice.py``);
function tools, ``tool_choice``, ``text.format`` (JSON schema), ``max_output_tokens`` and the
sampling fields map one to one. ``previous_response_id`` is resolved by the route from the store
(``history_of``): that call's chat messages without its instructions (the API does not carry
instructions over) and its answer.

Answer: output items (``reasoning``, ``message`` with ``output_text``, ``function_call``), the
status (``incomplete`` with ``max_output_tokens`` when vLLM stopped on length) and usage. A
stream is the documented event sequence, ``sequence_number`` counting from 0, ending with
``response.completed`` (or ``response.incomplete``) once the record committed.

Every field the translation does not use gets its rule from ``proxy/compat.py`` (accepted
without effect and echoed, served another way, or refused with a 400 naming it): client
metadata, cache keys, effort and summary hints, hosted tools (dropped or refused), ``namespace``
tool groups (flattened into functions named ``<namespace>__<name>``, their calls named back in
the answer), ``background``, ``conversation``, ``prompt`` templates, ``max_tool_calls``, and any
field unknown here, by kind. Refused here: ``truncation: auto``, ``include`` values other than
``message.output_text.logprobs`` and ``reasoning.encrypted_content``, input items that need
server state (``item_reference``). ``store: false`` answers as usual and is recorded for
training like any call (that is the proxy's job), but its id is then refused as a
``previous_response_id``.

Modules: ``request.py`` (validation, the chat body, ``history_of``), ``translation.py``
(``ResponsesTranslation`` and the ``Response``), ``stream.py`` (the events), ``answer.py`` (what
both answers build alike: usage, log-probs, sealed reasoning).
"""

from __future__ import annotations

from proxy.dialects.responses.request import INCLUDABLE, ResponsesRequest, history_of, input_messages, parse
from proxy.dialects.responses.stream import ResponsesStream
from proxy.dialects.responses.translation import ResponsesTranslation

__all__ = [
    "INCLUDABLE",
    "ResponsesRequest",
    "ResponsesStream",
    "ResponsesTranslation",
    "history_of",
    "input_messages",
    "parse",
]
