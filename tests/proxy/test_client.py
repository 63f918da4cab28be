"""contract/client.py: one retry policy for the sync and async clients, errors mapped, one client everywhere.

The retry rules run against ``fake_proxy``, a named ``httpx.MockTransport`` that answers from a
script (a status, or a transport error), so every failure is exact and no test waits. What the
rules rely on (a repeated reward, abandon, claim or ack changes nothing) runs against the real
proxy app in-process on SQLite, through the async client.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from contract.client import AsyncProxyClient, ProxyClient, ProxyError, ProxyUnreachable, RetryRule
from contract.schemas import AckIn, ClaimIn, GroupCreate, RewardIn
from tests.proxy.conftest import ADMIN_KEY, fake_upstream, make_settings, running_app
from tests.support.services import ROOT

URL = "http://proxy.test"
EPISODE = {"id": "e1", "group_id": "g1", "task_id": "t", "status": "rewarded", "reward": 1.0, "abandon_reason": None}
GROUP = {
    "id": "g1",
    "task_id": "t",
    "size": 1,
    "status": "open",
    "train_status": "pending",
    "counts": {},
    "metadata": {},
    "episode_keys": [{"id": "e1", "api_key": "fw-ep-x", "base_url": f"{URL}/episodes/e1/v1"}],
}
NO_WAIT = RetryRule(first_wait_s=0.0)

Script = list[int | type[httpx.TransportError]]
"""What ``fake_proxy`` does for each request in turn: answer with a status, or raise that transport error."""


class FakeProxy:
    """``fake_proxy``: a scripted stand-in for the proxy; the last entry repeats. Records every request."""

    def __init__(self, script: Script, ok: dict[str, Any] | None = None) -> None:
        self.script = script
        self.ok = ok if ok is not None else EPISODE
        self.requests: list[httpx.Request] = []
        self.transport = httpx.MockTransport(self.handle)

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        step = self.script[min(len(self.requests), len(self.script)) - 1]
        if not isinstance(step, int):
            raise step("scripted", request=request)
        if step < 400:
            return httpx.Response(step, json=self.ok)
        return httpx.Response(
            step,
            json={
                "error": {
                    "message": f"scripted {step}",
                    "type": "scripted_error",
                    "param": None,
                    "code": f"code_{step}",
                }
            },
        )

    def bodies(self) -> list[dict[str, Any]]:
        return [json.loads(r.content) for r in self.requests]


async def call(
    variant: str,
    fake: FakeProxy | httpx.MockTransport,
    method: str,
    *args: Any,
    retry: RetryRule = NO_WAIT,
    **kwargs: Any,
) -> Any:
    """``client.<method>(*args, **kwargs)`` on the sync or the async client over ``fake``."""
    transport = fake.transport if isinstance(fake, FakeProxy) else fake
    if variant == "sync":
        with ProxyClient(URL, ADMIN_KEY, retry=retry, transport=transport) as sync:
            return getattr(sync, method)(*args, **kwargs)
    async with AsyncProxyClient(URL, ADMIN_KEY, retry=retry, transport=transport) as client:
        return await getattr(client, method)(*args, **kwargs)


VARIANTS = pytest.mark.parametrize("variant", ["sync", "async"])


# -- the policy ------------------------------------------------------------------------------------


def test_waits_double_from_half_a_second_up_to_eight() -> None:
    rule = RetryRule()
    assert rule.attempts == 7
    assert [rule.wait_s(n) for n in range(1, rule.attempts)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]  # 23.5 s
    with pytest.raises(ValueError, match="attempts must be >= 1"):
        RetryRule(attempts=0)


@VARIANTS
async def test_a_safe_call_is_retried_after_5xx_and_transport_errors_with_the_same_body(variant: str) -> None:
    fake = FakeProxy([503, httpx.ReadError, httpx.ReadTimeout, 500, 200])
    episode = await call(variant, fake, "reward", "e1", 1.0, call_rewards={2: 0.5}, metadata={"k": 1})
    assert episode.status == "rewarded" and episode.reward == 1.0
    assert len(fake.requests) == 5
    assert fake.bodies() == [{"reward": 1.0, "call_rewards": {"2": 0.5}, "metadata": {"k": 1}}] * 5
    assert {r.headers["authorization"] for r in fake.requests} == {f"Bearer {ADMIN_KEY}"}


@VARIANTS
async def test_a_safe_call_gives_up_after_the_last_attempt_with_the_proxys_error(variant: str) -> None:
    fake = FakeProxy([503])
    with pytest.raises(ProxyError) as info:
        await call(variant, fake, "abandon", "e1", "agent crashed", retry=RetryRule(attempts=3, first_wait_s=0.0))
    assert len(fake.requests) == 3
    assert (info.value.status, info.value.message, info.value.error_type, info.value.code) == (
        503,
        "scripted 503",
        "scripted_error",
        "code_503",
    )


@VARIANTS
@pytest.mark.parametrize("status", [400, 401, 404, 409, 422])
async def test_a_4xx_is_never_retried(variant: str, status: int) -> None:
    fake = FakeProxy([status, 200])
    with pytest.raises(ProxyError) as info:
        await call(variant, fake, "ack", lease_id="l", group_ids=["g1"], step=1, status="trained")
    assert len(fake.requests) == 1
    assert (info.value.status, info.value.code) == (status, f"code_{status}")
    assert not isinstance(info.value, ProxyUnreachable)


@VARIANTS
@pytest.mark.parametrize("unsent", [httpx.ConnectError, httpx.ConnectTimeout])
async def test_creating_a_group_is_retried_only_when_the_request_never_left(
    variant: str, unsent: type[httpx.TransportError]
) -> None:
    fake = FakeProxy([unsent, unsent, 201], ok=GROUP)
    group = await call(variant, fake, "create_group", "t", 1, metadata={"workflow": "w"})
    assert len(fake.requests) == 3 and group.episode_keys[0].api_key == "fw-ep-x"
    assert fake.bodies()[0] == {"task_id": "t", "size": 1, "metadata": {"workflow": "w"}, "episode_metadata": None}


@VARIANTS
@pytest.mark.parametrize("sent", [503, httpx.ReadError, httpx.ReadTimeout, httpx.RemoteProtocolError])
async def test_creating_a_group_is_not_retried_once_the_request_may_have_arrived(
    variant: str, sent: int | type[httpx.TransportError]
) -> None:
    fake = FakeProxy([sent])
    with pytest.raises(ProxyError):
        await call(variant, fake, "create_group", "t", 1)
    with pytest.raises(ProxyError):
        await call(variant, fake, "create_episode", "t")
    assert len(fake.requests) == 2  # one attempt each: a repeat could create a second group or episode


@VARIANTS
async def test_no_answer_is_proxy_unreachable_with_the_transport_error_as_its_cause(variant: str) -> None:
    fake = FakeProxy([httpx.ConnectError])
    with pytest.raises(ProxyUnreachable) as info:
        await call(variant, fake, "policy", retry=RetryRule(attempts=2, first_wait_s=0.0))
    assert len(fake.requests) == 2
    assert info.value.status == 0 and isinstance(info.value.__cause__, httpx.ConnectError)
    assert info.value.message.startswith(f"cannot reach the proxy at {URL} (GET /policy: ConnectError: scripted)")


@VARIANTS
async def test_an_error_answer_that_is_not_json_keeps_its_text(variant: str) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(502, text="<html>bad gateway</html>")

    fake_proxy = httpx.MockTransport(handler)
    with pytest.raises(ProxyError) as info:
        await call(variant, fake_proxy, "group", "g1", retry=RetryRule(attempts=1))
    assert (info.value.status, info.value.message, info.value.error_type) == (502, "<html>bad gateway</html>", None)


@VARIANTS
async def test_a_retried_claim_sends_one_lease_id(variant: str) -> None:
    fake = FakeProxy(
        [httpx.ReadError, 200],
        ok={"lease_id": "x", "lease_expires_at": 1.0, "current_version": 0, "stale": 0, "groups": []},
    )
    await call(variant, fake, "claim", trainer_id="t", max_groups=2, lease_s=60.0, max_staleness=None)
    first, second = fake.bodies()
    assert first == second and len(first["lease_id"]) == 36  # a fresh uuid, kept across the attempts


@VARIANTS
async def test_request_bodies_are_the_proxys_own_wire_models(variant: str) -> None:
    fake = FakeProxy([200], ok={"object": "list", "data": []})
    await call(variant, fake, "ack", lease_id="lease-123", group_ids=["g1"], step=3, status="skipped", note="nan")
    AckIn.model_validate(fake.bodies()[-1])
    fake.ok = {"lease_id": "x", "lease_expires_at": 1.0, "current_version": 0, "groups": []}
    await call(variant, fake, "claim", trainer_id="t", max_groups=1, lease_s=5.0, max_staleness=0)
    ClaimIn.model_validate(fake.bodies()[-1])
    fake.ok = EPISODE
    await call(variant, fake, "reward", "e1", 0.0)
    RewardIn.model_validate(fake.bodies()[-1])
    fake.ok = GROUP
    await call(variant, fake, "create_group", "t", 2, episode_metadata=[{"i": 0}, {"i": 1}])
    GroupCreate.model_validate(fake.bodies()[-1])


# -- what the policy relies on, on the real proxy -------------------------------------------------


@pytest.fixture
async def proxy(sqlite_url: str) -> AsyncIterator[Callable[[str], AsyncProxyClient]]:
    """Async clients (given an admin key) of the real proxy app, in-process on a fresh SQLite store."""
    async with running_app(make_settings(sqlite_url), transport=fake_upstream()) as http:
        clients: list[AsyncProxyClient] = []

        def client(key: str = ADMIN_KEY) -> AsyncProxyClient:
            clients.append(
                AsyncProxyClient("http://proxy", key, retry=NO_WAIT, transport=httpx.ASGITransport(app=http.app))
            )  # type: ignore[attr-defined]
            return clients[-1]

        yield client
        for c in clients:
            await c.aclose()


async def test_a_repeated_reward_or_abandon_changes_nothing(proxy: Callable[..., AsyncProxyClient]) -> None:
    client = proxy()
    group = await client.create_group("task", 3, metadata={"workflow": "test"})
    a, b, c = (key.id for key in group.episode_keys)
    first = await client.reward(a, 1.0, call_rewards=None, metadata={"why": "right"})
    again = await client.reward(a, 1.0, metadata={"why": "right"})
    assert (first.status, again.status, again.reward) == ("rewarded", "rewarded", 1.0)
    with pytest.raises(ProxyError) as other:
        await client.reward(a, 0.0)
    assert (other.value.status, other.value.error_type, other.value.code) == (409, "conflict_error", "reward_conflict")
    assert (await client.abandon(b, "crashed")).abandon_reason == "crashed"
    assert (await client.abandon(b, "crashed again")).abandon_reason == "crashed"  # the first abandon stands
    with pytest.raises(ProxyError) as rewarded:
        await client.abandon(a, "too late")
    assert (rewarded.value.status, rewarded.value.code) == (409, "episode_rewarded")
    assert (await client.abandon(c, "x" * 5000)).abandon_reason == "x" * 4000  # cut to the proxy's limit
    assert (await client.group(group.id)).counts == {"rewarded": 1, "abandoned": 2}


async def test_a_repeated_claim_or_ack_changes_nothing(proxy: Callable[..., AsyncProxyClient]) -> None:
    client = proxy()
    group = await client.create_group("task", 2)
    for key in group.episode_keys:
        await client.reward(key.id, float(key.id == group.episode_keys[0].id))
    assert await client.pending_groups() == 1
    lease = "lease-0123456789"
    claims = [
        await client.claim(trainer_id="t", max_groups=4, lease_s=60.0, max_staleness=None, lease_id=lease)
        for _ in range(2)
    ]
    assert [g.id for g in claims[0].groups] == [g.id for g in claims[1].groups] == [group.id]
    assert await client.pending_groups() == 0  # leased: being trained, no longer waiting for the trainer
    acks = [await client.ack(lease_id=lease, group_ids=[group.id], step=1, status="trained") for _ in range(2)]
    assert [(g.train_status, g.trained_step) for ack in acks for g in ack] == [("trained", 1)] * 2
    with pytest.raises(ProxyError) as other_step:
        await client.ack(lease_id=lease, group_ids=[group.id], step=2, status="trained")
    assert (other_step.value.status, other_step.value.code) == (409, "already_acked")
    assert await client.pending_groups() == 0


async def test_the_proxys_refusals_are_proxy_errors(proxy: Callable[..., AsyncProxyClient]) -> None:
    with pytest.raises(ProxyError) as wrong_key:
        await proxy("not-the-admin-key-at-all").policy()
    assert (wrong_key.value.status, wrong_key.value.error_type) == (401, "authentication_error")
    with pytest.raises(ProxyError) as missing:
        await proxy().episode("00000000-0000-0000-0000-000000000000")
    assert (missing.value.status, missing.value.error_type) == (404, "not_found_error")
    assert (await proxy().policy()).version == 0


# -- one client everywhere -------------------------------------------------------------------------


def test_the_trainer_and_the_workflows_use_this_client() -> None:
    import contract.client
    import trainer.__main__
    import workflows.runner

    assert trainer.__main__.ProxyClient is contract.client.ProxyClient
    assert workflows.runner.AsyncProxyClient is contract.client.AsyncProxyClient
    assert importlib.util.find_spec("trainer.client") is None
    assert importlib.util.find_spec("workflows.client") is None


IMPORT_CHECK = """
import sys
import contract.client
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"fastapi", "starlette", "sqlalchemy", "torch", "uvicorn"})
assert not heavy, f"importing contract.client loaded {heavy}"
import workflows.runner
assert workflows.runner.AsyncProxyClient is contract.client.AsyncProxyClient
assert "proxy" not in sys.modules, "a client process loaded the proxy's package"
print(sys.version_info[:2])
"""


@pytest.mark.parametrize("venv", ["engine", "agents"])
def test_the_client_imports_in_both_venvs_without_the_server(venv: str) -> None:
    python = (
        sys.executable
        if venv == "engine"
        else os.environ.get("FLYWHEEL_AGENTS_PYTHON", str(ROOT / ".venv-agents" / "bin" / "python"))
    )
    if not os.path.exists(python):
        pytest.skip(f"no {venv} venv here ({python}); `make agents` builds it")
    done = subprocess.run(
        [python, "-c", IMPORT_CHECK],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("(3, 12)" if venv == "agents" else str(sys.version_info[:2]))
