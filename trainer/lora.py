"""The policy: a transformers causal LM with a peft LoRA adapter, run on packed micro-batches.

Packing without padding needs attention that stays inside each sample. transformers lets a model
use a registered attention function; ``packed_sdpa`` runs PyTorch SDPA causally on each sample's
slice of the packed row (boundaries from ``cu_seq_lens_q``), so no (L x L) block mask is built
and no attention is computed across samples. Positions restart at 0 per sample (RoPE). Should
the boundaries stop arriving (a transformers release that no longer forwards ``cu_seq_lens_q`` to
the attention function, or a model that does not use it), samples would silently attend across
each other: a packed forward therefore counts the attention calls that saw them and fails loudly.
Attention features this function does not implement (soft-capping, sinks, a sliding window shorter
than a sample) fail the same way instead of being ignored.

A micro-batch packed as a prefix tree (``trainer/packing.py``, ``shared_prefix``) has segments
instead of samples: ``cu_seq_lens_q`` holds their bounds and, as a host attribute, their parents
(``HOST_PARENTS``). A segment's queries attend to every key of its ancestors and causally to its
own keys (an explicit boolean mask: the lower-right causal one; grouped key/value heads expanded
first, since SDPA with a mask and ``enable_gqa`` takes the math kernel on CUDA), which is what the
same tokens see in a sample packed whole; a root segment takes the causal path above, unchanged. The keys and
values of a shared segment get the gradient of every branch below it through the same graph. A tree
whose parents do not arrive fails loudly as well: its branches would not see their prefix.

Log-probs come from the backbone's hidden states through ``selected_logprobs``: only rows that
predict a loss token go through the vocabulary projection, a chunk at a time. The reference
policy for the KL term is the same model with the adapter disabled (no second model in memory).
That skips whatever the model's own head does to its logits (soft-capping, scaling, a bias): such
models are refused at start (``check_logit_head``) until the log-prob path applies the same transform.

Under ``parallelism: fsdp`` with several ranks, the model is sharded with FSDP2 after LoRA is
attached (``trainer.distributed.shard_model``): one group per decoder layer, and the root is
``WholeForward``, the whole packed forward to log-probs, so the output embedding is used inside
the root's forward, where FSDP has gathered it. The base stays frozen; the LoRA weights are sharded
DTensors the optimizer steps shard by shard. The whole adapter is gathered onto every rank after
each update (``gather``): what ``adapter_state`` returns, checkpoints and publishes.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from trainer import memory
from trainer.config import ConfigError, TrainerConfig, cpu_has_native_bf16
from trainer.distributed import gathered, shard_like, shard_model
from trainer.logprobs import LogProbs, Truncation, selected_logprobs
from trainer.packing import MicroBatch

Tensor = torch.Tensor
ATTENTION = "flywheel_packed"


class PackingError(RuntimeError):
    """Packed samples would attend across each other, or attention would differ from the model's."""


class _Packed(threading.local):
    """This thread's packed forward: how many samples it packs, how many attention calls saw their bounds."""

    samples = 0
    bounded_calls = 0
    tree = False


_packed = _Packed()
HOST_BOUNDS = "flywheel_host_bounds"
"""The attribute of a device ``cu_seq_lens_q`` that holds its bounds as a host list (``LoraPolicy``
sets it; gradient checkpointing's recompute passes the same tensor again, on autograd's thread)."""
HOST_PARENTS = "flywheel_host_parents"
"""The attribute of ``cu_seq_lens_q`` that holds, for a prefix tree, each segment's parent segment as
a host list (-1: a root); absent when every segment is a whole sample. Set and carried as ``HOST_BOUNDS``."""


