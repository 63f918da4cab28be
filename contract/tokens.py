"""Token-id prefixes: the one test of whether a call continues an earlier one.

The trainer merges an episode's calls into one sample when a call's prompt ids start with the
earlier prompt followed by its sampled ids (``trainer/merge.py``); the store keeps such a call as a
delta on the earlier one (``proxy/store/delta.py``). Both ask these functions, so a call the
trainer merges is a call the store can keep as a delta. They take lists of ids or the same ids
packed as bytes (both sides in one form). The ``rejoin_*`` functions undo such a delta: the store
reads its rows with them and a client the calls of a delta claim (``contract/entities.py``);
``client_list`` names the list of a client's own request (Messages, Responses, Gemini) that such a delta continues.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def extends(ids: Sequence[int], prefix: Sequence[int]) -> bool:
    """``ids`` starts with ``prefix`` (equal sequences included)."""
    return ids[: len(prefix)] == prefix


def continues(ids: Sequence[int], prompt: Sequence[int], completion: Sequence[int]) -> bool:
    """``ids`` starts with ``prompt`` followed by ``completion``: a later prompt continuing a sample."""
    return extends(ids, prompt) and ids[len(prompt) : len(prompt) + len(completion)] == completion


def rejoin_ids(prompt: list[int], sampled: list[int] | None, suffix: list[int]) -> list[int]:
    """A delta call's whole prompt: its base's prompt, the base's sampled ids it continues (None:
    the base's prompt alone, e.g. a retried call), then its own ids."""
    return prompt + (sampled or []) + suffix


def rejoin_messages(
    base: dict[str, Any], inherit: int, request: dict[str, Any], *, key: str = "messages"
) -> dict[str, Any]:
    """A delta call's whole request: the base request's first ``inherit`` items of its list at
    ``key`` (a chat request's messages; a client's Messages ``messages`` or Responses ``input``),
    then its own. Key order is the request's."""
    return {**request, key: base[key][:inherit] + request[key]}


def client_list(request: Any) -> str | None:
    """The key of a client's own conversation in its request, when the client spoke another API
    than chat (``client_request``): Messages' ``messages``, Responses' ``input`` as a list, Gemini's
    ``contents``. A Messages, Gemini or stateless Responses agent resends it whole each turn, as a
    chat agent does its messages, so it is kept as a delta the same way (``client_from``)."""
    if type(request) is not dict:
        return None
    for key in ("messages", "input", "contents"):
        if type(request.get(key)) is list:
            return key
    return None
