"""Token-id prefixes: the one test of whether a call continues an earlier one.

The trainer merges an episode's calls into one sample when a call's prompt ids start with the
earlier prompt followed by its sampled ids (``trainer/data.py``); the store keeps such a call as a
delta on the earlier one (``proxy/store/delta.py``). Both ask these functions, so a call the
trainer merges is a call the store can keep as a delta. They take lists of ids or the same ids
packed as bytes (both sides in one form).
"""

from __future__ import annotations

from collections.abc import Sequence


def extends(ids: Sequence[int], prefix: Sequence[int]) -> bool:
    """``ids`` starts with ``prefix`` (equal sequences included)."""
    return ids[: len(prefix)] == prefix


def continues(ids: Sequence[int], prompt: Sequence[int], completion: Sequence[int]) -> bool:
    """``ids`` starts with ``prompt`` followed by ``completion``: a later prompt continuing a sample."""
    return extends(ids, prompt) and ids[len(prompt) : len(prompt) + len(completion)] == completion
