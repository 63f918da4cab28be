"""The compact call layout: token ids and log-probs as binary, prompts and messages as deltas.

Why. An agent sends its whole conversation on every call, so a store that keeps each call's prompt
ids and messages whole grows with the square of an episode's turns. Here a call whose prompt ids
continue an earlier call of its episode (that call's prompt followed by one of its choices' sampled
ids: ``contract.tokens.continues``, the test the trainer's merge applies) stores only the ids that
follow, with the earlier call's ordinal (``base_ordinal``); a call whose messages start with that
call's whole list stores only the messages that follow (``messages_from``: how many it inherits).

Encoding (``encoding`` = 1; 0 is the JSON layout of stores written before migration 0004):

- ``prompt_ids``: little-endian int32 ids, the whole prompt (``prompt_choice`` NULL) or what
  follows the base's prompt and the sampled ids of its choice at position ``prompt_choice``
  (-1: the base's prompt alone, e.g. a retried call).
- ``choice_ids`` / ``choice_logprobs``: every choice's ``token_ids`` / ``logprobs`` concatenated;
  in ``choices`` each such list is replaced by its length. Log-probs are float32 when every value
  of the call survives the round trip bit for bit (vLLM computes them in float32 and its JSON
  carries those values, so its calls do), else float64: the first byte says which (``f``/``d``).
  A Python float is a float64, which is what JSON text held before: nothing the trainer reads moves.

Exactness by construction: a reference is written only when the bytes compared are the bytes the
reader concatenates (messages are compared by a BLAKE2b-256 digest of their JSON text, the text the
store would write); anything else (ids outside int32, a bool among ids, an int among log-probs, JSON
orjson cannot write) is stored whole, in the old JSON columns. Readers get the full record back.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from contract.tokens import client_list, continues, extends, rejoin_ids, rejoin_messages

COMPACT = 1
"""``calls.encoding`` of rows in this layout (0: the JSON layout before migration 0004)."""
_INT32 = (-(2**31), 2**31 - 1)
_SWAP = sys.byteorder != "little"


def pack_ids(ids: Any) -> bytes | None:
    """Ids as little-endian int32, or None when they are not a list of ints in range.

    ``array`` refuses floats, strings and ids past int32 but takes bools, which JSON keeps apart
    from ints: a list holding something equal to 0 or 1 has its types checked too.
    """
    if type(ids) is not list:
        return None
    try:
        packed = array("i", ids)
    except (TypeError, OverflowError):
        return None
    if (True in ids or False in ids) and set(map(type, ids)) != {int}:
        return None
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def unpack_ids(data: bytes) -> list[int]:
    values = array("i")
    values.frombytes(data)
    if _SWAP:
        values.byteswap()
    return values.tolist()


def _pack_floats(values: list[float]) -> bytes:
    """``values`` as float32 if that keeps every bit of them, else float64; one tag byte first."""
    wide = array("d", values)
    try:
        narrow = array("f", values)
    except OverflowError:
        narrow = None
    if narrow is not None and array("d", narrow).tobytes() == wide.tobytes():
        chosen, tag = narrow, b"f"
    else:
        chosen, tag = wide, b"d"
    if _SWAP:
        chosen.byteswap()
    return tag + chosen.tobytes()


def _unpack_floats(data: bytes) -> list[float]:
    values: array[float] = array(data[:1].decode())
    values.frombytes(data[1:])
    if _SWAP:
        values.byteswap()
    return values.tolist()


@dataclass(slots=True)
class Tail:
    """One stored call of an episode as a later call may extend it: packed ids and a messages digest."""

    ordinal: int
    prompt: bytes
    completions: tuple[bytes | None, ...]
    """Each choice's packed sampled ids, by position (None: not packable)."""
    messages: int | None
    """How many messages its request had (None: no message list a later call can inherit)."""
    digest: bytes | None
    client: int | None = None
    """How many items its client's own list had (``client_list``; None: none a later call can inherit)."""
    client_digest: bytes | None = None
    client_key: str | None = None
    """Where that list is (``messages`` or ``input``): a later call inherits only from the same key."""

    @property
    def size(self) -> int:
        return len(self.prompt) + sum(len(c or b"") for c in self.completions)


