"""Grammar masks rebuilt with xgrammar over real SmolLM2 token ids: the allowed set of every sampled token,
forced tokens, refusals with their reasons, and the bit layout xgrammar itself applies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from trainer.config import TrainerConfig
from trainer.grammar import GrammarMasks, eos_token_ids, unpack

VOCAB = 49152  # SmolLM2's output rows (its tokenizer's vocabulary, as vLLM pads it)
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "op": {"type": "string", "enum": ["add", "multiply"]}},
    "required": ["a", "op"],
    "additionalProperties": False,
}
TAG = {  # the shape of the structural tag vLLM 0.32's hermes parser renders for a named tool
    "type": "structural_tag",
    "format": {
        "type": "tag",
        "begin": '<tool_call>\n{"name": "calc", "arguments": ',
        "content": {"type": "json_schema", "json_schema": SCHEMA},
        "end": "}\n</tool_call>",
    },
}


@pytest.fixture(scope="module")
def tokenizer(vllm_model_dir: str) -> Any:
    return AutoTokenizer.from_pretrained(vllm_model_dir)


@pytest.fixture(scope="module")
def masks(tokenizer: Any, vllm_model_dir: str) -> GrammarMasks:
    return GrammarMasks(tokenizer, VOCAB, eos_token_ids(Path(vllm_model_dir), tokenizer))


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_the_end_of_sequence_ids_are_the_tokenizers_and_the_generation_configs(
    tokenizer: Any, vllm_model_dir: str
) -> None:
    assert eos_token_ids(Path(vllm_model_dir), tokenizer) == [2]  # <|im_end|>, both places


def test_every_sampled_token_gets_the_set_it_was_drawn_from(tokenizer: Any, masks: GrammarMasks) -> None:
    completion = [*encode(tokenizer, '{"a": 12, "op": "multiply"}'), 2]
    found = masks({"json": json.dumps(SCHEMA)}, completion)
    assert isinstance(found, torch.Tensor) and found.shape == (len(completion), VOCAB // 32)
    allowed = unpack(found, VOCAB)
    assert allowed[torch.arange(len(completion)), torch.tensor(completion)].all()  # each sampled id was allowed
    sizes = allowed.sum(1).tolist()
    assert sizes[-1] == 1  # after the closing brace only the end of sequence
    assert 1 in sizes[1:-1] and max(sizes) > 100  # forced keys and free digits and whitespace
    # the same bits xgrammar applies to logits itself
    logits = torch.zeros(len(completion), VOCAB)
    xgr.apply_token_bitmask_inplace(logits, found)
    assert torch.equal(torch.isfinite(logits), allowed)


def test_a_structural_tag_forces_its_envelope(tokenizer: Any, masks: GrammarMasks) -> None:
    text = '<tool_call>\n{"name": "calc", "arguments": {"a": 3, "op": "add"}}\n</tool_call>'
    completion = [*encode(tokenizer, text), 2]
    found = masks({"structural_tag": json.dumps(TAG)}, completion)
    assert isinstance(found, torch.Tensor)
    sizes = unpack(found, VOCAB).sum(1).tolist()
    envelope = len(encode(tokenizer, '<tool_call>\n{"name": "calc", "arguments": '))
    # the envelope leaves only spellings of itself (a word or its prefixes), the arguments far more
    assert max(sizes[:envelope]) <= 5 and sizes.count(1) >= 8
    assert max(sizes[envelope:]) > 100 and sizes[-1] == 1


def test_what_cannot_be_rebuilt_says_why(tokenizer: Any, masks: GrammarMasks) -> None:
    completion = [*encode(tokenizer, '{"b": 1}'), 2]
    assert masks(None, completion) == "no grammar recorded (the engine's render route could not be asked)"
    refused = masks({"json": json.dumps(SCHEMA)}, completion)
    assert isinstance(refused, str) and refused.startswith("sampled token 1 ")
    multiple = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 5}}}
    assert "llguidance" in str(masks({"json": json.dumps(multiple)}, completion))
    broken = masks({"grammar": "root ::= ("}, completion)
    assert isinstance(broken, str) and broken.startswith("the grammar does not compile with xgrammar")
    assert (
        masks({"whitespace_pattern": " "}, completion)
        == "no grammar kind this trainer rebuilds in ['whitespace_pattern']"
    )


def test_choices_and_request_stop_ids(tokenizer: Any, masks: GrammarMasks) -> None:
    yes = encode(tokenizer, "yes")
    found = masks({"choice": ["yes", "no"]}, [*yes, 2])
    assert isinstance(found, torch.Tensor)
    # a request's own stop id ends the grammar as well as the end of sequence does
    stop = encode(tokenizer, "\n")[0]
    assert isinstance(masks({"choice": ["yes", "no"]}, [*yes, stop], [stop]), torch.Tensor)
    assert isinstance(masks({"choice": ["yes", "no"]}, [*yes, stop]), str)


def test_json_whitespace_is_the_servers_setting_not_the_requests(tokenizer: Any, vllm_model_dir: str) -> None:
    """vLLM 0.32's xgrammar backend reads ``disable_any_whitespace`` from ``--structured-outputs-config``
    only; a request's own value is read nowhere, so honouring it would mask what the engine allowed."""
    engine_default = pytest.importorskip("vllm.config.structured_outputs").StructuredOutputsConfig()
    assert TrainerConfig().grammar_disable_any_whitespace is engine_default.disable_any_whitespace is False
    spaced = [*encode(tokenizer, '{"a": 12, "op": "add"}'), 2]
    compact = [*encode(tokenizer, '{"a":12,"op":"add"}'), 2]
    eos = eos_token_ids(Path(vllm_model_dir), tokenizer)
    free = GrammarMasks(tokenizer, VOCAB, eos, disable_any_whitespace=TrainerConfig().grammar_disable_any_whitespace)
    asked = {"json": json.dumps(SCHEMA), "disable_any_whitespace": True}  # the request's value, as recorded
    assert isinstance(free(asked, spaced), torch.Tensor)
    assert isinstance(free({"json_object": True, "disable_any_whitespace": True}, spaced), torch.Tensor)
    strict = GrammarMasks(tokenizer, VOCAB, eos, disable_any_whitespace=True)  # a server started with it
    assert isinstance(strict({"json": json.dumps(SCHEMA)}, compact), torch.Tensor)
    refused = strict({"json": json.dumps(SCHEMA)}, spaced)
    assert isinstance(refused, str) and refused.startswith("sampled token ")


