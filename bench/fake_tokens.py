"""A test double of vLLM with a real token path: SmolLM2's tokenizer and the served tool template.

``bench/fake_script.py`` drives a harness with a toy tokenizer and no token API, so the proxy never
splices its follow-up calls. This engine renders every prompt exactly as the served vLLM would
(SmolLM2's own tokenizer, ``configs/templates/smollm2_tools.jinja`` through transformers' chat
template, the ids vLLM's chat route tokenizes without special tokens) and serves the routes the
splice calls (``proxy/splice.py``), so an agent harness's follow-ups are spliced against real ids:

- ``POST /v1/chat/completions`` (an episode's first call, and every call the splice refuses);
- ``POST /v1/chat/completions/render`` and ``/v1/completions/render`` (the prompt's ids, the
  sampling parameters with vLLM's ``max_tokens`` rule), ``GET /v1/models`` (``max_model_len``);
- ``POST /inference/v1/generate`` on token ids, whole or streamed one token per event;
- ``POST /v1/chat/completions/derender``: the sampled ids parsed back as vLLM's ``hermes`` tool
  parser reads this template's ``<tool_call>`` blocks, whole or one generate chunk at a time.

Not a model: the answers are scripted, and depend only on the prompt's ids (decoded), so the
ordinary route and the spliced one answer alike. While fewer tool results (``<tool_response>``
turns, plus those a compaction summary reports) follow the system block than the script has
commands: a call of the offered shell tool (found in the rendered ``<tools>`` block) running the
next command; then a final answer. A task holding ``DELEGATE`` where a sub-agent tool is offered
(Claude Code's ``Agent``) is handed to a sub-agent, whose own conversation runs the commands; a
compaction request (``SUMMARY_ASK``) gets a summary saying how many ran. The sampled ids are real
SmolLM2 ids: a tool call's opening, its argument JSON and its closing are tokenized apart (a
sampler may pick a tokenization the tokenizer would not), then ``<|im_end|>``, which vLLM keeps in
the sampled ids. Each answer is appended to a JSON Lines log (``--answer-log``) with its route, so
a test compares the store with what was sampled.

Run: ``python -m bench.fake_tokens --model-dir DIR --script CMD [--script CMD ...]`` prints
``fake_upstream listening on HOST:PORT``.
"""

from __future__ import annotations

import argparse
import itertools
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench.fake_script import SHELL_ARGUMENTS, _Answer

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "configs" / "templates" / "smollm2_tools.jinja"
CONTEXT = 131_072
"""The served window (``max_model_len``): harness prompts (10-17k tokens) fit, as on a GPU deployment."""
TOOLS_OPEN = "\n\nYou may call one or more functions. Their signatures are inside <tools></tools>:\n<tools>\n"
TOOL_TURN = "<|im_start|>user\n<tool_response>\n"
"""How the template opens a tool result: what the script counts to know which command is next."""
CALL_OPEN, CALL_CLOSE = "<tool_call>", "}\n</tool_call>"
CALL_HEAD = re.compile(r'<tool_call>\n\{"name": "([^"]+)", "arguments": ')


DELEGATE = "Delegate to a sub-agent:"
"""A task that holds this (and offers a sub-agent tool) is handed to a sub-agent, which runs the commands."""
SUB_TASK = {
    "description": "Run the commands",
    "prompt": "Run the shell commands one at a time.",
    "subagent_type": "general-purpose",
    "run_in_background": False,
}


SUMMARY_ASK = "create a detailed summary of the conversation"
"""Claude Code's compaction request (its last user turn): answered with ``summary_text``."""
CARRIED = re.compile(r"COMPACTED: (\d+) commands ran")


def summary_text(done: int) -> str:
    return f"<summary>COMPACTED: {done} commands ran.</summary>"


def final_text(done: int) -> str:
    return f"Done: {done} commands ran."


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content if isinstance(content, str) else ""


def tools_in(prompt: str) -> list[dict[str, Any]]:
    """The functions of the rendered ``<tools>`` block (one JSON object a line), in order."""
    system = prompt[: prompt.find("<|im_end|>")]
    start = system.rfind(TOOLS_OPEN)
    out: list[dict[str, Any]] = []
    for line in system[start + len(TOOLS_OPEN) :].split("\n") if start >= 0 else ():
        if line == "</tools>":
            break
        try:
            function = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(function, dict):
            out.append(function)
    return out


def _takes(function: dict[str, Any], name: str) -> bool:
    """The function requires a string argument ``name``."""
    parameters = function.get("parameters") or function.get("parametersJsonSchema") or {}
    properties = parameters.get("properties") or {}
    return name in (parameters.get("required") or []) and (properties.get(name) or {}).get("type") == "string"


