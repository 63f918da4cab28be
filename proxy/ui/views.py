"""What the pages show, from stored records: the conversation, the token view, group advantages.

Pure functions (no I/O): the routes read records, these shape them for the templates.

Token view: a call stores its prompt ids and, per choice, the sampled ids and their logprobs; the
prompt is loss-masked (a spliced prompt's prefix was trained as an earlier call's completion), the
sampled ids are what the trainer trains. The proxy keeps no tokenizer, so a token's text is shown
only where vLLM's answer carried it (``logprobs.content[i].token`` of a chat answer with as many
entries as ids); otherwise the view shows ids shaded by logprob and the text stays in the answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.export import group_advantages, loss_mask
from proxy.store.records import CallRecord, CanaryRecord, EpisodeRecord


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str
    id: str | None


@dataclass(slots=True)
class Message:
    role: str
    text: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class Token:
    id: int
    logprob: float | None
    text: str | None
    trained: bool = True
    """In the loss (``export.loss_mask``: the trainer's rule); False for a greedy, penalized or
    unrecorded call's tokens and a constrained call's forced ones."""

    @property
    def probability(self) -> float | None:
        return math.exp(self.logprob) if self.logprob is not None else None

    @property
    def shade(self) -> float:
        """0 (probability 1) to 1 (probability 0): how strongly the page tints the token."""
        p = self.probability
        return round(1.0 - p, 3) if p is not None else 0.0


@dataclass(slots=True)
class ChoiceView:
    index: int
    message: Message
    finish_reason: str | None
    tokens: list[Token]
    with_text: bool
    reward: float | None

    @property
    def trained(self) -> int:
        """How many of its sampled tokens the trainer trains."""
        return sum(t.trained for t in self.tokens)


@dataclass(slots=True)
class CallView:
    call: CallRecord
    messages: list[Message]
    """The messages new since the previous call (all of them for the first call or a rewritten history)."""
    rewritten: bool
    """The history is not the previous call's plus its answer: the agent edited or dropped turns."""
    choices: list[ChoiceView]
    prompt_ids: int
    splice: dict[str, Any] | None

    @property
    def refused(self) -> str | None:
        """Why the proxy refused this call before it reached the engine (``proxy/refusals.py``), else None."""
        reason = (self.call.notes or {}).get("refused")
        return str(reason) if reason else None


def _pretty(arguments: Any) -> str:
    """Tool arguments as indented JSON when they parse, else as sent."""
    if isinstance(arguments, str):
        try:
            arguments = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return str(arguments)
    return orjson.dumps(arguments, option=orjson.OPT_INDENT_2).decode()


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [
            p.get("text", "") if isinstance(p, dict) and "text" in p else orjson.dumps(p).decode() for p in content
        ]
        return "\n".join(parts)
    return orjson.dumps(content).decode()


def _tool_calls(raw: Any) -> list[ToolCall]:
    calls = []
    for item in raw or ():
        if not isinstance(item, dict):
            continue
        function = item.get("function") or {}
        calls.append(
            ToolCall(
                name=str(function.get("name", "?")), arguments=_pretty(function.get("arguments", "")), id=item.get("id")
            )
        )
    return calls


def message(raw: dict[str, Any]) -> Message:
    return Message(
        role=str(raw.get("role", "?")),
        text=_text(raw.get("content")),
        tool_calls=_tool_calls(raw.get("tool_calls")),
        tool_call_id=raw.get("tool_call_id"),
        name=raw.get("name"),
    )


def _request_messages(call: CallRecord) -> list[dict[str, Any]]:
    messages = call.request.get("messages")
    if isinstance(messages, list):
        return [m for m in messages if isinstance(m, dict)]
    if "prompt" not in call.request:  # a call refused before a request was built (``proxy/refusals.py``)
        return []
    prompt = call.request.get("prompt")  # a completions call: its prompt is one user turn
    return [{"role": "prompt", "content": prompt if isinstance(prompt, str) else orjson.dumps(prompt).decode()}]


def _token_texts(call: CallRecord, index: int, count: int) -> list[str] | None:
    for choice in (call.response or {}).get("choices") or ():
        if isinstance(choice, dict) and choice.get("index", 0) == index:
            content = (choice.get("logprobs") or {}).get("content")
            if isinstance(content, list) and len(content) == count:
                return [str(item.get("token", "")) for item in content]
    return None


def _choice(call: CallRecord, raw: dict[str, Any], call_rewards: dict[str, float] | None) -> ChoiceView:
    index = int(raw.get("index", 0))
    ids: list[int] = raw.get("token_ids") or []
    logprobs: list[float] = raw.get("logprobs") or []
    texts = _token_texts(call, index, len(ids))
    mask = loss_mask(call, ids, logprobs)
    tokens = [
        Token(
            id=t,
            logprob=logprobs[i] if i < len(logprobs) else None,
            text=texts[i] if texts else None,
            trained=bool(mask[i]),
        )
        for i, t in enumerate(ids)
    ]
    rewards = call_rewards or {}
    reward = rewards.get(f"{call.ordinal}:{index}", rewards.get(str(call.ordinal)))
    answer = Message(role="assistant", text=str(raw.get("text") or ""), tool_calls=_tool_calls(raw.get("tool_calls")))
    return ChoiceView(
        index=index,
        message=answer,
        finish_reason=raw.get("finish_reason"),
        tokens=tokens,
        with_text=texts is not None,
        reward=reward,
    )


def conversation(episode: EpisodeRecord) -> list[CallView]:
    """Each call with the messages the agent added since the previous one, and its answers."""
    views: list[CallView] = []
    seen = 0
    for call in episode.calls or []:
        messages = _request_messages(call)
        rewritten = bool(views) and len(messages) < seen
        start = 0 if rewritten else seen
        views.append(
            CallView(
                call=call,
                messages=[message(m) for m in messages[start:]],
                rewritten=rewritten,
                choices=[_choice(call, c, episode.call_rewards) for c in call.choices],
                prompt_ids=len(call.prompt_token_ids or []),
                splice=(call.notes or {}).get("splice"),
            )
        )
        if not views[-1].refused:  # a refused call was never answered: the next one repeats its messages
            seen = len(messages) + 1  # the next request repeats these messages and this call's answer
    return views


def advantages(episodes: list[EpisodeRecord]) -> dict[str, float]:
    """Each rewarded episode's reward minus its group's mean, over the group's std (GRPO's
    ``scale_rewards: group``); the trainer's own figure can differ (other scaling, skipped groups)."""
    return group_advantages({e.id: e.reward for e in episodes if e.status == "rewarded" and e.reward is not None})


@dataclass(frozen=True, slots=True)
class CanaryView:
    """One canary for the overview's panel: its record and the test's evidence (``Decision.evidence()``,
    as ``GET /policy/canary`` serves it), flattened so the template needs no dict lookups that could
    break on an older evidence shape."""

    canary_version: int
    baseline_version: int
    share: float
    verdict: str
    """The stored verdict once decided; the test's own (``continue`` while undecided) while it runs."""
    reason: str
    manual: bool | None
    decided_at: float | None
    canary_n: int | None
    canary_mean: float | None
    baseline_n: int | None
    baseline_mean: float | None
    lower: float | None
    upper: float | None
    margin: float | None
    pairs: int | None


def _arm(evidence: dict[str, Any], arm: str) -> tuple[int | None, float | None]:
    stats = evidence.get(arm)
    if not isinstance(stats, dict):
        return None, None
    return stats.get("n"), stats.get("mean")


def canary(record: CanaryRecord, evidence: dict[str, Any] | None) -> CanaryView:
    """A running canary with the test's decision now, or a decided one with the evidence it was decided on."""
    facts = evidence or {}
    canary_n, canary_mean = _arm(facts, "canary")
    baseline_n, baseline_mean = _arm(facts, "baseline")
    return CanaryView(
        canary_version=record.canary_version,
        baseline_version=record.baseline_version,
        share=record.share,
        verdict=record.verdict or str(facts.get("verdict", "")),
        reason=record.reason or str(facts.get("reason", "")),
        manual=record.manual,
        decided_at=record.decided_at,
        canary_n=canary_n,
        canary_mean=canary_mean,
        baseline_n=baseline_n,
        baseline_mean=baseline_mean,
        lower=facts.get("lower"),
        upper=facts.get("upper"),
        margin=facts.get("margin"),
        pairs=facts.get("pairs"),
    )
