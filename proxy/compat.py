"""The compatibility policy: one rule for every field a Responses or Messages client sends.

Agent harnesses send more than a self-hosted engine can act on (client metadata, cache hints,
context-management edits, effort hints, hosted tools), and each release moves the set. Every field
gets one of four rules, decided here and nowhere else (the translators in ``proxy/dialects`` call
this module):

    used      it changes what the engine renders or samples: sent on, recorded as such
    ignored   it cannot change sampling on this deployment: accepted, kept in ``client_request``,
              listed in the call's ``notes.compat.ignored`` and counted
    mapped    served another way (``TABLE``): listed in ``notes.compat.mapped`` and counted
    refused   a 400 naming the field: the engine cannot honestly do it

``compat.mode: strict`` refuses everything that is not *used*; ``lenient`` (the default) lets the
harnesses run unchanged. Hosted tools (``compat.hosted_tools``) are dropped from what the model
sees, noted and counted, or refused.

A field the table does not know is classified by kind, not by a list of today's fields: a name
that reads as sampling or rendering (``_SAMPLING_WORDS``: temperature, top_*, penalty, logit, seed,
stop, max_*, tokens, logprobs, grammar, schema, format, reasoning, thinking, effort, tool, system,
prompt, message, input, context, ...), or an object holding such a key, is refused; anything else
is metadata-like and ignored. A harness release that adds a harmless field keeps working, and
nothing that could change sampling is ever ignored silently. docs/guide/agents.md's compatibility table ("Point
a coding agent at it") mirrors this one:

    both APIs   sampling, max tokens, stop, stream, function tools, tool_choice     used
                metadata, cache_control (anywhere), service_tier                    ignored
                unknown: metadata-like / sampling-like (``sampling_like``)          ignored / refused
                hosted tools (``compat.hosted_tools``)                              dropped / refused
                tools[].defer_loading                                               mapped: not shown
    Messages    messages[].role "system" (``compat.system_messages``)               mapped: a turn / merged
                thinking (``compat.thinking_switch``; absent: off)                  mapped: disabled / used
                output_config.effort (``compat.reasoning_effort``)                  ignored / used
                context_management: clear_thinking / clear_tool_uses                ignored, mapped / refused
                citations, signature, caller, eager_input_streaming                 ignored
                container, mcp_servers, bash/text_editor/computer/memory tools      refused
    Responses   client_metadata, user, safety_identifier, prompt_cache_*            ignored
                reasoning.effort / summary, text.verbosity, include_obfuscation     ignored (effort: used)
                reasoning.context (``compat.thinking_switch`` null / set)           ignored / by kind
                input item "additional_tools" (Codex, a model it knows)             mapped: the request's tools
                tools[].type "namespace"                                            mapped: flattened
                background, conversation, prompt, max_tool_calls, context_mgmt      refused
                custom, local_shell, shell, apply_patch tools                       refused
    Gemini      safetySettings, labels, thoughtSignature, a function's response schema  ignored
                thinkingConfig (``compat.thinking_switch``; absent: the template's)  mapped: no thoughts / used
                thinkingConfig.thinkingLevel (``compat.reasoning_effort``)          ignored / used
                allowedFunctionNames (several, or with VALIDATED)                   mapped: only those shown
                googleSearch, codeExecution, urlContext, ... tools                  dropped / refused
                cachedContent, computerUse tools, non-text responseModalities       refused
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel

from proxy.errors import InvalidRequest
from proxy.settings import CompatSettings

Rule = Literal["used", "ignored", "mapped", "refused"]
SEPARATOR = "__"
"""Joins a tool namespace and a member's name into the function name the model sees."""


# -- classifying a field by kind ------------------------------------------------------------------

_SAMPLING_WORDS = frozenset(
    "top min max bias seed stop stops beam beams best regex schema schemas json format response effort "
    "verbosity tool tools function functions system prompt prompts message messages input inputs content "
    "contents context length n choice choices output constraint constraints decoding decode vocab model "
    "models adapter lora".split()
)
_SAMPLING_PREFIXES = (
    "temp",
    "penalt",
    "logit",
    "logprob",
    "sampl",
    "reason",
    "think",
    "truncat",
    "instruct",
    "token",
    "structur",
    "guid",
    "gramm",
)
_CAMEL = re.compile(r"([a-z0-9])([A-Z])")
_NOT_WORD = re.compile(r"[^a-z0-9]+")
_INDEX = re.compile(r"\.\d+|\[\d+\]")


