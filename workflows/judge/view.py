"""A compact, text view of one recorded episode: what a judge reads instead of the raw calls.

The view is built from the store (``GET /episodes/<id>``), from the episode's last successful model
call: its request already holds the whole conversation the agent saw (earlier turns, tool calls,
tool results), and its answer is the agent's final word. Trim rule (documented in
workflows/README.md):

- system messages are left out: an agent's system prompt is the same for every episode of a
  group, so it cannot tell them apart and only costs the judge tokens;
- a content longer than ``max_chars`` keeps its first two thirds and last third of ``max_chars``
  characters, with ``[... N chars trimmed ...]`` in between (the start says what was done, the
  end how it turned out);
- at most ``max_turns`` turns are kept: the first one (the task as the agent got it) and the last
  ``max_turns - 1``, with ``[... N turns trimmed ...]`` where the middle was;
- when the distinct views of a group together pass ``budget`` characters, ``max_chars`` is halved
  until they fit or it reaches ``MIN_CHARS`` (``fit``): the judge's prompt must stay inside its
  context (SmolLM2 serves 8k tokens; a group of long agent runs would not fit untrimmed).

Two episodes whose views are equal render to the same text, which is how the judge dedupes them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from contract.client import Call, Episode

MAX_CHARS = 1200
"""Per content (message, tool arguments, tool result): about 300 tokens."""
MAX_TURNS = 12
"""Turns per episode view: the first and the last 11."""
MAX_PROMPT_CHARS = 16_000
"""All distinct views of a group together: about 4k tokens, half of an 8k context (the rest: rules, task, answer)."""
MIN_CHARS = 150
"""``fit`` halves the per-content limit no further."""


@dataclass(frozen=True)
class Turn:
    role: str
    """user, assistant, tool, or ``note`` (the view's own remarks: no answer, trimmed turns)."""
    content: str


@dataclass(frozen=True)
class EpisodeView:
    episode_id: str
    turns: tuple[Turn, ...]

    def render(self) -> str:
        """The text the judge reads: one ``[role] content`` block per turn."""
        return "\n".join(f"[{t.role}] {t.content}" for t in self.turns)


def trim(text: str, max_chars: int = MAX_CHARS) -> str:
    """``text`` cut to about ``max_chars``: its head (2/3) and tail (1/3) around a marker naming the cut."""
    if len(text) <= max_chars:
        return text
    head = max_chars * 2 // 3
    tail = max_chars - head
    cut = len(text) - head - tail
    return f"{text[:head]} [... {cut} chars trimmed ...] {text[len(text) - tail :]}"


def _text(content: Any) -> str:
    """A message content as text: a string, or the text parts of a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict)]
        return "\n".join(p for p in parts if isinstance(p, str))
    return json.dumps(content, sort_keys=True)


def _tool_calls(calls: Any, max_chars: int) -> list[str]:
    out = []
    for call in calls or ():
        function = call.get("function") if isinstance(call, dict) else None
        function = function if isinstance(function, dict) else {}
        name = function.get("name") or "?"
        out.append(f"calls {name}({trim(str(function.get('arguments') or ''), max_chars)})")
    return out


def _message_turn(message: dict[str, Any], max_chars: int) -> Turn | None:
    role = str(message.get("role") or "user")
    if role in ("system", "developer"):
        return None
    lines = [trim(_text(message.get("content")), max_chars)] if message.get("content") else []
    lines += _tool_calls(message.get("tool_calls"), max_chars)
    if role == "tool" and message.get("name"):
        role = f"tool {message['name']}"
    return Turn(role, "\n".join(lines) or "(empty)")


def _answer_turn(call: Call, max_chars: int) -> Turn:
    if not call.choices:
        return Turn("note", "(no answer recorded)")
    choice = call.choices[0]
    lines = [trim(str(choice.get("text") or ""), max_chars)] if choice.get("text") else []
    lines += _tool_calls(choice.get("tool_calls"), max_chars)
    if choice.get("finish_reason") == "length":
        lines.append("(cut off: the reply hit its token limit)")
    return Turn("assistant", "\n".join(lines) or "(empty reply)")


def _keep(turns: list[Turn], max_turns: int) -> list[Turn]:
    if len(turns) <= max_turns:
        return turns
    tail = max_turns - 1
    dropped = len(turns) - 1 - tail
    return [turns[0], Turn("note", f"[... {dropped} turns trimmed ...]"), *turns[len(turns) - tail :]]


def view(episode: Episode, *, max_chars: int = MAX_CHARS, max_turns: int = MAX_TURNS) -> EpisodeView:
    """The episode's conversation as its last successful call saw and answered it, trimmed."""
    calls = sorted(episode.calls or [], key=lambda c: c.ordinal)
    ok = [c for c in calls if c.status_code < 400 and c.choices]
    if not ok:
        return EpisodeView(episode.id, (Turn("note", "(the agent made no successful model call)"),))
    last = ok[-1]
    turns: list[Turn] = []
    messages = last.request.get("messages")
    if isinstance(messages, list):
        turns += [t for m in messages if isinstance(m, dict) and (t := _message_turn(m, max_chars)) is not None]
    elif last.request.get("prompt") is not None:
        turns.append(Turn("user", trim(_text(last.request.get("prompt")), max_chars)))
    turns.append(_answer_turn(last, max_chars))
    return EpisodeView(episode.id, tuple(_keep(turns, max_turns)))


def fit(
    episodes: Sequence[Episode],
    *,
    max_chars: int = MAX_CHARS,
    max_turns: int = MAX_TURNS,
    budget: int = MAX_PROMPT_CHARS,
) -> list[EpisodeView]:
    """Views of ``episodes`` whose distinct texts together fit ``budget`` characters where halving allows."""
    while True:
        views = [view(e, max_chars=max_chars, max_turns=max_turns) for e in episodes]
        if sum(len(t) for t in distinct(views)[0]) <= budget or max_chars <= MIN_CHARS:
            return views
        max_chars = max(MIN_CHARS, max_chars // 2)


def distinct(views: Sequence[EpisodeView]) -> tuple[list[str], dict[str, int]]:
    """Dedupe: the distinct rendered views (first-seen order) and each episode's index among them."""
    texts: list[str] = []
    index: dict[str, int] = {}
    seen: dict[str, int] = {}
    for v in views:
        text = v.render()
        if text not in seen:
            seen[text] = len(texts)
            texts.append(text)
        index[v.episode_id] = seen[text]
    return texts, index
