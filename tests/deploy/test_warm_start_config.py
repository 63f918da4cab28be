"""The warm start with either agent on TAC-layout tasks: which workflows the run config accepts it
for, the demonstrator style each gets, and the demonstrator command line the stack builds from it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml

from deploy.run_config import (
    DEMONSTRATOR_STYLES,
    DemonstratorStyle,
    EngineSection,
    RunConfig,
    RunConfigError,
    load_run_config,
)
from deploy.stack import Child, Stack, demonstrator_command, workflow_options
from tests.support.services import ROOT
from workflows.miniswe.run import MiniSweOptions, MiniSweWorkflow
from workflows.options import parse_options
from workflows.tac.demonstrator import STYLES
from workflows.tac.run import TACOptions, TACWorkflow

MINISWE = ROOT / "configs/run-miniswe.yaml"
OPENHANDS = ROOT / "configs/run-openhands.yaml"


def load(tmp_path: Path, data: dict[str, Any]) -> RunConfig:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_run_config(path)


@pytest.mark.parametrize(
    ("workflow", "style"), [("tac", "openhands"), ("miniswe", "mini-swe-agent")], ids=["tac", "miniswe"]
)
def test_warm_start_is_accepted_for_both_tac_agents_each_with_its_style(
    workflow: str, style: str, tmp_path: Path
) -> None:
    config = load(tmp_path, {"workflow": {"name": workflow}, "warm_start": {"steps": 2}})
    assert config.warm_start is not None and config.warm_start.style is None
    assert config.demonstrator_style == style
    assert load(tmp_path, {"workflow": {"name": workflow}}).demonstrator_style is None  # no warm start


def test_an_explicit_style_wins_over_the_workflows(tmp_path: Path) -> None:
    config = load(tmp_path, {"workflow": {"name": "tac"}, "warm_start": {"style": "mini-swe-agent"}})
    assert config.demonstrator_style == "mini-swe-agent"
    config = load(tmp_path, {"workflow": {"name": "miniswe"}, "warm_start": {"style": "openhands"}})
    assert config.demonstrator_style == "openhands"


@pytest.mark.parametrize("workflow", ["math", "calc", "tau2"])
def test_warm_start_is_refused_for_other_workflows_naming_the_ones_it_needs(workflow: str, tmp_path: Path) -> None:
    with pytest.raises(RunConfigError) as caught:
        load(tmp_path, {"workflow": {"name": workflow}, "warm_start": {}})
    message = str(caught.value)
    assert str(tmp_path / "run.yaml") in message  # the file, then the rule
    assert "warm_start needs a workflow the scripted demonstrator can play to (tac or miniswe)" in message
    assert f"got workflow.name {workflow!r}" in message
    load(tmp_path, {"workflow": {"name": workflow}})  # without warm_start the workflow is fine


def test_an_unknown_style_is_refused_with_the_choices(tmp_path: Path) -> None:
    with pytest.raises(
        RunConfigError, match="warm_start.style: unknown value 'bash'; choose one of openhands, mini-swe-agent"
    ):
        load(tmp_path, {"workflow": {"name": "miniswe"}, "warm_start": {"style": "bash"}})


def test_the_configs_styles_are_the_demonstrators() -> None:
    """A style the run config accepts must be one the demonstrator's ``--style`` takes, and back."""
    assert set(get_args(DemonstratorStyle)) == set(STYLES)
    assert set(DEMONSTRATOR_STYLES.values()) <= set(STYLES)


def test_the_demonstrator_command_names_tasks_port_and_style(tmp_path: Path) -> None:
    assert demonstrator_command(tmp_path, 8311, "mini-swe-agent", python="/py") == [
        "/py",
        "-m",
        "workflows.tac.demonstrator",
        "--tasks-dir",
        str(tmp_path),
        "--port",
        "8311",
        "--style",
        "mini-swe-agent",
    ]
    assert demonstrator_command(tmp_path, "9000", "openhands")[-4:] == ["--port", "9000", "--style", "openhands"]


@pytest.mark.parametrize(
    ("path", "style"), [(MINISWE, "mini-swe-agent"), (OPENHANDS, "openhands")], ids=["miniswe", "openhands"]
)
def test_the_stack_starts_the_demonstrator_in_the_workflows_style(
    path: Path, style: DemonstratorStyle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stack's own start path, up to the process: the argv it hands the child carries the style."""
    monkeypatch.setenv("FLYWHEEL_ADMIN_KEY", "k" * 20)
    config = load_run_config(path)
    assert config.warm_start is not None
    engine = EngineSection(url="http://127.0.0.1:9000", model=str(tmp_path))
    warm = dataclasses.replace(config.warm_start, tasks_dir="workflows/tac/tasks")
    stack = Stack(dataclasses.replace(config, engine=engine, warm_start=warm), data_dir=tmp_path)
    assert stack.teacher_url is not None
    started: list[list[str]] = []
    monkeypatch.setattr(Child, "start", lambda child: started.append(child.argv))
    monkeypatch.setattr(Child, "alive", lambda child: False)  # "exits" at once: nothing is run
    with pytest.raises(SystemExit, match="the demonstrator exited"):
        stack._start_demonstrator(stack.teacher_url)
    port = stack.teacher_url.rsplit(":", 1)[1]
    assert started == [demonstrator_command(ROOT / "workflows/tac/tasks", port, style)]


def test_run_miniswe_is_run_openhands_with_the_miniswe_workflow() -> None:
    miniswe, openhands = load_run_config(MINISWE), load_run_config(OPENHANDS)
    assert miniswe.workflow.name == "miniswe" and miniswe.demonstrator_style == "mini-swe-agent"
    same = ("engine", "trainer", "model_name", "seed", "budget_minutes", "budget_steps", "warm_start", "guard")
    for name in same:
        assert getattr(miniswe, name) == getattr(openhands, name), name
    for args in (miniswe.workflow.args, miniswe.eval.args):
        options = parse_options(MiniSweOptions, workflow_options(args))  # every -o is one miniswe takes
        assert options.family == 400 and options.step_limit == 6 and options.max_tokens == 160


def test_miniswe_names_tacs_task_directory_for_the_demonstrator(tmp_path: Path) -> None:
    """The stack asks ``<workflow>(options).tasks_root`` for the demonstrator's tasks."""
    assert MiniSweWorkflow(MiniSweOptions()).tasks_root == TACWorkflow(TACOptions()).tasks_root
    assert MiniSweWorkflow(MiniSweOptions(tasks_dir=tmp_path)).tasks_root == tmp_path
