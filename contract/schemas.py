"""Wire models of the control and trainer APIs' requests, and of the answers that are no entity
(the OpenAI routes pass bodies through as JSON; calls, episodes, groups, policy versions and claims
are ``contract/entities.py``).

Every float that reaches the store is finite: NaN and infinity are refused here, anywhere in a
payload, with a 400 that names the field. The proxy validates requests with these models and
``contract/endpoints.py`` builds its request bodies from them, so a field renamed here is renamed
for both sides by the type checker. Pydantic and the standard library only (the JSON depth limit,
which needs orjson, is the proxy's: ``proxy/depth.py``).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from contract.vocabulary import (
    AbandonCause,
    AckStatus,
    AuditAction,
    ForkRule,
    TeacherRendering,
    TrainerSkip,
    TrainMode,
)


def _finite_json(value: Any, path: str = "") -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"non-finite number at {path or 'top level'}: JSON has no NaN or Infinity")
    if isinstance(value, dict):
        for key, item in value.items():
            _finite_json(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _finite_json(item, f"{path}[{i}]")
    return value


Metadata = Annotated[dict[str, Any], AfterValidator(_finite_json)]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
Limit = Annotated[int, Field(ge=1, le=1000)]
MAX_STORED_INT = 2**31 - 1
"""The largest integer an integer column holds on every store (PostgreSQL ``integer``): a number a
request gives that reaches such a column, or a query on one, is refused above it with a 400."""
StoredInt = Annotated[int, Field(le=MAX_STORED_INT)]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- episodes and groups ----------------------------------------------------------------------


class GroupCreate(_In):
    task_id: str = Field(min_length=1, max_length=256)
    size: int = Field(ge=1, description="episodes in the group (GRPO's G); the proxy caps it (episodes.max_group_size)")
    metadata: Metadata = {}
    episode_metadata: list[Metadata] | None = Field(
        None, description="one metadata object per episode (e.g. a seed); length must equal size"
    )


class EpisodeCreate(_In):
    task_id: str | None = Field(None, max_length=256)
    metadata: Metadata = {}


class ForkIn(_In):
    """``POST /episodes/{id}/fork``: ``size`` new episodes of the same task that replay the source's
    first ``at`` answered calls and sample from there (``proxy/replay.py``)."""

    at: int = Field(ge=0, le=MAX_STORED_INT, description="answered calls of the source to replay (0: none)")
    size: int = Field(ge=1, description="fork episodes (the fork group's G); capped like a group's")
    on_divergence: ForkRule = Field(
        "sample", description="a replayed call whose request differs: sample from there, or abandon the episode"
    )
    metadata: Metadata = {}


class RewardIn(_In):
    reward: FiniteFloat
    call_rewards: dict[str, FiniteFloat] | None = Field(
        None,
        description='optional per-call rewards keyed by call ordinal (0-based), e.g. {"2": 0.5}, or by '
        'ordinal and choice for calls with n > 1, e.g. {"0:3": 1.0}; a call may be named by the receipt its '
        'answer carried (x-flywheel-call-id), e.g. {"call_9f...": 0.0}, stored as its ordinal',
    )
    metadata: Metadata | None = None


class AbandonIn(_In):
    reason: str = Field(min_length=1, max_length=4000)
    cause: AbandonCause = "agent"


class ListOut(BaseModel):
    object: Literal["list"] = "list"
    data: list[Any]


# -- policy -----------------------------------------------------------------------------------


class PublishIn(_In):
    adapter_path: str = Field(min_length=1, description="adapter directory as the vLLM replicas see it")
    version: StoredInt | None = Field(None, ge=1, description="default: current version + 1")
    metadata: Metadata = {}


class CanaryOut(BaseModel):
    """One canary rollout (``GET /policy/canary``): how it started and, once decided, its decision."""

    model_config = ConfigDict(from_attributes=True)

    canary_version: int
    baseline_version: int = Field(description="the version the baseline arm stayed on")
    share: float = Field(description="the share of new episodes drawn into the canary arm")
    settings: dict[str, Any] = Field(description="the test's parameters, frozen when the canary started")
    started_at: float
    verdict: Literal["promote", "rollback"] | None = Field(description="None while the canary runs")
    reason: str | None = None
    manual: bool | None = Field(None, description="decided through the control API rather than by the test")
    evidence: dict[str, Any] | None = Field(
        None, description="the test's decision when it was decided: arm counts and means, bounds, levels"
    )
    decided_at: float | None = None


class CanaryStateOut(BaseModel):
    """``GET /policy/canary``: the running canary, the test's evidence on it now, and past decisions."""

    share: float = Field(description="policy.canary.share: 0 means a publish switches every caller at once")
    current_version: int = Field(description="the version the baseline arm (and every other caller) gets")
    running: CanaryOut | None = Field(description="the canary running now, or None")
    evidence: dict[str, Any] | None = Field(description="the test's decision on the running canary's rewards so far")
    decisions: list[CanaryOut] = Field(description="past decisions, newest canary first")