OBJECT_A = {"type": "object", "properties": {"a": {"type": "string"}}}
ROUTES: list[tuple[dict[str, Any], bool]] = [  # (schema, sent away from xgrammar by vLLM 0.32's auto backend)
    (SCHEMA, False),
    ({"type": "integer", "multipleOf": 5}, True),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, True),
    ({"allOf": [{"type": "string"}, {"enum": ["yes", "no"]}]}, True),
    ({"type": "string", "pattern": "^[a-z]+$", "minLength": 2}, True),
    ({"type": "string", "format": "email", "maxLength": 40}, True),
    ({"type": "string", "format": "phone"}, True),  # a format xgrammar lacks
    ({**OBJECT_A, "propertyNames": {"pattern": "^[a-z]$"}}, True),
    ({**OBJECT_A, "patternProperties": {"^x_": {"type": "integer"}}}, True),
    ({"type": "string", "format": "email"}, False),
    ({"type": "string", "pattern": "^[a-z]+$"}, False),
    ({"type": "string", "minLength": 2, "maxLength": 8}, False),
    ({"type": "object", "propertyNames": {"pattern": "^[a-z]$"}}, False),
    # keywords as property names are not keywords: vLLM keeps these on xgrammar
    ({"type": "object", "properties": {"multipleOf": {"type": "integer"}, "contains": {"type": "string"}}}, False),
]


def test_json_schemas_go_where_vllms_auto_backend_sends_them(masks: GrammarMasks) -> None:
    """The trainer asks vLLM's own rule (``has_xgrammar_unsupported_json_features``): a schema sent to
    llguidance has no rebuilt mask (context only, counted) instead of xgrammar's looser one. The table
    pins vLLM 0.32's rule, so an upgrade that moves a schema fails here and is looked at."""
    rule = pytest.importorskip("vllm.v1.structured_output.backend_xgrammar").has_xgrammar_unsupported_json_features
    for schema, away in ROUTES:
        assert rule(schema) is away, schema
        found = masks({"json": json.dumps(schema)}, [])
        if away:
            assert isinstance(found, str) and "llguidance" in found, schema
        else:
            assert isinstance(found, torch.Tensor), (schema, found)
