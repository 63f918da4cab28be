"""The policy on SmolLM2-135M: packed log-probs equal plain ones, and a real GRPO step moves them the right way."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.trainer.samples import chat_sample
from trainer.checkpoint import Checkpoints, CheckpointState
from trainer.config import ConfigError, TrainerConfig
from trainer.data import Sample
from trainer.learner import Learner
from trainer.lora import ATTENTION, LoraPolicy, PackingError, check_logit_head, packed_sdpa
from trainer.packing import collate

NAN = float("nan")


@pytest.fixture(scope="module")
def policy(vllm_model_dir: str) -> Iterator[LoraPolicy]:
    yield LoraPolicy(
        TrainerConfig(
            model=vllm_model_dir, learning_rate=1e-3, micro_batch_tokens=512, max_seq_len=512, logprob_chunk_rows=7
        )
    )


def sequence_logprobs(policy: LoraPolicy, samples: list[Sample], *, reference: bool = False) -> list[float]:
    with torch.no_grad():
        mb = collate(samples)
        table = mb.table(policy.logprobs(mb, reference=reference)[0])
    return (table * mb.mask).sum(-1).tolist()


def test_packed_logprobs_match_a_plain_forward_per_sample(policy: LoraPolicy) -> None:
    samples = [
        chat_sample(policy, "What is 2+3?", "5", 1.0),
        chat_sample(policy, "Name a colour.", "Blue, like the sky.", -1.0, temperature=0.7),
    ]
    mb = collate(samples)
    with torch.no_grad():
        packed = mb.table(policy.logprobs(mb)[0])
        for b, sample in enumerate(samples):
            ids = torch.tensor([sample.input_ids])
            logits = policy.model(input_ids=ids).logits[0, :-1].float()  # full vocabulary, one sample alone
            logits = logits / torch.tensor(sample.temperatures[1:])[:, None]
            plain = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None]).squeeze(1)
            wanted = plain[torch.tensor(sample.loss_mask[1:], dtype=torch.bool)]
            assert packed[b, : len(wanted)].tolist() == pytest.approx(wanted.tolist(), abs=2e-2)
            assert (packed[b, : len(wanted)] - wanted).abs().mean() < 5e-3


def test_gradient_checkpointing_gives_the_same_loss_and_gradients_on_packed_samples(vllm_model_dir: str) -> None:
    """Activation checkpointing (issue 33) recomputes each layer in the backward pass: the log-probs and
    the LoRA gradients of two packed samples must not change (float32, the real model), and the layers
    must really be checkpointed (saved activations are what it removes)."""

    def grads(checkpointing: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
        torch.manual_seed(0)
        config = TrainerConfig(model=vllm_model_dir, dtype="float32", lora_r=8, gradient_checkpointing=checkpointing)
        policy = LoraPolicy(config)
        with torch.no_grad():  # a non-zero adapter, so the LoRA A matrices get gradients too
            for param in policy.parameters():
                param.add_(torch.randn_like(param) * 0.01)
        samples = [
            chat_sample(policy, "What is 2+3?", "5, because two and three make five.", 1.0),
            chat_sample(policy, "Name a colour.", "Blue, like the sky.", -1.0),
        ]
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            out = policy.logprobs(collate(samples))
        out.logps.sum().backward()
        flat = torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])
        return out.logps.detach(), flat, sum(saved)

    plain_logps, plain_grads, plain_saved = grads(False)
    checked_logps, checked_grads, checked_saved = grads(True)
    torch.testing.assert_close(checked_logps, plain_logps, atol=1e-6, rtol=0)
    torch.testing.assert_close(checked_grads, plain_grads, atol=1e-7, rtol=1e-5)
    assert checked_saved < plain_saved / 3  # the layers' activations are no longer kept for backward


def test_a_real_step_raises_positive_completions_relative_to_negative(policy: LoraPolicy) -> None:
    good = chat_sample(policy, "What is 2+3?", "2 + 3 = 5", advantage=1.0)
    bad = chat_sample(policy, "What is 2+3?", "2 + 3 = 7", advantage=-1.0)
    before = sequence_logprobs(policy, [good, bad])
    for sample, logp in zip((good, bad), before, strict=True):  # engine log-probs = the trainer's: weights ~1
        sample.behaviour_logprobs = [NAN if not m else logp / sum(sample.loss_mask) for m in sample.loss_mask]
    adapter_before = {k: v.clone() for k, v in policy.adapter_state().items()}

    stats = Learner(policy, policy.config).step([good, bad])

    after = sequence_logprobs(policy, [good, bad])
    changed = [k for k, v in policy.adapter_state().items() if not torch.equal(v, adapter_before[k])]
    # B starts at zero, so the first step moves every B (A's gradient is B-weighted: zero on step one):
    # one per adapted projection (seven in each layer)
    config = policy.model.config
    assert changed == [k for k in adapter_before if "lora_B" in k] and len(changed) == 7 * config.num_hidden_layers
    assert stats.grad_norm > 0 and stats.loss_tokens == sum(good.loss_mask) + sum(bad.loss_mask)
    assert (after[0] - before[0]) - (after[1] - before[1]) > 0.05, (before, after)
    # the reference policy (adapter disabled) is still the base model, where the zero-initialised adapter started
    assert sequence_logprobs(policy, [good, bad], reference=True) == pytest.approx(before, abs=1e-3)


def test_checkpoint_round_trip_restores_the_adapter_and_optimizer(policy: LoraPolicy, tmp_path: Path) -> None:
    learner = Learner(policy, dataclasses.replace(policy.config, beta=0.1))  # with the KL term to the base model
    pair = [chat_sample(policy, "Say hi.", "Hi!", advantage=1.0), chat_sample(policy, "Say hi.", "No.", advantage=-1.0)]
    learner.step(pair)
    checkpoints = Checkpoints(tmp_path, keep=1)
    checkpoints.save(
        adapter=policy.adapter_state(),
        optimizer=learner.optimizer.state_dict(),
        state=CheckpointState(step=7, version_base=2, leases=[]),
    )
    saved = sequence_logprobs(policy, pair)

    assert learner.step(pair).kl > 0  # move on past the checkpoint (the adapter has moved: KL > 0) ...
    assert sequence_logprobs(policy, pair) != pytest.approx(saved, abs=1e-4)
    directory, state = checkpoints.latest() or (tmp_path, None)
    adapter, optimizer = checkpoints.load_tensors(directory)
    policy.load_adapter_state(adapter)  # ... and back
    restored = Learner(policy, policy.config)
    restored.optimizer.load_state_dict(optimizer)
    assert state is not None and (state.step, state.version_base) == (7, 2)
    assert sequence_logprobs(policy, pair) == pytest.approx(saved, abs=1e-6)
    assert int(restored.optimizer.state_dict()["state"][0]["step"]) == 1
    assert sorted(p.name for p in tmp_path.joinpath("checkpoints").iterdir()) == ["LATEST", "step-00000007"]


# -- loud failures instead of silent fallbacks -----------------------------------------------------------


def test_packed_samples_fail_loudly_when_their_boundaries_stop_arriving(
    policy: LoraPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If ``cu_seq_lens_q`` no longer reached the attention function, packed samples would attend
    across each other: that must be an error, not a quietly wrong log-prob."""
    pair = [chat_sample(policy, "What is 2+3?", "5", 1.0), chat_sample(policy, "Name a colour.", "Blue.", -1.0)]
    backbone = policy.backbone

    def dropping_the_boundaries(**kwargs: object) -> object:
        kwargs.pop("cu_seq_lens_q")
        return backbone(**kwargs)

    monkeypatch.setattr(policy, "backbone", dropping_the_boundaries)
    with torch.no_grad():
        with pytest.raises(PackingError, match="2 samples are packed in one row but the attention function got no"):
            policy.logprobs(collate(pair))
        policy.logprobs(collate(pair[:1]))  # one sample alone has nothing to attend across


