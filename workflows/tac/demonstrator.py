"""The scripted demonstrator: a teacher that solves TAC tasks by their scripted solutions.

``python -m workflows.tac.demonstrator --tasks-dir DIR --port P`` serves OpenAI's chat completions
(``POST /v1/chat/completions``, non-streamed) for the proxy's ``teachers`` (``proxy/teachers.py``),
so ``python -m workflows run tac --source teacher:<name>`` records demonstrations made by the real
OpenHands agent and tools, graded like any run: the warm start's default source of episodes on a
CPU, where no stronger model is at hand.

Each task directory of ``DIR`` with a ``solution.json`` (``{"steps": [{"tool": "terminal",
"arguments": {...}}, ...]}``: the tool calls the agent's LLM would make, arguments exactly as
OpenHands takes them) is a script. A request's task is the one whose ``task.md`` the
conversation's first user message holds (the agent's instruction; the longest such text wins); its
step is the number of assistant messages so far. The answer is that step as one native tool call
(``finish_reason: tool_calls``), with usage estimated at four characters a token (the demonstrator
has no tokenizer). Refused, in OpenAI's error shape: a task it has no script for (400
``unknown_task``), a test-split task (403 ``test_split``: ``splits.yml``'s ``test`` is never
demonstrated, and a tasks directory without ``splits.yml``, where every task is in both splits, is
refused at start), a step past the script's end (400 ``script_exhausted``), a tool the request does
not offer (400 ``tool_not_offered``) and streams (400 ``stream_unsupported``).

``--style mini-swe-agent`` plays the same scripts to mini-swe-agent (``workflows/miniswe``), whose
only tool is ``bash`` (``{"command": ...}``) and which ends when a command prints
``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``: each ``terminal`` step becomes a ``bash`` call with the
same command and ``finish`` becomes ``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``; a step with any
other tool (``file_editor``) is refused (400 ``step_untranslatable``). The default style,
``openhands``, answers each step as scripted.

Standard library and PyYAML only, so it runs in either venv.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped,unused-ignore]

SOLUTION = "solution.json"
MODEL = "demonstrator"
"""The model name it answers under, whatever was asked."""
CHARS_PER_TOKEN = 4
"""Usage is estimated: the demonstrator has no tokenizer."""
STYLES = ("openhands", "mini-swe-agent")
"""How a scripted step is put to the agent: as scripted (OpenHands' tools), or as mini-swe-agent's bash call."""
MINISWE_SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
"""The command that ends a mini-swe-agent run (its LocalEnvironment checks the first output line)."""


class Refused(Exception):
    """A request the demonstrator will not answer: its HTTP status, OpenAI error type and code."""

    def __init__(self, status: int, message: str, code: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict[str, Any]:
        kind = "permission_error" if self.status == 403 else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Step:
    tool: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Script:
    task: str
    instruction: str
    steps: tuple[Step, ...]


def _steps(path: Path) -> tuple[Step, ...]:
    """A ``solution.json``'s steps; a malformed one is an error naming the file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: unreadable ({exc})") from exc
    steps = data.get("steps") if isinstance(data, dict) else None
    if not isinstance(steps, list) or not steps:
        raise ValueError(f'{path}: expected {{"steps": [{{"tool": ..., "arguments": {{...}}}}, ...]}}')
    out = []
    for i, step in enumerate(steps):
        tool = step.get("tool") if isinstance(step, dict) else None
        arguments = step.get("arguments") if isinstance(step, dict) else None
        if not isinstance(tool, str) or not tool or not isinstance(arguments, dict):
            raise ValueError(f"{path}: steps[{i}] needs a tool name and an arguments object")
        out.append(Step(tool, arguments))
    return tuple(out)


def as_bash(step: Step, task: str, index: int) -> Step:
    """A scripted OpenHands step as mini-swe-agent's one tool call: ``bash`` with a command."""
    if step.tool == "terminal" and isinstance(step.arguments.get("command"), str):
        return Step("bash", {"command": step.arguments["command"]})
    if step.tool == "finish":
        return Step("bash", {"command": MINISWE_SUBMIT})
    raise Refused(
        400,
        f"task {task} step {index + 1} calls {step.tool!r}, which has no mini-swe-agent bash equivalent",
        "step_untranslatable",
    )


class Demonstrator:
    """The scripts of a tasks directory, indexed by instruction, and the refused test tasks."""

    def __init__(self, root: Path, style: str = "openhands") -> None:
        if style not in STYLES:
            raise ValueError(f"style must be one of {', '.join(STYLES)}, got {style!r}")
        self.style = style
        splits_file = root / "splits.yml"
        if not splits_file.is_file():
            raise ValueError(
                f"{root} has no splits.yml: every task would be in the test split too, which is never demonstrated"
            )
        splits = yaml.safe_load(splits_file.read_text()) or {}
        test = splits.get("test") if isinstance(splits, dict) else None
        if not isinstance(test, list | type(None)):
            raise ValueError(f"{splits_file}: test must be a list of task names")
        self.test = {str(name) for name in test or ()}
        self.scripts: dict[str, Script] = {}
        """Instruction text -> script (train and val tasks with a solution)."""
        self.held_out: dict[str, str] = {}
        """Instruction text -> test task name: recognised, to be refused."""
        for task in sorted(p for p in root.iterdir() if (p / "task.md").is_file()):
            instruction = (task / "task.md").read_text().strip()
            if task.name in self.test:
                self.held_out[instruction] = task.name
            elif (task / SOLUTION).is_file():
                self.scripts[instruction] = Script(task.name, instruction, _steps(task / SOLUTION))

    def task_of(self, messages: Sequence[Any]) -> Script:
        """The script of the task the conversation's first user message states."""
        first = next((m for m in messages if isinstance(m, dict) and m.get("role") == "user"), None)
        text = _text(first.get("content")) if first is not None else ""
        known = [(len(i), name, False) for i, name in self.held_out.items() if i in text]
        known += [(len(i), s.task, True) for i, s in self.scripts.items() if i in text]
        if not known:
            raise Refused(400, "no scripted task's instruction is in the first user message", "unknown_task")
        _, name, scripted = max(known)
        if not scripted:
            raise Refused(403, f"task {name} is in the test split, which is never demonstrated", "test_split")
        return next(s for s in self.scripts.values() if s.task == name)

    def answer(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The chat completion for ``body``: the task's next scripted step as a tool call."""
        if body.get("stream"):
            raise Refused(400, "the demonstrator answers whole (stream: false)", "stream_unsupported", param="stream")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise Refused(400, "'messages' must be a non-empty array", "invalid_messages", param="messages")
        script = self.task_of(messages)
        index = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")
        if index >= len(script.steps):
            raise Refused(
                400,
                f"task {script.task}'s script has {len(script.steps)} steps; this is step {index + 1}",
                "script_exhausted",
            )
        step = script.steps[index]
        if self.style == "mini-swe-agent":
            step = as_bash(step, script.task, index)
        offered = {t.get("function", {}).get("name") for t in body.get("tools") or () if isinstance(t, dict)}
        if step.tool not in offered:
            names = ", ".join(sorted(str(n) for n in offered)) or "none"
            raise Refused(
                400,
                f"task {script.task} step {index + 1} calls {step.tool!r}, which the request does not offer ({names})",
                "tool_not_offered",
                param="tools",
            )
        arguments = json.dumps(step.arguments)
        digest = hashlib.sha256(f"{script.task}/{index}".encode()).hexdigest()[:12]
        call = {"id": f"call_{digest}", "type": "function", "function": {"name": step.tool, "arguments": arguments}}
        asked_n = body.get("n")
        n = asked_n if isinstance(asked_n, int) and asked_n > 0 else 1
        prompt = _tokens(json.dumps(messages)) + _tokens(json.dumps(body.get("tools") or []))
        completion = _tokens(step.tool + arguments) * n
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": MODEL,
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                    "logprobs": None,
                    "finish_reason": "tool_calls",
                }
                for i in range(n)
            ],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion * n,
                "total_tokens": prompt + completion * n,
            },
        }


