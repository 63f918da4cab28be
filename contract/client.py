"""The proxy's control API over HTTP, sync (``ProxyClient``) and async (``AsyncProxyClient``).

Groups, episodes, rewards and abandons for workflows; claims, renewals, acks, step reports and
publishing for trainers. The trainer, the workflows and users' own scripts all use this client;
they still talk to the proxy over HTTP only.

Why it lives in ``contract``: it depends on httpx and pydantic alone. Importing ``contract.client``
loads ``contract/__init__.py`` (a docstring), ``contract.schemas`` and ``contract.entities``
(pydantic), ``contract.vocabulary`` (the statuses as ``Literal`` aliases) and ``contract.tokens``
(plain functions), never FastAPI, SQLAlchemy, the store or torch, so it imports in the engine venv
(Python 3.11: the trainer) and the agents venv (3.12: the workflows) alike.

Each call is declared once, in ``contract/endpoints.py`` (its signature, its request built from the
proxy's own wire models, its answer read into the entity the proxy's route built,
``contract/entities.py``); the two clients differ only in how they send (``_send``) and are
otherwise one table of those calls (``_Client``). Retry policy and errors: ``contract/retry.py``,
one rule for both clients.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Coroutine
from typing import Any, Generic, ParamSpec, TypeVar, overload

import httpx

from contract import endpoints
from contract.endpoints import CallRewards, Demand, Request
from contract.entities import Call, Claim, CreatedEpisode, CreatedGroup, Episode, EpisodeKey, Group, PolicyVersion
from contract.retry import RETRY, ProxyError, ProxyUnreachable, Refused, RetryRule, refusal

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
    "RetryRule",
]

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T", httpx.BaseTransport, httpx.AsyncBaseTransport)
H = TypeVar("H", httpx.Client, httpx.AsyncClient)
FAILED = (httpx.TransportError, Refused)
"""What a failed attempt raises: no answer, or an error answer (``retry.py`` decides what follows)."""


class _Method(Generic[P, R]):
    """A call of ``endpoints.py`` as a method of both clients: it returns the reply on a
    ``ProxyClient`` and a coroutine of it on an ``AsyncProxyClient``, with the call's signature and
    docstring either way."""

    def __init__(self, build: Callable[P, Request[R]]) -> None:
        self.build = build
        self.__doc__ = build.__doc__

    @overload
    def __get__(self, client: None, owner: type[Any]) -> _Method[P, R]: ...
    @overload
    def __get__(self, client: ProxyClient, owner: type[Any]) -> Callable[P, R]: ...
    @overload
    def __get__(self, client: AsyncProxyClient, owner: type[Any]) -> Callable[P, Coroutine[Any, Any, R]]: ...
    def __get__(self, client: ProxyClient | AsyncProxyClient | None, owner: type[Any]) -> Any:
        return self if client is None else client._bind(self.build)


class _Client(Generic[T, H]):
    """What both clients share: the connection settings, the retry rule, and every call as a method."""

    def __init__(
        self,
        proxy_url: str,
        admin_key: str,
        *,
        timeout_s: float = 120.0,
        connect_timeout_s: float = 10.0,
        retry: RetryRule = RETRY,
        transport: T | None = None,
    ) -> None:
        self.proxy_url = proxy_url.rstrip("/")
        self.retry = retry
        self._http: H = self._open(
            base_url=self.proxy_url,
            headers={"authorization": f"Bearer {admin_key}"},
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            transport=transport,
        )

    def _open(self, **options: Any) -> H:
        raise NotImplementedError

    def _wait_s(self, request: Request[Any], attempt: int, failure: httpx.TransportError | Refused) -> float:
        """The wait before the next attempt after failed attempt number ``attempt``; raises the error
        when the retry rule sends the call no more."""
        cause = failure.response if isinstance(failure, Refused) else failure
        if attempt < self.retry.attempts and self.retry.retries(request.repeat, cause):
            return self.retry.wait_s(attempt)
        if isinstance(cause, httpx.Response):
            raise refusal(cause) from None
        raise ProxyUnreachable(self.proxy_url, f"{request.method} {request.path}", cause) from cause

    # -- groups and episodes (workflows) ---------------------------------------------------------

    create_group = _Method(endpoints.create_group)
    fork = _Method(endpoints.fork)
    create_episode = _Method(endpoints.create_episode)
    group = _Method(endpoints.group)
    groups = _Method(endpoints.groups)
    pending_groups = _Method(endpoints.pending_groups)
    skip_counts = _Method(endpoints.skip_counts)
    episodes = _Method(endpoints.episodes)
    episode = _Method(endpoints.episode)
    reward = _Method(endpoints.reward)
    await_reward = _Method(endpoints.await_reward)
    abandon = _Method(endpoints.abandon)

    # -- policy and training (trainers) ----------------------------------------------------------

    policy = _Method(endpoints.policy)
    policy_versions = _Method(endpoints.policy_versions)
    publish = _Method(endpoints.publish)
    claim = _Method(endpoints.claim)
    renew = _Method(endpoints.renew)
    release = _Method(endpoints.release)
    ack = _Method(endpoints.ack)
    admission = _Method(endpoints.admission)
    report_step = _Method(endpoints.report_step)
    steps = _Method(endpoints.steps)

    # -- retention (operators) -------------------------------------------------------------------

    delete_episode = _Method(endpoints.delete_episode)
    delete_user = _Method(endpoints.delete_user)
    purge = _Method(endpoints.purge)
    audit_log = _Method(endpoints.audit_log)


class ProxyClient(_Client[httpx.BaseTransport, httpx.Client]):
    """Synchronous client (the trainer's loop is compute-bound and sequential; plain scripts).

    Thread-safe: one ``httpx.Client`` under it. ``transport`` replaces the network (tests)."""

    def _open(self, **options: Any) -> httpx.Client:
        return httpx.Client(**options)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ProxyClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, request: Request[R]) -> R:
        for attempt in range(1, self.retry.attempts + 1):
            try:
                return request.answer(self._http.request(**request.send_args()))
            except FAILED as failure:
                time.sleep(self._wait_s(request, attempt, failure))
        raise AssertionError("unreachable")

    def _bind(self, build: Callable[P, Request[R]]) -> Callable[P, R]:
        @functools.wraps(build)
        def method(*args: P.args, **kwargs: P.kwargs) -> R:
            return self._send(build(*args, **kwargs))

        return method


class AsyncProxyClient(_Client[httpx.AsyncBaseTransport, httpx.AsyncClient]):
    """Asynchronous client (workflows: many episodes at once); the same calls as ``ProxyClient``."""

    def _open(self, **options: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(**options)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncProxyClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _send(self, request: Request[R]) -> R:
        for attempt in range(1, self.retry.attempts + 1):
            try:
                return request.answer(await self._http.request(**request.send_args()))
            except FAILED as failure:
                await asyncio.sleep(self._wait_s(request, attempt, failure))
        raise AssertionError("unreachable")

    def _bind(self, build: Callable[P, Request[R]]) -> Callable[P, Coroutine[Any, Any, R]]:
        @functools.wraps(build)
        async def method(*args: P.args, **kwargs: P.kwargs) -> R:
            return await self._send(build(*args, **kwargs))

        return method
