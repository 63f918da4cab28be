"""Google's Gemini API (``models/<m>:generateContent``, ``:streamGenerateContent``, ``:countTokens``)
served as chat completions.

An agent on Google's API (Gemini CLI, the google-genai SDKs) sends ``GenerateContentRequest``s; they
are validated, translated to one chat completions body for vLLM, and the chat answer (or its
chunks) is translated back into a ``GenerateContentResponse`` (or its stream).

    systemInstruction (text parts)         -> a leading system message (parts joined with "\\n")
    user text / inlineData image parts      -> a user message (one string unless images are present)
    user functionResponse parts             -> tool messages, placed before the user's own text
    model text / functionCall parts         -> content (joined as sampled, no separator) / tool_calls
    model thought parts                     -> reasoning_content (what vLLM's chat templates read)
    functionDeclarations                    -> function tools (``parameters``, Google's Schema, as
                                               JSON Schema; ``parametersJsonSchema`` as it is)
    functionCallingConfig AUTO/ANY/NONE     -> tool_choice "auto" / "required" or the one allowed
                                               function / "none"; ANY and VALIDATED hold calls to
                                               their schema (strict functions), VALIDATED is "auto"
    generationConfig                        -> temperature, top_p, top_k, max_tokens, stop, n, seed,
                                               penalties, response_format (application/json with
                                               responseSchema or responseJsonSchema), logprobs
    thinkingConfig                          -> the chat template's thinking switch
                                               (``compat.thinking_switch``); includeThoughts: the
                                               answer's reasoning as ``thought`` parts

Choices this package makes where Google's API and chat completions differ:

- A function call's ``id`` is chat's tool-call id (vLLM's), which Gemini CLI passes back; a call
  passed back without one gets ``call_<content>_<part>`` and a ``functionResponse`` without one
  answers the first unanswered call of that name in the model turn before it, as the older API
  matched them.
- A ``functionResponse.response`` of only ``output`` / ``error`` (Google's documented keys) is the
  tool message's text (an error said with ``Error:``); any other object is sent as compact JSON.
  Function call arguments convert both ways as in the Messages dialect (``_raw_arguments``).
- A candidate's ``finishReason`` is ``STOP`` for a function call (as Gemini's), ``MAX_TOKENS`` for
  the length cut; ``usageMetadata`` has vLLM's counts (no separate thought count: vLLM has none).
- Every field the translation does not use (``safetySettings``, ``labels``, ``thoughtSignature``,
  ``cachedContent``, Google's hosted tools, and any field unknown here) gets its rule from
  ``proxy/compat.py``: accepted without effect, served another way, or refused with a 400 naming it.

Modules, in the order a call meets them: ``schema.py`` (request shapes, 400s), ``request.py`` (the
chat body, ``countTokens``), ``translation.py`` (``GeminiTranslation`` and the answer),
``stream.py`` (the chunks), ``answer.py`` (what both build alike), ``errors.py`` (the error shape).
"""

from __future__ import annotations

from proxy.dialects.gemini.errors import error_body, speaks_gemini, status_of
from proxy.dialects.gemini.request import count_tokens_chat, json_schema
from proxy.dialects.gemini.stream import GeminiStream
from proxy.dialects.gemini.translation import GeminiTranslation

__all__ = [
    "GeminiStream",
    "GeminiTranslation",
    "count_tokens_chat",
    "error_body",
    "json_schema",
    "speaks_gemini",
    "status_of",
]
