"""The proxy's control API over HTTP, sync (``ProxyClient``) and async (``AsyncProxyClient``).

Groups, episodes, rewards and abandons for workflows; claims, renewals, acks, step reports and
publishing for trainers. The trainer, the workflows and users' own scripts all use this client;
they still talk to the proxy over HTTP only.

Why it lives in ``contract``: it depends on httpx and pydantic alone. Importing ``contract.client``
loads ``contract/__init__.py`` (a docstring), ``contract.schemas`` (pydantic), ``contract.vocabulary``
(the statuses as ``Literal`` aliases) and ``contract.tokens`` (plain functions), never FastAPI,
SQLAlchemy, the store or torch, so it imports in the engine venv (Python 3.11: the trainer) and the
agents venv (3.12: the workflows) alike. The request bodies are the proxy's own wire models: a field
renamed in ``schemas.py`` is renamed here by the type checker, not found missing at run time. Replies
are read into this module's lenient models (unknown fields ignored, most fields optional), which keep
what trainers and workflows read.

Retry policy (``RetryPolicy``; one rule for both variants). Every call is of one of two kinds (``Repeat``):

- ``safe``: a repeat has no further effect, so it is retried after any transport error (the
  request may or may not have reached the proxy) and after any 5xx answer. Reads; a reward and an
  abandon (the same reward again is a no-op, another one 409; an abandoned episode stays as it
  is); a claim (it carries a lease id chosen here and sent with every attempt: a retry whose first
  answer was lost gets the groups that lease already holds, not a second set); renew, release,
  ack (the same step again is a no-op), step reports (a repeat replaces) and publish (a repeat of
  a version already applied is refused 409; ``trainer.publish`` then finds it among the versions).
- ``unsent``: creating a group or an episode; a repeat would create a second one, so it is
  retried only when the request cannot have left: the connection was refused or timed out
  (``httpx.ConnectError``, ``httpx.ConnectTimeout``).

A 4xx answer is never retried. Up to ``attempts`` (7) attempts; the waits between them start at
``first_wait_s`` (0.5 s) and double up to ``max_wait_s`` (8 s): 0.5, 1, 2, 4, 8, 8 s, 23.5 s in
all, long enough for a proxy restart.

Errors:

    ProxyError (status, message, error_type, code)   the proxy answered 4xx or 5xx (its OpenAI-style error)
    └── ProxyUnreachable (status 0)                  no answer: connect, timeout or read error (``__cause__``)
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import httpx
from pydantic import BaseModel, ConfigDict, Field

from contract.schemas import (
    AbandonIn,
    AckIn,
    CallDeltaOut,
    ClaimIn,
    EpisodeAudit,
    EpisodeCreate,
    EpisodeKey,
    GroupCreate,
    PublishIn,
    ReleaseIn,
    RenewIn,
    RewardIn,
    StepIn,
)
from contract.tokens import rejoin_ids, rejoin_messages
from contract.vocabulary import AbandonCause, AckStatus, CallKind, EpisodeStatus, GroupStatus, TrainMode, TrainStatus

__all__ = [
    "AsyncProxyClient",
    "Call",
    "CallRewards",
    "Claim",
    "CreatedEpisode",
    "Demand",
    "CreatedGroup",
    "Episode",
    "EpisodeKey",
    "Group",
    "PolicyVersion",
    "ProxyClient",
    "ProxyError",
    "ProxyUnreachable",
    "RetryPolicy",
]

R = TypeVar("R")
Repeat = Literal["safe", "unsent"]
"""When a call may be sent again: after any failure but a 4xx, or only when it never left (module docstring)."""
CallRewards = Mapping[int, float] | Mapping[str, float]
"""Per-call rewards keyed by call ordinal (``2`` or ``"2"``), or ``"ordinal:choice"`` for a call with n > 1."""
UNSENT = (httpx.ConnectError, httpx.ConnectTimeout)
"""Transport errors raised before the request left: no proxy can have acted on it."""


class ProxyError(Exception):
    """The proxy answered with an error: ``status``, its message, OpenAI error ``type`` and ``code``."""

    def __init__(
        self,
        status: int,
        message: str,
        error_type: str | None = None,
        code: str | None = None,
        *,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(f"proxy answered {status}: {message}")
        self.status = status
        self.message = message
        self.error_type = error_type
        self.code = code
        self.retry_after_s = retry_after_s
        """The answer's ``Retry-After`` in seconds (a 429: e.g. ``backlog_full`` from ``POST /groups``)."""


