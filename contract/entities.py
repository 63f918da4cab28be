"""The control API's entities, each declared once: what the proxy answers is what its clients read.

Calls, episodes, groups, policy versions and claims cross the process boundary as JSON. The proxy's
routes build these models from the store's records (``from_attributes``: ``proxy/store/records.py``,
kept in step by ``tests/proxy/test_entities.py``) and fill every field; the client reads its
answers into the same models (``contract/endpoints.py``). Unknown fields are ignored, so an older
client reads a newer proxy's answers, and every field but an entity's identity has a default, so
an answer from an older proxy (or a model a test builds by hand) lacks what it never had without
breaking. A delta claim's calls are made whole here (``Claim.read``, ``Episode.rejoined``): callers
never see the store's delta encoding.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from contract.tokens import client_list, rejoin_ids, rejoin_messages
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


class _Entity(BaseModel):
    model_config = ConfigDict(from_attributes=True, extra="ignore")


class EpisodeKey(_Entity):
    """Returned once, at creation: what an agent needs to be recorded under this episode."""

    id: str
    api_key: str
    base_url: str


class CallDelta(_Entity):
    """How a call of a delta claim joins its base, an earlier call of its episode: its whole prompt
    ids are the base's prompt ids, then the sampled ``token_ids`` of the base's choice at
    ``prompt_choice`` (none when -1), then its own ``prompt_token_ids``; its whole messages are the
    base request's first ``messages_from`` messages, then its own; the same for ``client_from`` and
    ``client_request``'s ``messages`` (Messages API) or ``input`` (Responses API). A null field:
    that part is whole."""

    base_ordinal: int
    prompt_choice: int | None
    messages_from: int | None
    client_from: int | None = None


class Call(_Entity):
    """One recorded model call of an episode."""

    id: int = 0
    """The store's row id (0: a call built by hand, never stored)."""
    ordinal: int
    """Its place in the episode (0-based)."""
    kind: CallKind = "chat"
    stream: bool = False
    request: dict[str, Any] = {}
    """The chat or completions request the proxy executed."""
    response: dict[str, Any] | None = None
    status_code: int = 200
    error: dict[str, Any] | None = None
    prompt_token_ids: list[int] | None = None
    choices: list[dict[str, Any]] = []
    exact_ids: bool = False
    model_requested: str = ""
    model_served: str | None = None
    policy_version: int | None = None
    replica: str | None = None
    started_at: float = 0.0
    latency_ms: float = 0.0
    ttft_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    notes: dict[str, Any] | None = None
    """What the proxy decided for the call; ``notes["sampling"]`` is the effective sampling (proxy/sampling.py)."""
    api: CallApi = "chat"
    """The API the client spoke (``proxy/dialects``)."""
    client_request: dict[str, Any] | None = None
    """The client's own request when it was not a chat or completions request (``request`` is then
    the chat request the proxy executed)."""
    response_id: str | None = None
    """The id the client was given, where the API names answers (``resp_...``, ``msg_...``)."""
    receipt: str | None = None
    """The proxy's id of the call, sent with its answer as ``x-flywheel-call-id``: a ``call_rewards``
    key may name the call by it (``"call_<hex>"``, or ``"call_<hex>:<choice>"``)."""
    delta: CallDelta | None = None
    """Only in a claim asked with ``calls: "delta"``: this call's prompt ids and messages follow its
    base's. The client makes such a call whole (``Episode.rejoined``): None after it."""

    def joined(self, base: Call) -> Call:
        """This call of a delta claim made whole on ``base``, its base call, already whole."""
        d = self.delta
        assert d is not None
        update: dict[str, Any] = {"delta": None}
        if d.prompt_choice is not None:
            assert base.prompt_token_ids is not None and self.prompt_token_ids is not None
            sampled = base.choices[d.prompt_choice]["token_ids"] if d.prompt_choice >= 0 else None
            update["prompt_token_ids"] = rejoin_ids(base.prompt_token_ids, sampled, self.prompt_token_ids)
        if d.messages_from is not None:
            update["request"] = rejoin_messages(base.request, d.messages_from, self.request)
        if d.client_from is not None:
            key = client_list(self.client_request)
            assert base.client_request is not None and self.client_request is not None and key is not None
            update["client_request"] = rejoin_messages(base.client_request, d.client_from, self.client_request, key=key)
        return self.model_copy(update=update)