def test_packed_samples_fail_loudly_when_the_model_bypasses_the_packed_attention(policy: LoraPolicy) -> None:
    pair = [chat_sample(policy, "What is 2+3?", "5", 1.0), chat_sample(policy, "Name a colour.", "Blue.", -1.0)]
    base = policy.model.get_base_model()
    base.set_attn_implementation("sdpa")
    try:
        with torch.no_grad(), pytest.raises(PackingError, match="no attention call went through 'flywheel_packed'"):
            policy.logprobs(collate(pair))
    finally:
        base.set_attn_implementation(ATTENTION)
    with torch.no_grad():
        policy.logprobs(collate(pair))


def test_attention_features_the_packed_path_lacks_are_refused() -> None:
    q = torch.zeros(1, 2, 6, 4)
    bounds = torch.tensor([0, 2, 6])
    with pytest.raises(PackingError, match="soft-capping"):
        packed_sdpa(torch.nn.Module(), q, q, q, None, cu_seq_lens_q=bounds, softcap=50.0)
    with pytest.raises(PackingError, match="sliding window"):
        packed_sdpa(torch.nn.Module(), q, q, q, None, cu_seq_lens_q=bounds, sliding_window=3)
    out, _ = packed_sdpa(torch.nn.Module(), q, q, q, None, cu_seq_lens_q=bounds, sliding_window=4, softcap=None)
    assert out.shape == (1, 6, 2, 4)