@dataclass(slots=True)
class Heavy:
    """A call's three large fields, whole: what ``pack`` takes and ``unpack`` gives back."""

    request: dict[str, Any]
    prompt_token_ids: list[int] | None
    choices: list[dict[str, Any]]
    client_request: dict[str, Any] | None = None


@dataclass(slots=True)
class Packed:
    """A call's large fields as stored: the JSON columns and the compact ones."""

    request: dict[str, Any]
    prompt_token_ids: list[int] | None
    choices: list[dict[str, Any]]
    base_ordinal: int | None
    prompt_choice: int | None
    prompt_ids: bytes | None
    messages_from: int | None
    choice_ids: bytes | None
    choice_logprobs: bytes | None
    client_request: dict[str, Any] | None
    client_from: int | None
    tail: Tail | None
    """This call as a base for later ones (None: its prompt ids are not packable)."""

    @property
    def delta(self) -> bool:
        return self.prompt_choice is not None or self.messages_from is not None or self.client_from is not None


PACKED_COLUMNS = (
    "base_ordinal",
    "prompt_choice",
    "prompt_ids",
    "messages_from",
    "choice_ids",
    "choice_logprobs",
    "client_from",
)


def _items(messages: list[Any]) -> bytes | None:
    """The messages' JSON text without the list's brackets (items joined by commas), as the store
    writes JSON; None when orjson cannot write them (such a list is never inherited)."""
    try:
        return orjson.dumps(messages, option=orjson.OPT_NON_STR_KEYS)[1:-1]
    except TypeError:
        return None


def _digest(*texts: bytes) -> Any:
    """BLAKE2b-256 of item texts joined by commas: the same bytes as one list's items, so the digest
    of a whole list and that of the same messages as a prefix of a longer one are equal."""
    hasher = hashlib.blake2b(digest_size=32)
    hasher.update(texts[0])
    for text in texts[1:]:
        if text:
            hasher.update(b"," + text)
    return hasher


def _inherit(items: list[Any], count: int | None, digest: bytes | None) -> tuple[int | None, bytes | None]:
    """(how many of ``items`` a call inherits from a base whose list had ``count`` items with
    ``digest``, or None; the digest of all of ``items``)."""
    if count is not None and digest is not None and count <= len(items):
        head, rest = _items(items[:count]), _items(items[count:])
        if head is None or rest is None:
            return None, None
        hasher = _digest(head)
        same = hasher.digest() == digest
        if rest:
            hasher.update(b"," + rest)
        return (count if same else None), hasher.digest()
    text = _items(items)
    return None, (_digest(text).digest() if text is not None else None)


def _floats(value: Any) -> bool:
    return type(value) is list and (not value or set(map(type, value)) == {float})


def _pack_choices(
    choices: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], bytes | None, bytes | None, tuple[bytes | None, ...]]:
    """(choices as stored, the ids blob, the log-probs blob, each choice's packed ids by position).

    A field goes to its blob only when every choice's value packs (or is None / absent, kept as
    is); otherwise every choice keeps that field as JSON, so a length in its place is unambiguous.
    """
    packed: list[bytes | None] = []
    lists: list[list[float]] = []
    ids_ok = logprobs_ok = True
    for choice in choices:
        if type(choice) is not dict:
            packed.append(None)
            ids_ok = logprobs_ok = False
            continue
        ids = choice.get("token_ids")
        packed.append(pack_ids(ids) if ids is not None else None)
        ids_ok = ids_ok and (ids is None or packed[-1] is not None)
        logprobs = choice.get("logprobs")
        if logprobs is not None:
            logprobs_ok = logprobs_ok and _floats(logprobs)
            lists.append(logprobs)
    if not (ids_ok or logprobs_ok):
        return choices, None, None, tuple(packed)
    stored = []
    for choice in choices:
        copy = dict(choice)
        if ids_ok and copy.get("token_ids") is not None:
            copy["token_ids"] = len(copy["token_ids"])
        if logprobs_ok and copy.get("logprobs") is not None:
            copy["logprobs"] = len(copy["logprobs"])
        stored.append(copy)
    ids_blob = b"".join(b for b in packed if b is not None) if ids_ok else None
    logprobs_blob = _pack_floats([x for values in lists for x in values]) if logprobs_ok else None
    return stored, ids_blob, logprobs_blob, tuple(packed)