def _words(name: str) -> list[str]:
    return [w for w in _NOT_WORD.split(_CAMEL.sub(r"\1_\2", name).lower()) if w]


def sampling_like(name: str, value: Any, depth: int = 0) -> bool:
    """True when a field could change what is rendered or sampled: its name, or a key inside it."""
    if any(w in _SAMPLING_WORDS or w.startswith(_SAMPLING_PREFIXES) for w in _words(name)):
        return True
    if depth >= 3:
        return False
    if isinstance(value, dict):
        return any(isinstance(k, str) and sampling_like(k, v, depth + 1) for k, v in value.items())
    if isinstance(value, list):
        return any(sampling_like("", v, depth + 1) for v in value[:64])
    return False


def _name(where: str) -> str:
    """A field's place without list positions: what the notes and the counters name."""
    return _INDEX.sub("", where)


_NESTED_IGNORED = {
    "cache_control": "a prompt-cache hint: vLLM's prefix cache needs none",
    "citations": "citation settings: nothing is cited",
    "signature": "a thinking block's signature: nothing to verify",
    "caller": "who made a tool call: the model itself",
    "eager_input_streaming": "a streaming hint: tool calls are sent whole",
}
_LABELS = frozenset(
    {
        *_NESTED_IGNORED,
        "metadata",
        "service_tier",
        "thinking",
        "thinking.budget_tokens",
        "thinking.display",
        "output_config.effort",
        "messages.output_config.effort",
        "context_management",
        "context_management.edits",
        "messages.role",
        "tools.defer_loading",
        "client_metadata",
        "user",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "reasoning.effort",
        "reasoning.summary",
        "reasoning.generate_summary",
        "reasoning.context",
        "input.additional_tools",
        "text.verbosity",
        "stream_options.include_obfuscation",
        "tools.namespace",
        "safetySettings",
        "labels",
        "thoughtSignature",
        "tools.functionDeclarations.response",
        "toolConfig.retrievalConfig",
        "toolConfig.functionCallingConfig",
        "generationConfig.thinkingConfig",
        "generationConfig.thinkingConfig.thinkingBudget",
        "generationConfig.thinkingConfig.thinkingLevel",
    }
)
"""Field names counted under their own label; any other (a client's own new field) counts as ``other``."""


# -- what was decided for one request -------------------------------------------------------------


