"""The proxy's control API as the workflows see it: groups, rewards, abandons, the policy version.

HTTP only (workflows never import the proxy). Replies are parsed into small pydantic models that
keep just the fields a workflow needs. Errors come back as ``ProxyError`` carrying the proxy's
status and OpenAI-style error type. Reward and abandon are idempotent on the proxy, so they are
retried on transport errors and 5xx; creating a group is not, so it is retried only when the
connection could not even be opened (the request never left).
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict

RETRIES = 4
"""Attempts for idempotent posts; the waits between them double from 0.5 s."""


class ProxyError(Exception):
    def __init__(self, status: int, message: str, error_type: str | None = None) -> None:
        super().__init__(f"proxy answered {status}: {message}")
        self.status = status
        self.message = message
        self.error_type = error_type


class _Reply(BaseModel):
    model_config = ConfigDict(extra="ignore")


class EpisodeKey(_Reply):
    id: str
    api_key: str
    base_url: str


class CreatedGroup(_Reply):
    id: str
    task_id: str
    size: int
    episode_keys: list[EpisodeKey]


class EpisodeState(_Reply):
    id: str
    group_id: str | None
    task_id: str | None
    status: str
    reward: float | None
    abandon_reason: str | None
    calls: list[dict[str, Any]] | None = None


class GroupState(_Reply):
    id: str
    status: str
    train_status: str
    counts: dict[str, int]


class ProxyClient:
    """One ``httpx.AsyncClient`` on the proxy's control API, authenticated with the admin key."""

    def __init__(self, proxy_url: str, admin_key: str, *, timeout_s: float = 60.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.proxy_url = proxy_url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.proxy_url, timeout=timeout_s, transport=transport,
                                       headers={"Authorization": f"Bearer {admin_key}"})

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, *, retry: Literal["idempotent", "connect", "no"] = "no",
                       **kwargs: Any) -> Any:
        attempts = 1 if retry == "no" else RETRIES
        for attempt in range(attempts):
            last = attempt + 1 >= attempts
            try:
                response = await self._http.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                unsent = isinstance(exc, httpx.ConnectError)
                if last or not (retry == "idempotent" or unsent):
                    raise ProxyError(0, f"{method} {path}: {type(exc).__name__}: {exc}") from exc
            else:
                if response.status_code < 400:
                    return response.json()
                if last or retry != "idempotent" or response.status_code < 500:
                    raise _error(response)
            await asyncio.sleep(0.5 * 2 ** attempt)
        raise AssertionError("unreachable")

    async def create_group(self, task_id: str, size: int, *, metadata: dict[str, Any],
                           episode_metadata: list[dict[str, Any]] | None = None) -> CreatedGroup:
        body = {"task_id": task_id, "size": size, "metadata": metadata, "episode_metadata": episode_metadata}
        return CreatedGroup.model_validate(await self._request("POST", "/groups", json=body, retry="connect"))

    async def reward(self, episode_id: str, reward: float, *, metadata: dict[str, Any] | None = None,
                     call_rewards: dict[int, float] | None = None) -> EpisodeState:
        body: dict[str, Any] = {"reward": reward, "metadata": metadata}
        if call_rewards:
            body["call_rewards"] = {str(k): v for k, v in call_rewards.items()}
        return EpisodeState.model_validate(
            await self._request("POST", f"/episodes/{episode_id}/reward", json=body, retry="idempotent"))

    async def abandon(self, episode_id: str, reason: str) -> EpisodeState:
        body = {"reason": reason[:4000] or "abandoned"}
        return EpisodeState.model_validate(
            await self._request("POST", f"/episodes/{episode_id}/abandon", json=body, retry="idempotent"))

    async def episode(self, episode_id: str, *, calls: bool = False) -> EpisodeState:
        return EpisodeState.model_validate(await self._request(
            "GET", f"/episodes/{episode_id}", params={"calls": str(calls).lower()}, retry="idempotent"))

    async def group(self, group_id: str) -> GroupState:
        return GroupState.model_validate(await self._request("GET", f"/groups/{group_id}", retry="idempotent"))

    async def pending_groups(self) -> int:
        """Complete groups the trainer has not taken yet (at most 1000 counted)."""
        reply = await self._request("GET", "/groups", params={"status": "complete", "train_status": "pending",
                                                               "limit": 1000}, retry="idempotent")
        return len(reply["data"])

    async def policy_version(self) -> int:
        return int((await self._request("GET", "/policy", retry="idempotent"))["version"])


def _error(response: httpx.Response) -> ProxyError:
    try:
        error = response.json()["error"]
        return ProxyError(response.status_code, str(error.get("message")), error.get("type"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return ProxyError(response.status_code, response.text[:500])
