"""ORM models: groups of episodes, their recorded calls, policy versions and trainer steps.

Typed SQLAlchemy 2.0 declarative models; they never leave ``proxy/store`` (the repository returns
plain dataclasses). Times are epoch seconds (float): portable between SQLite and PostgreSQL and
cheap to compare. A call's token ids and log-probs are binary (little-endian int32, float32 or float64
where float32 would not keep them exactly), and a call continuing an earlier call of its episode
stores only its new prompt ids and new messages (``delta.py`` has the layout; ``rows.py`` gives
readers whole calls back). Calls written before migration 0004 that it has not converted yet keep
the JSON layout (``encoding`` 0). The schema itself is owned by Alembic (``migrations/``).
"""

from __future__ import annotations

from typing import Any, Literal

from sqlalchemy import (
    JSON,
    Boolean,
    Double,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from contract.vocabulary import (
    AbandonCause,
    AuditAction,
    CallApi,
    CallKind,
    EpisodeStatus,
    ForkRule,
    GroupStatus,
    SkipReason,
    TrainStatus,
)
from proxy.canary import Arm

Decided = Literal["promote", "rollback"]
"""A canary's decision (``proxy.canary.Verdict`` without ``continue``)."""


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON, float: Double}


class Group(Base):
    """A task attempted ``size`` times; GRPO's unit of advantage normalisation."""

    __tablename__ = "groups"
    # The dashboard's keyset pages, newest first (``browse.py``): one index seek per page.
    __table_args__ = (Index("ix_groups_created_id", "created_at", "id"),)

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    task_id: Mapped[str] = mapped_column(String(256), index=True)
    size: Mapped[int] = mapped_column(Integer)
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)
    status: Mapped[GroupStatus] = mapped_column(String(16), index=True)
    created_at: Mapped[float]
    completed_at: Mapped[float | None]
    # Trainer side: a lease makes a claim exclusive; an expired lease offers the group again.
    train_status: Mapped[TrainStatus] = mapped_column(String(16), default="pending", index=True)
    lease_id: Mapped[str | None] = mapped_column(String(36), index=True)
    lease_owner: Mapped[str | None] = mapped_column(String(128))
    lease_expires_at: Mapped[float | None]
    trained_step: Mapped[int | None]
    train_note: Mapped[str | None] = mapped_column(Text)
    train_reason: Mapped[SkipReason | None] = mapped_column(String(16))
    """Why it was never trained (``skipped``/``stale``; migration 0011): what skips are counted by, never the note."""