class Ledger:
    """What the policy decided for one request: the call's ``notes.compat``, its counters, and
    what the decisions add to the chat body (``chat``: a thinking switch, an effort)."""

    __slots__ = ("settings", "ignored", "mapped", "dropped", "chat", "keep_thinking")

    def __init__(self, settings: CompatSettings | None = None) -> None:
        self.settings = settings or CompatSettings()
        self.ignored: dict[str, str] = {}
        self.mapped: dict[str, str] = {}
        self.dropped: list[str] = []
        self.chat: dict[str, Any] = {}
        self.keep_thinking: int | None = None
        """Reasoning kept on only the last this many assistant turns (Anthropic's ``clear_thinking``)."""

    @property
    def strict(self) -> bool:
        return self.settings.mode == "strict"

    def _strict(self, where: str, rule: str, why: str) -> InvalidRequest:
        return InvalidRequest(
            f"'{where}' is {rule} on this deployment ({why}); compat.mode is strict, which serves "
            "only the fields that are used",
            param=where,
            code="compat_strict",
        )

    def ignore(self, field: str, why: str, *, where: str | None = None) -> None:
        """Accepted without effect: noted and counted (refused in strict mode)."""
        if self.strict:
            raise self._strict(where or field, "accepted without effect", why)
        self.ignored.setdefault(field, why)

    def map(self, field: str, how: str, *, where: str | None = None) -> None:
        """Served another way: noted and counted (refused in strict mode)."""
        if self.strict:
            raise self._strict(where or field, "served another way", how)
        self.mapped.setdefault(field, how)

    def unknown(self, name: str, value: Any, *, where: str) -> None:
        """A field the table does not know, by kind: sampling-like is refused, anything else ignored."""
        if value is None:
            return
        if sampling_like(name, value):
            what = "field" if "." in where or "[" in where else "parameter"
            raise InvalidRequest(
                f"unknown {what} '{where}': it could change what the model sees or samples, and this "
                "deployment does not serve it",
                param=where,
                code="unsupported_parameter",
            )
        self.ignore(_name(where), "unknown to this deployment, and not a sampling or rendering field", where=where)

    def hosted(self, kind: str, *, where: str, message: str) -> None:
        """A tool the provider would run: dropped from what the model sees, or refused."""
        if self.strict or self.settings.hosted_tools == "reject":
            raise InvalidRequest(message, param=where, code="hosted_tool")
        self.dropped.append(kind)

    def screen(self, obj: BaseModel, where: str) -> None:
        """A validated block's fields the translator does not use: the known hints and unknown keys."""
        for name in _NESTED_IGNORED.keys() & obj.model_fields_set:
            if getattr(obj, name) is not None:
                self.ignore(name, _NESTED_IGNORED[name], where=f"{where}.{name}" if where else name)
        for name, value in (obj.model_extra or {}).items():
            self.unknown(name, value, where=f"{where}.{name}" if where else name)

    def note(self) -> dict[str, Any] | None:
        """The call's ``notes.compat``: what was accepted without effect, mapped, or dropped."""
        out: dict[str, Any] = {}
        if self.ignored:
            out["ignored"] = sorted(self.ignored)
        if self.mapped:
            out["mapped"] = dict(self.mapped)
        if self.dropped:
            out["dropped_tools"] = list(self.dropped)
        return out or None

    def counts(self) -> Iterator[tuple[str, str]]:
        """(rule, field label) per decision, for ``flywheel_compat_fields_total``."""
        for rule, names in (("ignored", self.ignored), ("mapped", self.mapped)):
            for name in names:
                yield rule, name if name in _LABELS else "other"
        for _ in self.dropped:
            yield "dropped", "hosted_tools"


# -- Anthropic Messages -----------------------------------------------------------------------------


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidRequest(f"'{where}' must be an object", param=where)
    return value


def effort(value: Any, where: str, ledger: Ledger) -> None:
    """An effort hint: sent as ``reasoning_effort`` where the template reads it, else without effect."""
    if ledger.settings.reasoning_effort:
        if not isinstance(value, str):
            raise InvalidRequest(f"'{where}' must be a string", param=where)
        ledger.chat["reasoning_effort"] = value
    else:
        ledger.ignore(_name(where), "an effort hint, and the model has no reasoning effort", where=where)


def _thinking(value: Any, body: dict[str, Any], ledger: Ledger) -> None:
    kind = _object(value, "thinking").get("type")
    if kind not in ("enabled", "adaptive", "disabled"):
        raise InvalidRequest(f"thinking.type must be enabled, adaptive or disabled: {kind!r}", param="thinking.type")
    on, switch = kind != "disabled", ledger.settings.thinking_switch
    if switch is None and on:
        ledger.map("thinking", "served as disabled: the model has no reasoning", where="thinking.type")
    elif switch is not None:
        ledger.chat.setdefault("chat_template_kwargs", {})[switch] = on
    for key, item in value.items():
        where = f"thinking.{key}"
        if key == "type" or item is None:
            continue
        if key in ("budget_tokens", "display"):
            if on and switch is not None:
                ledger.map(where, "served without a thinking budget or display choice (vLLM has neither)", where=where)
        else:
            ledger.unknown(key, item, where=where)


def _assistant_thinking(body: dict[str, Any]) -> int:
    """How many assistant turns of the conversation carry thinking blocks."""
    turns = 0
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and message.get("role") == "assistant":
            turns += any(isinstance(b, dict) and "thinking" in str(b.get("type")) for b in content)
    return turns


def _tool_results(body: dict[str, Any]) -> bool:
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(isinstance(b, dict) and b.get("type") == "tool_result" for b in content):
            return True
    return False


def _keep(value: Any, where: str) -> int | None:
    """``keep`` of a clear_thinking edit: None for all, else how many thinking turns (default 1)."""
    if value == "all":
        return None
    if value is None:
        return 1
    count = value.get("value") if isinstance(value, dict) else None
    if type(count) is not int or count < 0:
        raise InvalidRequest(f"'{where}' must be \"all\" or {{type: thinking_turns, value: N}}", param=where)
    return count


