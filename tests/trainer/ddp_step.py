"""Run under torchrun by test_distributed.py: for each loss type named (comma-separated), three real
optimizer steps on fixed samples from a fresh adapter, then each rank saves its adapter and step
statistics. One launch for every loss type: a torchrun start costs more than the steps. Not a test
module itself (no ``test_`` prefix)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tests.trainer.samples import chat_sample
from trainer.config import TrainerConfig
from trainer.distributed import init_world
from trainer.learner import Learner
from trainer.lora import LoraPolicy
from trainer.packing import pack

QUESTIONS = [
    ("What is 2+3?", "5", 1.0),
    ("What is 7+1?", "The answer is 8.", -0.5),
    ("Name a colour.", "Blue, like the sky on a clear day.", 0.7),
    ("What is 9+9?", "18", -1.2),
    ("Say hi.", "Hi! How can I help you today?", 0.4),
    ("What is 4+4?", "It is eight, I think.", -0.4),
]


def main(model_dir: str, out: Path, loss_types: list[str]) -> None:
    world = init_world(600)
    for loss_type in loss_types:
        config = TrainerConfig(
            model=model_dir,
            dtype="float32",
            learning_rate=1e-3,
            loss_type=loss_type,
            max_seq_len=64,
            micro_batch_tokens=64,  # two or more micro-batches to share out, prefix-shared (the system prompt) or not
            threads=1,
        )
        policy = LoraPolicy(config)  # seeds torch from config.seed: the same initial adapter every time
        learner = Learner(policy, config, world)
        samples = [chat_sample(policy, *q) for q in QUESTIONS]
        stats = [learner.step(samples[i:] + samples[:i]) for i in range(3)]
        torch.save(
            {
                "adapter": policy.adapter_state(),
                "loss": [s.loss for s in stats],
                "grad_norm": [s.grad_norm for s in stats],
                "entropy": [s.entropy for s in stats],
                "share": len(world.share(pack(samples, config.micro_batch_tokens, shared=config.shared_prefix))),
                "micro_batches": stats[0].micro_batches,
            },
            out / f"{loss_type}-rank{world.rank}-of-{world.size}.pt",
        )
    world.close()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3].split(","))
