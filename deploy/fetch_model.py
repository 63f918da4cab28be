"""Download a Hugging Face model once into a directory that vLLM and the trainer both read.

The compose ``model`` service runs this in the vLLM image (which ships ``huggingface_hub``):
``python3 fetch_model.py Qwen/Qwen2.5-1.5B-Instruct /models/Qwen/Qwen2.5-1.5B-Instruct``. vLLM
serves that directory and the trainer trains on it, so both see the same weights and tokenizer,
and the adapters the trainer writes name a base model path that exists in both containers.

A marker file is written last: an interrupted download is resumed on the next start, and a
finished one is never fetched again (the stack restarts without the network). ``HF_TOKEN`` is
read from the environment for gated models.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MARKER = ".flywheel-complete"


def fetch(repo_id: str, target: Path) -> Path:
    done = target / MARKER
    if done.exists() and json.loads(done.read_text()).get("repo_id") == repo_id:
        print(f"fetch_model: {repo_id} already in {target}", flush=True)
        return target
    if target.exists() and any(target.iterdir()) and not (target / ".cache").exists():
        raise SystemExit(f"fetch_model: {target} holds files not fetched from {repo_id}; remove them first")
    from huggingface_hub import snapshot_download

    target.mkdir(parents=True, exist_ok=True)
    # Weights as safetensors only: vLLM and transformers both load them; *.bin / *.pth would double the download.
    snapshot_download(
        repo_id=repo_id,
        local_dir=str(target),
        allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"],
    )
    if not (target / "config.json").is_file() or not any(target.glob("*.safetensors")):
        raise SystemExit(f"fetch_model: {repo_id} has no config.json or safetensors weights")
    done.write_text(json.dumps({"repo_id": repo_id}) + "\n")
    print(f"fetch_model: {repo_id} ready in {target}", flush=True)
    return target


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: fetch_model.py <hf-repo-id> <directory>")
    fetch(sys.argv[1], Path(sys.argv[2]))
