"""Effective sampling: what the proxy makes explicit, pins, flags and refuses on recorded routes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from proxy.errors import InvalidRequest
from proxy.sampling import SamplingDefaults, resolve

NONE = SamplingDefaults(values={}, source="vLLM neutral values")
QWEN = SamplingDefaults(values={"temperature": 0.7, "top_p": 0.8, "top_k": 20.0}, source="test")


def resolved(
    body: dict[str, Any], defaults: SamplingDefaults = NONE, **policy: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    upstream = dict(body)
    record = resolve(
        upstream, defaults, penalties=policy.get("penalties", "flag"), constrained=policy.get("constrained", "train")
    )
    return upstream, record


def test_omitted_fields_are_sent_explicitly_with_vllm_neutral_values() -> None:
    upstream, record = resolved({"messages": []})
    assert {k: upstream[k] for k in ("temperature", "top_p", "top_k", "min_p")} == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
    }
    assert {k: upstream[k] for k in ("repetition_penalty", "presence_penalty", "frequency_penalty")} == {
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
    }
    assert record["mode"] == "sampled" and "from_model" not in record
    assert record["pinned"] == ["repetition_penalty", "presence_penalty", "frequency_penalty"]


def test_model_defaults_fill_omitted_fields_and_the_request_wins() -> None:
    upstream, record = resolved({"temperature": 0.2}, QWEN)
    assert (upstream["temperature"], upstream["top_p"], upstream["top_k"]) == (0.2, 0.8, 20)
    assert record["from_model"] == ["top_p", "top_k"] and record["mode"] == "truncated"


def test_generation_config_is_read_from_a_model_directory(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "do_sample": True})
    )
    defaults = SamplingDefaults.load(str(tmp_path), {"min_p": 0.05})
    assert defaults.values == {"temperature": 0.7, "top_p": 0.8, "top_k": 20.0, "min_p": 0.05}
    upstream, record = resolved({}, defaults)
    assert upstream["repetition_penalty"] == 1.0  # the model's penalty is pinned neutral on recorded traffic
    assert "repetition_penalty" in record["pinned"]
    with pytest.raises(ValueError, match="does not exist"):
        SamplingDefaults.load(str(tmp_path / "missing"), {})
    with pytest.raises(ValueError, match="unknown fields"):
        SamplingDefaults.load(None, {"typical_p": 0.9})


def test_top_k_minus_one_means_all_tokens_and_tiny_temperature_is_greedy() -> None:
    assert resolved({"top_k": -1})[0]["top_k"] == 0
    assert resolved({"temperature": 0.0})[1]["mode"] == "greedy"
    assert resolved({"temperature": 1e-6})[1]["mode"] == "greedy"


@pytest.mark.parametrize("top_k", [2**64 - 1, 1e30, -2, -1e30])
def test_a_top_k_out_of_range_is_refused(top_k: float) -> None:
    """Found by tests/proxy/test_fuzz.py: 2**64 - 1 became the float 1.8e19 and then an integer past
    64 bits, which orjson could not send on (a 500)."""
    with pytest.raises(InvalidRequest) as refused:
        resolved({"top_k": top_k})
    assert (refused.value.status_code, refused.value.param) == (400, "top_k")


@pytest.mark.parametrize(
    "body",
    [
        {"repetition_penalty": 1.1},
        {"presence_penalty": 0.5},
        {"logit_bias": {"5": 3}},
        {"bad_words": ["x"]},
        {"min_tokens": 4},
        {"allowed_token_ids": [1, 2]},
    ],
)
def test_penalties_are_flagged_or_refused(body: dict[str, Any]) -> None:
    upstream, record = resolved(body)
    assert record["mode"] == "penalized" and set(record["penalties"]) == set(body)
    assert all(upstream[k] == v for k, v in body.items())  # flagged calls keep what the client asked
    with pytest.raises(InvalidRequest) as refused:
        resolved(body, penalties="reject")
    assert refused.value.code == "unsupported_sampling" and refused.value.status_code == 400


def test_neutral_penalties_sent_by_a_client_are_not_flagged() -> None:
    assert resolved({"frequency_penalty": 0.0, "presence_penalty": 0, "logit_bias": {}})[1]["mode"] == "sampled"


TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(
    ("body", "constraint"),
    [
        ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice=required"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}},
            "tool_choice=function:add",
        ),
        ({"response_format": {"type": "json_object"}}, "response_format=json_object"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
            "response_format=json_schema",
        ),
        ({"structured_outputs": {"regex": "[0-9]+"}}, "structured_outputs"),
    ],
)
def test_grammar_constraints_are_recorded_with_the_deployment_policy(body: dict[str, Any], constraint: str) -> None:
    record = resolved(body, constrained="exclude")[1]
    assert (record["mode"], record["constraint"], record["constrained"]) == ("constrained", constraint, "exclude")
    with pytest.raises(InvalidRequest):
        resolved(body, constrained="reject")


def test_auto_tool_choice_and_text_format_are_unconstrained() -> None:
    assert resolved({"tools": TOOLS, "tool_choice": "auto"})[1]["mode"] == "sampled"
    assert resolved({"tools": TOOLS})[1]["mode"] == "sampled"
    assert resolved({"tools": TOOLS, "parallel_tool_calls": True})[1]["mode"] == "sampled"
    assert resolved({"response_format": {"type": "text"}})[1]["mode"] == "sampled"


STRICT = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
PLAIN = {"type": "function", "function": {"name": "sub", "parameters": {"type": "object"}, "strict": False}}


@pytest.mark.parametrize(
    ("body", "constraint"),
    [
        ({"tools": STRICT, "tool_choice": "auto"}, "tools=strict"),
        ({"tools": [PLAIN, *STRICT]}, "tools=strict"),  # tool_choice omitted with tools: vLLM's auto
        ({"tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": False}, "parallel_tool_calls=false"),
        ({"tools": [{"function": {"name": "add", "strict": "true"}}]}, "tools=strict"),  # as pydantic reads it
        ({"tools": TOOLS, "parallel_tool_calls": "false"}, "parallel_tool_calls=false"),
    ],
)
def test_auto_tool_choice_with_a_strict_tool_or_one_call_is_constrained(body: dict[str, Any], constraint: str) -> None:
    """vLLM 0.32 applies its structural tag to ``tool_choice: auto`` once a tool is strict or
    ``parallel_tool_calls`` is false: without the render route to ask, the request must say so, or
    the call is trained over the full vocabulary."""
    record = resolved(body)[1]
    assert (record["mode"], record["constraint"], record["constrained"]) == ("constrained", constraint, "train")
    with pytest.raises(InvalidRequest) as refused:
        resolved(body, constrained="reject")
    assert refused.value.param == constraint.split("=")[0]


TOOL_BODIES: list[dict[str, Any]] = [
    {"tools": TOOLS},
    {"tools": TOOLS, "tool_choice": "auto"},
    {"tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": True},
    {"tools": [PLAIN], "tool_choice": "auto"},
    {"tools": STRICT},
    {"tools": STRICT, "tool_choice": "auto"},
    {"tools": [PLAIN, *STRICT], "tool_choice": "auto"},
    {"tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": False},
    {"tools": TOOLS, "parallel_tool_calls": "false"},
    {"tools": [{"function": {"name": "add", "strict": "true"}}]},
    {"tools": [{"function": {"name": "add", "strict": 0}}], "parallel_tool_calls": 1},
    {"tools": STRICT, "tool_choice": "none"},
    {"tools": STRICT, "tool_choice": "none", "parallel_tool_calls": False},
    {"tools": TOOLS, "tool_choice": "required"},
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}},
]


def test_which_tool_requests_are_constrained_is_vllms_rule(vllm_model_dir: str) -> None:
    """The proxy repeats vLLM's rule (importing vLLM would bring torch into the proxy); here it is
    held to the engine's own parser, built as Flywheel starts vLLM (``--enable-auto-tool-choice
    --tool-call-parser hermes``, the default ``--tool-strict-level auto``): a request is constrained
    exactly when the parser gives it a grammar."""
    manager = pytest.importorskip("vllm.parser.parser_manager").ParserManager
    protocol = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
    tokenizer = pytest.importorskip("transformers").AutoTokenizer.from_pretrained(vllm_model_dir)
    parser = manager.get_parser(tool_parser_name="hermes", enable_auto_tools=True)
    for body in TOOL_BODIES:
        request = protocol.ChatCompletionRequest(model="policy", messages=[{"role": "user", "content": "x"}], **body)
        theirs = parser(tokenizer, request.tools).adjust_request(request).structured_outputs is not None
        assert (resolved(body)[1]["mode"] == "constrained") is theirs, body


def test_a_non_numeric_temperature_is_a_clear_400() -> None:
    with pytest.raises(InvalidRequest) as refused:
        resolved({"temperature": "hot"})
    assert refused.value.param == "temperature"


ENGINE_RANGES: dict[str, list[float]] = {
    "n": [-1, 0, 1, 4],
    "temperature": [-1, -0.1, 0, 0.7, 2, 2.5, float("nan")],
    "top_p": [-0.5, 0, 0.1, 1, 1.5],
    "min_p": [-0.1, 0, 0.5, 1, 1.1],
    "max_tokens": [-1, 0, 1, 16],
    "min_tokens": [-1, 0, 3],
    "presence_penalty": [-2.5, -2, 0, 2, 2.5],
    "frequency_penalty": [-2.5, -2, 0, 2, 2.5],
    "repetition_penalty": [-1, 0, 0.5, 1.2, float("inf")],
    "logprobs": [-2, -1, 0, 5],
    "prompt_logprobs": [-2, -1, 0, 5],
}


def test_out_of_range_values_are_refused_as_the_engine_refuses_them() -> None:
    """The proxy repeats the ranges of vLLM's ``SamplingParams._verify_args`` (importing vLLM would
    bring torch into the proxy); here they are held to the engine's own rules, value by value."""
    engine = pytest.importorskip("vllm.sampling_params")
    refusal = pytest.importorskip("vllm.exceptions").VLLMClientError
    for field, values in ENGINE_RANGES.items():
        for value in values:
            try:
                engine.SamplingParams(**{field: value})
                theirs = None
            except refusal:
                theirs = field
            try:
                resolved({"messages": [], field: value})
                mine = None
            except InvalidRequest as refused:
                assert refused.status_code == 400
                mine = refused.param
            assert mine == theirs, f"{field}={value}"