class Episode(Base):
    """One attempt at a task by an agent; every model call it makes is a ``Call``."""

    __tablename__ = "episodes"
    __table_args__ = (
        Index("ix_episodes_created_id", "created_at", "id"),
        # Every status lookup (the idle sweep, counts) uses its first column; the dashboard's pages
        # filtered by status seek one range of it instead of sorting the status's rows (migration 0005).
        Index("ix_episodes_status_created_id", "status", "created_at", "id"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    group_id: Mapped[str | None] = mapped_column(ForeignKey("groups.id"), index=True)
    group_index: Mapped[int | None]
    """Position in its group (0..size-1), so episodes list in creation order."""
    task_id: Mapped[str | None] = mapped_column(String(256), index=True)
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)
    status: Mapped[EpisodeStatus] = mapped_column(String(16))
    reward: Mapped[float | None]
    call_rewards: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    reward_metadata: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    abandon_reason: Mapped[str | None] = mapped_column(Text)
    abandon_cause: Mapped[AbandonCause | None] = mapped_column(String(16))
    """Who or what ended it without a reward (migration 0008); the trainer reads it, never the reason."""
    created_at: Mapped[float]
    finished_at: Mapped[float | None]
    awaiting_since: Mapped[float | None]
    """When it began awaiting a late reward (status ``awaiting``, migration 0012): what
    ``late_rewards.max_wait_s`` counts from; kept once rewarded, so a late group is known as one."""
    train_audit: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    """What the trainer made of the episode (sent with its group's ack; migration 0007)."""
    # A fork episode (``proxy/replay.py``, migration 0009): its first ``fork_at`` answered calls are
    # replayed from ``fork_of``'s record; ``diverged_at`` is the call whose request differed, if one did.
    fork_of: Mapped[str | None] = mapped_column(String(36), index=True)
    fork_at: Mapped[int | None]
    fork_rule: Mapped[ForkRule | None] = mapped_column(String(16))
    diverged_at: Mapped[int | None]
    divergence: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    """Why the replay ended early: which request fields differed, and the rule applied."""
    purged_at: Mapped[float | None]
    """When retention purged its calls' bodies and token ids (``proxy/store/retention.py``, migration
    0010); the rows, counts and outcome stay. None: whole."""
    policy_arm: Mapped[Arm | None] = mapped_column(String(16))
    """Its arm of the canary running when it was created (``canary``/``baseline``; migration 0014);
    NULL when none ran. Drawn from its id, so a retried creation never moves it."""
    canary_version: Mapped[int | None] = mapped_column(Integer, index=True)
    """The canary (its policy version) ``policy_arm`` belongs to: its rewards are that test's data."""


class Call(Base):
    """One model call, exactly as the engine saw and sampled it."""

    __tablename__ = "calls"
    __table_args__ = (
        UniqueConstraint("episode_id", "ordinal", name="uq_calls_episode_ordinal"),
        Index("ix_calls_episode_started", "episode_id", "started_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    episode_id: Mapped[str] = mapped_column(ForeignKey("episodes.id"))
    ordinal: Mapped[int]
    kind: Mapped[CallKind] = mapped_column(String(16))
    stream: Mapped[bool] = mapped_column(Boolean)
    request: Mapped[dict[str, Any]] = mapped_column(JSON)
    response: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    status_code: Mapped[int]
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    prompt_token_ids: Mapped[list[Any] | None] = mapped_column(JSON)
    choices: Mapped[list[Any]] = mapped_column(JSON)
    """Per choice: index, token_ids, logprobs, finish_reason, text, tool_calls."""
    exact_ids: Mapped[bool] = mapped_column(Boolean)
    """False when the upstream did not return token ids: the trainer must not trust this call's ids."""
    model_requested: Mapped[str] = mapped_column(String(256))
    model_served: Mapped[str | None] = mapped_column(String(256))
    policy_version: Mapped[int | None] = mapped_column(Integer, index=True)
    replica: Mapped[str | None] = mapped_column(String(128))
    started_at: Mapped[float]
    latency_ms: Mapped[float]
    ttft_ms: Mapped[float | None]
    prompt_tokens: Mapped[int | None]
    completion_tokens: Mapped[int | None]
    notes: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    """What the proxy changed on the way (e.g. a dropped ``seed``)."""
    api: Mapped[CallApi] = mapped_column(String(16), server_default="chat")
    """The API the client spoke."""
    client_request: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    """The client's own request, for the APIs translated to chat (``request`` is the chat request)."""
    response_id: Mapped[str | None] = mapped_column(String(64), index=True)
    """The answer's id as the client saw it, where the API has one (``previous_response_id``)."""
    receipt: Mapped[str | None] = mapped_column(String(40), index=True, unique=True)
    """The proxy's id of the call, sent as ``x-flywheel-call-id`` (migration 0013; NULL before it)."""
    # The compact layout (``delta.py``): 0 = JSON layout (before migration 0004), 1 = compact.
    encoding: Mapped[int] = mapped_column(Integer, server_default="0")
    base_ordinal: Mapped[int | None]
    """The earlier call of the episode this row's deltas extend."""
    prompt_choice: Mapped[int | None]
    """Prompt = base prompt + that choice's sampled ids (-1: none) + ``prompt_ids``; NULL: ``prompt_ids`` is whole."""
    prompt_ids: Mapped[bytes | None] = mapped_column(LargeBinary)
    messages_from: Mapped[int | None]
    """Messages = the base's first ``messages_from`` messages + the stored ones; NULL: stored whole."""
    client_from: Mapped[int | None]
    """The same for ``client_request``'s list (``contract.tokens.client_list``); NULL: stored whole (migration 0006)."""
    choice_ids: Mapped[bytes | None] = mapped_column(LargeBinary)
    choice_logprobs: Mapped[bytes | None] = mapped_column(LargeBinary)


class AuditEntry(Base):
    """One retention action: a purge batch, or a deletion on request (migration 0010). ``actor`` is
    who asked (``admin:<key id>``, the key's sha256 prefix, never the key; ``retention``: the sweeper)."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[float]
    actor: Mapped[str] = mapped_column(String(64))
    action: Mapped[AuditAction] = mapped_column(String(32))
    target: Mapped[str] = mapped_column(Text)
    """What it was done to: an episode id, ``user:<id>``, or a purge's cutoff."""
    rows: Mapped[int]
    """Rows it removed or purged (calls, episodes, groups)."""
    detail: Mapped[dict[str, Any]] = mapped_column(JSON)


class PolicyVersion(Base):
    """A published adapter. The highest version is the current policy; version 0 is the base model."""

    __tablename__ = "policy_versions"

    version: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    name: Mapped[str] = mapped_column(String(256), unique=True)
    adapter_path: Mapped[str] = mapped_column(Text)
    created_at: Mapped[float]
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)


class Canary(Base):
    """One canary rollout of a published version (migration 0014): how it started, then its one
    decision with the evidence. ``verdict`` NULL: running (at most one at a time); the current
    policy is the highest version that is neither running as a canary nor rolled back."""

    __tablename__ = "canaries"

    canary_version: Mapped[int] = mapped_column(
        ForeignKey("policy_versions.version"), primary_key=True, autoincrement=False
    )
    baseline_version: Mapped[int]
    """The version the other episodes stayed on."""
    share: Mapped[float]
    """The share of new episodes drawn into the canary arm."""
    settings: Mapped[dict[str, Any]] = mapped_column(JSON)
    """The test's parameters (``proxy.canary.CanarySettings``) frozen at the start."""
    started_at: Mapped[float]
    verdict: Mapped[Decided | None] = mapped_column(String(16))
    """``promote`` or ``rollback``; NULL while it runs."""
    reason: Mapped[str | None] = mapped_column(Text)
    manual: Mapped[bool | None] = mapped_column(Boolean)
    """Decided through the control API rather than by the test."""
    evidence: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    """``Decision.evidence()`` when it was decided: the arms' counts and means, the bounds, the levels."""
    decided_at: Mapped[float | None]


class TrainerStep(Base):
    """Metrics the trainer reported for one optimisation step."""

    __tablename__ = "trainer_steps"

    step: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[float]
