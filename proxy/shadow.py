"""The splice's shadow check: a spliced prompt against vLLM's ordinary render of the same request.

Why. A spliced follow-up (``splice.py``) is generated from the earlier call's recorded prompt, the
ids the model sampled, the template's end-of-turn ids and the render of the new messages. Only the
sampled ids may legitimately differ from what the chat template renders (vLLM re-tokenizes a turn
from its parsed message); everything around them is the template's and must be what the ordinary
render shows. Where it is not, the model generated from, and the trainer trains on, a context the
template would never give it, silently, since the splice's own rules saw nothing wrong: a template
that renders the date or time into the system block (Llama 3.1's "Today Date"), a template or
tokenizer changed under a running episode, a render-shaping request field the splice does not
compare, or a bug in the splice.

How. The splice already renders the request the ordinary way (``rendered["token_ids"]``, its tail
and sampling parameters are used), so the check is one pass over two id lists, nearly free:
``splice.shadow_share`` of the spliced calls are checked, all of them by default. The sampled ids
of every continued turn are left out (``spans``: the earlier call's, inherited, and this call's);
the rest is aligned with the render piece by piece, and the first difference is classified
(``contract.vocabulary.ShadowMismatch``):

- ``prefix``: before the newest sampled turn, outside the earlier sampled turns and their
  end-of-turn ids: the earlier prompt as recorded is not the render of the same history now;
- ``closing``: the end-of-turn ids after a sampled turn: the render closes that turn with other ids
  than the splice put there, or has none after it;
- ``tail``: after the newest turn's end-of-turn ids: the new messages and the generation prompt.

The last id before a sampled turn is not compared: the render tokenizes the turn's text together
with the template's text before it, and a turn that opens with a newline merges with the newline
ending the generation prompt (``"\\n"`` then ``"\\n"`` sampled, ``"\\n\\n"`` rendered). The record
says what was found (``notes.splice.shadow``), ``flywheel_splice_shadow_total{result}`` counts it
and the trainer sums the mismatches per step (``data/splice_shadow_<cause>``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from contract.vocabulary import ShadowMismatch
from proxy.store.records import CallRecord

Span = list[int]
"""``[start, end)``: where one turn's sampled ids lie in a prompt's ids (a JSON pair in the record)."""


@dataclass(frozen=True, slots=True)
class Mismatch:
    """The first difference outside the sampled ids."""

    cause: ShadowMismatch
    at: int
    """Index in the spliced prompt of the first id that differs (its length when the render is longer)."""


def earlier_spans(call: CallRecord) -> list[Span] | None:
    """Where the sampled ids of earlier turns lie in ``call``'s prompt ids. A call rendered the
    ordinary way (the first call, a splice skipped or turned off) holds none; a spliced one says
    where in its note; None: unknown (a fork's replayed call carries its source's ids but not its
    note; a call spliced before the spans were recorded)."""
    notes = call.notes or {}
    if notes.get("replay") is not None:
        return None
    note = notes.get("splice")
    if not isinstance(note, dict) or "skipped" in note:
        return []
    spans = note.get("spans")
    return [list(s) for s in spans] if isinstance(spans, list) else None


def _differs(a: list[int], b: list[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (the shorter one's length when one extends the other)."""
    if a == b:  # the common case, compared in C
        return None
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def index_of(ids: list[int], needle: list[int], start: int) -> int | None:
    """The first index >= ``start`` where ``needle`` occurs in ``ids``."""
    for i in range(start, len(ids) - len(needle) + 1):
        if ids[i : i + len(needle)] == needle:
            return i
    return None


def compare(spliced: list[int], canonical: list[int], spans: list[Span], closing: list[int]) -> Mismatch | None:
    """The first difference between ``spliced`` and ``canonical`` (vLLM's render of the same request)
    outside the sampled ``spans`` (in order, as in ``spliced``), classified; None: they agree.

    Each sampled turn's re-rendered text in ``canonical`` runs to the first ``closing`` ids after
    it; the turn's sampled ids may end with part of ``closing`` (the stop token), and the rest of
    ``closing`` must follow them in ``spliced``."""
    i = j = 0  # aligned positions in spliced and canonical
    for start, end in spans:
        fixed = spliced[i:start]
        d = _differs(fixed, canonical[j : j + len(fixed)])
        if d is not None and d < len(fixed) - 1:  # the last id may merge with the turn's text
            return Mismatch("prefix", i + d)
        have = next(
            (k for k in range(min(len(closing), end - start), 0, -1) if spliced[end - k : end] == closing[:k]), 0
        )
        rest = spliced[end : end + len(closing) - have]
        d = _differs(rest, closing[have:])
        if d is not None:
            return Mismatch("closing", end + d)
        found = index_of(canonical, closing, j + len(fixed))
        if found is None:
            return Mismatch("closing", end - have)
        i, j = end + len(rest), found + len(closing)
    d = _differs(spliced[i:], canonical[j:])
    if d is None:
        return None
    return Mismatch("tail" if spans else "prefix", i + d)


def shadow_note(
    spliced: list[int], canonical: list[int], spans: list[Span] | None, closing: list[int]
) -> dict[str, Any]:
    """``notes.splice.shadow`` of a checked call: the first mismatch's cause and index, or null."""
    if spans is None:
        return {"checked": False, "why": "the earlier call's sampled spans are unknown"}
    found = compare(spliced, canonical, spans, closing)
    return {"checked": True, "mismatch": found.cause if found else None, "at": found.at if found else None}