def _prompt_delta(prompt: bytes, base: Tail) -> tuple[int, bytes] | None:
    """(choice position or -1, the ids that follow) when ``prompt`` continues ``base``."""
    for position, completion in enumerate(base.completions):
        if completion is not None and continues(prompt, base.prompt, completion):
            return position, prompt[len(base.prompt) + len(completion) :]
    if extends(prompt, base.prompt):
        return -1, prompt[len(base.prompt) :]
    return None


def pack(ordinal: int, heavy: Heavy, base: Tail | None) -> Packed:
    """The stored form of a call at ``ordinal``; deltas against ``base`` (an earlier call) where exact."""
    request, choices = heavy.request, heavy.choices
    prompt = pack_ids(heavy.prompt_token_ids)
    prompt_choice: int | None = None
    prompt_ids = prompt
    if prompt is not None and base is not None and (found := _prompt_delta(prompt, base)) is not None:
        prompt_choice, prompt_ids = found
    messages: Any = request.get("messages") if type(request) is dict else None
    messages_from: int | None = None
    digest: bytes | None = None
    if type(messages) is list:
        messages_from, digest = _inherit(messages, *((base.messages, base.digest) if base else (None, None)))
        if messages_from is not None:
            request = dict(request)
            request["messages"] = messages[messages_from:]
    client = heavy.client_request
    client_from: int | None = None
    client_digest: bytes | None = None
    client_count = 0
    if (key := client_list(client)) is not None:
        assert client is not None
        items = client[key]
        same_key = base is not None and base.client_key == key
        client_from, client_digest = _inherit(
            items, *((base.client, base.client_digest) if base and same_key else (None, None))
        )
        client_count = len(items) if client_digest is not None else 0
        if client_from is not None:
            client = dict(client)
            client[key] = items[client_from:]
    stored_choices, choice_ids, choice_logprobs, completions = _pack_choices(choices)
    tail = None
    if prompt is not None:
        count = len(messages) if digest is not None else 0  # a digest is only made of a list
        tail = Tail(
            ordinal,
            prompt,
            completions,
            count or None,
            digest if count else None,
            client_count or None,
            client_digest if client_count else None,
            key if client_count else None,
        )
    delta = prompt_choice is not None or messages_from is not None or client_from is not None
    return Packed(
        request=request,
        prompt_token_ids=heavy.prompt_token_ids if prompt is None else None,
        choices=stored_choices,
        base_ordinal=base.ordinal if delta and base is not None else None,
        prompt_choice=prompt_choice,
        prompt_ids=prompt_ids,
        messages_from=messages_from,
        choice_ids=choice_ids,
        choice_logprobs=choice_logprobs,
        client_request=client,
        client_from=client_from,
        tail=tail,
    )


def _unpack_choices(choices: list[Any], ids: bytes | None, logprobs: bytes | None) -> list[Any]:
    if ids is None and logprobs is None:
        return choices
    all_ids = unpack_ids(ids) if ids is not None else []
    all_logprobs = _unpack_floats(logprobs) if logprobs is not None else []
    at_id = at_lp = 0
    out = []
    for choice in choices:
        choice = dict(choice)
        n = choice.get("token_ids")
        if ids is not None and type(n) is int:
            choice["token_ids"], at_id = all_ids[at_id : at_id + n], at_id + n
        n = choice.get("logprobs")
        if logprobs is not None and type(n) is int:
            choice["logprobs"], at_lp = all_logprobs[at_lp : at_lp + n], at_lp + n
        out.append(choice)
    return out