def tiny(config_cls: str, **fields: object) -> torch.nn.Module:
    """A randomly initialised two-layer model of that architecture, built in memory (no download)."""
    import transformers

    config = getattr(transformers, config_cls)(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        **fields,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_llama_like_heads_pass_the_logit_check() -> None:
    for model in (tiny("LlamaConfig"), tiny("Qwen2Config"), tiny("LlamaConfig", tie_word_embeddings=True)):
        check_logit_head(model, model.model)


@pytest.mark.parametrize(
    ("config_cls", "fields", "named"),
    [
        ("Gemma2Config", {}, "final_logit_softcapping=30.0"),
        ("Gemma2Config", {"final_logit_softcapping": None}, "attn_logit_softcapping=50.0"),
        ("CohereConfig", {}, "logit_scale=0.0625"),
        ("GraniteConfig", {"logits_scaling": 8.0}, "logits_scaling=8.0"),
    ],
)
def test_heads_that_transform_logits_are_refused_by_name(
    config_cls: str, fields: dict[str, object], named: str
) -> None:
    model = tiny(config_cls, **fields)
    kind = model.config.model_type
    with pytest.raises(ConfigError, match=rf"model type '{kind}' sets {named}: .*not supported"):
        check_logit_head(model, model.model)


def test_an_lm_head_bias_or_an_unnamed_transform_is_refused() -> None:
    model = tiny("LlamaConfig")
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(64))
    with pytest.raises(ConfigError, match="bias on lm_head"):
        check_logit_head(model, model.model)
    model = tiny("LlamaConfig")
    model.lm_head.register_forward_hook(lambda _m, _i, out: out * 2.0)  # no config field says so
    with pytest.raises(ConfigError, match="not its hidden states times the output embedding"):
        check_logit_head(model, model.model)


def test_policy_refuses_a_soft_capped_model_at_start(tmp_path: Path, vllm_model_dir: str) -> None:
    import shutil

    model = tiny("Gemma2Config")
    model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(vllm_model_dir) / name).exists():
            shutil.copy(Path(vllm_model_dir) / name, tmp_path / name)
    with pytest.raises(ConfigError, match="model type 'gemma2' sets final_logit_softcapping=30.0"):
        LoraPolicy(TrainerConfig(model=str(tmp_path)))


def test_adapter_inputs_kept_in_bfloat16_under_autocast_change_no_logit_or_gradient() -> None:
    """On a GPU the policy stops peft casting LoRA inputs to float32 (``_keep_adapter_inputs``):
    under autocast the cast only round-trips bfloat16 through float32, so the logits and the
    adapter's gradients must come out bit for bit the same. Checked with the CPU's autocast."""
    from peft import LoraConfig, get_peft_model

    from trainer.lora import _keep_adapter_inputs

    def run(keep: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        torch.manual_seed(0)
        base = tiny("Qwen2Config").to(torch.bfloat16)
        target = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=target, init_lora_weights=False))
        assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if p.requires_grad)
        if keep:
            assert _keep_adapter_inputs(model) == 2 * len(target)
        seen: set[torch.dtype] = set()
        for name, module in model.named_modules():
            if name.endswith("lora_A.default"):
                module.register_forward_pre_hook(lambda _m, args: seen.add(args[0].dtype))
        ids = torch.randint(0, 64, (1, 12))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids).logits
        logits.float().logsumexp(-1).sum().backward()
        assert seen == {torch.bfloat16 if keep else torch.float32}  # what the adapter's matmul is handed
        return logits.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]

    cast_logits, cast_grads = run(keep=False)
    kept_logits, kept_grads = run(keep=True)
    assert torch.equal(cast_logits, kept_logits)
    assert len(cast_grads) == len(kept_grads) == 28
    for a, b in zip(cast_grads, kept_grads, strict=True):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)
