"""The generated TAC task family: deterministic, split by name, and every kind graded as TAC would.

Scripted solutions run as in ``test_tac_tasks.py``: a fresh local runtime workspace (seed copied,
``init.sh`` run), the commands in bash there, then the task's evaluator in its subprocess. The
``agents`` tests check every ``solution.json`` step against OpenHands' own tool schemas and run one
task of each variant through the real terminal tool.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from workflows.options import parse_options
from workflows.runner import task_order
from workflows.tac import family
from workflows.tac.run import TACOptions, TACWorkflow
from workflows.tac.runtime import LocalRuntime
from workflows.tac.scoring import Checkpoint, Result, score
from workflows.tac.task import BUNDLED, load_task, load_tasks

VARIANTS = {
    "write": {"line", "lines"},
    "edit": {"append", "replace"},
    "count": {"lines", "words", "word", "matching", "extract"},
    "fix": {"constant", "off_by_one"},
    "query": {f"{s}_{q}" for s in ("sql", "csv") for q in ("count", "sum", "max")},
}


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("family") / "tasks"
    family.write(out, count=600, seed=0)
    return out


def spec_of(task_dir: Path) -> dict[str, Any]:
    spec: dict[str, Any] = json.loads((task_dir / "spec.json").read_text())
    return spec


def first_of_each_variant(root: Path) -> list[Path]:
    seen: dict[tuple[str, str], Path] = {}
    for task_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        spec = spec_of(task_dir)
        seen.setdefault((spec["kind"], spec["variant"]), task_dir)
    return list(seen.values())


def test_the_same_seed_writes_the_same_bytes_and_another_seed_other_tasks(tmp_path: Path) -> None:
    family.write(tmp_path / "a", count=60, seed=3)
    family.write(tmp_path / "b", count=60, seed=3)
    family.write(tmp_path / "c", count=60, seed=4)
    a, c = tree(tmp_path / "a"), tree(tmp_path / "c")
    assert a == tree(tmp_path / "b")
    assert len(a) > 60 * 6
    mine = {text for path, text in a.items() if path.endswith("/task.md")}
    others = {text for path, text in c.items() if path.endswith("/task.md")}
    assert len(mine) == 60 and len(mine & others) <= 3  # another seed draws other tasks


def test_six_hundred_tasks_are_generated_fast(tmp_path: Path) -> None:
    started = time.monotonic()
    family.generate(600, seed=1)
    assert time.monotonic() - started < 2.0  # measured 0.05 s
    started = time.monotonic()
    family.write(tmp_path / "tasks", count=600, seed=1)  # about 4,000 files
    assert time.monotonic() - started < 10.0  # measured 1 s


def test_splits_are_80_10_10_by_name_and_stable_as_the_count_grows(generated: Path) -> None:
    splits = yaml.safe_load((generated / "splits.yml").read_text())
    names = sorted(p.name for p in generated.iterdir() if p.is_dir())
    assert sorted(n for s in ("train", "val", "test") for n in splits[s]) == names  # each once
    assert all(family.split_of(n) == s for s in splits for n in splits[s])
    shares = {s: len(splits[s]) / len(names) for s in splits}
    assert 0.74 < shares["train"] < 0.86 and 0.06 < shares["val"] < 0.14 and 0.06 < shares["test"] < 0.14
    small, large = family.generate(100, seed=0), family.generate(300, seed=0)
    assert large[:100] == small  # a larger count keeps every task, its files and its split
    assert [t.name for t in small] == names[:100]


def test_every_kind_and_variant_is_there_in_equal_shares_and_no_instruction_twice(generated: Path) -> None:
    """A demonstrator knows a task by its instruction: no two tasks share one."""
    task_dirs = [p for p in sorted(generated.iterdir()) if p.is_dir()]
    assert len({(p / "task.md").read_text() for p in task_dirs}) == 600
    specs = [spec_of(p) for p in task_dirs]
    assert Counter(s["kind"] for s in specs) == {kind: 120 for kind in family.KINDS}
    for kind, variants in VARIANTS.items():
        assert {s["variant"] for s in specs if s["kind"] == kind} == variants
    manifest = json.loads((generated / "family.json").read_text())
    assert manifest == {"version": family.VERSION, "seed": 0, "count": 600, "kinds": dict.fromkeys(family.KINDS, 120)}


def test_generated_tasks_load_as_tac_tasks(generated: Path) -> None:
    val = load_tasks(generated, "val")
    assert val and all(t.graded and t.dependencies == () and t.kind in family.KINDS for t in val)
    assert all(t.kind == t.name.rsplit("-", 1)[1] for t in val)
    sql = next(p for p in generated.iterdir() if p.is_dir() and spec_of(p)["variant"].startswith("sql_"))
    assert load_task(sql).init_script is not None and load_task(BUNDLED / "hello-file").kind is None


def test_a_full_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("")
    with pytest.raises(ValueError, match="is not empty"):
        family.write(tmp_path / "x", count=5)


def play(task_dir: Path, commands: list[str], root: Path) -> Result:
    runtime = LocalRuntime(root=root)
    prepared = runtime.prepare(load_task(task_dir), "00000000-scripted")
    try:
        for command in commands:
            subprocess.run(["bash", "-c", command], cwd=prepared.workdir, check=True, timeout=60)
        return runtime.evaluate(prepared, trajectory="[]")
    finally:
        runtime.cleanup(prepared)


def solution_commands(task_dir: Path) -> list[str]:
    steps = json.loads((task_dir / "solution.json").read_text())["steps"]
    assert steps[-1]["tool"] == "finish" and all(s["tool"] == "terminal" for s in steps[:-1])
    assert 2 <= len(steps) <= 4  # one to three commands, then finish
    return [s["arguments"]["command"] for s in steps[:-1]]


def test_the_scripted_solution_scores_one_on_every_variant(generated: Path, tmp_path: Path) -> None:
    for task_dir in first_of_each_variant(generated):
        assert score(play(task_dir, [], tmp_path).final_score) < 1.0, task_dir.name  # nothing done: not solved
        result = play(task_dir, solution_commands(task_dir), tmp_path)
        assert score(result.final_score) == 1.0, (task_dir.name, result)


def wrong(spec: dict[str, Any]) -> list[tuple[str, list[int]]]:
    """Scripted wrong or partial solutions of a task, each with the checkpoints it passes."""
    file, variant = spec["file"], spec["variant"]
    if spec["kind"] == "write":
        return [(f"echo 'hello world' > {file}", [1, 0]), ("true", [0, 0])]
    if variant == "append":
        last = spec["lines"][-1]
        return [(f"echo '{last}x' >> {file}", [1, 0]), (f"echo '{last}' > {file}", [0, 0])]
    if variant == "replace":
        key = spec["line"].split("=")[0].strip()
        return [(f"sed -i '/^{key}/s/$/0/' {file}", [1, 0]), (f"sed -i '/^{key}/d' {file}", [0, 0])]
    if variant == "extract":
        source = next(p for p in spec["lines"][0].split() if p.isupper())
        return [(f"grep {source} *.log | head -1 > {file}", [1, 1, 0]), (f"cat *.log > {file}", [1, 0, 0])]
    if spec["kind"] == "fix":
        cheat = f"sed -i 's/^    assert .*/    pass/' {file}"
        return [(cheat, [1, 0]), ("true", [0, 0])]
    # count and query: one line with the wrong answer, or not one line at all
    return [(f"echo 999999 > {file}", [1, 0]), (f"printf 'a\\nb\\n' > {file}", [0, 0])]


def test_scripted_wrong_solutions_score_their_exact_partial_credit(generated: Path, tmp_path: Path) -> None:
    for task_dir in first_of_each_variant(generated):
        for command, passed in wrong(spec_of(task_dir)):
            result = play(task_dir, [command], tmp_path)
            assert [c.result for c in result.checkpoints] == passed, (task_dir.name, command)
            assert score(result.final_score) == pytest.approx(0.5 * sum(passed) / len(passed))
    assert not list(tmp_path.iterdir())  # every workspace is gone after cleanup


def test_the_cache_generates_once_per_version_seed_and_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYWHEEL_CACHE", str(tmp_path))
    path = family.ensure(20, seed=2)
    assert path == tmp_path / "tac-family" / f"v{family.VERSION}-seed2-n20"
    stamp = (path / "family.json").stat().st_mtime_ns
    assert family.ensure(20, seed=2) == path and (path / "family.json").stat().st_mtime_ns == stamp
    assert family.ensure(25, seed=2) != path
    assert sorted(p.name for p in (tmp_path / "tac-family").iterdir()) == ["v1-seed2-n20", "v1-seed2-n25"]


def test_the_workflow_takes_the_family_with_its_splits_and_kinds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLYWHEEL_CACHE", str(tmp_path))
    workflow = TACWorkflow(parse_options(TACOptions, ["family=250", "family_seed=1"]))
    train, val, test = (workflow.split_tasks(s) for s in ("train", "val", "test"))
    assert len(train) + len(val) + len(test) == 250 and val and test
    assert not {t.name for t in train} & {t.name for t in val + test}
    assert all(family.split_of(t.name) == s for s, ts in (("train", train), ("val", val), ("test", test)) for t in ts)
    assert {workflow.stratum(t) for t in train} == set(family.KINDS)
    assert workflow.task_metadata(train[0])["kind"] == train[0].kind
    order = task_order(list(train), seed=0, stratum=workflow.stratum)
    assert len({workflow.stratum(t) for t in order[:5]}) >= 4  # any short stretch mixes the kinds
    bundled = TACWorkflow(TACOptions())
    assert bundled.split_tasks("val") == [] and bundled.stratum(bundled.split_tasks("train")[0]) is None
    with pytest.raises(ValueError, match="family must be a number of tasks >= 1"):
        TACOptions(family=0)
    with pytest.raises(ValueError, match="leave tasks_dir unset"):
        TACOptions(family=10, tasks_dir=tmp_path)


# ---- the agents venv: OpenHands' own tools ----------------------------------------------------


@pytest.fixture(scope="module")
def openhands(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One real OpenHands conversation (terminal + file editor, as ``agent.py`` builds them) whose
    LLM is never called, its terminal ready. One shell for the module: each new shell runs the
    host's login scripts, which can be slow (a ``pyenv rehash``), and OpenHands may take the prompt
    that a slow shell finally prints for the end of the first command sent to it."""
    os.environ.setdefault("ALLOW_SHORT_CONTEXT_WINDOWS", "true")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    os.environ.setdefault("OPENHANDS_SUPPRESS_BANNER", "1")
    import openhands.tools.file_editor  # noqa: F401 - registers the tool
    import openhands.tools.terminal  # noqa: F401
    from openhands.sdk import LLM, Agent, Conversation, Tool
    from openhands.sdk.workspace import LocalWorkspace
    from pydantic import SecretStr

    llm = LLM(model="openai/policy", base_url="http://127.0.0.1:9/v1", api_key=SecretStr("unused"), usage_id="t")
    agent = Agent(llm=llm, tools=[Tool(name="terminal"), Tool(name="file_editor")])
    workspace = LocalWorkspace(working_dir=str(tmp_path_factory.mktemp("openhands")))
    conversation: Any = Conversation(agent=agent, workspace=workspace, conversation_id=uuid.uuid4(), visualizer=None)
    try:
        conversation._ensure_agent_ready()  # resolves the tools without a first LLM call
        for _ in range(30):  # until a command's own output comes back
            if "ready-2" in terminal(conversation, "echo ready-$((1 + 1))"):
                break
        else:
            pytest.fail("OpenHands' terminal never ran a command")
        yield conversation
    finally:
        conversation.close()


