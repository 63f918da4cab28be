"""The token masks vLLM sampled a constrained call under, rebuilt from the grammar the proxy recorded.

Under a grammar vLLM sets the logit of every token the grammar forbids at that position to -inf
before sampling (xgrammar's bitmask, applied to the raw logits ahead of temperature, min-p, top-k
and top-p), so its recorded log-probs are those of the masked distribution. The trainer must score
the same distribution: unmasked, a negative advantage pushes probability onto tokens the engine can
never sample, and as that mass grows the masked remainder the engine samples from flattens
(issue 28: calculator calls filled with whitespace after 25 steps, the engine/trainer gap on
constrained tokens growing from 0.9 to 5.9 nats).

The proxy records the grammar as vLLM's render route reports it (``proxy/grammar.py``:
``notes.sampling.grammar``, one of ``structural_tag``, ``json``, ``json_object``, ``regex``,
``choice``, ``grammar``). Here it is compiled with xgrammar as vLLM 0.32's xgrammar backend
compiles it (``vllm/v1/structured_output/backend_xgrammar.py``: the tokenizer's vocabulary padded
to the model's ``vocab_size``; JSON with free whitespace unless the *server's*
``--structured-outputs-config`` sets ``disable_any_whitespace``, the trainer's
``grammar_disable_any_whitespace``: the engine reads it nowhere else, so a request's own value is
ignored here too; the matcher's stop tokens are the request's stop ids plus the model's
end-of-sequence ids), and a matcher walks the sampled ids: before each token,
``fill_next_token_bitmask`` gives the allowed set it was sampled from, then the token is accepted.
Once the grammar has ended, vLLM applies no mask, so neither does this.

A call whose grammar cannot be rebuilt here gets a reason instead of masks, and the trainer keeps
it as context only (counted): no grammar recorded (the engine could not be asked), a JSON schema
vLLM's ``auto`` backend would not give to xgrammar (decided by vLLM's own
``has_xgrammar_unsupported_json_features``, not a copy of it: xgrammar would compile such a schema
by dropping the constraint, a looser mask than llguidance's), a grammar that does not compile, or a
sampled token the rebuilt grammar refuses (the engine applied something else: a reasoning model's
thinking span, another backend).

Bitmask layout (xgrammar's): int32 words, token ``t`` allowed iff bit ``t % 32`` of word
``t // 32`` is set; ``unpack`` turns rows of it into booleans.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("flywheel.trainer")
Tensor = torch.Tensor
SPEC_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
"""The kinds vLLM compiles, in the order it checks them (``get_structured_output_key``)."""


def words(vocab_size: int) -> int:
    """Int32 words per bitmask row."""
    return (vocab_size + 31) // 32


def unpack(packed: Tensor, vocab_size: int) -> Tensor:
    """(n, words) int32 bitmask rows to (n, vocab_size) booleans, True where a token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1  # (n, words, 32)
    return bits.reshape(packed.shape[0], -1)[:, :vocab_size].bool()


def _ebnf_literal(text: str) -> str:
    escapes = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
    return "".join(escapes.get(c, c if ord(c) >= 0x20 and ord(c) != 0x7F else f"\\u{ord(c):04x}") for c in text)


