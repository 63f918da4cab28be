"""Make each recorded call's sampling explicit, so the trainer can reproduce the distribution vLLM sampled.

Why: vLLM fills a field a request omits from the model's ``generation_config.json`` (its default
``--generation-config auto``; Qwen2.5-Instruct's sets temperature 0.7, top_p 0.8, top_k 20 and
repetition_penalty 1.05), and its ``processed_logprobs`` are taken after penalties, temperature,
min_p and top-k/top-p (vLLM v1 sampler). A trainer that assumed temperature 1.0 for an omitted
field would train on a distribution other than the one sampled. So the proxy resolves every
recorded request's *effective* parameters and sends all of them to vLLM explicitly: the record
says what vLLM applied, whatever vLLM's own ``--generation-config`` setting is.

The rules, per deployment (``sampling`` in the proxy settings):

- ``temperature``, ``top_p``, ``top_k``, ``min_p``: the request's value, else the model's default
  (``sampling.generation_config`` / ``sampling.defaults``), else vLLM's neutral value. The trainer
  reproduces all four in its log-probs.
- Penalties and token biases (``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``,
  ``logit_bias``, ``bad_words``, ``allowed_token_ids``, ``min_tokens``, beam search): the trainer
  does not reproduce them. An omitted one is pinned neutral, even where the model's generation
  config sets one (recorded as ``pinned``). A request that sets one: ``penalties: flag`` passes it
  on and marks the call ``penalized`` (its tokens stay as context, never in the loss, and the
  trainer counts them); ``penalties: reject`` answers 400.
- Grammar constraints (``tool_choice`` ``required`` or a named function, ``response_format``
  ``json_object``/``json_schema``/``structural_tag``, ``structured_outputs``, legacy ``guided_*``,
  and in vLLM 0.32 ``tool_choice: auto`` with a ``strict`` tool or ``parallel_tool_calls: false``):
  vLLM samples under a token mask, and its processed log-probs are those of the masked
  distribution. Which grammar it applies is the engine's own decision, so the proxy asks the
  engine (``grammar.py``) and records it with the call (``grammar``); ``settle_grammar`` then
  makes the engine's answer decide the mode (unasked, ``_constraint``'s copy of the rule). The trainer
  replays that grammar over the sampled ids and scores each token under the same mask
  (``trainer/grammar.py``); tokens the grammar forced (one allowed token, engine log-prob 0) carry
  no decision and stay out of the loss. ``constrained: train`` (default) trains such calls,
  ``exclude`` keeps them as context only, ``reject`` answers 400. A constrained call whose grammar
  the engine could not be asked for is kept as context by the trainer (counted).
- A temperature below vLLM's sampling epsilon (1e-5) is greedy: not a sample from the policy,
  kept as context only.
- A value out of the range vLLM's ``SamplingParams`` accepts (``n: -1``, ``top_p: 0``) is the
  proxy's own 400 (``RANGES``), before anything is sent: the rules are repeated rather than
  vLLM's code called, since importing it would bring torch into the proxy (seconds, half a GiB),
  and the proxy's image has no vLLM; ``tests/proxy/test_sampling.py`` holds them to vLLM's own.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from contract.vocabulary import SamplingMode
from proxy.errors import InvalidRequest
from proxy.grammar import UNKNOWN
from proxy.settings import Constrained, Penalties

log = logging.getLogger("flywheel.sampling")

Mode = SamplingMode
"""How the trainer treats a call: ``sampled`` (temperature only) and ``truncated`` (top-k/top-p/min-p
as well) are reproduced exactly; ``constrained`` (grammar mask) per ``constrained``; ``penalized``
and ``greedy`` are context only."""

NEUTRAL: dict[str, float] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
"""vLLM's values when neither the request nor the model sets a field (its ``_DEFAULT_SAMPLING_PARAMS``)."""
PENALTIES: dict[str, Any] = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
"""Penalties and their neutral values: pinned when omitted."""
BIASES = ("logit_bias", "bad_words", "allowed_token_ids", "min_tokens", "use_beam_search")
"""Fields that change the distribution when set to anything truthy."""
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
LAX_FLAG: TypeAdapter[bool | None] = TypeAdapter(bool | None)
"""vLLM's request models are lax pydantic: a tool's ``strict`` or ``parallel_tool_calls`` may be a string."""
SAMPLING_EPS = 1e-5
"""vLLM samples greedily below this temperature."""
MODEL_FIELDS = ("temperature", "top_p", "top_k", "min_p")
MAX_TOP_K = 2**31 - 1
"""No vocabulary is larger; a larger ``top_k`` (say 1e30, read as a float) would become an integer
orjson cannot send on."""


RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "n": (lambda v: v >= 1, "at least 1"),
    "temperature": (lambda v: 0 <= v <= 2, "in [0, 2]"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "min_p": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "max_tokens": (lambda v: v >= 1, "at least 1"),
    "max_completion_tokens": (lambda v: v >= 1, "at least 1"),
    "min_tokens": (lambda v: v >= 0, "at least 0"),
    "presence_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "frequency_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "repetition_penalty": (lambda v: 0 < v < math.inf, "a finite number above 0"),
    "logprobs": (lambda v: v >= 0 or v == -1, "at least 0, or -1"),
    "top_logprobs": (lambda v: v >= 0 or v == -1, "at least 0, or -1"),
    "prompt_logprobs": (lambda v: v >= 0 or v == -1, "at least 0, or -1"),
}
"""What vLLM 0.32's ``SamplingParams._verify_args`` accepts per field (``top_k``: ``resolve``); NaN
fails every rule. A value of another type is left to vLLM's own 400."""


def check_ranges(body: dict[str, Any]) -> None:
    """Refuse a request whose sampling value the engine would refuse, naming the field."""
    for key, (accepts, allowed) in RANGES.items():
        value = body.get(key)
        if key == "max_tokens" and body.get("max_completion_tokens") is not None:
            continue  # vLLM's chat route reads max_completion_tokens first, max_tokens only without it
        if isinstance(value, int | float) and not isinstance(value, bool) and not accepts(value):
            raise InvalidRequest(f"'{key}' must be {allowed}, got {value!r}", param=key)


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """The model's own defaults for the reproducible fields (from its generation config)."""

    values: dict[str, float]
    source: str

    @classmethod
    def load(cls, generation_config: str | None, overrides: dict[str, float]) -> SamplingDefaults:
        """Read ``generation_config.json`` (a file, or a model directory holding one), then ``overrides``."""
        values: dict[str, float] = {}
        source = "vLLM neutral values"
        if generation_config:
            path = Path(generation_config).expanduser()
            if path.is_dir():
                path = path / "generation_config.json"
            if path.is_file():
                data = json.loads(path.read_text())
                values = {k: float(data[k]) for k in MODEL_FIELDS if isinstance(data.get(k), int | float)}
                source = str(path)
            else:
                raise ValueError(
                    f"sampling.generation_config: {path} does not exist (point it at the model directory "
                    "vLLM serves, or its generation_config.json; null means vLLM's neutral values)"
                )
        unknown = set(overrides) - set(MODEL_FIELDS)
        if unknown:
            raise ValueError(f"sampling.defaults: unknown fields {sorted(unknown)}; use {list(MODEL_FIELDS)}")
        values.update({k: float(v) for k, v in overrides.items()})
        if overrides:
            source += " + sampling.defaults"
        return cls(values=values, source=source)


def _constraint(body: dict[str, Any]) -> str | None:
    """The grammar vLLM will sample this request under, if any (a short description).

    The request's side of the rule, for when the engine cannot be asked (``grammar.py``). With tools
    and ``tool_choice: auto`` (also what an omitted ``tool_choice`` means), vLLM 0.32's parser
    (``DelegatingParser._apply_structural_tag``, ``resolve_tool_strictness``) applies its structural
    tag once a tool is ``strict`` or ``parallel_tool_calls`` is false, under the default
    ``--tool-strict-level auto`` and a parser with a structural tag (hermes, Flywheel's). A parser
    without one samples those calls free: the render then says so (``settle_grammar``); unasked,
    they stay constrained, so context only, never trained over the full vocabulary.
    """
    tools = body.get("tools")
    choice = body.get("tool_choice", "auto" if tools else None)
    if tools and choice == "required":
        return "tool_choice=required"
    if tools and isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        return f"tool_choice=function:{name}"
    if tools and choice == "auto" and isinstance(tools, list):
        functions = [t["function"] for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)]
        if any(_flag(f.get("strict")) for f in functions):
            return "tools=strict"
        if functions and _flag(body.get("parallel_tool_calls")) is False:
            return "parallel_tool_calls=false"
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return f"response_format={fmt.get('type')}"
    for key in GUIDED:
        if body.get(key):
            return key
    return None


def _flag(value: Any) -> bool | None:
    """A ``bool | None`` field as vLLM's pydantic models read it (``"true"`` and ``1`` are True)."""
    try:
        return LAX_FLAG.validate_python(value)
    except ValidationError:
        return None  # the engine answers 400 for it


def _penalties(body: dict[str, Any]) -> dict[str, Any]:
    """The distribution-changing fields the request sets to a non-neutral value."""
    found = {k: body[k] for k, neutral in PENALTIES.items() if body.get(k) is not None and body[k] != neutral}
    found.update({k: body[k] for k in BIASES if body.get(k)})
    return found


