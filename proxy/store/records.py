"""Plain records the repository takes and returns, so ORM objects never leave ``proxy/store``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from contract.vocabulary import (
    AbandonCause,
    CallApi,
    CallKind,
    EpisodeStatus,
    ForkRule,
    GroupStatus,
    SkipReason,
    TrainStatus,
)


@dataclass(slots=True)
class NewCall:
    """A finished model call, ready to be written. The ordinal is assigned by the store."""

    episode_id: str
    kind: CallKind
    stream: bool
    request: dict[str, Any]
    response: dict[str, Any] | None
    status_code: int
    error: dict[str, Any] | None
    prompt_token_ids: list[int] | None
    choices: list[dict[str, Any]]
    exact_ids: bool
    model_requested: str
    model_served: str | None
    policy_version: int | None
    replica: str | None
    started_at: float
    latency_ms: float
    ttft_ms: float | None
    prompt_tokens: int | None
    completion_tokens: int | None
    notes: dict[str, Any] | None = None
    api: CallApi = "chat"
    """The API the client spoke (``proxy/dialects``)."""
    client_request: dict[str, Any] | None = None
    """The client's own request when it was not a chat or completions request (``request`` is then
    the chat request the proxy executed)."""
    response_id: str | None = None
    """The id the client was given, where the API names answers (``resp_...``, ``msg_...``)."""
    receipt: str | None = None
    """The proxy's own id of the call, sent with its answer (``x-flywheel-call-id``), so a service can
    name this one call in feedback (``call_rewards``) without counting calls."""


@dataclass(slots=True, frozen=True)
class CallDelta:
    """How a call in delta form joins its base, an earlier call of its episode (``contract/tokens.py``)."""

    base_ordinal: int
    prompt_choice: int | None
    """The base's choice whose sampled ids sit between the base's prompt and this call's
    ``prompt_token_ids`` (-1: none; None: the prompt ids are whole)."""
    messages_from: int | None
    """How many of the base request's messages come before this call's ``request["messages"]``
    (None: the messages are whole)."""
    client_from: int | None = None
    """The same for ``client_request``'s own list (``contract.tokens.client_list``: ``messages`` or ``input``)."""


@dataclass(slots=True, kw_only=True)
class CallRecord(NewCall):
    """A stored call: what was written, plus the row id and the per-episode ordinal (0-based)."""

    id: int
    ordinal: int
    delta: CallDelta | None = None
    """Set only on a call read in delta form (a trainer's claim): its prompt ids and messages are
    then what follows its base's."""


@dataclass(slots=True)
class EpisodeRecord:
    id: str
    group_id: str | None
    group_index: int | None
    task_id: str | None
    metadata: dict[str, Any]
    status: EpisodeStatus
    reward: float | None
    call_rewards: dict[str, float] | None
    reward_metadata: dict[str, Any] | None
    abandon_reason: str | None
    created_at: float
    finished_at: float | None
    calls: list[CallRecord] | None = None
    train_audit: dict[str, Any] | None = None
    abandon_cause: AbandonCause | None = None
    fork_of: str | None = None
    fork_at: int | None = None
    fork_rule: ForkRule | None = None
    diverged_at: int | None = None
    divergence: dict[str, Any] | None = None
    purged_at: float | None = None
    awaiting_since: float | None = None
    policy_arm: str | None = None
    """Its canary arm (``canary``/``baseline``), None when no canary ran at its creation."""
    canary_version: int | None = None
    canary_decided: CanaryRecord | None = None
    """The canary decision its reward reached (``set_reward`` only; never stored on the episode)."""


@dataclass(slots=True)
class GroupRecord:
    id: str
    task_id: str
    size: int
    metadata: dict[str, Any]
    status: GroupStatus
    created_at: float
    completed_at: float | None
    train_status: TrainStatus
    trained_step: int | None
    train_note: str | None
    train_reason: SkipReason | None
    episodes: list[EpisodeRecord] | None = None
    counts: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class PolicyVersionRecord:
    version: int
    name: str
    adapter_path: str
    created_at: float
    metadata: dict[str, Any]


@dataclass(slots=True)
class CanaryStart:
    """What a publish that starts a canary stores with its version (``Versions.add``)."""

    baseline_version: int
    share: float
    settings: dict[str, Any]
    """``CanarySettings`` as JSON: frozen for the test's life."""


@dataclass(slots=True)
class CanaryRecord:
    """One canary rollout; ``verdict`` None while it runs."""

    canary_version: int
    baseline_version: int
    share: float
    settings: dict[str, Any]
    started_at: float
    verdict: str | None
    reason: str | None
    manual: bool | None
    evidence: dict[str, Any] | None
    decided_at: float | None


@dataclass(slots=True)
class Claim:
    lease_id: str
    lease_expires_at: float
    groups: list[GroupRecord]
    stale: int
    """Groups marked stale (older than the staleness bound) while looking for fresh ones."""


@dataclass(slots=True)
class TrainerStepRecord:
    step: int
    metrics: dict[str, Any]
    created_at: float