def _context_management(value: Any, body: dict[str, Any], ledger: Ledger) -> None:
    """Edits the server would make to the conversation: ignored where there is nothing to act on,
    thinking of older turns dropped as asked, anything that would clear other content refused."""
    edits = _object(value, "context_management").get("edits") or []
    if not isinstance(edits, list) or not all(isinstance(e, dict) for e in edits):
        raise InvalidRequest("'context_management.edits' must be an array of edits", param="context_management.edits")
    for key, item in value.items():
        if key != "edits":
            ledger.unknown(key, item, where=f"context_management.{key}")
    for i, edit in enumerate(edits):
        where, kind = f"context_management.edits.{i}", str(edit.get("type"))
        if kind.startswith("clear_thinking"):
            keep = _keep(edit.get("keep"), f"{where}.keep")
            if keep is not None and _assistant_thinking(body) > keep:
                ledger.map("context_management.edits", "clear_thinking: older turns' reasoning dropped", where=where)
                ledger.keep_thinking = keep
                continue
        elif kind.startswith("clear_tool_uses"):
            if _tool_results(body):
                raise InvalidRequest(
                    f"'{where}': clearing tool results is not served (this deployment does not edit the "
                    "conversation); drop the edit, or clear them in the agent",
                    param=f"{where}.type",
                    code="unsupported_parameter",
                )
        else:
            raise InvalidRequest(f"'{where}.type': context edit {kind!r} is not served", param=f"{where}.type")
        ledger.ignore("context_management", "context edits with nothing to act on", where=where)


def output_config(value: Any, where: str, ledger: Ledger) -> None:
    """``output_config`` at the top level, or on a message (Claude Code run under its default model
    name sends it on a system message inside ``messages``, as Anthropic accepts): one rule for both."""
    for key, item in _object(value, where).items():
        if key == "effort" and item is not None:
            effort(item, f"{where}.effort", ledger)
        else:
            ledger.unknown(key, item, where=f"{where}.{key}")


def _output_config(value: Any, body: dict[str, Any], ledger: Ledger) -> None:
    output_config(value, "output_config", ledger)


def _ignored(why: str) -> Any:
    def handle(value: Any, body: dict[str, Any], ledger: Ledger, *, name: str) -> None:
        ledger.ignore(name, why, where=name)

    return handle


def _refused(why: str) -> Any:
    def handle(value: Any, body: dict[str, Any], ledger: Ledger, *, name: str) -> None:
        raise InvalidRequest(f"'{name}': {why}", param=name, code="unsupported_parameter")

    return handle


_MESSAGES_TOP: dict[str, Any] = {
    "metadata": _ignored("client metadata"),
    "cache_control": _ignored("a prompt-cache hint: vLLM's prefix cache needs none"),
    "service_tier": _ignored("a scheduling class: one engine, one tier"),
    "container": _refused("containers (code execution, skills) are not served by this deployment"),
    "mcp_servers": _refused("MCP servers are not served by this deployment; run the tools in the agent"),
}
_MESSAGES_SHAPED = {"thinking": _thinking, "context_management": _context_management, "output_config": _output_config}


def messages_top(extras: dict[str, Any], body: dict[str, Any], ledger: Ledger) -> None:
    """The top-level fields of a Messages request that its translator does not use. Without
    ``thinking``, a configured thinking switch is sent off: Anthropic's default, where the chat
    template's own may be on (Qwen3's is)."""
    switch = ledger.settings.thinking_switch
    if switch is not None and extras.get("thinking") is None:
        ledger.chat.setdefault("chat_template_kwargs", {})[switch] = False
    for name, value in extras.items():
        if value is None:
            continue
        if name in _MESSAGES_TOP:
            _MESSAGES_TOP[name](value, body, ledger, name=name)
        elif name in _MESSAGES_SHAPED:
            _MESSAGES_SHAPED[name](value, body, ledger)
        else:
            ledger.unknown(name, value, where=name)


