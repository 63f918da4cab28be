"""The policy: a transformers causal LM with a peft LoRA adapter, run on packed micro-batches.

Packing without padding needs attention that stays inside each sample. transformers lets a model
use a registered attention function; ``packed_sdpa`` runs PyTorch SDPA causally on each sample's
slice of the packed row (boundaries from ``cu_seq_lens_q``), so no (L x L) block mask is built
and no attention is computed across samples. Positions restart at 0 per sample (RoPE).

Log-probs come from the backbone's hidden states through ``selected_logprobs``: only rows that
predict a loss token go through the vocabulary projection, a chunk at a time. The reference
policy for the KL term is the same model with the adapter disabled (no second model in memory).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from trainer.config import ConfigError, TrainerConfig
from trainer.logprobs import selected_logprobs
from trainer.packing import MicroBatch

Tensor = torch.Tensor
ATTENTION = "flywheel_packed"


def packed_sdpa(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                dropout: float = 0.0, scaling: float | None = None, cu_seq_lens_q: Tensor | None = None,
                **_: Any) -> tuple[Tensor, None]:
    """Causal SDPA per packed sample. query (1, heads, L, D); key/value (1, kv_heads, L, D)."""
    bounds = cu_seq_lens_q.tolist() if cu_seq_lens_q is not None else [0, query.shape[2]]
    gqa = key.shape[1] != query.shape[1]
    outs = [F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True,
                                           dropout_p=dropout, scale=scaling, enable_gqa=gqa)
            for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # (1, heads, L, D)
    return out.transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(ATTENTION, packed_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, lambda *args, **kwargs: None)  # boundaries replace the mask


def cpu_has_bf16() -> bool:
    """Native bf16 matmuls (AVX512-BF16 or AMX); elsewhere bf16 on CPU is emulated and slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "float32":
        return torch.float32
    if name == "bfloat16" or device != "cpu":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_bf16() else torch.float32


class Policy:
    """Model + tokenizer + adapter. ``logprobs`` on a micro-batch is the only compute entry point."""

    def __init__(self, config: TrainerConfig) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model_dir = config.model_dir
        if not str(model_dir) or not (model_dir / "config.json").is_file():
            raise ConfigError(f"model directory not found or not a Hugging Face model: {str(model_dir)!r}; set "
                              "`model:` or FLYWHEEL_MODEL_DIR (`python -m deploy.model path` prints the local SmolLM2)")
        if config.threads:
            torch.set_num_threads(config.threads)
        torch.manual_seed(config.seed)
        _register_attention()
        self.config = config
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=self.dtype, attn_implementation="sdpa")
        base.set_attn_implementation(ATTENTION)
        lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                          target_modules=list(config.lora_target_modules), bias="none", task_type="CAUSAL_LM")
        try:
            self.model = get_peft_model(base, lora).to(self.device)
        except ValueError as exc:
            raise ConfigError(f"cannot attach LoRA to {model_dir}: {exc} (check lora_target_modules)") from exc
        self.model.train()
        backbone = self.model.get_base_model().model
        assert isinstance(backbone, torch.nn.Module)
        self.backbone = backbone
        self.output_weight = self.model.get_output_embeddings().weight  # frozen, often tied to the embedding

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return (p for p in self.model.parameters() if p.requires_grad)

    def logprobs(self, mb: MicroBatch, *, reference: bool = False) -> tuple[Tensor, Tensor]:
        """Per-loss-token log-probs (N,) (with grad unless ``reference``) and entropies (N,)."""
        if reference:
            with torch.no_grad(), self.model.disable_adapter():
                return self._logprobs(mb)
        return self._logprobs(mb)

    def _logprobs(self, mb: MicroBatch) -> tuple[Tensor, Tensor]:
        hidden = self.backbone(input_ids=mb.input_ids.to(self.device), position_ids=mb.position_ids.to(self.device),
                               cu_seq_lens_q=mb.cu_seqlens.to(self.device), use_cache=False).last_hidden_state
        selected = hidden[0].index_select(0, mb.select.to(self.device))  # (N, H)
        logps, entropy = selected_logprobs(selected, self.output_weight, mb.targets.to(self.device),
                                           mb.temperatures, rows=self.config.logprob_chunk_rows)
        return logps.cpu(), entropy.cpu()

    # -- adapter state ---------------------------------------------------------------------------

    def adapter_state(self) -> dict[str, Tensor]:
        from peft import get_peft_model_state_dict

        return {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(self.model).items()}

    def load_adapter_state(self, state: dict[str, Tensor]) -> None:
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(self.model, state)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ValueError(f"checkpoint adapter does not match this LoRA config (unexpected keys {unexpected[:3]})")

    def save_adapter(self, directory: Path) -> None:
        """Write ``adapter_model.safetensors`` + ``adapter_config.json`` as vLLM loads them."""
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        save_file(self.adapter_state(), str(directory / "adapter_model.safetensors"))
        peft_config = self.model.peft_config["default"].to_dict()
        peft_config["base_model_name_or_path"] = str(self.config.model_dir)
        for key, value in list(peft_config.items()):
            if isinstance(value, set):
                peft_config[key] = sorted(value)
        (directory / "adapter_config.json").write_text(json.dumps(peft_config, indent=2, default=str))
        for name in ("adapter_model.safetensors", "adapter_config.json"):
            with open(directory / name, "rb") as fh:
                os.fsync(fh.fileno())