class ProxyUnreachable(ProxyError):
    """No answer from the proxy (status 0); the transport error is the ``__cause__``."""

    def __init__(self, url: str, call: str, cause: Exception) -> None:
        super().__init__(
            0,
            f"cannot reach the proxy at {url} ({call}: {type(cause).__name__}: {cause}); "
            "is `python -m proxy serve` running and the proxy URL right?",
        )


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a call is repeated (the rule itself: module docstring)."""

    attempts: int = 7
    """Attempts per call, the first included."""
    first_wait_s: float = 0.5
    """Wait after the first failed attempt (s); it doubles after each further one."""
    max_wait_s: float = 8.0
    """The longest wait between two attempts (s)."""

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1 (got {self.attempts})")

    def wait_s(self, failed: int) -> float:
        """The wait after ``failed`` attempts have failed (1, 2, ...)."""
        return float(min(self.first_wait_s * 2 ** (failed - 1), self.max_wait_s))

    def retries(self, repeat: Repeat, failure: httpx.Response | httpx.TransportError) -> bool:
        """Whether a call of kind ``repeat`` is sent again after ``failure`` (an error answer or a transport error)."""
        if isinstance(failure, httpx.Response):
            return repeat == "safe" and failure.status_code >= 500
        return repeat == "safe" or isinstance(failure, UNSENT)


RETRY = RetryPolicy()
"""The default: 7 attempts, waits of 0.5 s doubling up to 8 s."""


@dataclass(frozen=True)
class Demand:
    """What a trainer takes, sent with its claims: the proxy admits new groups from it (``proxy/admission.py``)."""

    groups_per_step: int
    mode: TrainMode


# -- replies ---------------------------------------------------------------------------------------


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


# -- requests --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Request(Generic[R]):
    """One call: what to send, when it may be sent again, how to read the answer."""

    method: Literal["GET", "POST"]
    path: str
    repeat: Repeat
    read: Callable[[Any], R]
    body: BaseModel | None = None
    params: dict[str, str | int] | None = None

    def send_args(self) -> dict[str, Any]:
        # model_construct + model_dump: the proxy validates; a bad value gets its 400, as from any client.
        body = None if self.body is None else self.body.model_dump(warnings=False)
        return {"method": self.method, "url": self.path, "json": body, "params": self.params}


def _data(read: Callable[[Any], R]) -> Callable[[Any], list[R]]:
    return lambda reply: [read(item) for item in reply["data"]]


def _none(_: Any) -> None:
    return None


class _Api:
    """The requests of the control API, built once for both clients."""

    @staticmethod
    def create_group(
        task_id: str, size: int, metadata: dict[str, Any] | None, episode_metadata: list[dict[str, Any]] | None
    ) -> _Request[CreatedGroup]:
        body = GroupCreate.model_construct(
            task_id=task_id, size=size, metadata=metadata or {}, episode_metadata=episode_metadata
        )
        return _Request("POST", "/groups", "unsent", CreatedGroup.model_validate, body)

    @staticmethod
    def create_episode(task_id: str | None, metadata: dict[str, Any] | None) -> _Request[CreatedEpisode]:
        body = EpisodeCreate.model_construct(task_id=task_id, metadata=metadata or {})
        return _Request("POST", "/episodes", "unsent", CreatedEpisode.model_validate, body)

    @staticmethod
    def group(group_id: str) -> _Request[Group]:
        return _Request("GET", f"/groups/{group_id}", "safe", Group.model_validate)

    @staticmethod
    def pending_groups() -> _Request[int]:
        # Not leased: groups a trainer holds are being trained, not waiting (counting them kept the
        # runner from generating during a step: generation and training took turns).
        params: dict[str, str | int] = {
            "status": "complete",
            "train_status": "pending",
            "leased": "false",
            "limit": 1000,
        }
        return _Request("GET", "/groups", "safe", lambda reply: len(reply["data"]), params=params)

    @staticmethod
    def episode(episode_id: str, calls: bool) -> _Request[Episode]:
        return _Request(
            "GET", f"/episodes/{episode_id}", "safe", Episode.model_validate, params={"calls": str(calls).lower()}
        )

    @staticmethod
    def reward(
        episode_id: str, reward: float, call_rewards: CallRewards | None, metadata: dict[str, Any] | None
    ) -> _Request[Episode]:
        keyed = {str(k): v for k, v in call_rewards.items()} if call_rewards else None
        body = RewardIn.model_construct(reward=reward, call_rewards=keyed, metadata=metadata)
        return _Request("POST", f"/episodes/{episode_id}/reward", "safe", Episode.model_validate, body)

    @staticmethod
    def abandon(episode_id: str, reason: str, cause: AbandonCause) -> _Request[Episode]:
        body = AbandonIn.model_construct(reason=reason[:4000] or "abandoned", cause=cause)  # the proxy's limits
        return _Request("POST", f"/episodes/{episode_id}/abandon", "safe", Episode.model_validate, body)

    @staticmethod
    def policy() -> _Request[PolicyVersion]:
        return _Request("GET", "/policy", "safe", PolicyVersion.model_validate)

    @staticmethod
    def policy_versions() -> _Request[list[PolicyVersion]]:
        return _Request("GET", "/policy/versions", "safe", _data(PolicyVersion.model_validate))

    @staticmethod
    def publish(adapter_path: str, version: int | None, metadata: dict[str, Any] | None) -> _Request[PolicyVersion]:
        body = PublishIn.model_construct(adapter_path=adapter_path, version=version, metadata=metadata or {})
        return _Request("POST", "/policy/publish", "safe", PolicyVersion.model_validate, body)

    @staticmethod
    def claim(
        trainer_id: str,
        max_groups: int,
        lease_s: float,
        max_staleness: int | None,
        lease_id: str | None,
        demand: Demand | None,
    ) -> _Request[Claim]:
        body = ClaimIn.model_construct(
            trainer_id=trainer_id,
            max_groups=max_groups,
            lease_s=lease_s,
            max_staleness=max_staleness,
            lease_id=lease_id or str(uuid.uuid4()),
            groups_per_step=demand.groups_per_step if demand else None,
            mode=demand.mode if demand else None,
            calls="delta",
        )
        return _Request("POST", "/trainer/claim", "safe", Claim.read, body)

    @staticmethod
    def renew(lease_id: str, group_ids: list[str], lease_s: float, trainer_id: str | None) -> _Request[float]:
        body = RenewIn.model_construct(lease_id=lease_id, group_ids=group_ids, lease_s=lease_s, trainer_id=trainer_id)
        return _Request("POST", "/trainer/renew", "safe", lambda reply: float(reply["lease_expires_at"]), body)

    @staticmethod
    def release(lease_id: str, group_ids: list[str] | None) -> _Request[int]:
        body = ReleaseIn.model_construct(lease_id=lease_id, group_ids=group_ids)
        return _Request("POST", "/trainer/release", "safe", lambda reply: int(reply["released"]), body)

    @staticmethod
    def ack(
        lease_id: str,
        group_ids: list[str],
        step: int,
        status: AckStatus,
        note: str | None,
        audits: dict[str, EpisodeAudit] | None,
    ) -> _Request[list[Group]]:
        body = AckIn.model_construct(
            lease_id=lease_id, group_ids=group_ids, step=step, status=status, note=note, audits=audits
        )
        return _Request("POST", "/trainer/ack", "safe", _data(Group.model_validate), body)

    @staticmethod
    def report_step(step: int, metrics: dict[str, Any]) -> _Request[None]:
        return _Request("POST", "/trainer/steps", "safe", _none, StepIn.model_construct(step=step, metrics=metrics))

    @staticmethod
    def steps(since_step: int) -> _Request[list[dict[str, Any]]]:
        return _Request(
            "GET", "/trainer/steps", "safe", lambda reply: list(reply["data"]), params={"since_step": since_step}
        )


def _answer(request: _Request[R], response: httpx.Response) -> R:
    return request.read(response.json() if response.content else None)


def _give_up(
    retry: RetryPolicy, url: str, request: _Request[Any], attempt: int, failure: httpx.Response | httpx.TransportError
) -> ProxyError | None:
    """After failed attempt number ``attempt``: None to try again, else the error to raise."""
    if attempt < retry.attempts and retry.retries(request.repeat, failure):
        return None
    if isinstance(failure, httpx.TransportError):
        unreachable = ProxyUnreachable(url, f"{request.method} {request.path}", failure)
        unreachable.__cause__ = failure
        return unreachable
    try:
        error = failure.json().get("error") or {}
    except (ValueError, AttributeError):  # not JSON, or JSON but not an object
        error = {}
    if not isinstance(error, dict):
        error = {"message": str(error)}
    return ProxyError(
        failure.status_code,
        str(error.get("message") or failure.text[:500]),
        error.get("type"),
        error.get("code"),
        retry_after_s=_retry_after(failure.headers.get("retry-after")),
    )


def _retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds; the proxy sends whole seconds (an HTTP date is not expected, so None)."""
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