def _text(content: Any) -> str:
    """A message's text: a string, or the text parts of a content array."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def _tokens(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)


class _Handler(BaseHTTPRequestHandler):
    demonstrator: Demonstrator
    server_version = "flywheel-demonstrator"

    def _send(self, status: int, body: Mapping[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(200, {})
        elif self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "flywheel"}]})
        else:
            self._send(404, Refused(404, f"no route {self.path}", "not_found").body())

    def do_POST(self) -> None:
        try:
            if self.path != "/v1/chat/completions":
                raise Refused(404, f"no route {self.path}", "not_found")
            length = int(self.headers.get("content-length") or 0)
            try:
                body = json.loads(self.rfile.read(length) or b"null")
            except json.JSONDecodeError as exc:
                raise Refused(400, f"the body is not JSON: {exc}", "invalid_json") from exc
            if not isinstance(body, dict):
                raise Refused(400, "the body must be a JSON object", "invalid_json")
            self._send(200, self.demonstrator.answer(body))
        except Refused as exc:
            self._send(exc.status, exc.body())

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """One line per request on stderr, without bodies."""
        sys.stderr.write(f"demonstrator: {self.address_string()} {format % args}\n")


def serve(demonstrator: Demonstrator, host: str, port: int) -> ThreadingHTTPServer:
    """A server for ``demonstrator`` on ``host:port`` (0: any free port), not yet serving."""
    handler = type("Handler", (_Handler,), {"demonstrator": demonstrator})
    return ThreadingHTTPServer((host, port), handler)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workflows.tac.demonstrator", description=__doc__.split("\n")[0])
    parser.add_argument("--tasks-dir", type=Path, required=True, help="TAC tasks with solution.json and splits.yml")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8300)
    parser.add_argument(
        "--style",
        choices=STYLES,
        default="openhands",
        help="openhands: each step as scripted; mini-swe-agent: as its bash tool call, finish as its submit command",
    )
    args = parser.parse_args(argv)
    try:
        demonstrator = Demonstrator(args.tasks_dir, args.style)
    except ValueError as exc:
        parser.error(str(exc))
    server = serve(demonstrator, args.host, args.port)
    tasks = ", ".join(sorted(s.task for s in demonstrator.scripts.values())) or "none"
    print(f"demonstrator on http://{args.host}:{server.server_port}: {tasks}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
