"""Trainer configuration: one frozen dataclass, TRL's names, read from YAML plus ``key=value`` overrides.

Field names follow TRL's ``GRPOConfig`` where one exists (``loss_type``, ``scale_rewards``,
``epsilon``, ``epsilon_high``, ``beta``, ``num_iterations``, ``importance_sampling_level``,
``max_completion_length``, ``vllm_importance_sampling_*``), so a TRL user reads them without a map.
Each field carries one docstring: unit, effect, why the default. Bad values fail at start with a
message that says how to fix them, never mid-training.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from contract.keyfile import key_file_keys
from contract.vocabulary import Abandoned, TrainMode

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
ScaleRewards = Literal["group", "batch", "none"]
ImportanceLevel = Literal["token", "sequence"]
CorrectionMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]

DType = Literal["auto", "bfloat16", "float32"]
TurnCredit = Literal["episode", "discounted"]
Shaping = Literal["gated", "always"]
LongSamples = Literal["split", "truncate"]
AbandonedRule = Literal["workflow", Abandoned]
Parallelism = Literal["data", "fsdp"]

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class ConfigError(ValueError):
    """A configuration the trainer refuses to start with; the message says how to fix it."""


@dataclass(frozen=True)
class TrainerConfig:
    # -- model and LoRA --------------------------------------------------------------------------
    model: str = ""
    """Hugging Face model directory (the one vLLM serves). Empty: ``$FLYWHEEL_MODEL_DIR``
    (``python -m deploy.model path`` prints the converted SmolLM2)."""
    dtype: DType = "auto"
    """Weights dtype. ``auto``: bfloat16 when the CPU has native bf16 (avx512_bf16/AMX) or a GPU
    is used, else float32. LoRA weights and optimizer state stay float32 either way."""
    lora_r: int = 8
    """LoRA rank. Must not exceed the engine's ``--max-lora-rank`` (``max_lora_rank``)."""
    lora_alpha: int = 16
    """LoRA scaling numerator (update scale = alpha / r)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA path. 0 keeps the trainer's log-probs deterministic, so the ratio of
    the first pass is exactly 1 (TRL disables dropout for GRPO for the same reason)."""
    lora_target_modules: tuple[str, ...] = DEFAULT_TARGETS
    """Module names that get adapters; every linear layer of a Llama block by default."""
    max_lora_rank: int = 16
    """The engine's ``--max-lora-rank`` (configs/run-local.yaml ``engine.max_lora_rank``); vLLM
    refuses adapters of higher rank, so a larger ``lora_r`` fails here instead of at publish."""
    threads: int | None = None
    """torch CPU threads; None keeps torch's default (one per core). Next to vLLM on 2 cores use 1:
    two OpenMP threads that must share a core with another busy process spin-wait and run several
    times slower than one thread (measured: 4.9 s vs 18-63 s for one step)."""

    # -- optimisation ------------------------------------------------------------------------------
    learning_rate: float = 5e-5
    """AdamW learning rate for the LoRA weights."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1: decay rate of the running mean of the gradient."""
    adam_beta2: float = 0.999
    """AdamW beta2: decay rate of the running mean of the squared gradient."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm (0 disables)."""
    num_iterations: int = 1
    """Optimizer steps per batch (TRL's mu). With 1, the 'old' policy is the current one, so its
    log-probs come free from the same forward pass (detached): no second pass."""
    seed: int = 0
    """torch seed (LoRA initialisation)."""

    # -- loss --------------------------------------------------------------------------------------
    loss_type: LossType = "dapo"
    """Token aggregation, as TRL's GRPOTrainer defines it: grpo = mean of per-sequence means
    (Shao et al. 2024, DeepSeekMath); bnpo = per micro-batch token mean; dr_grpo = sum /
    (sequences * max_completion_length) (Liu et al. 2025, "Understanding R1-Zero-Like Training");
    dapo = sum / tokens of the whole step (Yu et al. 2025, DAPO; TRL's default: no length bias).
    A "sequence" is a group member under ``normalize_per_episode``."""
    scale_rewards: ScaleRewards = "group"
    """Advantage scaling: divide by the group's reward std (group), the step's (batch: the std of
    every reward of the step, equal-reward groups included, as TRL), or not at all (none, Dr. GRPO)."""
    turn_credit: TurnCredit = "episode"
    """How multi-turn episodes get credit. ``episode``: every trained token of an episode gets its
    group-relative advantage (GRPO; per-call rewards are ignored and counted). ``discounted``: turn
    t gets the return G_t = c_t + turn_discount * G_{t+1} (c_t its ``call_rewards`` entry, the
    episode reward arriving at the last turn), normalised over all turns of the group's episodes:
    AReaL's turn-level ``turn_discount`` credit for agent episodes."""
    turn_discount: float = 1.0
    """gamma of ``turn_credit: discounted``: 1 gives every turn the sum of what follows it; AReaL's
    agent examples use values around 0.9 to credit turns near the outcome more."""
    shaping: Shaping = "gated"
    """How shaping (per-call rewards, and the discount's spread of one reward over turns) combines with
    the outcome (the episode reward) under ``turn_credit: discounted``. ``gated``: a group whose
    members' episode rewards are all equal is skipped (``data/groups_skipped_shaping_only``) even if
    their per-turn returns differ, so shaping only refines credit among the turns and members of a
    group whose outcomes differ and is never the only signal. ``always``: per-turn returns are compared
    whatever the outcomes (before issue 44), so a group that failed alike still trains on its call
    rewards: the calc agent collapsed that way (success 0 on every episode from step 30 while every
    group trained on shaping alone). Shaping that provably leaves the optimal policy unchanged is
    potential-based (Ng, Harada & Russell 1999); ``call_rewards`` are not, and ungated they are a
    target of their own. No effect under ``turn_credit: episode``."""
    normalize_per_episode: bool = True
    """Every episode (group member) weighs the same in the loss, however many samples its calls
    break into (a chat template that re-renders earlier turns splits an episode into k samples;
    without this, ``grpo`` and ``dr_grpo`` count it k times: rLLM PR #512). The split count is
    reported as ``data/episodes_split``."""
    abandoned: AbandonedRule = "workflow"
    """Abandoned episodes (crash, timeout, context overflow): ``penalize`` makes them group members
    with ``abandoned_reward`` (failure is penalised), ``skip`` leaves them out of the baseline,
    ``workflow`` follows each group's workflow (its ``abandoned`` metadata: agent workflows
    penalize, math skips). Episodes the proxy abandoned at their deadline are always skipped: their
    workflow never reported, which is not the agent's doing."""
    abandoned_reward: float = 0.0
    """The reward a penalized abandoned episode counts with (the workflows' failure reward is 0)."""
    epsilon: float = 0.2
    """Lower clip: the ratio is clipped to [1 - epsilon, 1 + epsilon_high]."""
    epsilon_high: float | None = None
    """Upper clip; None means ``epsilon``. DAPO recommends 0.28 (clip-higher)."""
    beta: float = 0.0
    """KL coefficient against the reference (the base model: adapter disabled). 0 skips the
    reference forward pass entirely."""
    importance_sampling_level: ImportanceLevel = "token"
    """Policy ratio per token, or one per sequence from the mean log-ratio (GSPO)."""
    vllm_importance_sampling_correction: bool = True
    """Weight each token by pi_trainer_old / pi_engine (truncated importance sampling): corrects
    the engine/trainer numeric mismatch and, in async mode, the staleness of the samples."""
    vllm_importance_sampling_mode: CorrectionMode = "token_truncate"
    """``*_truncate`` caps the weight at the cap, ``*_mask`` zeroes weights above it; ``sequence_*``
    uses one weight per sample (product over its tokens). Token truncation keeps long multi-turn
    samples usable, where a sequence product almost always crosses the cap."""
    vllm_importance_sampling_cap: float = 3.0
    """Cap C on the importance weight (TRL's default)."""
    engine_logp_tolerance: float = 0.1
    """|trainer - engine| log-prob (nats) above which a token counts as mismatched in
    ``policy/engine_logp_frac_above`` (the trainer under the version that sampled it vs vLLM)."""
    engine_logp_check_samples: int = 8
    """Samples per step from older policy versions whose tokens are re-scored under the adapter
    that served them (one no-grad pass per version), so the engine mismatch is measured on stale
    samples too; tokens of the current version are compared for free. 0 checks current-version
    tokens only."""
    grammar_mask: bool = True
    """Score grammar-constrained tokens under the token mask the engine sampled them under, rebuilt
    from the grammar the proxy recorded (``trainer/grammar.py``), so their log-probs equal vLLM's.
    False scores them unmasked, as before issue 28, where the calc agent collapsed after ~20 steps:
    for ablations only."""
    grammar_disable_any_whitespace: bool = False
    """Must equal ``disable_any_whitespace`` of the engine's ``--structured-outputs-config`` (vLLM's
    default False, which Flywheel's launcher keeps): JSON grammars are rebuilt with free whitespace
    unless it is set. vLLM 0.32 reads only the server's value, never the request's field, so the
    trainer does the same (``trainer/grammar.py``)."""
    max_completion_length: int = 1024
    """Dr. GRPO's constant normaliser (tokens): dr_grpo divides the summed loss by
    sequences * this. Used by no other loss type."""

    # -- data ----------------------------------------------------------------------------------------
    groups_per_step: int = 4
    """Completed groups per optimizer step; the trainer waits up to ``batch_wait_s`` to fill it."""
    batch_wait_s: float = 30.0
    """After the first group of a step arrives, wait at most this long for the rest, then train
    on what is there (s)."""
    micro_batch_tokens: int = 2048
    """Token budget of one packed forward/backward pass (micro-batch); samples are packed into
    micro-batches without padding and gradients accumulate across them."""
    max_seq_len: int = 2048
    """The longest sample (tokens) a pass holds; longer ones are split or truncated (``long_samples``)."""
    long_samples: LongSamples = "split"
    """Samples longer than ``max_seq_len``: ``split`` at turn boundaries into continuation samples (a
    later one is the sequence's last ``max_seq_len`` tokens up to its last turn, the earlier tokens
    context only), so a long agent episode keeps its loss on every turn (``data/samples_split``,
    ``data/tokens_context_cut``: those tokens are scored without the earliest context); ``truncate``
    cuts at ``max_seq_len``, and everything past the cut, trained completions included, loses its
    loss (``data/samples_truncated``; as before issue 33). A turn longer than ``max_seq_len`` by
    itself is truncated either way (``trainer/merge.py``)."""
    retokenize_inexact: bool = False
    """Calls recorded without exact token ids: retokenize with the chat template (True) or drop
    them (False, default: retokenized text drifts from what the engine sampled). Counted either way."""
    chat_template: str | None = None
    """Jinja chat template for retokenizing (use the one vLLM serves with, e.g.
    configs/templates/smollm2_tools.jinja); None uses the tokenizer's own."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them
    (non-reentrant activation checkpointing): memory grows with the tokens of a micro-batch, not with
    tokens x layers, for about a third more compute. Same loss and gradients. On for long samples
    (the GPU configs); measured here on a 4,096-token sample of SmolLM2: 9.0 GB over the loaded model
    without, 3.3 GB with."""
    shared_prefix: bool = True
    """Pack each micro-batch as a prefix tree: tokens that several of its samples begin with (a group's
    shared prompt, a system prompt and tools, a fork group's replayed context) are computed once, each
    sample's own tokens attending to them (``trainer/packing.py``). Exact: the same loss and gradient
    as every sample packed whole (``tests/trainer/test_shared_prefix.py``; with ``lora_dropout`` above 0
    a shared token draws one dropout mask for all its samples, not one each); the planner puts samples
    that share prefixes together and fills ``micro_batch_tokens`` with distinct tokens. Segments with a
    shared prefix above them use a masked attention call (not the causal kernel). ``perf/shared_share``
    says how much was saved; false packs every sample whole (before issue 45). Measured on 2 CPU cores
    (``bench/shared_prefix.py``: SmolLM2's shape with 4 layers, bf16, random weights): trained tokens/s
    1.45x on math groups (42% of the tokens computed), 1.22x on calc-like groups (45%), 3.0x on an
    OpenHands-shaped fork group (6k shared, 8 branches of 500; 20%); a step's added peak memory 0.71x,
    0.68x, 0.85x."""
    mmap_threshold_kb: int | None = None
    """CPU only: fix glibc's ``M_MMAP_THRESHOLD`` at this size, so every tensor above it is mapped on
    allocation and unmapped on free; the step's resident peak is then what is alive. glibc's default
    threshold rises after each large free, later tensors come from a heap that keeps what it once
    held, and the peak is several times the live tensors. Measured on a 2-core Xeon (SmolLM2-135M,
    bf16, checkpointing on, forward and backward of one sample; ``bench/long_context.py
    --mmap-threshold-kb 1024`` compares whole steps): added peak 0.55 / 0.68 / 0.72 / 0.44 GB per 1k
    tokens at 1k / 2k / 4k / 8k tokens by default, 0.15 / 0.10 / 0.10 / 0.10 with 1024 KB, for 2.0x /
    1.9x / 1.6x / 1.3x the time (the kernel zeroes every fresh page). None (default) keeps glibc's
    rule: faster where memory is not the limit. On a GPU the activations are the device's, not this."""
    logprob_chunk_rows: int = 512
    """Rows of the vocabulary projection computed at once: the selective log-softmax never holds
    more than rows x vocab logits."""
    pass_threshold: float = 0.5
    """An episode with reward at or above this counts as passed (the pass-rate metric only)."""

    # -- warm start ----------------------------------------------------------------------------------
    warm_start_steps: int = 0
    """Supervised fine-tuning steps of the LoRA on recorded episodes before GRPO (``trainer/warmstart.py``):
    ``python -m trainer warmstart`` runs only these, checkpoints and publishes the adapter, and ``trainer
    run`` resumes GRPO from it; ``trainer run`` itself runs them first on a fresh ``output_dir`` (never
    on a resumed one). They are steps 1..N of the run: ``max_steps`` counts them. 0: no warm start."""
    warm_start_min_reward: float | None = None
    """Select only episodes rewarded at least this (rejection sampling: the agent's own best episodes).
    None: any rewarded episode. Only rewarded episodes are ever selected."""
    warm_start_tasks: tuple[str, ...] = ()
    """Select only episodes of these task ids (exact, any of them; at most 256). Empty: every task."""
    warm_start_source: str | None = None
    """Select only episodes whose metadata ``source`` is exactly this string (the source tag: e.g.
    ``teacher:<name>`` for a teacher's episodes, or a scripted demonstrator's own tag). None: any."""
    warm_start_learning_rate: float | None = None
    """AdamW learning rate of the warm start; None uses ``learning_rate``. Supervised steps usually
    take a larger one than GRPO (TRL's SFTConfig defaults to 2e-5 for full models; LoRA takes ~1e-4)."""
    warm_start_episodes_per_step: int = 8
    """Selected episodes per warm-start step; steps go through the selection in a shuffled order
    (``seed``), epoch after epoch, so N steps see N x this many episodes (repeating them as needed)."""
    warm_start_max_episodes: int = 1000
    """The newest this many selected episodes are used (their calls are fetched once, at the start)."""

    # -- rollout coupling ------------------------------------------------------------------------------
    mode: TrainMode = "async"
    """``sync``: train only on groups whose every call came from the current policy version.
    ``async``: train on anything within ``max_staleness`` versions while rollouts continue."""
    max_staleness: int | None = None
    """Async mode: groups whose oldest call is more than this many versions behind are dropped
    (proxy marks them stale). None means 1. Sync mode always uses 0."""
    late_after_s: float = 1800.0
    """A group whose oldest call started longer ago than this (s) when its step is built is late, as is
    one that awaited its reward (the proxy's ``await_reward``) or lags more than the staleness bound
    (the proxy offers a late group whatever its staleness). A late group trains like any other, on the
    recorded log-probs under the bounded importance weight (``vllm_importance_sampling_cap``), and is
    counted in ``data/groups_late``."""
    late_max_versions: int | None = None
    """A late group whose oldest call lags the current policy by more than this many versions is
    skipped (reason ``late``, ``data/groups_skipped_late``): too far off-policy for the capped weight.
    None: no limit."""
    late_max_age_s: float | None = None
    """A late group whose oldest call started longer ago than this (s) is skipped (reason ``late``,
    ``data/groups_skipped_late``). None: no limit."""
    publish_every: int = 1
    """Publish the adapter to vLLM every this many steps."""
    keep_adapters: int = 4
    """Published adapter directories kept on disk. Keep at least the proxy's
    ``policy.keep_versions`` (3): a restarted vLLM replica reloads those from disk."""
    keep_checkpoints: int = 2
    """Step checkpoints kept on disk (the newest is what a restart resumes from)."""
    max_steps: int | None = None
    """Stop after this many steps in total (resumed runs count earlier steps); None runs until stopped."""

    # -- proxy and output --------------------------------------------------------------------------------
    proxy_url: str = "http://127.0.0.1:8100"
    """The proxy's base URL."""
    admin_key_file: str | None = "data/admin.key"
    """Where the admin key is read from when ``FLYWHEEL_ADMIN_KEY`` is unset."""
    trainer_id: str = "trainer"
    """Lease owner name shown by the proxy."""
    lease_s: float = 900.0
    """Lease on claimed groups (s). Must outlast a step plus its checkpoint; a crashed trainer's
    groups are offered again after it expires."""
    poll_interval_s: float = 2.0
    """Wait between claims when no completed group is available (s)."""
    request_timeout_s: float = 120.0
    """Timeout of one proxy request (s); publishing loads the adapter on every replica."""
    parallelism: Parallelism = "data"
    """Under torchrun with several ranks, how the model is spread: ``data`` keeps the whole model on
    every device and splits each step's micro-batches (the frozen base in ``dtype`` plus a
    micro-batch's activations must fit one device); ``fsdp`` shards the frozen base, the LoRA weights,
    their gradients and the AdamW state over the ranks with FSDP2 (one ``fully_shard`` group per
    decoder layer, one at the root), for models that do not fit one device. The same update either
    way (``tests/trainer/test_fsdp.py``). One process: no effect."""
    distributed_timeout_s: float = 7200.0
    """Under torchrun: how long ranks wait at a collective (s). Followers wait there while the
    leader waits for rewarded groups, so this bounds the longest wait for a step's groups."""
    output_dir: str = "runs/trainer"
    """Checkpoints, published adapters, TensorBoard events and the step journal."""
    tensorboard: bool = True
    """Write TensorBoard event files under ``output_dir/tensorboard``."""
    progress: bool = True
    """Rich progress display on a terminal (a plain line per step otherwise)."""

    def __post_init__(self) -> None:
        _check_choices(self)
        checks: list[tuple[bool, str]] = [
            (self.lora_r >= 1, "lora_r must be >= 1"),
            (
                self.lora_r <= self.max_lora_rank,
                f"lora_r={self.lora_r} exceeds max_lora_rank={self.max_lora_rank} (vLLM's --max-lora-rank); "
                "lower lora_r or start vLLM with a larger --max-lora-rank and set max_lora_rank to match",
            ),
            (self.lora_alpha > 0, "lora_alpha must be > 0"),
            (0.0 <= self.lora_dropout < 1.0, "lora_dropout must be in [0, 1)"),
            (bool(self.lora_target_modules), "lora_target_modules must name at least one module"),
            (
                not {"lm_head", "embed_tokens"} & set(self.lora_target_modules),
                "lora_target_modules must not include lm_head or embed_tokens (the selective log-softmax reads "
                "the frozen output embedding directly); adapt the attention and MLP projections instead",
            ),
            (self.learning_rate > 0, "learning_rate must be > 0"),
            (self.max_grad_norm >= 0, "max_grad_norm must be >= 0 (0 disables clipping)"),
            (self.num_iterations >= 1, "num_iterations must be >= 1"),
            (0.0 < self.epsilon < 1.0, "epsilon must be in (0, 1); TRL's default is 0.2"),
            (self.epsilon_high is None or self.epsilon_high > 0, "epsilon_high must be > 0 (or null for epsilon)"),
            (self.beta >= 0, "beta must be >= 0 (0 disables the KL term)"),
            (self.vllm_importance_sampling_cap > 0, "vllm_importance_sampling_cap must be > 0"),
            (0.0 <= self.turn_discount <= 1.0, "turn_discount must be in [0, 1]"),
            (self.engine_logp_tolerance > 0, "engine_logp_tolerance must be > 0 (nats)"),
            (self.engine_logp_check_samples >= 0, "engine_logp_check_samples must be >= 0"),
            (self.max_completion_length >= 1, "max_completion_length must be >= 1"),
            (self.groups_per_step >= 1, "groups_per_step must be >= 1"),
            (self.max_seq_len >= 2, "max_seq_len must be >= 2"),
            (
                self.micro_batch_tokens >= self.max_seq_len,
                f"micro_batch_tokens={self.micro_batch_tokens} must be >= max_seq_len={self.max_seq_len} so the "
                "longest sample fits one pass; raise micro_batch_tokens or lower max_seq_len",
            ),
            (self.logprob_chunk_rows >= 1, "logprob_chunk_rows must be >= 1"),
            (
                self.mmap_threshold_kb is None or 4 <= self.mmap_threshold_kb <= 32 * 1024,
                "mmap_threshold_kb must be 4 to 32768 (glibc's limits on 64-bit) or null for glibc's own rule",
            ),
            (self.max_staleness is None or self.max_staleness >= 0, "max_staleness must be >= 0"),
            (
                not (self.mode == "sync" and self.max_staleness not in (None, 0)),
                f"mode=sync trains only on groups from the current version (staleness 0), but max_staleness="
                f"{self.max_staleness}; drop max_staleness or use mode=async",
            ),
            (self.late_after_s > 0, "late_after_s must be > 0"),
            (
                self.late_max_versions is None or self.late_max_versions >= 0,
                "late_max_versions must be >= 0 (or null for no limit)",
            ),
            (
                self.late_max_age_s is None or self.late_max_age_s > 0,
                "late_max_age_s must be > 0 (or null for no limit)",
            ),
            (self.publish_every >= 1, "publish_every must be >= 1"),
            (self.keep_adapters >= 1, "keep_adapters must be >= 1 (3 or more: the proxy keeps 3 versions loaded)"),
            (self.keep_checkpoints >= 1, "keep_checkpoints must be >= 1"),
            (self.max_steps is None or self.max_steps >= 0, "max_steps must be >= 0 (or null to run until stopped)"),
            (
                self.lease_s > 0 and self.poll_interval_s > 0 and self.batch_wait_s >= 0,
                "lease_s and poll_interval_s must be > 0, batch_wait_s >= 0",
            ),
            (self.request_timeout_s > 0, "request_timeout_s must be > 0"),
            (self.distributed_timeout_s > 0, "distributed_timeout_s must be > 0"),
            (
                self.proxy_url.startswith(("http://", "https://")),
                f"proxy_url must be an http(s) URL, got {self.proxy_url!r}",
            ),
            (self.threads is None or self.threads >= 1, "threads must be >= 1 (or null for torch's default)"),
            (self.warm_start_steps >= 0, "warm_start_steps must be >= 0 (0: no warm start)"),
            (
                self.warm_start_min_reward is None or math.isfinite(self.warm_start_min_reward),
                "warm_start_min_reward must be a finite number (or null for any reward)",
            ),
            (len(self.warm_start_tasks) <= 256, "warm_start_tasks names at most 256 task ids"),
            (self.warm_start_source != "", "warm_start_source must be a non-empty tag (or null for any source)"),
            (
                self.warm_start_learning_rate is None or self.warm_start_learning_rate > 0,
                "warm_start_learning_rate must be > 0 (or null for learning_rate)",
            ),
            (self.warm_start_episodes_per_step >= 1, "warm_start_episodes_per_step must be >= 1"),
            (self.warm_start_max_episodes >= 1, "warm_start_max_episodes must be >= 1"),
        ]
        errors = [message for ok, message in checks if not ok]
        if errors:
            raise ConfigError("invalid trainer config:\n  - " + "\n  - ".join(errors))

    @property
    def epsilon_upper(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def staleness_bound(self) -> int:
        """Versions a group may lag the current policy: 0 in sync mode."""
        if self.mode == "sync":
            return 0
        return 1 if self.max_staleness is None else self.max_staleness

    @property
    def model_dir(self) -> Path:
        return Path(self.model or os.environ.get("FLYWHEEL_MODEL_DIR", "")).expanduser()

    @property
    def out(self) -> Path:
        return Path(self.output_dir).expanduser().resolve()

    def admin_key(self) -> str:
        """FLYWHEEL_ADMIN_KEY, else the key file; never stored on the config (it is logged)."""
        key = os.environ.get("FLYWHEEL_ADMIN_KEY", "").strip()
        if key:
            return key
        if self.admin_key_file and Path(self.admin_key_file).is_file():
            keys = key_file_keys(Path(self.admin_key_file).read_text())  # later lines: a rotation's old keys
            if keys:
                return keys[0]
        raise ConfigError(
            f"no admin key: set FLYWHEEL_ADMIN_KEY or admin_key_file (tried {self.admin_key_file!r}; "
            "`python -m proxy serve` creates data/admin.key)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _check_choices(config: TrainerConfig) -> None:
    hints = get_type_hints(TrainerConfig)
    for f in dataclasses.fields(config):
        hint = hints[f.name]
        if get_origin(hint) is Literal and getattr(config, f.name) not in get_args(hint):
            raise ConfigError(
                f"unknown {f.name} {getattr(config, f.name)!r}; choose one of {', '.join(map(str, get_args(hint)))}"
            )


# -- loading ---------------------------------------------------------------------------------------


def coerce_number(name: str, value: Any, hint: type[bool | int | float], error: type[ValueError]) -> Any:
    """A YAML value as a ``bool``, ``int`` or ``float`` field takes it, or ``error`` naming the field.

    Strict where YAML is loose: ``1`` is not ``true``, ``true`` is not ``1``. YAML 1.1 (PyYAML)
    reads ``2e-5`` (no dot) as a string, so a float field parses strings. Shared by the run config
    (``deploy/run_config.py``)."""
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise error(f"{name}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise error(f"{name}: expected an integer, got {value!r}")
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise error(f"{name}: expected a number, got {value!r}")


def _coerce(name: str, value: Any, hint: Any) -> Any:
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(name, value, inner[0])
    if origin is Literal:
        return value  # checked with a full message in __post_init__
    if origin is tuple:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list | tuple):
            raise ConfigError(f"{name}: expected a list, got {value!r}")
        return tuple(str(i).strip() for i in items if str(i).strip())
    if hint in (bool, int, float):
        return coerce_number(name, value, hint, ConfigError)
    if hint is str:
        if isinstance(value, str | int | float):
            return os.path.expandvars(str(value))
        raise ConfigError(f"{name}: expected a string, got {value!r}")
    return value


def parse_override(pair: str) -> tuple[str, Any]:
    """``key=value`` (or ``--key=value``) with the value read as a YAML scalar or list."""
    key, sep, raw = pair.lstrip("-").partition("=")
    if not sep or not key:
        raise ConfigError(f"override {pair!r}: expected key=value, e.g. max_steps=10")
    return key.strip().replace("-", "_"), yaml.safe_load(raw) if raw.strip() else ""


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainerConfig:
    """Build the config from YAML (a top-level ``trainer:`` section or the whole file) and overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"config file not found: {file}")
        loaded = yaml.safe_load(file.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{file}: expected a mapping of trainer settings")
        data = dict(loaded.get("trainer", loaded))
    for pair in overrides or []:
        key, value = parse_override(pair)
        data[key] = value
    hints = get_type_hints(TrainerConfig)
    unknown = [k for k in data if k not in hints]
    if unknown:
        hint = "; ".join(
            f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, hints, 1)) else repr(k)
            for k in unknown
        )
        raise ConfigError(f"unknown trainer setting {hint}")
    values = {k: _coerce(k, v, hints[k]) for k, v in data.items()}
    return TrainerConfig(**values)


def cpu_has_native_bf16() -> bool:
    """Whether the CPU multiplies bf16 natively (AVX512-BF16 or AMX), which ``dtype: auto`` decides by.

    Elsewhere (e.g. AVX2-only CPUs) bf16 is emulated and far slower than fp32. Kept here, free of
    torch, so the launcher (``deploy/vllm.py``, vLLM's ``--dtype auto``) decides by the same test.
    """
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
