"""Teachers behind the proxy (``proxy/teachers.py``): a teacher episode's calls answered by the
scripted demonstrator (``workflows/tac/demonstrator.py``, the product's scripted teacher), recorded
with the student's ids rendered by the real vLLM, and never claimed by GRPO.

The engine tests run ``python -m proxy serve`` with ``FLYWHEEL_TEACHERS`` in front of the plumbing
model and the demonstrator as a subprocess on a small fixture task (its ``solution.json`` written
here); the creation and claim rules run in-process on both stores.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.proxy.conftest import ADMIN, make_settings, running_app
from tests.support.services import (
    ProxyProcess,
    free_port,
    serving_proxy,
    stored_calls,
    wait_http,
)

INSTRUCTION = "Write the word hello into greeting.txt in your working directory."
HELD_OUT = "Count the lines of notes.txt and write the number to count.txt."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "terminal",
            "description": "Run a shell command.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "finish",
            "description": "Finish the task.",
            "parameters": {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"]},
        },
    },
]
STEPS = [
    {"tool": "terminal", "arguments": {"command": "echo hello > greeting.txt"}},
    {"tool": "finish", "arguments": {"message": "greeting.txt holds hello"}},
]
TEACHER_KEY = "teacher-secret-0123456789"


def write_tasks(root: Path) -> Path:
    """A TAC-layout fixture: one train task with a script, one test task (scripted too: still refused)."""
    for name, instruction in (("greet", INSTRUCTION), ("count", HELD_OUT)):
        (root / name).mkdir(parents=True)
        (root / name / "task.md").write_text(instruction + "\n")
        (root / name / "solution.json").write_text(json.dumps({"steps": STEPS}))
    (root / "splits.yml").write_text("train: [greet]\ntest: [count]\n")
    return root


@pytest.fixture(scope="module")
def demonstrator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``python -m workflows.tac.demonstrator`` on the fixture tasks: its URL."""
    tasks = write_tasks(tmp_path_factory.mktemp("tasks"))
    port = free_port()
    log = tmp_path_factory.mktemp("demo") / "demonstrator.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "workflows.tac.demonstrator", "--tasks-dir", str(tasks), "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 30, proc, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def proxy(vllm_url: str, demonstrator: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    teachers = json.dumps([{"name": "demo", "url": demonstrator, "model": "demonstrator", "api_key": TEACHER_KEY}])
    with serving_proxy(vllm_url, tmp_path_factory.mktemp("proxy"), FLYWHEEL_TEACHERS=teachers) as process:
        yield process


def teacher_group(proxy: ProxyProcess, size: int = 1, source: str = "teacher:demo") -> dict[str, Any]:
    response = httpx.post(
        f"{proxy.url}/groups",
        json={"task_id": "greet", "size": size, "metadata": {"source": source}},
        headers=ADMIN,
    )
    assert response.status_code == 201, response.text
    return dict(response.json())


def render(vllm_url: str, messages: list[dict[str, Any]], **extra: Any) -> list[int]:
    body = {"model": "policy-base", "messages": messages, "tools": TOOLS, **extra}
    response = httpx.post(f"{vllm_url}/v1/chat/completions/render", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return list(response.json()["token_ids"])


def rendered_count(proxy: ProxyProcess) -> float:
    """``flywheel_teacher_calls_total`` of demo's calls whose ids were rendered."""
    metrics = httpx.get(f"{proxy.url}/metrics", headers=ADMIN).text
    line = 'flywheel_teacher_calls_total{ids="rendered",teacher="demo"} '
    return next((float(m[len(line) :]) for m in metrics.splitlines() if m.startswith(line)), 0.0)


def detokenize(vllm_url: str, ids: list[int]) -> str:
    response = httpx.post(f"{vllm_url}/detokenize", json={"model": "policy-base", "tokens": ids}, timeout=60)
    assert response.status_code == 200, response.text
    return str(response.json()["prompt"])


@pytest.mark.vllm
def test_teacher_calls_are_recorded_in_the_students_token_space(proxy: ProxyProcess, vllm_url: str) -> None:
    counted = rendered_count(proxy)
    key = teacher_group(proxy)["episode_keys"][0]
    client = httpx.Client(base_url=key["base_url"], headers={"authorization": f"Bearer {key['api_key']}"}, timeout=120)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."}]
    messages.append({"role": "user", "content": INSTRUCTION})
    answers = []
    for step in STEPS:
        response = client.post("/chat/completions", json={"model": "policy", "messages": messages, "tools": TOOLS})
        assert response.status_code == 200, response.text
        assert "x-policy-version" not in response.headers  # no policy served it
        answer = response.json()
        assert answer["model"] == "demonstrator"  # the teacher's answer, unchanged
        assert answer["choices"][0]["finish_reason"] == "tool_calls"
        call = answer["choices"][0]["message"]["tool_calls"][0]
        assert call["function"]["name"] == step["tool"]
        assert json.loads(call["function"]["arguments"]) == step["arguments"]
        answers.append(answer)
        messages.append(answer["choices"][0]["message"])
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": "ok"})

    calls = stored_calls(proxy, key["id"])
    assert len(calls) == 2
    for i, (recorded, answer) in enumerate(zip(calls, answers, strict=True)):
        asked = messages[: 2 + 2 * i]
        prompt = render(vllm_url, asked)
        assert recorded["prompt_token_ids"] == prompt  # the student's render of the request
        turn = {k: v for k, v in answer["choices"][0]["message"].items() if k in ("role", "content", "tool_calls")}
        whole = render(vllm_url, [*asked, turn], add_generation_prompt=False)
        choice = recorded["choices"][0]
        assert whole[: len(prompt)] == prompt and choice["token_ids"] == whole[len(prompt) :]
        text = detokenize(vllm_url, choice["token_ids"])
        assert text.startswith('<tool_call>\n{"name": "' + STEPS[i]["tool"] + '", "arguments": ')
        assert json.loads(text.split('"arguments": ', 1)[1].rsplit("}\n</tool_call>", 1)[0]) == STEPS[i]["arguments"]
        assert text.endswith("</tool_call><|im_end|>\n")
        assert choice["logprobs"] == []  # the student sampled nothing
        assert recorded["exact_ids"] is True
        assert recorded["policy_version"] is None
        assert recorded["model_served"] == "demonstrator"
        notes = recorded["notes"]
        assert notes["teacher"]["name"] == "demo" and notes["teacher"]["rendered"] == "student_template"
        assert notes["teacher"]["usage"] == answer["usage"]
        assert "sampling" not in notes
    # the second call's prompt continues the first call's ids: one sequence for a warm start
    assert calls[1]["prompt_token_ids"][: len(calls[0]["prompt_token_ids"])] == calls[0]["prompt_token_ids"]
    assert TEACHER_KEY not in proxy.log_path.read_text()  # the teacher's key is never logged
    assert rendered_count(proxy) == counted + 2


@pytest.mark.vllm
def test_a_rendering_that_does_not_extend_the_prompt_is_recorded_inexact(proxy: ProxyProcess) -> None:
    """A template that renders the last message otherwise (here: marked LAST) breaks the prefix
    property: the agent still gets the teacher's answer, the record keeps no ids and says why."""
    template = (
        "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['role'] }}: {{ m['content'] or '' }}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    key = teacher_group(proxy)["episode_keys"][0]
    body = {
        "model": "policy",
        "messages": [{"role": "user", "content": INSTRUCTION}],
        "tools": TOOLS,
        "chat_template": template,
    }
    headers = {"authorization": f"Bearer {key['api_key']}"}
    response = httpx.post(f"{key['base_url']}/chat/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["tool_calls"]
    (recorded,) = stored_calls(proxy, key["id"])
    assert recorded["exact_ids"] is False and recorded["prompt_token_ids"] is None
    assert recorded["choices"][0]["token_ids"] == []
    assert "does not extend the prompt's rendering" in recorded["notes"]["inexact"]["why"][0]
    assert recorded["notes"]["teacher"]["name"] == "demo"


@pytest.mark.vllm
def test_a_streamed_teacher_call_is_sent_as_a_stream_after_its_record(proxy: ProxyProcess) -> None:
    key = teacher_group(proxy)["episode_keys"][0]
    body = {"model": "policy", "messages": [{"role": "user", "content": INSTRUCTION}], "tools": TOOLS, "stream": True}
    headers = {"authorization": f"Bearer {key['api_key']}"}
    response = httpx.post(f"{key['base_url']}/chat/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    calls = [c for chunk in chunks for choice in chunk["choices"] for c in choice["delta"].get("tool_calls") or ()]
    assert [c["function"]["name"] for c in calls] == ["terminal"]
    assert not any("usage" in chunk for chunk in chunks)  # not asked for
    (recorded,) = stored_calls(proxy, key["id"])
    assert recorded["stream"] is True and recorded["exact_ids"] is True and recorded["choices"][0]["token_ids"]


@pytest.mark.vllm
def test_the_teachers_refusals_reach_the_agent_and_the_record(proxy: ProxyProcess) -> None:
    """The test split is never demonstrated: the demonstrator's 403 is the agent's, recorded as failed."""
    key = teacher_group(proxy)["episode_keys"][0]
    headers = {"authorization": f"Bearer {key['api_key']}"}
    body = {"model": "policy", "messages": [{"role": "user", "content": HELD_OUT}], "tools": TOOLS}
    response = httpx.post(f"{key['base_url']}/chat/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 403, response.text
    assert response.json()["error"]["code"] == "teacher_rejected"
    assert "test split" in response.json()["error"]["message"]
    body["messages"] = [{"role": "user", "content": "an unknown task"}]
    response = httpx.post(f"{key['base_url']}/chat/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 400 and "no scripted task" in response.json()["error"]["message"]
    calls = stored_calls(proxy, key["id"])
    assert [c["status_code"] for c in calls] == [403, 400]


@pytest.mark.vllm
def test_a_teacher_episode_refuses_the_other_apis(proxy: ProxyProcess) -> None:
    key = teacher_group(proxy)["episode_keys"][0]
    headers = {"authorization": f"Bearer {key['api_key']}"}
    response = httpx.post(
        f"{key['base_url']}/completions", json={"model": "policy", "prompt": "hi"}, headers=headers, timeout=60
    )
    assert response.status_code == 400 and response.json()["error"]["code"] == "teacher_unsupported"
    response = httpx.post(
        f"{key['base_url']}/messages",
        json={"model": "policy", "max_tokens": 16, "messages": [{"role": "user", "content": INSTRUCTION}]},
        headers=headers,
        timeout=60,
    )
    assert response.status_code == 400 and "teacher demo" in response.text
    assert [c["status_code"] for c in stored_calls(proxy, key["id"])] == [400, 400]


@pytest.mark.vllm
def test_episodes_without_a_teacher_still_go_to_the_policy(proxy: ProxyProcess) -> None:
    key = teacher_group(proxy, source="agent")["episode_keys"][0]
    headers = {"authorization": f"Bearer {key['api_key']}"}
    body = {"model": "policy", "messages": [{"role": "user", "content": INSTRUCTION}], "max_tokens": 4}
    response = httpx.post(f"{key['base_url']}/chat/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 200 and response.headers["x-policy-version"] == "0"
    (recorded,) = stored_calls(proxy, key["id"])
    assert "teacher" not in (recorded["notes"] or {}) and len(recorded["choices"][0]["logprobs"]) > 0


# -- creation and claim, no engine ---------------------------------------------------------------

TEACHERS = [{"name": "demo", "url": "http://teacher", "model": "demonstrator"}]


async def test_an_unknown_teacher_is_refused_and_nothing_written(store_url: str) -> None:
    async with running_app(make_settings(store_url, teachers=TEACHERS)) as client:
        bad = [
            ("/groups", {"task_id": "t", "size": 2, "metadata": {"source": "teacher:nope"}}, "metadata.source"),
            (
                "/groups",
                {"task_id": "t", "size": 2, "episode_metadata": [{"source": "teacher:nope"}, {}]},
                "episode_metadata[0].source",
            ),
            ("/episodes", {"task_id": "t", "metadata": {"source": "teacher:nope"}}, "metadata.source"),
        ]
        for path, body, param in bad:
            response = await client.post(path, json=body, headers=ADMIN)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert (error["code"], error["param"], error["type"]) == ("unknown_teacher", param, "invalid_request_error")
            assert "demo" in error["message"]
        mixed = {"task_id": "t", "size": 2, "episode_metadata": [{"source": "teacher:demo"}, {}]}
        response = await client.post("/groups", json=mixed, headers=ADMIN)
        assert response.status_code == 400 and response.json()["error"]["code"] == "mixed_source"
        assert (await client.get("/groups", headers=ADMIN)).json()["data"] == []
        assert (await client.get("/episodes", headers=ADMIN)).json()["data"] == []
        ok = {"task_id": "t", "size": 2, "metadata": {"source": "teacher:demo"}}
        assert (await client.post("/groups", json=ok, headers=ADMIN)).status_code == 201


async def test_no_teachers_configured_refuses_every_teacher_source(store_url: str) -> None:
    async with running_app(make_settings(store_url)) as client:
        body = {"task_id": "t", "size": 2, "metadata": {"source": "teacher:demo"}}
        response = await client.post("/groups", json=body, headers=ADMIN)
        assert response.status_code == 400 and "none configured" in response.json()["error"]["message"]


async def test_grpo_never_claims_a_teachers_group(store_url: str) -> None:
    async with running_app(make_settings(store_url, teachers=TEACHERS)) as client:
        made = {}
        for source in ("teacher:demo", None, "teacher:demo"):
            metadata = {"source": source} if source else {}
            response = await client.post(
                "/groups", json={"task_id": "t", "size": 2, "metadata": metadata}, headers=ADMIN
            )
            group = response.json()
            for key in group["episode_keys"]:
                reward = await client.post(f"/episodes/{key['id']}/reward", json={"reward": 1.0}, headers=ADMIN)
                assert reward.status_code == 200, reward.text
            made[group["id"]] = source
        claim = await client.post("/trainer/claim", json={"trainer_id": "t", "max_groups": 8}, headers=ADMIN)
        assert claim.status_code == 200, claim.text
        assert [g["id"] for g in claim.json()["groups"]] == [g for g, s in made.items() if s is None]
        for group_id, source in made.items():
            group = (await client.get(f"/groups/{group_id}", headers=ADMIN)).json()
            if source is None:
                assert group["train_status"] == "pending"  # leased, not yet acked
            else:
                assert group["train_status"] == "skipped"
                assert group["train_note"].startswith("teacher:demo: demonstrations")
        again = await client.post("/trainer/claim", json={"trainer_id": "t2", "max_groups": 8}, headers=ADMIN)
        assert again.json()["groups"] == []