def stored(row: Any) -> Heavy:
    """A row's large fields as stored, ids and log-probs decoded but deltas not joined: a delta
    row's prompt ids are those after its base's (``row.prompt_choice``), its messages those after
    the base's first ``row.messages_from`` and its client's list those after the base's first
    ``row.client_from``. What a delta claim ships (``POST /trainer/claim``).

    Rows read by migration 0004, which predates ``client_request`` and ``client_from`` as
    layout columns, have neither: their client request is whole.
    """
    client = getattr(row, "client_request", None)
    if not row.encoding:
        return Heavy(row.request, row.prompt_token_ids, row.choices, client)
    prompt = unpack_ids(row.prompt_ids) if row.prompt_ids is not None else row.prompt_token_ids
    return Heavy(row.request, prompt, _unpack_choices(row.choices, row.choice_ids, row.choice_logprobs), client)


def unpack(row: Any, bases: Mapping[int, Heavy]) -> Heavy:
    """A stored call's large fields, whole. ``bases``: its episode's earlier calls by ordinal, whole
    (a delta row needs its base; rows of the JSON layout need nothing).

    Lists are the record's own; messages inherited from the base are the base's message objects.
    """
    own = stored(row)
    if not row.encoding or row.base_ordinal is None:
        return own
    base = bases[row.base_ordinal]
    prompt, request, client = own.prompt_token_ids, own.request, own.client_request
    if row.prompt_choice is not None:
        assert base.prompt_token_ids is not None and prompt is not None
        sampled = base.choices[row.prompt_choice]["token_ids"] if row.prompt_choice >= 0 else None
        prompt = rejoin_ids(base.prompt_token_ids, sampled, prompt)
    if row.messages_from is not None:
        request = rejoin_messages(base.request, row.messages_from, request)
    client_from = getattr(row, "client_from", None)
    if client_from is not None:
        assert base.client_request is not None and client is not None
        key = client_list(client)
        assert key is not None
        client = rejoin_messages(base.client_request, client_from, client, key=key)
    return Heavy(request, prompt, own.choices, client)


def tail_of(ordinal: int, heavy: Heavy) -> Tail | None:
    """A whole call as a base for later ones (the store read when the cache has none)."""
    return pack(ordinal, heavy, None).tail


class Tails:
    """The last usable call of each recently written episode, least recently used evicted first.

    Bounded by episodes and by bytes (a 30k-token prompt is 120 KB packed). A miss costs one read
    of the episode's stored calls, never correctness: a reference is only ever made to a call that
    is committed, and entries are put here only after their batch committed.
    """

    def __init__(self, *, max_episodes: int = 4096, max_bytes: int = 128 * 2**20) -> None:
        self._tails: OrderedDict[str, Tail] = OrderedDict()
        self._max_episodes = max_episodes
        self._max_bytes = max_bytes
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._tails)

    def get(self, episode_id: str) -> Tail | None:
        tail = self._tails.get(episode_id)
        if tail is not None:
            self._tails.move_to_end(episode_id)
        return tail

    def put(self, episode_id: str, tail: Tail) -> None:
        self.drop(episode_id)
        self._tails[episode_id] = tail
        self._bytes += tail.size
        while self._tails and (len(self._tails) > self._max_episodes or self._bytes > self._max_bytes):
            _, evicted = self._tails.popitem(last=False)
            self._bytes -= evicted.size

    def drop(self, episode_id: str) -> None:
        old = self._tails.pop(episode_id, None)
        if old is not None:
            self._bytes -= old.size