class Episode(_Entity):
    id: str
    group_id: str | None = None
    group_index: int | None = None
    task_id: str | None = None
    metadata: dict[str, Any] = {}
    status: EpisodeStatus
    reward: float | None = None
    call_rewards: dict[str, float] | None = None
    reward_metadata: dict[str, Any] | None = None
    abandon_reason: str | None = None
    abandon_cause: AbandonCause | None = None
    created_at: float = 0.0
    finished_at: float | None = None
    calls: list[Call] | None = None
    train_audit: dict[str, Any] | None = None
    """The trainer's ``EpisodeAudit`` once its group was trained (kept as sent, so older rows read)."""
    fork_of: str | None = None
    """A fork episode's source (``POST /episodes/{id}/fork``): its first ``fork_at`` answered calls
    were replayed from that episode's record, never sampled, and are context only in training."""
    fork_at: int | None = None
    fork_rule: ForkRule | None = None
    """What happens when the agent's request differs from the replayed one (``on_divergence``)."""
    diverged_at: int | None = None
    """The fork's call (0-based among its answered calls) whose request differed from the source's."""
    divergence: dict[str, Any] | None = None
    """Which request fields differed there, and the rule applied."""
    purged_at: float | None = None
    """When retention purged its calls' bodies and token ids (``retention.bodies_ttl_s``): its calls
    keep their counts, status and versions, with ``notes.purged``, and are never trained. None: whole."""
    awaiting_since: float | None = None
    """When it began awaiting a late reward (``POST /episodes/{id}/await_reward``, or the reaper for a
    task matching ``late_rewards.tasks``); kept once rewarded: its group is a late one. None: never."""
    policy_arm: Literal["canary", "baseline"] | None = None
    """Its arm of the canary running when it was created (``policy.canary``); None: no canary ran."""
    canary_version: int | None = None
    """The canary version whose test its reward is evidence for (with ``policy_arm``)."""

    def rejoined(self) -> Episode:
        """This episode with every call of a delta claim made whole, as ``calls: "whole"`` sends it.

        Calls come in ordinal order and a base is always an earlier call, so one pass suffices.
        """
        if not self.calls or all(c.delta is None for c in self.calls):
            return self
        whole: dict[int, Call] = {}
        for call in self.calls:
            if call.delta is not None:
                call = call.joined(whole[call.delta.base_ordinal])
            whole[call.ordinal] = call
        return self.model_copy(update={"calls": list(whole.values())})


class CreatedEpisode(Episode):
    """A lone episode just created: its key and base URL are handed out only here."""

    api_key: str
    base_url: str


class Group(_Entity):
    id: str
    task_id: str
    size: int = 0
    """Episodes in the group (GRPO's G); the proxy always sends it (0: a group built by hand without it)."""
    metadata: dict[str, Any] = {}
    status: GroupStatus
    created_at: float = 0.0
    completed_at: float | None = None
    train_status: TrainStatus = "pending"
    trained_step: int | None = None
    train_reason: SkipReason | None = None
    """Why it was never trained (``skipped`` or ``stale``); None: trained, pending, or skipped without one."""
    train_note: str | None = None
    counts: dict[str, int] = {}
    """Episodes by status, e.g. ``{"rewarded": 2}``."""
    episodes: list[Episode] | None = None


class CreatedGroup(Group):
    """A group just created: each episode's key and base URL are handed out only here."""

    episode_keys: list[EpisodeKey]


class PolicyVersion(_Entity):
    """A published policy version: what ``policy`` routes to once it is the newest (0: the base model)."""

    version: int
    name: str
    adapter_path: str = ""
    """The adapter directory as the vLLM replicas see it ("": the base model)."""
    created_at: float = 0.0
    metadata: dict[str, Any] = {}


class Claim(_Entity):
    """Complete groups leased to a trainer until ``lease_expires_at`` (``POST /trainer/claim``)."""

    lease_id: str
    lease_expires_at: float
    current_version: int
    stale: int = 0
    """Groups marked stale (older than the staleness bound) while looking for fresh ones."""
    groups: list[Group]

    @classmethod
    def read(cls, reply: Any) -> Claim:
        """A claim answer with its calls whole (a delta claim's are rejoined here)."""
        claim = cls.model_validate(reply)
        for group in claim.groups:
            if group.episodes:
                group.episodes = [e.rejoined() for e in group.episodes]
        return claim
