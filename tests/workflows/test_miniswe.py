"""The mini-swe-agent workflow (``workflows/miniswe``): options, tasks and registry without a model;
the demonstrator's ``mini-swe-agent`` style over real HTTP; the real agent (agents venv) driven by
the demonstrator directly on one train task of each generated variant; and, end to end, ``python -m
workflows run miniswe --source teacher:demo``: the real agent through a real proxy whose teacher is
the demonstrator, the student's ids rendered by the real vLLM, graded 1.0 by the task's evaluator.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml  # type: ignore[import-untyped,unused-ignore]

from tests.support.services import ProxyProcess, free_port, serving_proxy, wait_http
from tests.workflows.conftest import ADMIN, admin_get, groups_of, run_workflow
from workflows import registry
from workflows.base import Endpoint, Episode, EpisodeFailed
from workflows.miniswe.run import MiniSweOptions, MiniSweWorkflow
from workflows.options import parse_options
from workflows.tac import family
from workflows.tac.demonstrator import MINISWE_SUBMIT, Demonstrator, serve
from workflows.tac.run import TACOptions, TACWorkflow
from workflows.tac.task import BUNDLED

BASH = [{"type": "function", "function": {"name": "bash", "parameters": {}}}]
HELLO = json.loads((BUNDLED / "hello-file" / "solution.json").read_text())["steps"]


def test_options_are_checked_and_parsed_from_the_command_line() -> None:
    options = parse_options(MiniSweOptions, ["step_limit=4", "tasks=hello-file,sql-shop", "temperature=0.5"])
    assert (options.step_limit, options.tasks, options.temperature) == (4, ["hello-file", "sql-shop"], 0.5)
    assert MiniSweOptions().step_limit == 6 and MiniSweOptions().max_tokens == 256
    with pytest.raises(ValueError, match="step_limit must be >= 1"):
        MiniSweOptions(step_limit=0)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        MiniSweOptions(max_tokens=0)
    with pytest.raises(ValueError, match="command_timeout_s must be >= 1"):
        MiniSweOptions(command_timeout_s=0)
    with pytest.raises(ValueError, match="family=N generates its own tasks"):  # tac's own check
        MiniSweOptions(family=10, tasks_dir=Path("/elsewhere"))


def test_tasks_and_splits_are_tacs(tmp_path: Path) -> None:
    bundled = MiniSweWorkflow(MiniSweOptions())
    tac = TACWorkflow(TACOptions())
    for split in ("train", "val", "test"):
        assert [t.name for t in bundled.split_tasks(split)] == [t.name for t in tac.split_tasks(split)]
    assert [t.name for t in bundled.split_tasks("test")] == ["json-config", "word-count"]
    hello = bundled.tasks("train")[0]
    assert bundled.task_id(hello) == "miniswe/hello-file" and bundled.stratum(hello) is None
    assert bundled.task_metadata(hello) == {"task": "hello-file", "agent": "mini-swe-agent"}
    assert bundled.describe_task(hello) == hello.instruction
    only = MiniSweWorkflow(MiniSweOptions(tasks=["sql-shop"]))
    assert [t.name for t in only.tasks("train")] == ["sql-shop"]
    with pytest.raises(ValueError, match="no train TAC tasks named"):
        MiniSweWorkflow(MiniSweOptions(tasks=["nope"])).tasks("train")
    family.write(tmp_path / "fam", count=20, seed=0)
    generated = MiniSweWorkflow(MiniSweOptions(tasks_dir=tmp_path / "fam"))
    names = {t.name for s in ("train", "val", "test") for t in generated.split_tasks(s)}
    assert len(names) == 20  # the family's own three splits, each task in one
    assert {generated.stratum(t) for t in generated.tasks("train")} <= {"write", "edit", "count", "fix", "query"}


def test_it_is_registered() -> None:
    assert registry.BUILTIN["miniswe"] == "workflows.miniswe.run:MiniSweWorkflow"
    if importlib.util.find_spec("minisweagent") is None:  # the engine venv: named, and refused with why
        with pytest.raises(ValueError, match="needs minisweagent.*agents venv"):
            registry.load("miniswe")
    else:
        assert registry.load("miniswe") is MiniSweWorkflow


# -- the demonstrator's mini-swe-agent style ------------------------------------------------------


@pytest.fixture
def bash_demo(tmp_path: Path) -> Iterator[str]:
    """The demonstrator in the mini-swe-agent style on the bundled tasks, plus one with a file_editor step."""
    root = tmp_path / "tasks"
    for task in ("hello-file", "json-config"):
        (root / task).mkdir(parents=True)
        (root / task / "task.md").write_text((BUNDLED / task / "task.md").read_text())
        (root / task / "solution.json").write_text((BUNDLED / task / "solution.json").read_text())
    (root / "edit").mkdir()
    (root / "edit" / "task.md").write_text("Edit notes.txt with the editor.\n")
    steps = [{"tool": "file_editor", "arguments": {"command": "view", "path": "/tmp/x"}}]
    (root / "edit" / "solution.json").write_text(json.dumps({"steps": steps}))
    (root / "splits.yml").write_text("train: [hello-file, edit]\ntest: [json-config]\n")
    server = serve(Demonstrator(root, "mini-swe-agent"), "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def chat(url: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] = BASH) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/chat/completions", json={"model": "x", "messages": messages, "tools": tools}, timeout=10
    )


def test_the_mini_swe_agent_style_answers_bash_calls_then_the_submit_command(bash_demo: str) -> None:
    instruction = (BUNDLED / "hello-file" / "task.md").read_text().strip()
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful assistant that can interact with a computer."},
        {"role": "user", "content": f"Please solve this issue: {instruction}\n\nYou can execute bash commands."},
    ]
    commands = []
    for _ in HELLO:
        response = chat(bash_demo, messages)
        assert response.status_code == 200, response.text
        (choice,) = response.json()["choices"]
        (call,) = choice["message"]["tool_calls"]
        assert choice["finish_reason"] == "tool_calls" and call["function"]["name"] == "bash"
        commands.append(json.loads(call["function"]["arguments"]))
        messages += [choice["message"], {"role": "tool", "tool_call_id": call["id"], "content": "<returncode>0"}]
    assert commands == [{"command": HELLO[0]["arguments"]["command"]}, {"command": MINISWE_SUBMIT}]
    assert chat(bash_demo, messages).json()["error"]["code"] == "script_exhausted"


@pytest.mark.parametrize(
    ("task_md", "tools", "status", "code"),
    [
        ("Edit notes.txt with the editor.", BASH, 400, "step_untranslatable"),
        ((BUNDLED / "hello-file" / "task.md").read_text(), [], 400, "tool_not_offered"),
        ((BUNDLED / "json-config" / "task.md").read_text(), BASH, 403, "test_split"),
    ],
)
def test_the_mini_swe_agent_style_refuses(
    bash_demo: str, task_md: str, tools: list[dict[str, Any]], status: int, code: str
) -> None:
    response = chat(bash_demo, [{"role": "user", "content": task_md}], tools)
    assert response.status_code == status and response.json()["error"]["code"] == code


def test_the_style_is_checked_and_the_default_stays_openhands(tmp_path: Path) -> None:
    (tmp_path / "splits.yml").write_text("train: []\ntest: []\n")
    assert Demonstrator(tmp_path).style == "openhands"
    with pytest.raises(ValueError, match="style must be one of openhands, mini-swe-agent"):
        Demonstrator(tmp_path, "text")
    done = subprocess.run(
        [sys.executable, "-m", "workflows.tac.demonstrator", "--tasks-dir", str(tmp_path), "--style", "text"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "invalid choice: 'text'" in done.stderr


# -- the real agent, driven by the demonstrator (agents venv, no engine) --------------------------


def train_task_of_each_variant(root: Path) -> list[str]:
    train = set(yaml.safe_load((root / "splits.yml").read_text())["train"])
    seen: dict[tuple[str, str], str] = {}
    for task_dir in sorted(p for p in root.iterdir() if p.is_dir() and p.name in train):
        spec = json.loads((task_dir / "spec.json").read_text())
        seen.setdefault((spec["kind"], spec["variant"]), task_dir.name)
    return list(seen.values())


@pytest.mark.agents
def test_the_real_agent_solves_a_train_task_of_each_variant_played_by_the_demonstrator(tmp_path: Path) -> None:
    """mini-swe-agent's own loop, prompt, model class (litellm) and LocalEnvironment (``/bin/sh``
    subprocesses in the workspace) on the demonstrator's answers: every variant's script runs
    under its shell and submits, and the task's evaluator grades 1.0."""
    root = tmp_path / "fam"
    family.write(root, count=200, seed=0)
    names = train_task_of_each_variant(root)
    assert len({n.rsplit("-", 1)[0] for n in names}) >= 5 and len(names) >= 10
    server = serve(Demonstrator(root, "mini-swe-agent"), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        workflow = MiniSweWorkflow(MiniSweOptions(tasks_dir=root, workspace_root=tmp_path / "ws"))
        tasks = {t.name: t for t in workflow.tasks("train")}
        for i, name in enumerate(names):
            episode_id = f"{i:08d}-0000-0000-0000-000000000000"
            episode = Episode(episode_id, "g", 0, f"{url}/v1", "key", "demonstrator", Endpoint(url, "k"), url)
            outcome = workflow.play(tasks[name], episode)
            steps = len(json.loads((root / name / "solution.json").read_text())["steps"])
            assert outcome.reward == 1.0, (name, outcome.metadata)
            assert outcome.metadata["ending"] == "submitted" and outcome.metadata["exit_status"] == "Submitted"
            assert (outcome.metadata["steps"], outcome.metadata["format_errors"]) == (steps, 0), name
        assert not any((tmp_path / "ws").iterdir())  # every workspace cleaned up
        # The step limit ends it before the submit command; graded all the same.
        short = MiniSweWorkflow(MiniSweOptions(tasks_dir=root, tasks=[names[0]], step_limit=1))
        episode = Episode("a" * 8 + "-0", "g", 0, f"{url}/v1", "key", "demonstrator", Endpoint(url, "k"), url)
        outcome = short.play(short.tasks("train")[0], episode)
        assert (outcome.metadata["ending"], outcome.metadata["exit_status"]) == ("step_limit", "LimitsExceeded")
        assert outcome.metadata["steps"] == 1 and outcome.reward is not None
        # A model call that fails (nothing listens) is no ending of the agent's: the episode is abandoned.
        dead = f"http://127.0.0.1:{free_port()}/v1"
        episode = Episode("b" * 8 + "-0", "g", 0, dead, "key", "demonstrator", Endpoint(dead, "k"), dead)
        with pytest.raises(EpisodeFailed, match="mini-swe-agent run failed: .*Connection"):
            short.play(short.tasks("train")[0], episode)
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.agents
def test_the_agent_is_mini_swe_agents_own_with_its_tool_calling_config() -> None:
    """The shipped ``mini`` config, its tool-calling model class and its one bash tool: nothing ours."""
    from minisweagent.models import get_model_class
    from minisweagent.models.litellm_model import LitellmModel
    from minisweagent.models.utils.actions_toolcall import BASH_TOOL

    from workflows.miniswe.agent import package_config

    config = package_config()
    assert "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in config["agent"]["instance_template"]
    assert "bash tool call" in config["agent"]["instance_template"]
    assert get_model_class("openai/policy") is LitellmModel and BASH_TOOL["function"]["name"] == "bash"
    assert registry.load("miniswe") is MiniSweWorkflow  # its packages are here


# -- end to end: the real mini-swe-agent, demonstrated through the proxy ---------------------------


@pytest.fixture(scope="module")
def teacher_proxy(vllm_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    """``python -m workflows.tac.demonstrator --style mini-swe-agent`` on the bundled tasks, and a
    proxy serving it as teacher ``demo``."""
    port = free_port()
    log = tmp_path_factory.mktemp("demo") / "demonstrator.log"
    command = [sys.executable, "-m", "workflows.tac.demonstrator", "--tasks-dir", str(BUNDLED)]
    with open(log, "wb") as out:
        demonstrator = subprocess.Popen(
            [*command, "--style", "mini-swe-agent", "--port", str(port)], stdout=out, stderr=subprocess.STDOUT
        )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 30, demonstrator, log)
        teachers = json.dumps([{"name": "demo", "url": f"http://127.0.0.1:{port}", "model": "demonstrator"}])
        with serving_proxy(vllm_url, tmp_path_factory.mktemp("proxy"), FLYWHEEL_TEACHERS=teachers) as proxy:
            yield proxy
    finally:
        demonstrator.terminate()
        demonstrator.wait(timeout=10)


@pytest.mark.vllm
def test_mini_swe_agent_records_a_demonstration_graded_one(teacher_proxy: ProxyProcess) -> None:
    proxy = teacher_proxy
    summary = run_workflow(
        proxy,
        "run",
        "miniswe",
        groups=1,
        group_size=1,
        concurrency=1,
        source="teacher:demo",
        options={"tasks": "hello-file"},
        timeout=600,
    )
    assert (summary["episodes"], summary["rewarded"]) == (1, 1), summary
    (group,) = groups_of(proxy, "miniswe")
    assert group["task_id"] == "miniswe/hello-file" and group["status"] == "complete"
    (listed,) = admin_get(proxy, "/episodes", group_id=group["id"])["data"]
    episode = admin_get(proxy, f"/episodes/{listed['id']}")
    assert episode["reward"] == 1.0  # hello-file's own evaluator: both checkpoints
    metadata = episode["reward_metadata"]
    assert metadata["final_score"] == [2, 2] and episode["metadata"]["source"] == "teacher:demo"
    assert (metadata["ending"], metadata["steps"], metadata["format_errors"]) == ("submitted", 2, 0), metadata
    calls = episode["calls"]
    commands = [json.loads(c["choices"][0]["tool_calls"][0]["function"]["arguments"]) for c in calls]
    assert commands == [{"command": HELLO[0]["arguments"]["command"]}, {"command": MINISWE_SUBMIT}]
    for call in calls:
        assert call["status_code"] == 200 and call["exact_ids"] is True and call["policy_version"] is None
        assert call["prompt_token_ids"] and call["choices"][0]["token_ids"] and call["choices"][0]["logprobs"] == []
        assert call["notes"]["teacher"]["name"] == "demo" and call["request"]["model"] == "policy"
        assert [t["function"]["name"] for t in call["request"]["tools"]] == ["bash"]  # its own one tool
    claim = httpx.post(f"{proxy.url}/trainer/claim", json={"trainer_id": "grpo"}, headers=ADMIN, timeout=30)
    assert claim.status_code == 200 and claim.json()["groups"] == []
    assert admin_get(proxy, f"/groups/{group['id']}")["train_status"] == "skipped"