def shell_in(prompt: str) -> tuple[str, str, list[str]] | None:
    """(tool, argument, other required string arguments) of the first tool in the rendered
    ``<tools>`` block that takes a shell command (opencode's ``bash`` also requires a ``description``)."""
    for function in tools_in(prompt):
        for name in SHELL_ARGUMENTS:
            if _takes(function, name):
                required = (function.get("parameters") or function.get("parametersJsonSchema") or {}).get("required")
                others = [r for r in required or () if r != name and _takes(function, r)]
                return str(function["name"]), name, others
    return None


def agent_in(prompt: str) -> str | None:
    """The offered tool that starts a sub-agent (Claude Code's ``Agent``: a ``description`` and a
    ``prompt``), if any."""
    for function in tools_in(prompt):
        if _takes(function, "description") and _takes(function, "prompt") and not _takes(function, "command"):
            return str(function["name"])
    return None


def users(prompt: str) -> str:
    """The text of the prompt's user turns other than tool results (the task, and any reminders)."""
    turns = prompt.split("<|im_start|>user\n")[1:]
    return "".join(t.split("<|im_end|>")[0] for t in turns if not t.startswith("<tool_response>"))


@dataclass(frozen=True, slots=True)
class Sampled:
    """One scripted answer: its ids in parts (call opening, arguments, closing; or the text), the
    ids' texts and log-probs, and the tool call it makes (None: a final answer)."""

    parts: list[list[int]]
    texts: list[str]
    logprobs: list[float]
    call: tuple[str, str] | None
    """(tool name, argument JSON)."""
    content: str | None

    @property
    def ids(self) -> list[int]:
        return [t for part in self.parts for t in part]