# -- trainer ----------------------------------------------------------------------------------


class ClaimIn(_In):
    trainer_id: str = Field("trainer", min_length=1, max_length=128)
    max_groups: int = Field(8, ge=1, le=1024)
    lease_s: float = Field(600.0, gt=0, le=86400)
    max_staleness: StoredInt | None = Field(
        None,
        ge=0,
        description="skip groups whose oldest call is more than this many policy versions behind the current one",
    )
    lease_id: str | None = Field(
        None,
        min_length=8,
        max_length=36,
        description="client-chosen lease id: retrying "
        "a claim whose answer was lost returns the same groups instead of leasing more",
    )
    groups_per_step: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="groups the trainer trains per policy version (default max_groups); with max_staleness it "
        "sets how many groups POST /groups admits ahead of the trainer",
    )
    mode: TrainMode | None = Field(None, description="the trainer's mode (reported by GET /admission)")
    calls: Literal["whole", "delta"] = Field(
        "whole",
        description="delta: a call that continues an earlier call of its episode comes as stored, its prompt ids "
        "and messages only those that follow (its `delta` says how to rejoin them): claim bytes grow with an "
        "episode's tokens, not their square",
    )


class TrainerDemandOut(BaseModel):
    groups_per_step: int
    max_staleness: int | None
    mode: TrainMode | None
    seconds_per_step: float | None
    seconds_since_seen: float


class AdmissionOut(BaseModel):
    enabled: bool
    limit: int | None = Field(description="groups admitted ahead of the trainer; null: admission is open")
    backlog: int = Field(description="open groups plus complete, untrained ones (leased included)")
    settling: int = Field(description="groups acked since the trainer's last claim, their version not yet published")
    refused: int = Field(description="groups this proxy process refused with 429 since it started")
    trainers: dict[str, TrainerDemandOut]
    groups: dict[str, int] = Field(
        description="every group in the store by outcome: open, failed, or a complete group's train_status "
        "(pending, trained, skipped, stale)"
    )


class ReleaseIn(_In):
    lease_id: str = Field(min_length=1)
    group_ids: list[str] | None = Field(None, description="default: every untrained group the lease holds")


class RenewIn(_In):
    lease_id: str = Field(min_length=1)
    trainer_id: str | None = Field(None, min_length=1, max_length=128, description="keeps its admission demand alive")
    group_ids: list[str] = Field(min_length=1, description="the lease's groups the trainer is still training")
    lease_s: float = Field(600.0, gt=0, le=86400)


class RenewOut(BaseModel):
    lease_id: str
    lease_expires_at: float


