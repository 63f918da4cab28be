"""The proxy's trainer and policy API over HTTP: claim, ack, steps, publish (the trainer never imports the proxy).

Replies are parsed into small pydantic models with just the fields training needs. Errors come
back as ``ProxyError`` with the proxy's status, error type and code. Every request is idempotent on
the proxy, so each is retried on transport errors and 5xx: ack, renew, step reports and publish by
nature, and a claim because it carries a lease id chosen here (a retry whose first answer was lost
gets the groups that lease already holds, not a second set nobody would train).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field

RETRIES = 7
"""Attempts for idempotent requests; waits between them double from 0.5 s up to 8 s (about 30 s in
all: long enough for a proxy restart)."""


class ProxyError(Exception):
    def __init__(self, status: int, message: str, error_type: str | None = None, code: str | None = None) -> None:
        super().__init__(f"proxy answered {status}: {message}")
        self.status = status
        self.message = message
        self.error_type = error_type
        self.code = code


class ProxyUnreachable(ProxyError):
    def __init__(self, url: str, cause: Exception) -> None:
        super().__init__(0, f"cannot reach the proxy at {url} ({type(cause).__name__}: {cause}); "
                            "is `python -m proxy serve` running and proxy_url right?")


class _Reply(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Call(_Reply):
    ordinal: int
    kind: str = "chat"
    request: dict[str, Any] = Field(default_factory=dict)
    status_code: int = 200
    prompt_token_ids: list[int] | None = None
    choices: list[dict[str, Any]] = Field(default_factory=list)
    exact_ids: bool = False
    policy_version: int | None = None
    model_requested: str = ""
    notes: dict[str, Any] | None = None
    """What the proxy decided for the call; ``notes["sampling"]`` is the effective sampling (proxy/sampling.py)."""


class Episode(_Reply):
    id: str
    group_id: str | None = None
    status: str
    reward: float | None = None
    call_rewards: dict[str, float] | None = None
    abandon_reason: str | None = None
    calls: list[Call] | None = None


class Group(_Reply):
    id: str
    task_id: str
    status: str
    train_status: str = "pending"
    trained_step: int | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    episodes: list[Episode] | None = None


class Claim(_Reply):
    lease_id: str
    lease_expires_at: float
    current_version: int
    stale: int = 0
    groups: list[Group]


class Policy(_Reply):
    version: int
    name: str
    adapter_path: str = ""


class ProxyClient:
    """Synchronous client: the trainer's loop is compute-bound and sequential."""

    def __init__(self, base_url: str, admin_key: str, *, timeout_s: float = 120.0, retries: int = RETRIES,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self._http = httpx.Client(base_url=self.base_url, headers={"authorization": f"Bearer {admin_key}"},
                                  timeout=httpx.Timeout(timeout_s, connect=10.0), transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ProxyClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transport -------------------------------------------------------------------------------

    def _send(self, method: str, path: str, *, idempotent: bool, **kwargs: Any) -> Any:
        delay = 0.5
        for attempt in range(self.retries):
            last = attempt == self.retries - 1
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.ConnectError as exc:
                if last:
                    raise ProxyUnreachable(self.base_url, exc) from exc
            except httpx.TransportError as exc:  # the request may have reached the proxy
                if not idempotent or last:
                    raise ProxyUnreachable(self.base_url, exc) from exc
            else:
                if response.status_code < 400:
                    return response.json() if response.content else None
                if response.status_code < 500 or not idempotent or last:
                    raise _error(response)
            time.sleep(delay)
            delay = min(delay * 2, 8.0)
        raise AssertionError("unreachable")

    # -- API -------------------------------------------------------------------------------------

    def policy(self) -> Policy:
        return Policy.model_validate(self._send("GET", "/policy", idempotent=True))

    def policy_versions(self) -> list[Policy]:
        return [Policy.model_validate(p) for p in self._send("GET", "/policy/versions", idempotent=True)["data"]]

    def claim(self, *, trainer_id: str, max_groups: int, lease_s: float, max_staleness: int | None,
              lease_id: str | None = None) -> Claim:
        """Lease up to ``max_groups`` groups under a new lease id (``lease_id``, default a fresh one):
        retried with that id, a claim whose answer was lost returns the same groups."""
        body = {"trainer_id": trainer_id, "max_groups": max_groups, "lease_s": lease_s,
                "max_staleness": max_staleness, "lease_id": lease_id or str(uuid.uuid4())}
        return Claim.model_validate(self._send("POST", "/trainer/claim", idempotent=True, json=body))

    def renew(self, *, lease_id: str, group_ids: list[str], lease_s: float) -> float:
        """Extend a lease on ``group_ids`` by ``lease_s`` from now; returns the new expiry. A 409
        ``lease_lost`` means one of the groups was claimed again: the step must be dropped."""
        body = {"lease_id": lease_id, "group_ids": group_ids, "lease_s": lease_s}
        return float(self._send("POST", "/trainer/renew", idempotent=True, json=body)["lease_expires_at"])

    def release(self, *, lease_id: str, group_ids: list[str] | None = None) -> int:
        """Hand a lease's untrained groups back now instead of when it expires."""
        body = {"lease_id": lease_id, "group_ids": group_ids}
        return int(self._send("POST", "/trainer/release", idempotent=True, json=body)["released"])

    def ack(self, *, lease_id: str, group_ids: list[str], step: int,
            status: Literal["trained", "skipped"], note: str | None = None) -> list[Group]:
        body = {"lease_id": lease_id, "group_ids": group_ids, "step": step, "status": status, "note": note}
        reply = self._send("POST", "/trainer/ack", idempotent=True, json=body)
        return [Group.model_validate(g) for g in reply["data"]]

    def report_step(self, step: int, metrics: dict[str, Any]) -> None:
        self._send("POST", "/trainer/steps", idempotent=True, json={"step": step, "metrics": metrics})

    def steps(self, since_step: int = -1) -> list[dict[str, Any]]:
        return list(self._send("GET", "/trainer/steps", idempotent=True, params={"since_step": since_step})["data"])

    def publish(self, *, adapter_path: str, version: int, metadata: dict[str, Any]) -> Policy:
        body = {"adapter_path": adapter_path, "version": version, "metadata": metadata}
        return Policy.model_validate(self._send("POST", "/policy/publish", idempotent=True, json=body))

    def group(self, group_id: str) -> Group:
        return Group.model_validate(self._send("GET", f"/groups/{group_id}", idempotent=True))

    def episode(self, episode_id: str) -> Episode:
        return Episode.model_validate(self._send("GET", f"/episodes/{episode_id}", idempotent=True,
                                                 params={"calls": "true"}))


def _error(response: httpx.Response) -> ProxyError:
    try:
        err = response.json().get("error") or {}
    except ValueError:
        err = {}
    if not isinstance(err, dict):
        err = {"message": str(err)}
    return ProxyError(response.status_code, str(err.get("message") or response.text[:500]),
                      err.get("type"), err.get("code"))
