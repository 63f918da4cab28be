"""What the whole answer and the stream build alike from vLLM's: finish reasons, usage, calls, log-probs.

``translation.py`` (the ``GenerateContentResponse``) and ``stream.py`` (its chunks) both call these,
so an answer reads the same streamed or not.
"""

from __future__ import annotations

from typing import Any

from proxy.dialects.messages.arguments import tool_input

_FINISH = {"stop": "STOP", "tool_calls": "STOP", "length": "MAX_TOKENS", "content_filter": "SAFETY"}


def finish_reason(finish: Any) -> str:
    """Google's ``finishReason`` for vLLM's ``finish_reason``: a function call ends as ``STOP``, as
    Gemini's do; a matched stop sequence too."""
    return _FINISH.get(finish, "OTHER") if isinstance(finish, str) else "OTHER"


def usage_metadata(prompt: Any, completion: Any) -> dict[str, int]:
    """vLLM's usage as ``usageMetadata`` (counts it lacks: zeros)."""
    p = prompt if type(prompt) is int else 0
    c = completion if type(completion) is int else 0
    return {"promptTokenCount": p, "candidatesTokenCount": c, "totalTokenCount": p + c}


def function_call(ident: str, name: str, arguments: Any) -> dict[str, Any]:
    """A ``functionCall`` part: chat's call id as its ``id`` (what the client answers with), the
    arguments parsed (text that is not a JSON object kept whole under ``_raw_arguments``)."""
    return {"functionCall": {"id": ident, "name": name, "args": tool_input(arguments)}}


def logprobs_result(items: list[dict[str, Any]], ids: Any, top: int) -> dict[str, Any]:
    """vLLM's per-token log-probs (``logprobs.content``) as a candidate's ``logprobsResult``: the
    sampled token, its id where vLLM gave one per token, and ``top`` alternatives per step."""
    ids = ids if isinstance(ids, list) and len(ids) == len(items) else None
    chosen = []
    for n, item in enumerate(items):
        entry: dict[str, Any] = {"token": item.get("token", ""), "logProbability": item["logprob"]}
        if ids is not None:
            entry["tokenId"] = ids[n]
        chosen.append(entry)
    result: dict[str, Any] = {
        "chosenCandidates": chosen,
        "logProbabilitySum": sum(item["logprob"] for item in items),
    }
    if top:
        result["topCandidates"] = [
            {
                "candidates": [
                    {"token": t.get("token", ""), "logProbability": t["logprob"]}
                    for t in (item.get("top_logprobs") or ())[:top]
                ]
            }
            for item in items
        ]
    return result