class EpisodeAudit(_In):
    """What the trainer made of one episode (``trainer/audit.py``), sent with its group's ack and
    kept on the episode: whether what was trained is what was sampled."""

    step: StoredInt = Field(ge=0)
    calls: int = Field(ge=0)
    calls_failed: int = Field(ge=0)
    calls_deduped: int = Field(ge=0)
    """Retries: earlier calls with the prompt of a later one that no call continued."""
    calls_context_only: int = Field(ge=0)
    """Calls kept out of the loss (greedy, penalized, excluded or unmasked constrained, inexact)."""
    calls_merged: int = Field(ge=0)
    """Calls appended to the sample of the call they continue."""
    breaks: int = Field(ge=0)
    """Calls that started a new sample (their prompt did not extend the episode so far)."""
    samples: int = Field(ge=0)
    samples_truncated: int = Field(ge=0)
    tokens_trained: int = Field(ge=0)
    tokens_under_grammar: int = Field(ge=0)
    """Trained tokens scored under the engine's rebuilt grammar mask."""
    tokens_forced: int = Field(ge=0)
    """Constrained tokens the grammar forced: no decision, out of the loss."""
    gap_mean: FiniteFloat | None = None
    """Mean |trainer - engine| log-prob (nats) of the tokens compared; None: none compared."""
    gap_max: FiniteFloat | None = None
    gap_tokens: int = Field(0, ge=0)


class AckIn(_In):
    lease_id: str = Field(min_length=1)
    group_ids: list[str] = Field(min_length=1)
    step: StoredInt = Field(ge=0)
    status: AckStatus = "trained"
    reason: TrainerSkip | None = None
    """Why the groups are skipped (a ``skipped`` ack only; stored as ``train_reason``): counted by it,
    never by the note. None: a trainer that sends none (counted as ``other``)."""
    note: str | None = Field(None, max_length=4000)
    """The reason in words, for people."""
    audits: dict[str, EpisodeAudit] | None = None
    """Episode id -> its audit, for episodes of these groups (a trained ack)."""

    @field_validator("reason")
    @classmethod
    def _reason_of_a_skip(cls, reason: TrainerSkip | None, info: ValidationInfo) -> TrainerSkip | None:
        status = info.data.get("status")
        if reason is not None and status != "skipped":
            raise ValueError(f"a reason is for a skipped ack; a {status} ack carries none")
        return reason


class StepIn(_In):
    step: StoredInt = Field(ge=0)
    metrics: Metadata


# -- notes on recorded calls ------------------------------------------------------------------


class TeacherNote(BaseModel):
    """``notes.teacher`` of a call a teacher answered (``metadata.source: teacher:<name>``): the
    proxy writes it, a trainer's warm start reads it off the claimed or listed call. The call's ids
    are in the student's token space (``rendered``), with no sampling log-probs and no policy version."""

    name: str
    """The teacher (``teachers[].name`` in the proxy's settings)."""
    model: str
    """The model the teacher served the call with."""
    rendered: TeacherRendering = "student_template"
    usage: dict[str, Any] | None = None
    """The teacher's own usage counts (its tokenizer), as it answered them."""


# -- retention: purges, deletions on request, the audit log -------------------------------------


class PurgeIn(_In):
    """``POST /retention/purge``: purge now what the sweeper would (``proxy/retention.py``)."""

    older_than_s: FiniteFloat | None = Field(
        None,
        gt=0,
        description="purge episodes finished longer ago than this (s); default the proxy's retention.bodies_ttl_s",
    )


class PurgedOut(BaseModel):
    episodes: int = Field(description="episodes whose calls' bodies and token ids were purged")
    calls: int = Field(description="call rows purged (kept with their counts, status and versions)")
    audit_ids: list[int] = Field(description="the audit log entries written, one per batch")


class DeletedOut(BaseModel):
    """``DELETE /episodes/{id}`` and ``DELETE /episodes?user=``: what left the store."""

    episodes: list[str] = Field(description="ids of the deleted episodes: those asked for, then their forks")
    forks: int = Field(description="of those, episodes deleted because they were forked from one asked for")
    calls: int = Field(description="call rows deleted")
    groups_deleted: list[str] = Field(description="groups left without members, deleted")
    groups_changed: list[str] = Field(
        description="groups that lost members and kept others: size, and an undecided group's status, follow"
    )
    audit_id: int = Field(description="the audit log entry of this deletion")


class AuditEntryOut(BaseModel):
    """One entry of ``GET /retention/audit``."""

    id: int
    at: float
    actor: str = Field(description="admin:<key id> (the admin key's sha256, first 16 hex digits), or retention")
    action: AuditAction
    target: str = Field(description="an episode id, user:<id>, or a purge's cutoff")
    rows: int = Field(description="rows removed or purged (calls, episodes, groups)")
    detail: dict[str, Any]
