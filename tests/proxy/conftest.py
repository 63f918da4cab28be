"""Proxy test helpers: settings, an in-process app with its lifespan, and a named fake upstream.

The fake upstream (an ``httpx.MockTransport``) is used only where a test isolates the proxy itself
(auth, validation, replica choice); everything about recording runs against the real vLLM.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from proxy.app import create_app
from proxy.settings import Settings
from tests.support.services import ADMIN_KEY, ProxyProcess

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


def make_settings(store_url: str, upstreams: list[dict[str, Any]] | None = None, **overrides: Any) -> Settings:
    data: dict[str, Any] = {
        "upstreams": upstreams or [{"name": "vllm-0", "url": "http://upstream-0"}],
        "store": {"url": store_url},
        "auth": {"admin_key": ADMIN_KEY, "agent_keys": ["agent-key-0123456789abcdef"]},
        "episodes": {"reaper_interval_s": 3600},
        "health_interval_s": 3600,
    }
    data.update(overrides)
    return Settings.model_validate(data)


@asynccontextmanager
async def running_app(
    settings: Settings, transport: httpx.AsyncBaseTransport | None = None
) -> AsyncIterator[httpx.AsyncClient]:
    """The app with its lifespan running, and a client that calls it in-process."""
    app = create_app(settings, transport=transport)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
            client.app = app  # type: ignore[attr-defined]
            yield client


_ids = itertools.count(1000)


def fake_vllm_completion(body: dict[str, Any]) -> dict[str, Any]:
    """A vLLM-shaped chat completion with token ids and sampled-token logprobs."""
    n = body.get("n", 1)
    choices = []
    for i in range(n):
        choices.append(
            {
                "index": i,
                "message": {"role": "assistant", "content": f"answer {i}"},
                "logprobs": {"content": [{"token": "answer", "logprob": -0.5}, {"token": f" {i}", "logprob": -0.25}]}
                if body.get("logprobs")
                else None,
                "finish_reason": "stop",
                "stop_reason": None,
                "token_ids": [42, 100 + i] if body.get("return_token_ids") else None,
            }
        )
    return {
        "id": f"chatcmpl-{next(_ids)}",
        "object": "chat.completion",
        "created": 1,
        "model": body["model"],
        "choices": choices,
        "usage": {"prompt_tokens": 3, "completion_tokens": 2 * n, "total_tokens": 3 + 2 * n},
        "prompt_token_ids": [1, 2, 3] if body.get("return_token_ids") else None,
    }


def fake_upstream(
    seen: list[tuple[str, dict[str, Any]]] | None = None,
    respond: Callable[[httpx.Request, dict[str, Any]], httpx.Response | None] | None = None,
    adapters: dict[str, str] | None = None,
) -> httpx.MockTransport:
    """A named fake vLLM: health, models, adapter loading and chat completions, answering at once.
    ``adapters`` (name -> path) is its loaded-adapter state; share one dict to fake one engine."""
    loaded: dict[str, str] = {} if adapters is None else adapters

    def handler(request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content) if request.content else {}
        if seen is not None:
            seen.append((f"{request.url.host}{request.url.path}", body))
        if respond is not None and (custom := respond(request, body)) is not None:
            return custom
        path = request.url.path
        if path == "/health":
            return httpx.Response(200)
        if path == "/v1/models":
            models = [{"id": "policy-base", "object": "model", "root": "/models/base"}]
            models += [
                {"id": name, "object": "model", "root": root, "parent": "policy-base"} for name, root in loaded.items()
            ]
            return httpx.Response(200, json={"object": "list", "data": models})
        if path == "/v1/load_lora_adapter":
            if body["lora_name"] in loaded:
                return httpx.Response(
                    400,
                    json={
                        "error": {
                            "message": f"The lora adapter '{body['lora_name']}' has already been loaded.",
                            "code": 400,
                        }
                    },
                )
            loaded[body["lora_name"]] = body["lora_path"]
            return httpx.Response(200, text="ok")
        if path == "/v1/unload_lora_adapter":
            if loaded.pop(body["lora_name"], None) is None:
                return httpx.Response(404, json={"error": {"message": "cannot be found", "code": 404}})
            return httpx.Response(200, text="ok")
        if path == "/v1/chat/completions":
            return httpx.Response(200, json=fake_vllm_completion(body))
        return httpx.Response(404, json={"error": {"message": "no such path", "type": "NotFound", "code": 404}})

    return httpx.MockTransport(handler)


@pytest.fixture
async def sqlite_url(tmp_path: Path) -> str:
    from proxy.store.db import migrate_async

    url = f"sqlite+aiosqlite:///{tmp_path / 'flywheel.db'}"
    await migrate_async(url)
    return url


async def new_group(client: httpx.AsyncClient, size: int = 2, task_id: str = "task-1") -> dict[str, Any]:
    response = await client.post("/groups", json={"task_id": task_id, "size": size}, headers=ADMIN)
    assert response.status_code == 201, response.text
    return response.json()


def episode_auth(group: dict[str, Any], i: int = 0) -> dict[str, str]:
    return {"authorization": f"Bearer {group['episode_keys'][i]['api_key']}"}


__all__ = [
    "ADMIN",
    "ADMIN_KEY",
    "ProxyProcess",
    "episode_auth",
    "fake_upstream",
    "make_settings",
    "new_group",
    "running_app",
]