class TokenEngine:
    """Renders, samples (by script), generates on ids and derenders, with SmolLM2's tokenizer."""

    def __init__(self, model_dir: str, commands: list[str], log: Path | None, template: Path = TEMPLATE) -> None:
        from transformers import AutoTokenizer  # heavy: only the token engine's process imports it

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.template = template.read_text()
        self.end = int(self.tokenizer.eos_token_id)  # <|im_end|>: SmolLM2-Instruct's end of turn
        self.commands = commands
        self.log = log
        self.counter = itertools.count(1)

    # --- rendering -------------------------------------------------------------------------------

    def render(self, body: dict[str, Any]) -> list[int]:
        """The chat request's prompt ids, as vLLM's chat route renders them (text parts joined)."""
        messages = []
        for m in body.get("messages") or ():
            message = {**m, "content": _text(m.get("content"))}
            if not message.get("tool_calls"):
                message.pop("tool_calls", None)
            messages.append(message)
        text = self.tokenizer.apply_chat_template(
            messages,
            tools=body.get("tools") or None,
            chat_template=body.get("chat_template") or self.template,
            add_generation_prompt=body.get("add_generation_prompt", True),
            continue_final_message=body.get("continue_final_message", False),
            tokenize=False,
            **(body.get("chat_template_kwargs") or {}),
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    # --- the script ------------------------------------------------------------------------------

    def sample(self, prompt: list[int], route: str, model: Any) -> Sampled:
        """What the script answers to ``prompt`` (logged)."""
        text = self.decode(prompt)
        asked = users(text)
        # tool results in the prompt, and those a compaction summary says ran before it
        done = text.count(TOOL_TURN) + max((int(n) for n in CARRIED.findall(asked)), default=0)
        last_user = text.rsplit("<|im_start|>user\n", 1)[-1]
        shell, agent = shell_in(text), agent_in(text)
        encode = self.tokenizer.encode
        tool: tuple[str, bytes] | None = None
        if SUMMARY_ASK in last_user:  # compaction: a summary, no tool call
            pass
        elif agent is not None and DELEGATE in asked:  # the main agent: delegate, then report
            tool = None if done else (agent, orjson.dumps(SUB_TASK))
        elif shell is not None and done < len(self.commands):
            filled = {other: "Runs the next command" for other in shell[2]}
            tool = shell[0], orjson.dumps({shell[1]: self.commands[done], **filled})
        if tool is not None:
            arguments = tool[1].decode()
            head = f'{CALL_OPEN}\n{{"name": "{tool[0]}", "arguments": '
            parts = [encode(head, add_special_tokens=False), encode(arguments, add_special_tokens=False)]
            parts.append([*encode(CALL_CLOSE, add_special_tokens=False), self.end])
            call: tuple[str, str] | None = (tool[0], arguments)
            content = None
        else:
            content = summary_text(done) if SUMMARY_ASK in last_user else final_text(done)
            parts, call = [[*encode(content, add_special_tokens=False), self.end]], None
        ids = [t for part in parts for t in part]
        texts = self._texts(ids)
        logprobs = [-0.05 * (1 + i % 9) for i in range(len(ids))]
        sampled = Sampled(parts, texts, logprobs, call, content)
        if self.log is not None:
            line = {
                "route": route,
                "model": model,
                "prompt_token_ids": prompt,
                "token_ids": ids,
                "logprobs": logprobs,
                "tool_call": None if call is None else {"name": call[0], "arguments": call[1]},
                "content": content,
            }
            with self.log.open("ab") as out:
                out.write(orjson.dumps(line) + b"\n")
        return sampled

    def _texts(self, ids: list[int]) -> list[str]:
        """Each id's text (special tokens as nothing), so that the texts join to the decoded answer."""
        out, before = [], ""
        for n in range(1, len(ids) + 1):
            now = str(self.tokenizer.decode(ids[:n], skip_special_tokens=True))
            out.append(now[len(before) :])
            before = now
        return out

    # --- routes ----------------------------------------------------------------------------------

    def chat(self, body: dict[str, Any]) -> bytes | list[bytes]:
        """The ordinary chat route: render, sample, answer in vLLM's chat shape (``fake_script``'s)."""
        prompt = self.render(body)
        s = self.sample(prompt, "chat", body.get("model"))
        tokens = list(zip(s.ids, s.texts, s.logprobs, strict=True))
        call = None if s.call is None else {"id": self._tool_id(), "name": s.call[0], "arguments": s.call[1]}
        answer = _Answer(
            body, prompt, tokens, call, [len(p) for p in s.parts], f"chatcmpl-{next(self.counter):016x}", s.content
        )
        return answer.events() if body.get("stream") else answer.whole()

    def chat_render(self, body: dict[str, Any]) -> dict[str, Any]:
        """A GenerateRequest: the ids, and the sampling parameters with vLLM's ``max_tokens`` rule."""
        ids = self.render(body)
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        room = CONTEXT - len(ids)
        params: dict[str, Any] = {"max_tokens": min(int(asked), room) if asked else room}
        for key in ("temperature", "top_p", "top_k", "seed", "stop"):
            if body.get(key) is not None:
                params[key] = body[key]
        return {"request_id": f"render-{next(self.counter)}", "token_ids": ids, "sampling_params": params}

    def tokens_render(self, body: dict[str, Any]) -> tuple[int, Any]:
        """``/v1/completions/render`` of a prompt of ids: 400 when it leaves no room, as vLLM's."""
        ids = body.get("prompt") or []
        room = CONTEXT - len(ids)
        if room <= 0:
            return 400, {"error": {"message": "prompt too long", "type": "BadRequestError"}}
        limit = int(body.get("max_tokens") or room)
        return 200, [{"token_ids": ids, "sampling_params": {"max_tokens": min(limit, room)}}]

    def generate(self, body: dict[str, Any]) -> bytes | list[bytes]:
        """``/inference/v1/generate`` on token ids: the script's ids with their log-probs, whole or
        one token per event, then a usage event (``stream_options.include_usage``)."""
        prompt = list(body["token_ids"])
        s = self.sample(prompt, "generate", body.get("model"))
        ident = f"gen-{next(self.counter)}"
        entries = [{"token_id": t, "logprob": lp, "top_logprobs": []} for t, lp in zip(s.ids, s.logprobs, strict=True)]
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(s.ids),
            "total_tokens": len(prompt) + len(s.ids),
        }
        if not body.get("stream"):
            choice = {"index": 0, "finish_reason": "stop", "stop_reason": None, "token_ids": s.ids}
            return orjson.dumps(
                {
                    "request_id": ident,
                    "model": body.get("model"),
                    "created": int(time.time()),
                    "choices": [{**choice, "logprobs": {"content": entries}}],
                    "usage": usage,
                    "prompt_token_ids": prompt,
                }
            )
        events = []
        for n, (tid, entry) in enumerate(zip(s.ids, entries, strict=True)):
            last = n == len(s.ids) - 1
            choice = {"index": 0, "finish_reason": "stop" if last else None, "stop_reason": None, "token_ids": [tid]}
            chunk: dict[str, Any] = {"request_id": ident, "choices": [{**choice, "logprobs": {"content": [entry]}}]}
            if n == 0:
                chunk["prompt_token_ids"] = prompt
            events.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
        events.append(b"data: " + orjson.dumps({"request_id": ident, "choices": [], "usage": usage}) + b"\n\n")
        return events

    def derender(self, body: dict[str, Any]) -> dict[str, Any]:
        """Sampled ids back into a chat answer: the whole ``generate_response``, or one
        ``generate_chunk`` with the ``stream_state`` the caller carries between chunks."""
        if body.get("stream"):
            return self._derender_chunk(body)
        generated = body["generate_response"]
        choices = []
        for c in generated["choices"]:
            text = str(self.tokenizer.decode(c["token_ids"], skip_special_tokens=True))
            message: dict[str, Any] = {"role": "assistant", "content": text, "reasoning": None, "tool_calls": []}
            head = CALL_HEAD.match(text)
            if head is not None and text.endswith(CALL_CLOSE):
                arguments = text[head.end() : -len(CALL_CLOSE)]
                function = {"name": head.group(1), "arguments": arguments}
                message.update(
                    content=None, tool_calls=[{"id": self._tool_id(), "type": "function", "function": function}]
                )
            logprobs = (c.get("logprobs") or {}).get("content")
            choices.append(
                {
                    "index": c["index"],
                    "message": message,
                    "logprobs": None if logprobs is None else {"content": [_chat_logprob(e) for e in logprobs]},
                    "finish_reason": "tool_calls" if message["tool_calls"] else c.get("finish_reason"),
                    "stop_reason": c.get("stop_reason"),
                    "token_ids": c["token_ids"],
                }
            )
        prompt = int(body.get("prompt_tokens") or 0)
        completion = sum(len(c["token_ids"]) for c in generated["choices"])
        return {
            "id": f"chatcmpl-{next(self.counter):016x}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model"),
            "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
        }

    def _derender_chunk(self, body: dict[str, Any]) -> dict[str, Any]:
        """One generate chunk as a chat chunk: text deltas, or (once the ``<tool_call>`` opening is
        whole) the call's id and name, then argument deltas that hold back what may be its closing."""
        chunk = body["generate_chunk"]
        state = dict(body.get("stream_state") or {"ids": [], "sent": 0, "call": None, "ident": None})
        head = {"id": state["ident"] or f"chatcmpl-{next(self.counter):016x}", "object": "chat.completion.chunk"}
        state["ident"] = head["id"]
        head |= {"created": int(time.time()), "model": body.get("model")}
        if not chunk.get("choices"):
            usage = chunk.get("usage") or {}
            prompt = int(body.get("prompt_tokens") or 0)
            usage = {**usage, "prompt_tokens": prompt, "total_tokens": prompt + int(usage.get("completion_tokens", 0))}
            return {"chunk": {**head, "choices": [], "usage": usage}, "stream_state": state}
        (c,) = chunk["choices"]
        first = not state["ids"]
        state["ids"] = [*state["ids"], *c["token_ids"]]
        finished = c.get("finish_reason") is not None
        text = str(self.tokenizer.decode(state["ids"], skip_special_tokens=True))
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        call = CALL_HEAD.match(text)
        if call is not None or text.startswith(CALL_OPEN) or CALL_OPEN.startswith(text):
            if call is not None:
                if state["call"] is None:
                    state["call"] = self._tool_id()
                    function = {"name": call.group(1), "arguments": ""}
                    opening = {"index": 0, "id": state["call"], "type": "function", "function": function}
                    delta = {**delta, "tool_calls": [opening]}
                    delta.pop("content", None)
                    state["sent"] = 0
                arguments = text[call.end() :]
                if finished:
                    arguments = arguments.removesuffix(CALL_CLOSE)
                else:
                    arguments = arguments[: max(0, len(arguments) - len(CALL_CLOSE))]
                if len(arguments) > state["sent"]:
                    more = {"index": 0, "function": {"arguments": arguments[state["sent"] :]}}
                    delta["tool_calls"] = [*delta.get("tool_calls", []), more]
                    state["sent"] = len(arguments)
        elif len(text) > state["sent"]:
            delta["content"] = text[state["sent"] :]
            state["sent"] = len(text)
        reason = c.get("finish_reason")
        if finished and state["call"] is not None:
            reason = "tool_calls"
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason, "token_ids": c["token_ids"]}
        if finished:
            choice["stop_reason"] = c.get("stop_reason")
        return {"chunk": {**head, "choices": [choice]}, "stream_state": state}

    def _tool_id(self) -> str:
        return f"chatcmpl-tool-{next(self.counter):08x}"


def _chat_logprob(entry: dict[str, Any]) -> dict[str, Any]:
    token = f"token_id:{entry['token_id']}"
    return {"token": token, "logprob": entry["logprob"], "bytes": None, "top_logprobs": []}


def main() -> None:
    import uvloop

    from bench.fake_upstream import serve

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (printed)")
    parser.add_argument(
        "--model-dir", required=True, help="the tokenizer's directory (python -m deploy.model path tiny)"
    )
    parser.add_argument("--script", action="append", default=[], help="a shell command the script runs, in order")
    parser.add_argument("--answer-log", type=Path, help="append each answer to this JSON Lines file")
    args = parser.parse_args()
    engine = TokenEngine(args.model_dir, args.script, args.answer_log)
    uvloop.run(serve(args.host, args.port, tokens=16, interval_s=0.5, token_api=engine))


if __name__ == "__main__":
    main()