# -- the clients -----------------------------------------------------------------------------------


class ProxyClient:
    """Synchronous client (the trainer's loop is compute-bound and sequential; plain scripts).

    Thread-safe: one ``httpx.Client`` under it. ``transport`` replaces the network (tests)."""

    def __init__(
        self,
        proxy_url: str,
        admin_key: str,
        *,
        timeout_s: float = 120.0,
        connect_timeout_s: float = 10.0,
        retry: RetryPolicy = RETRY,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.proxy_url = proxy_url.rstrip("/")
        self.retry = retry
        self._http = httpx.Client(
            base_url=self.proxy_url,
            headers={"authorization": f"Bearer {admin_key}"},
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            transport=transport,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ProxyClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, request: _Request[R]) -> R:
        for attempt in range(1, self.retry.attempts + 1):
            failure: httpx.Response | httpx.TransportError
            try:
                response = self._http.request(**request.send_args())
            except httpx.TransportError as exc:
                failure = exc
            else:
                if response.status_code < 400:
                    return _answer(request, response)
                failure = response
            if (error := _give_up(self.retry, self.proxy_url, request, attempt, failure)) is not None:
                raise error
            time.sleep(self.retry.wait_s(attempt))
        raise AssertionError("unreachable")

    # -- groups and episodes (workflows) ---------------------------------------------------------

    def create_group(
        self,
        task_id: str,
        size: int,
        *,
        metadata: dict[str, Any] | None = None,
        episode_metadata: list[dict[str, Any]] | None = None,
    ) -> CreatedGroup:
        """A group of ``size`` episodes for one task; each episode's key and base URL are in ``episode_keys``."""
        return self._send(_Api.create_group(task_id, size, metadata, episode_metadata))

    def create_episode(self, task_id: str | None = None, *, metadata: dict[str, Any] | None = None) -> CreatedEpisode:
        """A lone episode (recorded, never trained on by GRPO)."""
        return self._send(_Api.create_episode(task_id, metadata))

    def group(self, group_id: str) -> Group:
        return self._send(_Api.group(group_id))

    def pending_groups(self) -> int:
        """Complete groups the trainer has not taken yet (at most 1000 counted)."""
        return self._send(_Api.pending_groups())

    def episode(self, episode_id: str, *, calls: bool = True) -> Episode:
        return self._send(_Api.episode(episode_id, calls))

    def reward(
        self,
        episode_id: str,
        reward: float,
        *,
        call_rewards: CallRewards | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Episode:
        """Finish an episode with its reward; ``call_rewards`` keyed by call ordinal (or ``"ordinal:choice"``)."""
        return self._send(_Api.reward(episode_id, reward, call_rewards, metadata))

    def abandon(self, episode_id: str, reason: str, cause: AbandonCause = "agent") -> Episode:
        """Finish an episode without a reward (never trained on); the reason is cut to the proxy's 4000 characters."""
        return self._send(_Api.abandon(episode_id, reason, cause))

    # -- policy and training (trainers) ----------------------------------------------------------

    def policy(self) -> PolicyVersion:
        return self._send(_Api.policy())

    def policy_versions(self) -> list[PolicyVersion]:
        return self._send(_Api.policy_versions())

    def publish(
        self, *, adapter_path: str, version: int | None = None, metadata: dict[str, Any] | None = None
    ) -> PolicyVersion:
        return self._send(_Api.publish(adapter_path, version, metadata))

    def claim(
        self,
        *,
        trainer_id: str,
        max_groups: int,
        lease_s: float,
        max_staleness: int | None,
        lease_id: str | None = None,
        demand: Demand | None = None,
    ) -> Claim:
        """Lease up to ``max_groups`` complete groups under ``lease_id`` (default a fresh one): retried
        with that id, a claim whose answer was lost returns the same groups. ``demand`` tells the
        proxy's admission control what the trainer takes per step (``proxy/admission.py``)."""
        return self._send(_Api.claim(trainer_id, max_groups, lease_s, max_staleness, lease_id, demand))

    def renew(self, *, lease_id: str, group_ids: list[str], lease_s: float, trainer_id: str | None = None) -> float:
        """Extend a lease on ``group_ids`` by ``lease_s`` from now; returns the new expiry. A 409
        ``lease_lost`` means one of the groups was claimed again: the step must be dropped."""
        return self._send(_Api.renew(lease_id, group_ids, lease_s, trainer_id))

    def release(self, *, lease_id: str, group_ids: list[str] | None = None) -> int:
        """Hand a lease's untrained groups back now instead of when it expires."""
        return self._send(_Api.release(lease_id, group_ids))

    def ack(
        self,
        *,
        lease_id: str,
        group_ids: list[str],
        step: int,
        status: AckStatus,
        note: str | None = None,
        audits: dict[str, EpisodeAudit] | None = None,
    ) -> list[Group]:
        """Ack leased groups for ``step``; ``audits``: the fidelity audit of each of their episodes."""
        return self._send(_Api.ack(lease_id, group_ids, step, status, note, audits))

    def report_step(self, step: int, metrics: dict[str, Any]) -> None:
        self._send(_Api.report_step(step, metrics))

    def steps(self, since_step: int = -1) -> list[dict[str, Any]]:
        return self._send(_Api.steps(since_step))


class AsyncProxyClient:
    """Asynchronous client (workflows: many episodes at once); the same calls as ``ProxyClient``."""

    def __init__(
        self,
        proxy_url: str,
        admin_key: str,
        *,
        timeout_s: float = 120.0,
        connect_timeout_s: float = 10.0,
        retry: RetryPolicy = RETRY,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.proxy_url = proxy_url.rstrip("/")
        self.retry = retry
        self._http = httpx.AsyncClient(
            base_url=self.proxy_url,
            headers={"authorization": f"Bearer {admin_key}"},
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            transport=transport,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncProxyClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _send(self, request: _Request[R]) -> R:
        for attempt in range(1, self.retry.attempts + 1):
            failure: httpx.Response | httpx.TransportError
            try:
                response = await self._http.request(**request.send_args())
            except httpx.TransportError as exc:
                failure = exc
            else:
                if response.status_code < 400:
                    return _answer(request, response)
                failure = response
            if (error := _give_up(self.retry, self.proxy_url, request, attempt, failure)) is not None:
                raise error
            await asyncio.sleep(self.retry.wait_s(attempt))
        raise AssertionError("unreachable")

    # -- groups and episodes (workflows) ---------------------------------------------------------

    async def create_group(
        self,
        task_id: str,
        size: int,
        *,
        metadata: dict[str, Any] | None = None,
        episode_metadata: list[dict[str, Any]] | None = None,
    ) -> CreatedGroup:
        return await self._send(_Api.create_group(task_id, size, metadata, episode_metadata))

    async def create_episode(
        self, task_id: str | None = None, *, metadata: dict[str, Any] | None = None
    ) -> CreatedEpisode:
        return await self._send(_Api.create_episode(task_id, metadata))

    async def group(self, group_id: str) -> Group:
        return await self._send(_Api.group(group_id))

    async def pending_groups(self) -> int:
        return await self._send(_Api.pending_groups())

    async def episode(self, episode_id: str, *, calls: bool = True) -> Episode:
        return await self._send(_Api.episode(episode_id, calls))

    async def reward(
        self,
        episode_id: str,
        reward: float,
        *,
        call_rewards: CallRewards | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Episode:
        return await self._send(_Api.reward(episode_id, reward, call_rewards, metadata))

    async def abandon(self, episode_id: str, reason: str, cause: AbandonCause = "agent") -> Episode:
        return await self._send(_Api.abandon(episode_id, reason, cause))

    # -- policy and training (trainers) ----------------------------------------------------------

    async def policy(self) -> PolicyVersion:
        return await self._send(_Api.policy())

    async def policy_versions(self) -> list[PolicyVersion]:
        return await self._send(_Api.policy_versions())

    async def publish(
        self, *, adapter_path: str, version: int | None = None, metadata: dict[str, Any] | None = None
    ) -> PolicyVersion:
        return await self._send(_Api.publish(adapter_path, version, metadata))

    async def claim(
        self,
        *,
        trainer_id: str,
        max_groups: int,
        lease_s: float,
        max_staleness: int | None,
        lease_id: str | None = None,
        demand: Demand | None = None,
    ) -> Claim:
        return await self._send(_Api.claim(trainer_id, max_groups, lease_s, max_staleness, lease_id, demand))

    async def renew(
        self, *, lease_id: str, group_ids: list[str], lease_s: float, trainer_id: str | None = None
    ) -> float:
        return await self._send(_Api.renew(lease_id, group_ids, lease_s, trainer_id))

    async def release(self, *, lease_id: str, group_ids: list[str] | None = None) -> int:
        return await self._send(_Api.release(lease_id, group_ids))

    async def ack(
        self,
        *,
        lease_id: str,
        group_ids: list[str],
        step: int,
        status: AckStatus,
        note: str | None = None,
        audits: dict[str, EpisodeAudit] | None = None,
    ) -> list[Group]:
        """Ack leased groups for ``step``; ``audits``: the fidelity audit of each of their episodes."""
        return await self._send(_Api.ack(lease_id, group_ids, step, status, note, audits))

    async def report_step(self, step: int, metrics: dict[str, Any]) -> None:
        await self._send(_Api.report_step(step, metrics))

    async def steps(self, since_step: int = -1) -> list[dict[str, Any]]:
        return await self._send(_Api.steps(since_step))
