"""The scripted demonstrator (``workflows/tac/demonstrator.py``): its answers and refusals over real
HTTP, and, end to end, ``python -m workflows run tac --source teacher:demo``: the real OpenHands agent
(agents venv) through a real proxy whose teacher is the demonstrator, the student's ids rendered by
the real vLLM, the episode graded 1.0 by the task's own evaluator and never claimed by GRPO.

The fixture scripts are written here (a copy of the bundled tasks with a ``solution.json``), so the
test does not depend on which scripts the task generator ships.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.services import ProxyProcess, free_port, serving_proxy, wait_http
from tests.workflows.conftest import ADMIN, admin_get, groups_of, run_workflow
from workflows.config import RunConfig
from workflows.tac.demonstrator import Demonstrator, serve
from workflows.tac.task import BUNDLED

GREET = "Write hello into greeting.txt."
SECRET = "Count the words of notes.txt."
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {}}} for name in ("terminal", "finish")]
STEPS = [
    {"tool": "terminal", "arguments": {"command": "echo hello > greeting.txt"}},
    {"tool": "finish", "arguments": {"message": "done"}},
]
HELLO_FILE = [  # the bundled hello-file task, solved through OpenHands' own tools
    {"tool": "terminal", "arguments": {"command": "echo 'hello flywheel' > greeting.txt"}},
    {"tool": "finish", "arguments": {"message": "greeting.txt holds the line."}},
]


def tasks_dir(root: Path) -> Path:
    for name, instruction in (("greet", GREET), ("secret", SECRET)):
        (root / name).mkdir(parents=True)
        (root / name / "task.md").write_text(instruction + "\n")
        (root / name / "solution.json").write_text(json.dumps({"steps": STEPS}))
    (root / "splits.yml").write_text("train: [greet]\ntest: [secret]\n")
    return root


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[str]:
    """The demonstrator's server on a free port, in a thread: its URL."""
    server = serve(Demonstrator(tasks_dir(tmp_path)), "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def chat(url: str, messages: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    body = {"model": "anything", "messages": messages, "tools": TOOLS, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=10)


def test_it_answers_the_next_scripted_step_as_a_native_tool_call(demo: str) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": [{"type": "text", "text": f"{GREET}\n\nWork in /tmp/x."}]},
    ]
    for step in STEPS:
        response = chat(demo, messages)
        assert response.status_code == 200, response.text
        answer = response.json()
        (choice,) = answer["choices"]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] == step["tool"]
        assert json.loads(call["function"]["arguments"]) == step["arguments"]
        usage = answer["usage"]
        assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        messages += [choice["message"], {"role": "tool", "tool_call_id": call["id"], "content": "ok"}]
    exhausted = chat(demo, messages)
    assert exhausted.status_code == 400 and exhausted.json()["error"]["code"] == "script_exhausted"


@pytest.mark.parametrize(
    ("content", "extra", "status", "code"),
    [
        (SECRET, {}, 403, "test_split"),
        ("Some task nobody scripted.", {}, 400, "unknown_task"),
        (GREET, {"tools": [TOOLS[1]]}, 400, "tool_not_offered"),
        (GREET, {"stream": True}, 400, "stream_unsupported"),
    ],
)
def test_it_refuses_in_openais_error_shape(
    demo: str, content: str, extra: dict[str, Any], status: int, code: str
) -> None:
    response = chat(demo, [{"role": "user", "content": content}], **extra)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == code and set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("permission_error" if status == 403 else "invalid_request_error")


