"""A training sample: one token sequence of an episode (or of one choice), and what each token carries.

Token layout: ``input_ids[j]`` with ``loss_mask[j] = 1`` when the policy sampled it and it is
trained, ``behaviour_logprobs[j]`` the engine's (processed) log-prob of it (NaN where unknown or
masked), and per token the sampling it was drawn with (``temperatures``, ``top_k``, ``top_p``,
``min_p``), the serving policy ``versions``, the sampling ``modes`` (index into ``MODES``) and the
member's ``turns`` (per-turn credit). ``merge.py`` builds samples (and splits long ones into
windows of the sequence), ``packing.py`` lays them out in micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from contract.vocabulary import TRAINED_MODES

NAN = float("nan")
"""The log-prob of a token whose engine log-prob is unknown, or that is not trained."""
NOT_SAMPLED = -1
"""The per-token entry (``versions``, ``modes``, ``turns``) of a token the engine did not sample for
this sample's loss: prompt, tool results, context-only calls. Tensors need an int; the API's "no
version" is None (``contract.vocabulary.BASE_VERSION`` says which is which)."""
MODES = TRAINED_MODES
"""Sampling modes whose tokens are trained; a token's ``modes`` entry indexes this (``NOT_SAMPLED``: none)."""


@dataclass
class Sample:
    group_id: str
    episode_id: str
    input_ids: list[int]
    loss_mask: list[int]
    behaviour_logprobs: list[float]
    temperatures: list[float]
    min_version: int | None = None
    advantage: float = 0.0
    """The member's advantage; ``advantages`` overrides it per token (per-turn credit)."""
    member: str = ""
    """The group member the sample belongs to (episode id, or ``<episode>#<choice>``)."""
    top_k: list[int] | None = None
    top_p: list[float] | None = None
    min_p: list[float] | None = None
    versions: list[int] | None = None
    """Serving policy version per token (``NOT_SAMPLED`` where not sampled)."""
    modes: list[int] | None = None
    """Index into ``MODES`` per token (``NOT_SAMPLED`` where not sampled)."""
    allowed: dict[int, torch.Tensor] = field(default_factory=dict)
    """Position -> the (words,) int32 grammar bitmask the token there was sampled under (constrained
    calls only; ``grammar.py``'s layout). Absent positions were sampled without a mask."""
    turns: list[int] | None = None
    """Turn index within the member per token (``NOT_SAMPLED`` where not sampled): per-turn advantages."""
    advantages: list[float] | None = None
    member_loss_tokens: int = 0
    """Loss tokens of the whole member (all its samples): the per-episode normaliser; 0 = this sample's."""
    rerendered: bool = False
    """Some of its turns are a teacher's text (a warm start's) re-rendered with the student's chat
    template (``notes.teacher``): their ids are the template's, not ones the student sampled."""

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)

    def __len__(self) -> int:
        return len(self.input_ids)


PER_TOKEN = (
    "input_ids",
    "loss_mask",
    "behaviour_logprobs",
    "temperatures",
    "top_k",
    "top_p",
    "min_p",
    "versions",
    "modes",
    "turns",
    "advantages",
)
"""The fields of ``Sample`` that hold one entry per token (cut and split together, ``merge.py``)."""
CONTEXT: dict[str, float] = {
    "loss_mask": 0,
    "behaviour_logprobs": NAN,
    "temperatures": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "versions": NOT_SAMPLED,
    "modes": NOT_SAMPLED,
    "turns": NOT_SAMPLED,
    "advantages": 0.0,
}
"""Per-token entries (every ``PER_TOKEN`` field but the ids) of a token that is context only: what a
sampled token becomes where it is repeated as the context of a later part of a split sample."""