def terminal(conversation: Any, command: str) -> str:
    tool = conversation.agent.tools_map["terminal"]
    return str(tool(tool.action_from_arguments({"command": command}), conversation).to_llm_content)


def every_solution(generated: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    for task_dir in [*sorted(p for p in generated.iterdir() if p.is_dir()), *sorted(BUNDLED.iterdir())]:
        if task_dir.is_dir():
            for step in json.loads((task_dir / "solution.json").read_text())["steps"]:
                yield task_dir.name, step


@pytest.mark.agents
def test_every_solution_step_is_a_valid_openhands_tool_call(generated: Path, openhands: Any) -> None:
    """Each step as the agent takes a model's tool call: the tool exists, its arguments fit the
    schema the model is shown (``to_openai_tool``) and build the tool's action unchanged."""
    import jsonschema
    from openhands.sdk.agent.utils import fix_malformed_tool_arguments, normalize_tool_call
    from openhands.tools.terminal.utils import split_bash_commands

    tools = openhands.agent.tools_map
    schemas = {name: tool.to_openai_tool(add_security_risk_prediction=True) for name, tool in tools.items()}
    steps = 0
    for name, step in every_solution(generated):
        tool_name, arguments = normalize_tool_call(step["tool"], dict(step["arguments"]), tools.keys())
        assert (tool_name, arguments) == (step["tool"], step["arguments"]), name
        tool = tools[tool_name]
        jsonschema.validate(arguments, schemas[tool_name]["function"]["parameters"])
        assert fix_malformed_tool_arguments(dict(arguments), tool.action_type) == arguments, name
        action = tool.action_from_arguments(dict(arguments))
        assert action.model_dump(include=set(arguments)) == arguments, name
        if tool_name == "terminal":
            assert len(split_bash_commands(arguments["command"])) == 1, (name, arguments)  # one command a call
        steps += 1
    assert steps > 600 * 2


@pytest.mark.agents
def test_one_task_of_each_variant_solved_through_the_real_openhands_tools(
    generated: Path, openhands: Any, tmp_path: Path
) -> None:
    """The steps a demonstrator replays, executed by OpenHands' own tools (its tmux terminal), in
    each task's fresh workspace (the terminal moves there first), then graded."""
    tools = openhands.agent.tools_map
    for task_dir in [*first_of_each_variant(generated), *(p for p in sorted(BUNDLED.iterdir()) if p.is_dir())]:
        runtime = LocalRuntime(root=tmp_path)
        prepared = runtime.prepare(load_task(task_dir), "00000000-openhands")
        try:
            assert str(prepared.workdir) in terminal(openhands, f"cd {prepared.workdir}")
            for step in json.loads((task_dir / "solution.json").read_text())["steps"]:
                tool = tools[step["tool"]]
                observation = tool(tool.action_from_arguments(dict(step["arguments"])), openhands)
                assert not observation.is_error, (task_dir.name, step, observation)
            result = runtime.evaluate(prepared, trajectory="[]")
        finally:
            runtime.cleanup(prepared)
        assert result.final_score == Checkpoint(result.final_score.total, result.final_score.total), task_dir.name
