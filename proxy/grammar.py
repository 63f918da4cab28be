"""The grammar vLLM samples a call under, asked of vLLM itself, so the trainer can rebuild its mask.

Why. Under a grammar (a named or ``required`` ``tool_choice``, a JSON ``response_format``, guided
decoding) vLLM sets the logits of every token the grammar forbids to -inf before sampling, and its
processed log-probs are those of the masked distribution. A trainer that scores the same tokens
without the mask computes another distribution: its gradient moves probability onto tokens the
engine can never sample, and under the mask the engine then samples from whatever is left (issue
28: the calc agent's calls filled with whitespace after 25 steps). With the grammar recorded, the
trainer replays it over the sampled ids and scores each token under the same mask
(``trainer/grammar.py``), so its log-probs equal the engine's.

Which grammar vLLM applies is vLLM's own decision and changes between releases: vLLM 0.32 turns a
tool request into an xgrammar *structural tag* built by the tool parser (for ``hermes``: the
``<tool_call>`` envelope around each tool's JSON schema), even for ``tool_choice: auto`` once a
tool is ``strict``, where the request alone says nothing is constrained. So the proxy does not
guess: it asks the engine's render route (``/v1/chat/completions/render``, vLLM >= 0.32 with
``--enable-scale-out``), whose answer carries the ``structured_outputs`` the engine will compile,
and records that (``notes.sampling.grammar``). A grammar depends only on the request's tool and
format fields, never on the conversation, so answers are cached by those fields: one render per
distinct tool set, not per call. A replica without the render route, or a render that fails,
gives ``UNKNOWN``: the call keeps the request-based rule of ``sampling.py`` and the trainer keeps
a constrained call it cannot rebuild as context only (counted).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Final

import orjson

from contract.vocabulary import CallKind
from proxy.answers import json_object
from proxy.errors import FlywheelError
from proxy.upstream import Replica, Upstreams

log = logging.getLogger("flywheel.grammar")

RENDER: dict[CallKind, str] = {"chat": "/v1/chat/completions/render", "completion": "/v1/completions/render"}
SHAPING: Final = (
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "chat_template_kwargs",
)
"""The request fields a grammar can depend on (vLLM derives it from these alone)."""
SPEC_FIELDS: Final = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
"""``StructuredOutputsParams`` fields that name a grammar (vLLM compiles the first one set)."""
OPTION_FIELDS: Final = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
"""Options recorded as the render reports them; vLLM 0.32's backends read none of them from a request
(only from ``--structured-outputs-config``), so the trainer ignores them."""
NO_TOKEN_API = (403, 404, 405, 501)
"""Render answers of a replica without the route (no ``--enable-scale-out``, or vLLM < 0.32)."""


class _Unknown:
    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN: Final = _Unknown()
"""The engine could not be asked: the request-based rule stands."""
Grammar = dict[str, Any]
"""What the trainer compiles: one of ``SPEC_FIELDS`` and the options vLLM passes with it."""


def may_constrain(body: dict[str, Any]) -> bool:
    """Whether vLLM could sample ``body`` under a grammar at all (otherwise nothing is asked)."""
    if body.get("tools") and body.get("tool_choice") != "none":
        return True
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return True
    return any(body.get(k) for k in SHAPING[4:10])


def from_sampling_params(params: Any) -> Grammar | None:
    """The grammar in a render's ``sampling_params`` (None: sampled unconstrained)."""
    outputs = params.get("structured_outputs") if isinstance(params, dict) else None
    if not isinstance(outputs, dict):
        return None
    spec = {k: outputs[k] for k in SPEC_FIELDS if outputs.get(k) not in (None, False)}
    if not spec:
        return None
    spec.update({k: outputs[k] for k in OPTION_FIELDS if outputs.get(k) not in (None, False)})
    return spec


class Grammars:
    """Per-proxy cache of the engine's grammar for each distinct set of shaping fields."""

    def __init__(self, upstreams: Upstreams, *, size: int = 512) -> None:
        self.upstreams = upstreams
        self.size = size
        self._cache: OrderedDict[bytes, Grammar | None] = OrderedDict()
        self._no_render: set[str] = set()
        """Replicas whose render route answered as absent: not asked again until the proxy restarts."""

    async def lookup(self, replica: Replica, kind: CallKind, body: dict[str, Any]) -> Grammar | None | _Unknown:
        """The grammar ``replica`` will sample ``body`` (the upstream body) under, None, or UNKNOWN."""
        if not may_constrain(body):
            return None
        key = orjson.dumps({"kind": kind, **{k: body.get(k) for k in SHAPING}}, option=orjson.OPT_SORT_KEYS)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        if replica.name in self._no_render:
            return UNKNOWN
        found = await self._ask(replica, kind, body)
        if found is UNKNOWN:
            return UNKNOWN
        assert not isinstance(found, _Unknown)
        self._cache[key] = found
        while len(self._cache) > self.size:
            self._cache.popitem(last=False)
        return found

    async def _ask(self, replica: Replica, kind: CallKind, body: dict[str, Any]) -> Grammar | None | _Unknown:
        render = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        try:
            response = await self.upstreams.send(replica, "POST", RENDER[kind], content=orjson.dumps(render))
        except FlywheelError as exc:
            log.warning("grammar: render failed", extra={"replica": replica.name, "why": exc.message})
            return UNKNOWN
        if response.status_code in NO_TOKEN_API:
            self._no_render.add(replica.name)
            log.warning(
                "grammar: the replica has no render route (run vLLM >= 0.32 with --enable-scale-out); "
                "constrained calls are recorded without their grammar",
                extra={"replica": replica.name, "status": response.status_code},
            )
            return UNKNOWN
        if response.status_code >= 400:  # the call itself will get the same answer from the engine
            return UNKNOWN
        try:
            return from_sampling_params(json_object(response.content, replica.name).get("sampling_params"))
        except FlywheelError:
            return UNKNOWN