def packed_sdpa(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Causal SDPA per packed sample (or per prefix-tree segment, over its ancestors' keys too).
    query (1, heads, L, D); key/value (1, kv_heads, L, D)."""
    parents: list[int] | None = None
    if cu_seq_lens_q is None:
        if _packed.samples > 1:
            raise PackingError(
                f"{_packed.samples} samples are packed in one row but the attention function got no "
                "cu_seq_lens_q: they would attend across each other (does this transformers release "
                "still pass the sequence-length kwargs through to the attention function?)"
            )
        bounds = [0, query.shape[2]]
    else:
        # read on the host: ``.tolist()`` of a GPU tensor would stall the device once per layer
        bounds = getattr(cu_seq_lens_q, HOST_BOUNDS, None) or cu_seq_lens_q.tolist()
        parents = getattr(cu_seq_lens_q, HOST_PARENTS, None)
        _packed.bounded_calls += 1
    if _packed.tree and parents is None:
        raise PackingError(
            "the micro-batch is packed as a prefix tree but the attention function got no segment parents "
            f"({HOST_PARENTS!r} on cu_seq_lens_q): its branches would not see their shared prefix"
        )
    spans = list(zip(bounds[:-1], bounds[1:], strict=True))
    chains = _ancestors(parents) if parents is not None and any(p >= 0 for p in parents) else None
    _refuse_unsupported(kwargs, _seen(spans, chains))
    gqa = key.shape[1] != query.shape[1]
    outs: list[Tensor] = []
    for g, (s, e) in enumerate(spans):
        if chains is None or not chains[g]:
            outs.append(
                F.scaled_dot_product_attention(
                    query[:, :, s:e],
                    key[:, :, s:e],
                    value[:, :, s:e],
                    is_causal=True,
                    dropout_p=dropout,
                    scale=scaling,
                    enable_gqa=gqa,
                )
            )
            continue
        keys = _merged([spans[a] for a in chains[g]] + [(s, e)])  # the ancestors root first, then its own
        seen = sum(b - a for a, b in keys) - (e - s)
        mask = torch.ones(e - s, seen + e - s, dtype=torch.bool, device=query.device).tril(seen)
        k, v = _gather(key, keys), _gather(value, keys)
        if gqa:  # a mask with enable_gqa falls back to the math kernel on CUDA (O(q x k) scores): expand instead
            groups = query.shape[1] // key.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        outs.append(
            F.scaled_dot_product_attention(
                query[:, :, s:e], k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=False
            )
        )
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # (1, heads, L, D)
    return out.transpose(1, 2).contiguous(), None


def _ancestors(parents: list[int]) -> list[list[int]]:
    """Each segment's ancestor segments, root first (a parent comes before its children)."""
    chains: list[list[int]] = []
    for g, p in enumerate(parents):
        if not -1 <= p < g:
            raise PackingError(f"segment {g} has parent {p}: a prefix tree's parent must come before it")
        chains.append([] if p < 0 else [*chains[p], p])
    return chains


def _seen(spans: list[tuple[int, int]], chains: list[list[int]] | None) -> list[int]:
    """The keys each segment's last query sees (its sample's length so far)."""
    own = [e - s for s, e in spans]
    if chains is None:
        return own
    return [n + sum(own[a] for a in chain) for n, chain in zip(own, chains, strict=True)]


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent spans joined (depth-first, a first child follows its parent in the row)."""
    out = [spans[0]]
    for s, e in spans[1:]:
        if s == out[-1][1]:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def _gather(x: Tensor, spans: list[tuple[int, int]]) -> Tensor:
    """The spans of (1, heads, L, D) ``x`` along L, in order (a view where there is one)."""
    parts = [x[:, :, s:e] for s, e in spans]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def _refuse_unsupported(kwargs: dict[str, Any], seen: list[int]) -> None:
    """What the model asks of its attention that plain causal SDPA would silently not do."""
    if kwargs.get("softcap") is not None:
        raise PackingError(
            f"attention logit soft-capping ({kwargs['softcap']}) is not supported by the packed "
            "attention (attn_logit_softcapping)"
        )
    if kwargs.get("s_aux") is not None:
        raise PackingError("attention sinks (s_aux) are not supported by the packed attention")
    if kwargs.get("is_causal") is False:
        raise PackingError("the model asked for non-causal attention; the packed attention is causal only")
    window = kwargs.get("sliding_window")
    if window is not None and max(seen, default=0) > window:
        raise PackingError(
            f"a sample is longer than the sliding window ({window} tokens), which the packed "
            "attention does not apply; lower max_seq_len to the window"
        )


class PackedForward:
    """Count, for one packed forward of ``samples`` samples, the attention calls that saw the boundaries
    (``tree``: the row is a prefix tree, whose attention calls must also see the segments' parents)."""

    def __init__(self, samples: int, tree: bool = False) -> None:
        self.samples = samples
        self.tree = tree

    def __enter__(self) -> PackedForward:
        _packed.samples, _packed.bounded_calls, _packed.tree = self.samples, 0, self.tree
        return self

    def __exit__(self, *exc: object) -> None:
        self.bounded_calls = _packed.bounded_calls
        _packed.samples, _packed.bounded_calls, _packed.tree = 0, 0, False

    def check(self) -> None:
        """After the forward: a multi-sample row must have gone through ``packed_sdpa`` with its boundaries."""
        if self.samples > 1 and self.bounded_calls == 0:
            raise PackingError(
                f"{self.samples} samples were packed in one row but no attention call went through "
                f"{ATTENTION!r} with their boundaries: the model does not use the packed attention "
                "(attn_implementation changed?), so the samples attended across each other"
            )


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(ATTENTION, packed_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, lambda *args, **kwargs: None)  # boundaries replace the mask


# Config fields with which a model's head transforms the logits after the output projection, and the
# value that means "no transform". The log-prob path (hidden @ output embedding) skips the head, so
# its log-probs would not be the policy vLLM samples from.
LOGIT_TRANSFORMS: dict[str, float | None] = {
    "final_logit_softcapping": None,  # Gemma 2/3: cap * tanh(logits / cap)
    "attn_logit_softcapping": None,  # Gemma 2: the same inside attention, which packed_sdpa does not do
    "logit_scale": 1.0,  # Cohere: logits * logit_scale
    "logits_scaling": 1.0,  # Granite: logits / logits_scaling
    "output_multiplier": 1.0,
    "output_multiplier_scale": 1.0,  # Grok-1
    "lm_head_multiplier": 1.0,  # Falcon-H1
    "mup_width_multiplier": 1.0,  # Phi-3-small (muP): logits / mup_width_multiplier
}


def check_logit_head(model: torch.nn.Module, backbone: torch.nn.Module) -> None:
    """Refuse a model whose logits are not ``hidden @ output_embedding.T``: first by the config field
    that says so, then by measuring one short forward (a transform no field names)."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", type(model).__name__)
    configs = [config] if config is not None else []
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else None
    if text is not None and text is not config:
        configs.append(text)
    for cfg in configs:
        for name, identity in LOGIT_TRANSFORMS.items():
            value = getattr(cfg, name, identity)
            if value != identity and not (identity is not None and value is None):
                raise ConfigError(
                    f"model type {kind!r} sets {name}={value!r}: its logits are transformed after the "
                    "output projection, which the trainer's log-prob path does not do yet (not "
                    "supported); its log-probs would not be the ones vLLM samples from"
                )
        base, width = getattr(cfg, "dim_model_base", None), getattr(cfg, "hidden_size", None)
        if base and width and width != base:  # MiniCPM (muP): logits of hidden / (hidden_size / dim_model_base)
            raise ConfigError(
                f"model type {kind!r} scales its logits by dim_model_base/hidden_size ({base}/{width}), "
                "which the trainer's log-prob path does not do yet (not supported)"
            )
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise ConfigError(f"model type {kind!r} has no output embedding the log-prob path can use")
    if getattr(head, "bias", None) is not None:
        raise ConfigError(
            f"model type {kind!r} has a bias on lm_head, which the trainer's log-prob path does not "
            "add yet (not supported)"
        )
    ids = torch.arange(1, 9, device=head.weight.device)[None] % head.weight.shape[0]
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits.float()
        wanted = F.linear(backbone(input_ids=ids, use_cache=False).last_hidden_state, head.weight).float()
    if logits.shape != wanted.shape or (logits - wanted).abs().max() > 1e-2 * (1 + wanted.abs().max()):
        raise ConfigError(
            f"model type {kind!r}: its logits are not its hidden states times the output embedding "
            "(the head transforms them), which the trainer's log-prob path does not do (not supported)"
        )


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "float32":
        return torch.float32
    if name == "bfloat16" or device != "cpu":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


class WholeForward(torch.nn.Module):
    """The peft model, with the policy's whole packed forward (ids to log-probs) as its forward.

    FSDP's root: the output embedding (often tied to the input embedding) is used inside the root's
    forward, where FSDP has gathered it, with the embeddings and the final norm; the backbone's own
    forward, called alone, would leave it sharded.
    """

    def __init__(self, model: torch.nn.Module, forward: Callable[..., LogProbs]) -> None:
        super().__init__()
        self.model = model
        self.run = forward

    def forward(self, *args: Any, **kwargs: Any) -> LogProbs:
        return self.run(*args, **kwargs)


class LoraPolicy:
    """The policy being trained: base model + tokenizer + LoRA adapter (the proxy's published versions
    are its saved adapters). ``logprobs`` on a micro-batch is the only compute entry point."""

    def __init__(self, config: TrainerConfig) -> None:
        from transformers import AutoTokenizer

        model_dir = config.model_dir
        if not str(model_dir) or not (model_dir / "config.json").is_file():
            raise ConfigError(
                f"model directory not found or not a Hugging Face model: {str(model_dir)!r}; set "
                "`model:` or FLYWHEEL_MODEL_DIR (`python -m deploy.model path` prints the local SmolLM2)"
            )
        if config.threads:
            torch.set_num_threads(config.threads)
        if config.mmap_threshold_kb is not None and not memory.fix_mmap_threshold(config.mmap_threshold_kb):
            raise RuntimeError("mmap_threshold_kb needs glibc's mallopt, which this C library does not offer")
        torch.manual_seed(config.seed)
        _register_attention()
        self.config = config
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.sharded = (
            config.parallelism == "fsdp"
            and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1
        )
        """FSDP2 over the ranks of the process group (one process never shards: nothing to share)."""
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        model = _peft_model(config, self.dtype)
        self.model = model if self.sharded else model.to(self.device)  # FSDP moves each rank's shards there
        if config.gradient_checkpointing:
            # Non-reentrant checkpointing needs no input that requires grad (the reentrant kind does,
            # which peft's frozen embeddings would not give: peft's enable_input_require_grads).
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.train()
        self.autocast = self.device == "cuda" and self.dtype != torch.float32
        """Mixed precision on a GPU: peft keeps the adapter in float32 (AdamW's updates of a few 1e-5
        would round away in bfloat16), so without autocast every LoRA projection casts its input to
        float32 and multiplies in float32; under autocast the adapter's matmuls run in the base
        dtype, as vLLM's LoRA kernels do, and the weights stay float32 (a step 1.18x faster on an
        H200 at 8k tokens: deploy/README.md, "Measured on one GPU")."""
        if self.autocast:
            _keep_adapter_inputs(self.model)
        backbone = self.model.get_base_model().model
        assert isinstance(backbone, torch.nn.Module)
        self.backbone = backbone
        self.module = WholeForward(self.model, self._forward)
        self._gathered: dict[str, Tensor] = {}
        """Under FSDP: the whole adapter as of the last update or load, on the CPU of every rank."""
        if self.sharded:
            self._gathered = self._peft_state()  # before sharding: the whole adapter, no collective
            shard_model(self.module, _decoder_layers(backbone), self.device)

    @property
    def output_weight(self) -> Tensor:
        """The output embedding (frozen, often tied to the input embedding; a DTensor under FSDP)."""
        weight = self.model.get_output_embeddings().weight
        assert isinstance(weight, Tensor)
        return weight

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return (p for p in self.model.parameters() if p.requires_grad)

    def logprobs(self, mb: MicroBatch, *, reference: bool = False) -> LogProbs:
        """Per-loss-token log-probs (N,) (with grad unless ``reference``), entropies (N,) and ``outside``
        flags (N,), under each token's recorded temperature, top-k, top-p and min-p."""
        if reference:
            with torch.no_grad(), self.model.disable_adapter():
                return self._logprobs(mb)
        return self._logprobs(mb)

    def _logprobs(self, mb: MicroBatch) -> LogProbs:
        device = self.device
        cu_seqlens = mb.cu_seqlens.to(device)
        setattr(cu_seqlens, HOST_BOUNDS, mb.cu_seqlens.tolist())  # packed_sdpa reads them without a sync
        if mb.parents is not None:
            setattr(cu_seqlens, HOST_PARENTS, list(mb.parents))
        out = self.module(  # plain tensors only: FSDP moves a root's tensor inputs to the device
            mb.input_ids.to(device),
            mb.position_ids.to(device),
            cu_seqlens,
            mb.select.to(device),
            mb.targets.to(device),
            mb.temperatures,
            Truncation(top_k=mb.top_k, top_p=mb.top_p, min_p=mb.min_p) if mb.truncated else None,
            mb.allowed,
            samples=len(mb.samples),
            tree=mb.parents is not None,
        )
        return LogProbs(out.logps.cpu(), out.entropy.cpu(), out.outside.cpu())

    def _forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        cu_seq_lens_q: Tensor,
        select: Tensor,
        targets: Tensor,
        temperatures: Tensor,
        truncation: Truncation | None,
        allowed: Tensor | None,
        *,
        samples: int,
        tree: bool = False,
    ) -> LogProbs:
        """``WholeForward``'s forward: the backbone on one packed row (a prefix tree: ``tree``), then the
        selected tokens' log-probs."""
        with (
            PackedForward(samples, tree) as packed,
            torch.autocast(self.device, dtype=self.dtype, enabled=self.autocast),
        ):
            hidden = self.backbone(
                input_ids=input_ids, position_ids=position_ids, cu_seq_lens_q=cu_seq_lens_q, use_cache=False
            ).last_hidden_state
        packed.check()
        selected = hidden[0].index_select(0, select)  # (N, H)
        return selected_logprobs(
            selected,
            self.output_weight,
            targets,
            temperatures,
            rows=self.config.logprob_chunk_rows,
            truncation=truncation,
            allowed=allowed,
        )

    # -- adapter state ---------------------------------------------------------------------------

    def _peft_state(self, state: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        """The adapter in PEFT's names (what vLLM loads), from ``state`` (the model's names) or the model."""
        from peft import get_peft_model_state_dict

        adapter = get_peft_model_state_dict(self.model, state_dict=state)
        return {k: v.detach().cpu().contiguous() for k, v in adapter.items()}

    def gather(self) -> None:
        """Under FSDP: gather the whole adapter onto every rank's CPU, what ``adapter_state`` returns
        from then on. A collective: every rank calls it after each update. Nothing otherwise."""
        if self.sharded:
            trained = {name: p for name, p in self.model.named_parameters() if p.requires_grad}
            self._gathered = self._peft_state(gathered(trained))

    def adapter_state(self) -> dict[str, Tensor]:
        """The whole adapter in PEFT's names, on the CPU (on the CPU without FSDP it shares the weights' storage)."""
        if self.sharded:
            return dict(self._gathered)
        return self._peft_state()

    def load_adapter_state(self, state: dict[str, Tensor]) -> None:
        """Load a whole adapter (PEFT's names). Under FSDP each rank cuts its own shards out of it (every
        rank holds ``state``): nothing is sent, so any rank may load alone."""
        from peft import set_peft_model_state_dict

        like = next(self.parameters())  # under FSDP every adapter weight is sharded alike: dim 0 over the ranks
        local = {k: shard_like(v, like) for k, v in state.items()} if self.sharded else state
        unexpected = getattr(set_peft_model_state_dict(self.model, local), "unexpected_keys", [])
        if unexpected:
            raise ValueError(f"checkpoint adapter does not match this LoRA config (unexpected keys {unexpected[:3]})")
        if self.sharded:
            self._gathered = {k: v.detach().to("cpu", like.dtype).clone() for k, v in state.items()}

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


def _peft_model(config: TrainerConfig, dtype: torch.dtype) -> Any:
    """The base model (packed attention, its logit head checked) with a fresh LoRA adapter, on the CPU."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(config.model_dir), dtype=dtype, attn_implementation="sdpa")
    base.set_attn_implementation(ATTENTION)
    check_logit_head(base, base.model)
    lora = LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=list(config.lora_target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(base, lora)
    except ValueError as exc:
        raise ConfigError(f"cannot attach LoRA to {config.model_dir}: {exc} (check lora_target_modules)") from exc


def _keep_adapter_inputs(model: torch.nn.Module) -> int:
    """Stop peft casting each LoRA layer's input to the adapter's float32 (returns the layers changed).

    Under autocast the cast is undone at once: the adapter's matmul runs in bfloat16 anyway, so
    the input goes bfloat16 -> float32 -> bfloat16, two copies of a (tokens, hidden) activation per
    projection and pass, both exact. On an H100 such copies were 17% of a 7B step's GPU time at 8k
    tokens (torch.profiler, ``aten::copy_``). Without autocast the cast is needed (float32 weights
    take no bfloat16 input) and stays."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers: list[Any] = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.cast_input_dtype_enabled = False
    return len(layers)


def _decoder_layers(backbone: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers FSDP shards one group each (``model.layers`` in transformers' decoder-only models)."""
    layers = getattr(backbone, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise ConfigError(
            f"{type(backbone).__name__} has no decoder layers at .layers: parallelism=fsdp does not know "
            "how to shard this model; use parallelism=data"
        )
    return list(layers)
