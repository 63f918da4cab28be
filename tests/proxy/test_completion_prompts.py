"""A recorded ``/v1/completions`` call holds one prompt: several would pair every choice with the first.

On the named fake upstream (``fake_upstream``): the rule is the proxy's, before anything is sent.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.proxy.conftest import ADMIN, fake_upstream, make_settings, running_app


def completion(request: httpx.Request, body: dict[str, Any]) -> httpx.Response | None:
    if request.url.path != "/v1/completions":
        return None
    choice = {"index": 0, "text": " ok", "finish_reason": "stop", "token_ids": [5], "prompt_token_ids": [1, 2]}
    choice["logprobs"] = {"token_logprobs": [-0.5], "tokens": [" ok"]}
    return httpx.Response(
        200, json={"id": "c", "object": "text_completion", "model": body["model"], "choices": [choice]}
    )


@pytest.mark.parametrize(
    ("prompt", "status"),
    [(["2+2=", "3+3="], 400), ([[1, 2], [3, 4]], 400), (["2+2="], 200), ([1, 2], 200), ([[1, 2]], 200), ("2+2=", 200)],
)
async def test_a_recorded_completion_takes_one_prompt(sqlite_url: str, prompt: Any, status: int) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    async with running_app(make_settings(sqlite_url), fake_upstream(seen, completion)) as client:
        created = await client.post("/episodes", json={"task_id": "prompts"}, headers=ADMIN)
        reply = await client.post(
            f"/episodes/{created.json()['id']}/v1/completions",
            headers=ADMIN,
            json={"model": "policy", "prompt": prompt, "max_tokens": 1},
        )
        assert reply.status_code == status, reply.text
        if status == 400:
            error = reply.json()["error"]
            assert (error["type"], error["param"], error["code"]) == (
                "invalid_request_error",
                "prompt",
                "multiple_prompts",
            )
            assert not [p for p, _ in seen if p.endswith("/v1/completions")]  # nothing reached the engine
        unrecorded = await client.post(
            "/passthrough/v1/completions", headers=ADMIN, json={"model": "policy", "prompt": prompt, "max_tokens": 1}
        )
        assert unrecorded.status_code == 200  # unrecorded batches pass as they are
