"""``DataStats``: a counter for every data rule that changes or drops data; nothing is dropped silently.

Summed over a step's groups they are the step's ``data/*`` metrics (the names are read by the
tests and the dashboard: keep them); per episode they are its fidelity audit (``audit.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class DataStats:
    """Counters of every rule that changes or drops data (summed over a step's groups)."""

    calls: int = 0
    """Calls read from the episodes, before any rule."""
    calls_failed: int = 0
    """Errored calls or calls without a choice: nothing to train on."""
    calls_foreign: int = 0
    """Calls to a model that is not the policy (no policy version): not the behaviour policy. In a warm
    start, those of a model that is not a teacher (no ``notes.teacher``): their ids may be another
    tokenizer's."""
    calls_teacher: int = 0
    """Warm start only: calls a teacher answered (``notes.teacher``), trained on the ids the proxy made by
    re-rendering the teacher's text with the student's chat template (``Sample.rerendered``)."""
    calls_deduped: int = 0
    """Earlier copies of retried calls (same prompt ids)."""
    calls_retokenized: int = 0
    """Calls without exact token ids rebuilt with the chat template (``retokenize_inexact``): no engine log-probs."""
    calls_dropped_inexact: int = 0
    """Calls without exact token ids, dropped because retokenize_inexact is off (or it failed)."""
    calls_greedy: int = 0
    """Temperature-0 calls, kept as context with loss mask 0."""
    calls_penalized: int = 0
    """Calls with penalties or token biases the trainer cannot reproduce: context only."""
    calls_replayed: int = 0
    """Fork episodes' calls answered from their source's record (``notes.replay``): context only."""
    calls_purged: int = 0
    """Calls whose bodies and token ids retention purged (``notes.purged``): nothing left to train on, dropped."""
    calls_constrained: int = 0
    """Grammar-constrained calls trained, scored under the engine's rebuilt token mask."""
    calls_constrained_excluded: int = 0
    """Grammar-constrained calls the proxy marked ``exclude``: context only."""
    calls_constrained_unmasked: int = 0
    """Grammar-constrained calls whose mask could not be rebuilt (no grammar recorded, another backend,
    a token the grammar refuses): context only, never scored without the mask."""
    calls_sampling_unrecorded: int = 0
    """Calls stored without their effective sampling (written before the proxy recorded it): context only."""
    calls_truncated_sampling: int = 0
    """Calls sampled with top-k/top-p/min-p (reproduced in the trainer's log-probs)."""
    calls_logprobs_missing: int = 0
    """Trained calls without per-token engine log-probs: no importance correction for them."""
    tokens_forced: int = 0
    """Constrained tokens the grammar forced (engine log-prob 0): no decision, out of the loss."""
    choices_unused: int = 0
    """Choices of n > 1 calls that no later call continued (and no per-choice reward named)."""
    splice_shadow_prefix: int = 0
    """Spliced calls whose prompt differs from vLLM's ordinary render before the continued turn, outside
    the sampled ids (``notes.splice.shadow``, ``proxy/shadow.py``): trained as sampled, but from a
    context the template would not give the model."""
    splice_shadow_closing: int = 0
    """Spliced calls whose end-of-turn ids after a sampled turn differ from the render's."""
    splice_shadow_tail: int = 0
    """Spliced calls whose new messages (after the continued turn) differ from the render's."""
    merged: int = 0
    """Calls appended to the previous call's sample."""
    breaks: int = 0
    """Calls whose prompt did not extend the episode so far: a new sample started."""
    samples_built: int = 0
    """Samples built from the members' turns, continuation samples included (skipped groups' too);
    ``data/samples`` counts the trained ones."""
    samples_split: int = 0
    """Continuation samples made by splitting samples longer than ``max_seq_len`` at turn boundaries
    (``long_samples: split``): a sample split into k parts counts k - 1."""
    tokens_context_cut: int = 0
    """Trained tokens of continuation samples: scored after the sequence's most recent
    ``max_seq_len`` tokens, not all it was generated from (the engine gap covers them)."""
    samples_truncated: int = 0
    """Samples cut at ``max_seq_len``: their tail (and, when split, every turn after it) loses its
    loss. Splitting cuts only a turn no part can hold whole: a sample's first turn longer than
    ``max_seq_len``, or a later completion that does not fit."""
    samples_empty: int = 0
    """Samples left without a trainable token (e.g. truncated to the prompt): dropped."""
    episodes_split: int = 0
    """Members whose calls broke (or were split) into more than one sample (each weighs one episode
    if normalised)."""
    episodes_untrainable: int = 0
    """GRPO members none of whose calls left a trained turn (all greedy, failed, penalized, replayed,
    without exact ids...: ``contract/trainability.py``; the per-call counters above say which). Their rewards
    still count in their group; an agent whose episodes are all like this is recorded for nothing,
    and its episode pages say what to change."""
    episodes_abandoned_penalized: int = 0
    """Abandoned episodes made group members with ``abandoned_reward`` (``abandoned: penalize``)."""
    episodes_abandoned_skipped: int = 0
    """Abandoned episodes left out of their group (``abandoned: skip``, or a cause not the agent's, such as
    the proxy's deadline)."""
    choice_members: int = 0
    """Group members that are single choices of an n > 1 call with per-choice rewards."""
    call_rewards_used: int = 0
    """Per-call rewards that credited a turn (``turn_credit: discounted``) or made a choice a member."""
    call_rewards_ignored: int = 0
    """Per-call rewards present but unused (``turn_credit: episode``, or naming an unmerged choice)."""
    turn_returns_untrained: int = 0
    """Per-turn credit: returns of turns with no trained token (greedy, penalized, excluded, truncated
    away), left out of their group's mean and std."""

    def add(self, other: DataStats) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)
