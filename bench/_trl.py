"""What every bench that runs TRL's ``GRPOTrainer`` asks of it besides the algorithm: train only.

Left to its defaults, TRL (transformers' ``TrainingArguments``) picks bf16 or an accelerator where
it finds one, checkpoints, logs, reports to any tracker installed, draws progress bars and shuffles
its dataset: each costs time the benches measure, or reorders what they compare with Flywheel's
trainer step for step (the datasets come in Flywheel's own order).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.config import TrainerConfig

TRAIN_ONLY: dict[str, Any] = {
    "use_cpu": True,
    "bf16": False,
    "gradient_checkpointing": False,
    "save_strategy": "no",
    "logging_steps": 1_000_000,
    "report_to": [],
    "disable_tqdm": True,
    "shuffle_dataset": False,
}
"""``GRPOConfig`` keywords: CPU in float32, no checkpoints, logs, trackers or progress bars, the
dataset in the order given."""


def peft_lora(config: TrainerConfig, *, dropout: float | None = None) -> Any:
    """The trainer config's LoRA (rank, alpha, targets) as the PEFT ``LoraConfig`` TRL is given, so
    both sides train the same adapter; ``dropout`` None: the config's."""
    from peft import LoraConfig

    return LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout if dropout is None else dropout,
        target_modules=list(config.lora_target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