def system_turn(out: list[dict[str, Any]], text: str, where: str, ledger: Ledger) -> None:
    """A system message inside ``messages``: a system turn where it stands, or merged into the first."""
    if ledger.settings.system_messages == "turn":
        ledger.map("messages.role", "a system message in the conversation: a system turn where it stands", where=where)
        out.append({"role": "system", "content": text})
        return
    ledger.map("messages.role", "a system message in the conversation: appended to the leading one", where=where)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
    else:
        out.insert(0, {"role": "system", "content": text})


def clear_thinking(messages: list[dict[str, Any]], ledger: Ledger) -> None:
    """Drop the reasoning of all but the last ``keep_thinking`` assistant turns that carry some."""
    if ledger.keep_thinking is None:
        return
    thinking = [i for i, m in enumerate(messages) if m["role"] == "assistant" and "reasoning_content" in m]
    for i in thinking[: max(len(thinking) - ledger.keep_thinking, 0)]:
        messages[i] = {k: v for k, v in messages[i].items() if k != "reasoning_content"}


def deferred(where: str, ledger: Ledger) -> None:
    """``defer_loading: true``: the tool stays out of what the model sees, as the provider would
    keep it until tool search loads it (tool search itself is not served)."""
    ledger.map("tools.defer_loading", "a deferred tool is not shown to the model", where=where)


CLIENT_BUILTINS = ("bash_", "text_editor_", "computer_", "memory_")
"""Anthropic-defined tools the client runs, whose schema only Anthropic's models know: refused."""


# -- OpenAI Responses -------------------------------------------------------------------------------

_RESPONSES_TOP: dict[str, Any] = {
    "client_metadata": _ignored("client metadata"),
    "prompt_cache_retention": _ignored("a prompt-cache hint: vLLM's prefix cache needs none"),
    "background": _refused("background responses are not served (the proxy answers while the call runs)"),
    "conversation": _refused("conversations are not stored; pass previous_response_id or the input items"),
    "prompt": _refused("prompt templates are not served; send instructions and input"),
    "max_tool_calls": _refused("max_tool_calls is not served; the agent loop decides how many calls to make"),
    "context_management": _refused("context management is not served"),
}
_RESPONSES_DECLARED = {
    "metadata": "client metadata",
    "user": "client bookkeeping",
    "safety_identifier": "client bookkeeping",
    "prompt_cache_key": "a prompt-cache hint: vLLM's prefix cache needs none",
    "service_tier": "a scheduling class: one engine, one tier",
}
_SUBFIELDS: dict[str, dict[str, str]] = {
    "reasoning": {
        "summary": "the answer carries the reasoning itself",
        "generate_summary": "the answer carries the reasoning itself",
    },
    "text": {"verbosity": "a verbosity hint, and the model has none"},
    "stream_options": {"include_obfuscation": "no padding is sent"},
}
"""Keys of the Responses request's objects accepted without effect (``text.format`` is used, an
effort decided by ``effort``; any other key by kind)."""


def responses_top(request: BaseModel, ledger: Ledger) -> None:
    """The top-level fields of a validated Responses request that its translator does not use."""
    for name, why in _RESPONSES_DECLARED.items():
        if getattr(request, name) is not None:
            ledger.ignore(name, why, where=name)
    for parent, known in _SUBFIELDS.items():
        for key, item in (getattr(request, parent) or {}).items():
            where = f"{parent}.{key}"
            if item is None or key == "format":
                continue
            if key == "effort":
                effort(item, where, ledger)
            elif (parent, key) == ("reasoning", "context") and ledger.settings.thinking_switch is None:
                ledger.ignore(where, "which turns' reasoning to keep, and the model has no reasoning", where=where)
            elif key in known:
                ledger.ignore(where, known[key], where=where)
            else:
                ledger.unknown(key, item, where=where)
    for name, value in (request.model_extra or {}).items():
        if value in (None, False):
            continue
        if name in _RESPONSES_TOP:
            _RESPONSES_TOP[name](value, {}, ledger, name=name)
        else:
            ledger.unknown(name, value, where=name)


CLIENT_TOOLS = frozenset({"custom", "local_shell", "shell", "apply_patch"})
"""Responses tools the client runs with a grammar or format only OpenAI's models know: refused."""


