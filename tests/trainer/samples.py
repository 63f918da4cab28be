"""Hand-made training samples on the real tokenizer (shared by the LoRA tests and the torchrun script)."""

from __future__ import annotations

from trainer.data import Sample
from trainer.lora import LoraPolicy

NAN = float("nan")


def chat_sample(policy: LoraPolicy, question: str, answer: str, advantage: float, temperature: float = 1.0) -> Sample:
    """A one-turn chat: the prompt masked out, ``answer`` + EOS as the sampled completion."""
    tok = policy.tokenizer
    prompt = list(
        tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True)[
            "input_ids"
        ]
    )
    completion = tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]
    n = len(prompt) + len(completion)
    return Sample(
        group_id="g",
        episode_id=answer,
        input_ids=prompt + completion,
        loss_mask=[0] * len(prompt) + [1] * len(completion),
        behaviour_logprobs=[NAN] * n,
        temperatures=[1.0] * len(prompt) + [temperature] * len(completion),
        advantage=advantage,
    )
