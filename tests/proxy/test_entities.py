"""The store's records and the wire's entities declare the same fields with the same defaults.

The proxy's routes build each entity of ``contract/entities.py`` from a record of
``proxy/store/records.py`` (``from_attributes``). An entity field the record lacks would not fail:
pydantic would fill it with its default, and every answer would carry that default instead of what
was stored. These tests fail instead, when a field is renamed or added on one side only, or when
both sides give a field a default and the defaults differ.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from contract import entities
from proxy.store import records

PAIRS: list[tuple[type[BaseModel], type[Any], frozenset[str], frozenset[str]]] = [
    # (entity, record, entity fields the route fills itself, record fields that never leave the proxy)
    (entities.Call, records.CallRecord, frozenset(), frozenset({"episode_id"})),
    (entities.CallDelta, records.CallDelta, frozenset(), frozenset()),
    (entities.Episode, records.EpisodeRecord, frozenset(), frozenset({"canary_decided"})),
    (entities.Group, records.GroupRecord, frozenset(), frozenset()),
    (entities.PolicyVersion, records.PolicyVersionRecord, frozenset(), frozenset()),
    # current_version: the adapter table's, read by the route (proxy/routes/trainer.py)
    (entities.Claim, records.Claim, frozenset({"current_version"}), frozenset()),
]
IDS = [entity.__name__ for entity, *_ in PAIRS]
_NONE = object()


def _entity_default(entity: type[BaseModel], name: str) -> Any:
    value = entity.model_fields[name].get_default(call_default_factory=True)
    return _NONE if value is PydanticUndefined else value


def _record_default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return _NONE


@pytest.mark.parametrize(("entity", "record", "route_fills", "proxy_only"), PAIRS, ids=IDS)
def test_every_field_the_server_sends_is_on_its_record(
    entity: type[BaseModel], record: type[Any], route_fills: frozenset[str], proxy_only: frozenset[str]
) -> None:
    """Each entity field the route does not fill itself is a field of the record, and each record
    field reaches the wire unless it is the store's own."""
    sent = set(entity.model_fields) - route_fills
    stored = {f.name for f in dataclasses.fields(record)}
    assert sent - stored == set(), f"{entity.__name__} fields its record {record.__name__} lacks"
    assert stored - proxy_only - sent == set(), f"{record.__name__} fields that never reach {entity.__name__}"


@pytest.mark.parametrize(("entity", "record", "route_fills", "proxy_only"), PAIRS, ids=IDS)
def test_a_field_defaulted_on_both_sides_has_one_default(
    entity: type[BaseModel], record: type[Any], route_fills: frozenset[str], proxy_only: frozenset[str]
) -> None:
    stored = {f.name: _record_default(f) for f in dataclasses.fields(record)}
    differ = {
        name: (wire, stored[name])
        for name in set(entity.model_fields) & set(stored)
        if (wire := _entity_default(entity, name)) is not _NONE and stored[name] is not _NONE and wire != stored[name]
    }
    assert differ == {}, f"(wire, store) defaults of {entity.__name__} and {record.__name__}"


def test_created_answers_are_their_entity_plus_the_keys() -> None:
    """A creation answer is the entity the other routes send, plus what is handed out only then."""
    assert set(entities.CreatedEpisode.model_fields) - set(entities.Episode.model_fields) == {"api_key", "base_url"}
    assert set(entities.CreatedGroup.model_fields) - set(entities.Group.model_fields) == {"episode_keys"}


def test_a_delta_claim_call_rejoins_its_client_request() -> None:
    """A Messages call of a delta claim comes back whole: its chat request, its prompt ids and its
    client's own ``messages`` (``client_from``), as ``calls: "whole"`` sends it."""
    first = {"role": "user", "content": "hi"}
    base = entities.Call(
        ordinal=0,
        request={"messages": [first]},
        prompt_token_ids=[1, 2],
        choices=[{"token_ids": [3]}],
        api="messages",
        client_request={"system": "s", "messages": [first]},
    )
    later = [{"role": "assistant", "content": "a"}, {"role": "user", "content": "again"}]
    delta = entities.Call(
        ordinal=1,
        request={"messages": later},
        prompt_token_ids=[4],
        api="messages",
        client_request={"system": "s", "messages": later},
        delta=entities.CallDelta(base_ordinal=0, prompt_choice=0, messages_from=1, client_from=1),
    )
    episode = entities.Episode(id="e", status="rewarded", calls=[base, delta]).rejoined()
    assert episode.calls is not None
    whole = episode.calls[1]
    assert whole.delta is None and whole.prompt_token_ids == [1, 2, 3, 4]
    assert whole.request == {"messages": [first, *later]}
    assert whole.client_request == {"system": "s", "messages": [first, *later]}