def namespace_members(tool: dict[str, Any], where: str, ledger: Ledger) -> tuple[str, list[dict[str, Any]]]:
    """A ``namespace`` tool group's name and its function tools, flattened by the translator into
    functions named ``<namespace>__<name>`` (the answer's calls are named back)."""
    name, members = tool.get("name"), tool.get("tools")
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"'{where}.name' is required", param=f"{where}.name")
    if not isinstance(members, list) or not all(isinstance(m, dict) for m in members):
        raise InvalidRequest(f"'{where}.tools' must be an array of function tools", param=f"{where}.tools")
    for key, item in tool.items():
        if key not in ("type", "name", "description", "tools"):
            ledger.unknown(key, item, where=f"{where}.{key}")
    for j, member in enumerate(members):
        if member.get("type", "function") != "function":
            at = f"{where}.tools[{j}].type"
            why = f"'{at}': only function tools are served in a namespace"
            if member.get("type") in CLIENT_TOOLS:  # Codex under a model name it knows sends freeform tools
                why += (
                    f"; {member.get('type')!r} tools take a grammar or format only OpenAI's models know "
                    "(Codex sends function tools for a model name it does not know, such as policy)"
                )
            raise InvalidRequest(why, param=at, code="unsupported_parameter")
    ledger.map("tools.namespace", f"flattened into function tools named <namespace>{SEPARATOR}<name>", where=where)
    return name, members


def flat_name(namespace: str, name: str) -> str:
    return f"{namespace}{SEPARATOR}{name}"


# -- Google Gemini ----------------------------------------------------------------------------------

GEMINI_TOP: dict[str, Any] = {
    "safetySettings": _ignored("safety settings: this deployment runs no safety filter"),
    "labels": _ignored("billing labels"),
    "cachedContent": _refused("cached contents are not stored by this deployment; send the contents"),
}
GEMINI_TOP |= {
    "safety_settings": GEMINI_TOP["safetySettings"],
    "cached_content": GEMINI_TOP["cachedContent"],
}
"""Top-level fields of a ``generateContent`` request its translator does not use (either spelling)."""
GEMINI_HOSTED = frozenset(
    {
        "googleSearch",
        "googleSearchRetrieval",
        "codeExecution",
        "urlContext",
        "fileSearch",
        "googleMaps",
        "enterpriseWebSearch",
        "retrieval",
        "mcpServers",
    }
)
"""Gemini tools Google runs: dropped from what the model sees, or refused (``compat.hosted_tools``)."""
GEMINI_CLIENT_TOOLS = frozenset({"computerUse"})
"""Gemini tools the client runs with actions only Google's models know: refused."""


def gemini_top(extras: dict[str, Any], ledger: Ledger) -> None:
    """The top-level ``GEMINI_TOP`` fields of a Gemini request (``safetySettings``, ``cachedContent``, ...)."""
    for name, value in extras.items():
        if value is not None:
            GEMINI_TOP[name](value, {}, ledger, name=camel(name))


def gemini_thinking(config: Any, where: str, ledger: Ledger) -> bool:
    """``generationConfig.thinkingConfig``: the thinking switch from ``thinkingBudget`` (0: off; absent:
    the template's default, as Gemini's own default is its model's), ``thinkingLevel`` as an effort.
    Returns whether the answer shows the model's thoughts (``includeThoughts``)."""
    switch = ledger.settings.thinking_switch
    budget, level, include = config.thinking_budget, config.thinking_level, bool(config.include_thoughts)
    if switch is None:
        if include or (budget is not None and budget != 0):
            ledger.map(
                "generationConfig.thinkingConfig",
                "served without thoughts: the model has no reasoning",
                where=f"{where}.{'includeThoughts' if include else 'thinkingBudget'}",
            )
    elif budget is not None:
        ledger.chat.setdefault("chat_template_kwargs", {})[switch] = budget != 0
        if budget > 0:
            ledger.map(
                "generationConfig.thinkingConfig.thinkingBudget",
                "served without a thinking budget (vLLM has none)",
                where=f"{where}.thinkingBudget",
            )
    if level is not None:
        effort(level.lower(), f"{where}.thinkingLevel", ledger)
    for key, item in (config.model_extra or {}).items():
        ledger.unknown(key, item, where=f"{where}.{key}")
    return include


def camel(name: str) -> str:
    """A proto field name (snake_case) as proto3 JSON's lowerCamelCase; lowerCamelCase stays as it is."""
    head, *rest = name.split("_")
    return head + "".join(word.title() for word in rest)
