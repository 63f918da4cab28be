"""The control API's answers as the client reads them: lenient models of what trainers and workflows use.

Unknown fields are ignored and most fields are optional, so a proxy that answers with more (a newer
version) does not break an older client. A delta claim's calls come back whole (``Claim.read``,
``Episode.rejoined``): callers never see the store's delta encoding.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from contract.schemas import CallDeltaOut, EpisodeKey
from contract.tokens import rejoin_ids, rejoin_messages
from contract.vocabulary import AbandonCause, CallKind, EpisodeStatus, GroupStatus, TrainStatus


class _Reply(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Call(_Reply):
    """One recorded model call of an episode (``CallOut``), the fields a trainer reads."""

    ordinal: int
    kind: CallKind = "chat"
    request: dict[str, Any] = Field(default_factory=dict)
    status_code: int = 200
    prompt_token_ids: list[int] | None = None
    choices: list[dict[str, Any]] = Field(default_factory=list)
    exact_ids: bool = False
    policy_version: int | None = None
    model_requested: str = ""
    notes: dict[str, Any] | None = None
    """What the proxy decided for the call; ``notes["sampling"]`` is the effective sampling (proxy/sampling.py)."""
    delta: CallDeltaOut | None = None
    """Set on a call of a delta claim until ``Episode.rejoined`` makes it whole (always None after it)."""


class Episode(_Reply):
    id: str
    group_id: str | None = None
    task_id: str | None = None
    status: EpisodeStatus
    reward: float | None = None
    call_rewards: dict[str, float] | None = None
    abandon_reason: str | None = None
    abandon_cause: AbandonCause | None = None
    calls: list[Call] | None = None
    train_audit: dict[str, Any] | None = None

    def rejoined(self) -> Episode:
        """This episode with every call of a delta claim made whole, as ``calls: "whole"`` sends it.

        Calls come in ordinal order and a base is always an earlier call, so one pass suffices.
        """
        if not self.calls or all(c.delta is None for c in self.calls):
            return self
        whole: dict[int, Call] = {}
        for call in self.calls:
            d = call.delta
            if d is not None:
                base = whole[d.base_ordinal]
                update: dict[str, Any] = {"delta": None}
                if d.prompt_choice is not None:
                    assert base.prompt_token_ids is not None and call.prompt_token_ids is not None
                    sampled = base.choices[d.prompt_choice]["token_ids"] if d.prompt_choice >= 0 else None
                    update["prompt_token_ids"] = rejoin_ids(base.prompt_token_ids, sampled, call.prompt_token_ids)
                if d.messages_from is not None:
                    update["request"] = rejoin_messages(base.request, d.messages_from, call.request)
                call = call.model_copy(update=update)
            whole[call.ordinal] = call
        return self.model_copy(update={"calls": list(whole.values())})


class CreatedEpisode(Episode):
    """A lone episode just created: its key and base URL are handed out only here."""

    api_key: str
    base_url: str


class Group(_Reply):
    id: str
    task_id: str
    status: GroupStatus
    train_status: TrainStatus = "pending"
    trained_step: int | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    counts: dict[str, int] = Field(default_factory=dict)
    """Episodes by status, e.g. ``{"rewarded": 2}``."""
    episodes: list[Episode] | None = None


class CreatedGroup(Group):
    """A group just created: each episode's key and base URL are handed out only here."""

    size: int
    episode_keys: list[EpisodeKey]


class Claim(_Reply):
    lease_id: str
    lease_expires_at: float
    current_version: int
    stale: int = 0
    groups: list[Group]

    @classmethod
    def read(cls, reply: Any) -> Claim:
        """A claim answer with its calls whole (a delta claim's are rejoined here)."""
        claim = cls.model_validate(reply)
        for group in claim.groups:
            if group.episodes:
                group.episodes = [e.rejoined() for e in group.episodes]
        return claim


class PolicyVersion(_Reply):
    """A published policy version: what ``policy`` routes to once it is the newest (0: the base model)."""

    version: int
    name: str
    adapter_path: str = ""