def _number(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"'{key}' must be a number", param=key)
    return float(value)


def resolve(
    body: dict[str, Any], defaults: SamplingDefaults, *, penalties: Penalties, constrained: Constrained
) -> dict[str, Any]:
    """Fill ``body`` (the upstream copy) with every effective sampling field; return the call's record.

    The record is stored with the call (``notes.sampling``): ``temperature``, ``top_p``, ``top_k``,
    ``min_p`` as vLLM applied them, ``mode``, ``from_model`` (fields the model's defaults supplied),
    ``pinned`` (penalties set neutral), and ``constraint`` / ``penalties`` when present.
    """
    check_ranges(body)
    effective: dict[str, float] = {}
    from_model: list[str] = []
    for key in MODEL_FIELDS:
        value = _number(body, key)
        if value is None and key in defaults.values:
            value = defaults.values[key]
            from_model.append(key)
        effective[key] = NEUTRAL[key] if value is None else value
    if not -1 <= effective["top_k"] <= MAX_TOP_K:
        raise InvalidRequest(f"'top_k' must be in [-1, {MAX_TOP_K}] (0 and -1: all tokens)", param="top_k")
    top_k = int(effective["top_k"])
    effective["top_k"] = 0 if top_k < 0 else top_k  # vLLM: 0 and -1 both mean "all tokens"
    for key, value in effective.items():
        body[key] = int(value) if key == "top_k" else value
    pinned = [k for k in PENALTIES if body.get(k) is None]
    for key in pinned:
        body[key] = PENALTIES[key]
    set_penalties = _penalties(body)
    constraint = _constraint(body)
    if set_penalties and penalties == "reject":
        names = ", ".join(sorted(set_penalties))
        raise InvalidRequest(
            f"{names} change the sampling distribution in ways the trainer cannot reproduce; this "
            "deployment refuses them on recorded routes (sampling.penalties: reject). Drop them, or "
            "use /passthrough/v1 for unrecorded calls",
            param=sorted(set_penalties)[0],
            code="unsupported_sampling",
        )
    if constraint and constrained == "reject":
        raise InvalidRequest(
            f"{constraint} samples under a grammar mask the trainer cannot reproduce; this deployment "
            "refuses constrained decoding on recorded routes (sampling.constrained: reject)",
            param=constraint.split("=")[0],
            code="unsupported_sampling",
        )
    mode: Mode
    if effective["temperature"] < SAMPLING_EPS:
        mode = "greedy"
    elif set_penalties:
        mode = "penalized"
    elif constraint:
        mode = "constrained"
    elif effective["top_p"] < 1.0 or effective["top_k"] > 0 or effective["min_p"] > 0.0:
        mode = "truncated"
    else:
        mode = "sampled"
    record: dict[str, Any] = {**effective, "mode": mode}
    if from_model:
        record["from_model"] = from_model
    if pinned:
        record["pinned"] = pinned
    if constraint:
        record["constraint"] = constraint
        record["constrained"] = constrained
    if set_penalties:
        record["penalties"] = set_penalties
    return record


def settle_grammar(record: dict[str, Any], grammar: Any, *, constrained: Constrained) -> None:
    """Let the grammar the engine reported (``grammar.py``: a spec, None, or ``UNKNOWN``) decide the
    call's mode in ``record`` (``resolve``'s), and record it. ``UNKNOWN`` keeps the request-based rule."""
    mode = record["mode"]
    if grammar is UNKNOWN:
        if mode == "constrained":
            record["grammar"] = None  # constrained, but not how: the trainer keeps it as context
        return
    if grammar is None:
        if mode == "constrained":  # the engine samples it unconstrained (its tool parser extracts calls)
            truncated = record["top_p"] < 1.0 or record["top_k"] > 0 or record["min_p"] > 0.0
            record["mode"] = "truncated" if truncated else "sampled"
            record["constraint_ignored"] = record.pop("constraint", None)
            record.pop("constrained", None)
        return
    if mode in ("greedy", "penalized"):  # context only either way
        return
    constraint = record.get("constraint") or f"engine:{next(iter(grammar))}"
    if constrained == "reject":
        raise InvalidRequest(
            f"{constraint} samples under a grammar mask; this deployment refuses constrained decoding "
            "on recorded routes (sampling.constrained: reject)",
            param="tools" if constraint.startswith("engine:") else constraint.split("=")[0],
            code="unsupported_sampling",
        )
    record.update(mode="constrained", constraint=constraint, constrained=constrained, grammar=grammar)
