"""Clients' keys stay in the proxy: vLLM gets the upstream's own key, never the admin, agent or episode key.

In-process, on the named fake upstream (``fake_upstream``), which keeps every request it gets:
this isolates what the proxy forwards. The real run that searches logs, the store and answers for
keys is ``tests/integration/test_secrets_real.py``.
"""

from __future__ import annotations

from typing import Any

import httpx

from tests.proxy.conftest import ADMIN, ADMIN_KEY, fake_upstream, make_settings, new_group, running_app

AGENT_KEY = "agent-key-0123456789abcdef"
UPSTREAM_KEY = "upstream-key-for-vllm-0123456789"
MESSAGES = [{"role": "user", "content": "2+2?"}]


async def test_the_upstream_never_sees_a_clients_key(sqlite_url: str) -> None:
    sent: list[httpx.Request] = []

    def keep(request: httpx.Request, _: dict[str, Any]) -> None:
        sent.append(request)

    upstreams = [{"name": "vllm-0", "url": "http://upstream-0", "api_key": UPSTREAM_KEY}]
    settings = make_settings(sqlite_url, upstreams=upstreams)
    async with running_app(settings, transport=fake_upstream(respond=keep)) as client:
        group = await new_group(client, size=2)
        first, second = group["episode_keys"]
        chat = {"model": "policy", "messages": MESSAGES, "max_tokens": 4}
        by_key = {"authorization": f"Bearer {first['api_key']}"}
        answers = [
            await client.post("/v1/chat/completions", json=chat, headers=by_key),
            await client.post(
                f"/episodes/{first['id']}/v1/responses", json={"model": "policy", "input": "hi"}, headers=by_key
            ),
            await client.post(
                f"/episodes/{second['id']}/v1/messages",
                json={"model": "policy", "max_tokens": 4, "messages": MESSAGES},
                headers={"x-api-key": second["api_key"]},
            ),
            await client.post(
                "/v1/chat/completions",
                json=chat,
                headers={"authorization": f"Bearer {AGENT_KEY}", "x-episode-id": second["id"]},
            ),
            await client.post("/passthrough/v1/chat/completions", json=chat, headers=ADMIN),
        ]
        assert [a.status_code for a in answers] == [200] * 5, [a.text for a in answers]
    generations = [r for r in sent if r.url.path == "/v1/chat/completions"]
    assert len(generations) == 5
    assert all(r.headers["authorization"] == f"Bearer {UPSTREAM_KEY}" for r in sent)  # the proxy's own key
    client_keys = [ADMIN_KEY, AGENT_KEY, first["api_key"], second["api_key"]]
    for request in sent:
        raw = b"".join(f"{k}: {v}\n".encode() for k, v in request.headers.multi_items()) + request.content
        raw += str(request.url).encode()
        leaked = [k for k in client_keys if k.encode() in raw]
        assert not leaked, f"{request.method} {request.url.path} carried a client's key"