class GrammarMasks:
    """Rebuilds the allowed-token bitmask of every sampled token of a constrained call.

    ``tokenizer``: the model's Hugging Face tokenizer; ``vocab_size``: rows of the output embedding
    (vLLM pads the tokenizer's vocabulary to it); ``eos_token_ids``: the model's end-of-sequence ids
    (its ``generation_config.json`` and tokenizer), which vLLM adds to every request's stop ids;
    ``disable_any_whitespace``: the engine's ``--structured-outputs-config`` value. Needs xgrammar
    and vLLM (for its backend rule), both imported here: ``ImportError`` without them.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        disable_any_whitespace: bool = False,
        cache: int = 64,
    ) -> None:
        import xgrammar as xgr
        from vllm.v1.structured_output.backend_xgrammar import has_xgrammar_unsupported_json_features

        self._xgr = xgr
        self._leaves_xgrammar: Callable[[dict[str, Any]], bool] = has_xgrammar_unsupported_json_features
        self.disable_any_whitespace = disable_any_whitespace
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(set(eos_token_ids))
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._size = cache

    def __call__(
        self, grammar: dict[str, Any] | None, completion: Sequence[int], stop_ids: Sequence[int] = ()
    ) -> Tensor | str:
        """(len(completion), words) int32: the mask each token was sampled under, or why there is none."""
        if not grammar:
            return "no grammar recorded (the engine's render route could not be asked)"
        compiled = self._compile(grammar)
        if isinstance(compiled, str):
            return compiled
        stops = sorted({*self.eos_token_ids, *(int(t) for t in stop_ids)})
        matcher = self._xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None)
        masks = torch.full((len(completion), words(self.vocab_size)), -1, dtype=torch.int32)
        for i, token in enumerate(completion):
            if matcher.is_terminated():
                break  # vLLM applies no mask after the grammar ended: rows stay all-allowed
            matcher.fill_next_token_bitmask(masks, i)
            if not matcher.accept_token(int(token)):
                return f"sampled token {i} ({token}) is outside the rebuilt grammar: the engine applied another mask"
        return masks

    def _compile(self, grammar: dict[str, Any]) -> Any:
        key = json.dumps(grammar, sort_keys=True)
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return self._compiled[key]
        try:
            compiled = self._build(grammar)
        except Exception as exc:  # xgrammar raises RuntimeError and ValueError subclasses alike
            compiled = f"the grammar does not compile with xgrammar ({type(exc).__name__}: {str(exc)[:200]})"
        self._compiled[key] = compiled
        while len(self._compiled) > self._size:
            self._compiled.popitem(last=False)
        return compiled

    def _build(self, grammar: dict[str, Any]) -> Any:
        """Compile the first grammar kind set, with the options vLLM's xgrammar backend passes (the
        server's, never the request's option fields: vLLM 0.32 reads those nowhere)."""
        kind = next((k for k in SPEC_KINDS if grammar.get(k) not in (None, False)), None)
        compiler = self._compiler
        exact = self.disable_any_whitespace
        separators = (",", ":") if exact else None
        if kind == "json":
            schema = grammar["json"] if isinstance(grammar["json"], str) else json.dumps(grammar["json"])
            if self._leaves_xgrammar(json.loads(schema)):
                return "vLLM's auto backend samples this JSON schema with llguidance, which is not rebuilt here"
            return compiler.compile_json_schema(schema, any_whitespace=not exact, separators=separators)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=not exact, separators=separators)
        if kind == "regex":
            return compiler.compile_regex(grammar["regex"])
        if kind == "choice":
            choices = grammar["choice"] if isinstance(grammar["choice"], list) else json.loads(grammar["choice"])
            return compiler.compile_grammar("root ::= " + " | ".join(f'"{_ebnf_literal(c)}"' for c in choices))
        if kind == "grammar":
            return compiler.compile_grammar(grammar["grammar"])
        if kind == "structural_tag":
            tag = grammar["structural_tag"]
            spec = json.loads(tag) if isinstance(tag, str) else tag
            if "structures" in spec:  # the older form: begin/schema/end items and their triggers
                items = [
                    self._xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                    for s in spec["structures"]
                ]
                return compiler.compile_structural_tag(items, spec["triggers"])
            return compiler.compile_structural_tag(tag if isinstance(tag, str) else json.dumps(tag))
        return f"no grammar kind this trainer rebuilds in {sorted(grammar)}"


def eos_token_ids(model_dir: Path, tokenizer: Any) -> list[int]:
    """The ids vLLM adds to every request's stop ids: the tokenizer's end of sequence and the
    ``eos_token_id`` (an int or a list) of the model's ``generation_config.json``."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    path = model_dir / "generation_config.json"
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else [e for e in eos or [] if isinstance(e, int)])
    return sorted(ids)


def masks_for(
    model_dir: Path, tokenizer: Any, vocab_size: int, *, disable_any_whitespace: bool = False
) -> GrammarMasks | None:
    """The trainer's mask rebuilder, or None (logged) where xgrammar or vLLM is not installed (the
    trainer image): constrained calls are then kept as context only, counted in
    ``data/calls_constrained_unmasked``."""
    try:
        eos = eos_token_ids(model_dir, tokenizer)
        return GrammarMasks(tokenizer, vocab_size, eos, disable_any_whitespace=disable_any_whitespace)
    except ImportError as exc:
        log.warning("grammar masks need xgrammar and vLLM (%s): grammar-constrained calls will be context only", exc)
        return None


def unmasked(vocab_size: int) -> Callable[[dict[str, Any] | None, Sequence[int], Sequence[int]], Tensor]:
    """A masker that allows every token (``grammar_mask: false``): constrained calls scored as if
    sampled without their grammar, the rule before issue 28, kept for ablations."""

    def everything(grammar: dict[str, Any] | None, completion: Sequence[int], stop_ids: Sequence[int]) -> Tensor:
        return torch.full((len(completion), words(vocab_size)), -1, dtype=torch.int32)

    return everything