def test_a_tasks_dir_without_splits_is_refused_at_start(tmp_path: Path) -> None:
    (tasks_dir(tmp_path) / "splits.yml").unlink()
    with pytest.raises(ValueError, match="no splits.yml"):
        Demonstrator(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "workflows.tac.demonstrator", "--tasks-dir", str(tmp_path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "test split" in done.stderr


def test_a_malformed_solution_names_its_file(tmp_path: Path) -> None:
    tasks_dir(tmp_path)
    (tmp_path / "greet" / "solution.json").write_text(json.dumps({"steps": [{"tool": "terminal"}]}))
    with pytest.raises(ValueError, match=r"greet/solution.json: steps\[0\]"):
        Demonstrator(tmp_path)


def test_a_teacher_never_runs_the_test_split() -> None:
    with pytest.raises(ValueError, match="never demonstrates the test split"):
        RunConfig(proxy_url="http://p", admin_key="k", split="test", source="teacher:demo")
    with pytest.raises(ValueError, match="fork_share 0"):
        RunConfig(proxy_url="http://p", admin_key="k", fork_share=0.5, source="teacher:demo")
    assert RunConfig(proxy_url="http://p", admin_key="k", split="test", source="agent").source == "agent"


# -- end to end: the real OpenHands agent, demonstrated -------------------------------------------


@pytest.fixture(scope="module")
def bundled_with_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled tasks, hello-file with a script (the generator's ``solution.json`` layout)."""
    root = tmp_path_factory.mktemp("tac") / "tasks"
    shutil.copytree(BUNDLED, root)
    (root / "hello-file" / "solution.json").write_text(json.dumps({"steps": HELLO_FILE}))
    return root


@pytest.fixture(scope="module")
def teacher_proxy(
    vllm_url: str, bundled_with_script: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProxyProcess]:
    """``python -m workflows.tac.demonstrator`` and a proxy serving it as teacher ``demo``."""
    port = free_port()
    log = tmp_path_factory.mktemp("demo") / "demonstrator.log"
    command = [sys.executable, "-m", "workflows.tac.demonstrator", "--tasks-dir", str(bundled_with_script)]
    with open(log, "wb") as out:
        demonstrator = subprocess.Popen([*command, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 30, demonstrator, log)
        teachers = json.dumps([{"name": "demo", "url": f"http://127.0.0.1:{port}", "model": "demonstrator"}])
        with serving_proxy(vllm_url, tmp_path_factory.mktemp("proxy"), FLYWHEEL_TEACHERS=teachers) as proxy:
            yield proxy
    finally:
        demonstrator.terminate()
        demonstrator.wait(timeout=10)


@pytest.mark.vllm
def test_openhands_records_a_demonstration_graded_one(teacher_proxy: ProxyProcess, bundled_with_script: Path) -> None:
    proxy = teacher_proxy
    options = {"tasks_dir": bundled_with_script, "tasks": "hello-file", "system_prompt": "short"}
    summary = run_workflow(
        proxy, "run", "tac", groups=1, group_size=1, concurrency=1, source="teacher:demo", options=options, timeout=600
    )
    assert (summary["episodes"], summary["rewarded"]) == (1, 1), summary
    (group,) = groups_of(proxy, "tac")
    assert group["metadata"]["source"] == "teacher:demo" and group["status"] == "complete"
    (listed,) = admin_get(proxy, "/episodes", group_id=group["id"])["data"]
    episode = admin_get(proxy, f"/episodes/{listed['id']}")
    assert episode["metadata"]["source"] == "teacher:demo"
    assert episode["reward"] == 1.0  # hello-file's own evaluator: both checkpoints
    calls = episode["calls"]
    assert [c["choices"][0]["tool_calls"][0]["function"]["name"] for c in calls] == ["terminal", "finish"]
    for call in calls:
        assert call["status_code"] == 200 and call["exact_ids"] is True and call["policy_version"] is None
        assert call["prompt_token_ids"] and call["choices"][0]["token_ids"] and call["choices"][0]["logprobs"] == []
        assert call["notes"]["teacher"]["name"] == "demo" and call["request"]["model"] == "policy"
    claim = httpx.post(f"{proxy.url}/trainer/claim", json={"trainer_id": "grpo"}, headers=ADMIN, timeout=30)
    assert claim.status_code == 200 and claim.json()["groups"] == []
    assert admin_get(proxy, f"/groups/{group['id']}")["train_status"] == "skipped"
