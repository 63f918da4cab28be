"""The calculator environment: two tools, their OpenAI schemas, and their execution on one task.

The tools are designed for a 135M model: few, short arguments; strict JSON schemas
(``additionalProperties: false``, every property required, ``strict: true``), so vLLM's grammar
makes the argument *names* right and leaves the model only the decisions that matter: which
numbers and which operation. Execution re-validates every call against the schema itself (a tool
call is judged by what it says, never by trusting the grammar) and records what happened, which
``reward.py`` turns into task success and call validity.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from workflows.calc.tasks import OP_OF, CalcTask, apply, say

CALCULATOR = "calculator"
SUBMIT = "submit_answer"


def _tool(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": list(properties),
                "additionalProperties": False,
            },
        },
    }


TOOLS: list[dict[str, Any]] = [
    _tool(
        CALCULATOR,
        "Compute a op b.",
        {"a": {"type": "integer"}, "op": {"type": "string", "enum": list(OP_OF)}, "b": {"type": "integer"}},
    ),
    _tool(SUBMIT, "Submit the final answer.", {"answer": {"type": "integer"}}),
]
"""The ``tools`` of every request: a calculator and the final answer."""
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
TAPE_LINES = 10
"""The calculator's tape shows its last this many lines: the tool output grows with the episode up
to there, then by a line per call (a whole tape would grow it quadratically)."""
MAX_ABS = 10**12
"""Operands beyond this are refused (a runaway chain of multiplications is not arithmetic practice)."""


def named(tool: str) -> dict[str, Any]:
    """The ``tool_choice`` that makes the model call ``tool`` (vLLM samples its arguments under the schema)."""
    return {"type": "function", "function": {"name": tool}}


def check_arguments(tool: str, arguments: str) -> tuple[dict[str, Any] | None, str | None]:
    """(arguments, None) when they satisfy ``tool``'s schema exactly, else (None, why)."""
    schema = SCHEMAS.get(tool)
    if schema is None:
        return None, f"unknown tool {tool!r}"
    try:
        args = json.loads(arguments)
    except (json.JSONDecodeError, TypeError):
        return None, "arguments are not JSON"
    if not isinstance(args, dict):
        return None, "arguments are not a JSON object"
    expected = set(schema["properties"])
    if set(args) != expected:
        return None, f"arguments must be exactly {sorted(expected)}, got {sorted(args)}"
    for key, spec in schema["properties"].items():
        value = args[key]
        if spec["type"] == "integer" and (isinstance(value, bool) or not isinstance(value, int)):
            return None, f"{key} must be an integer"
        if spec["type"] == "string" and not isinstance(value, str):
            return None, f"{key} must be a string"
        if "enum" in spec and value not in spec["enum"]:
            return None, f"{key} must be one of {spec['enum']}"
        if isinstance(value, int) and abs(value) > MAX_ABS:
            return None, f"{key} is too large"
    return args, None


@dataclass(frozen=True)
class ToolCall:
    """One model call's outcome as the environment saw it."""

    tool: str | None
    """The called function's name (None: the reply held no tool call)."""
    arguments: str | None
    valid: bool
    """A single call of a known tool whose arguments satisfy its schema exactly."""
    error: str | None = None
    result: str | None = None
    """What the tool answered (sent back as the ``role: tool`` message)."""
    useful: bool = False
    """A calculator call that computes a step of the reference solution, or the right final answer."""


@dataclass
class CalcEnv:
    """One episode's state: the calls made so far and the submitted answer."""

    task: CalcTask
    tape: bool = False
    """Answer a calculator call with its tape, the episode's computations so far (the last
    ``TAPE_LINES``) and the next step of the task, instead of the bare result: long tool output, as
    a long-horizon agent's is (file listings, logs), and a pointer to where the chain stands."""
    calls: list[ToolCall] = field(default_factory=list)
    answer: int | None = None
    lines: list[str] = field(default_factory=list)
    """The tape: one line per valid calculator call."""

    @property
    def submitted(self) -> bool:
        return self.answer is not None

    def no_call(self, why: str) -> ToolCall:
        """Record a model reply that held no usable tool call (e.g. cut off at ``max_tokens``)."""
        call = ToolCall(tool=None, arguments=None, valid=False, error=why)
        self.calls.append(call)
        return call

    def execute(self, tool: str, arguments: str, *, extra_calls: int = 0) -> ToolCall:
        """Run one tool call and record it; ``extra_calls`` > 0 marks a reply with several calls (invalid)."""
        args, error = check_arguments(tool, arguments)
        if error is None and extra_calls:
            error = f"one tool call per turn, got {extra_calls + 1}"
        if args is None or error is not None:
            call = ToolCall(tool=tool, arguments=arguments, valid=False, error=error, result=f"error: {error}")
        elif tool == CALCULATOR:
            op = OP_OF[args["op"]]
            value = apply(args["a"], op, args["b"])
            useful = any(step.matches(args["a"], op, args["b"]) for step in self.task.steps)
            self.lines.append(f"{args['a']} {op} {args['b']} = {value}")
            result = self._tape() if self.tape else str(value)
            call = ToolCall(tool=tool, arguments=arguments, valid=True, result=result, useful=useful)
        else:
            self.answer = args["answer"]
            call = ToolCall(
                tool=tool, arguments=arguments, valid=True, result="submitted", useful=self.answer == self.task.answer
            )
        self.calls.append(call)
        return call

    def _tape(self) -> str:
        """The tape's last lines, numbered, then ``next: <the task's next step>`` (or ``next: submit the
        answer``)."""
        done = 1 + sum(c.tool == CALCULATOR for c in self.calls)  # calculator turns, this one included
        steps = self.task.steps
        upcoming = f"next: {say(steps[done])}" if done < len(steps) else "next: submit the answer"
        shown = [f"{k}. {line}" for k, line in enumerate(self.lines, 1)][-TAPE_LINES:]
        return "\n".join([*shown, upcoming])
