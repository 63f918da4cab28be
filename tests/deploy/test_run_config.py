"""The launcher's run config: every shipped file loads, typos and wrong types are refused before anything starts."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.run_config import EngineSection, RunConfig, RunConfigError, load_run_config
from deploy.vllm import DEFAULT_TEMPLATE, VLLMServer
from tests.support.services import ROOT
from trainer.config import TrainerConfig

RUN_CONFIGS = sorted((ROOT / "configs").glob("run-*.yaml"))

# What the launcher used when a key was absent, before the config was typed: the defaults of its
# `config.get(key, default)` calls in deploy/local.py and deploy/loop.py, copied from there.
LAUNCHER_DEFAULTS: dict[str, Any] = {
    "data_dir": "data",
    "proxy_config": "configs/local.yaml",
    "proxy_port": None,
    "model_name": "SmolLM2-135M-Instruct",
    "seed": 0,
    "budget_minutes": 30.0,
    "budget_steps": None,
    "eval_after_slowdown": 5.0,
    "min_train_minutes": 10.0,
    "resume": True,
    "engine": {
        "url": None,
        "seed_rule": "drop",
        "model": None,
        "served_name": "policy-base",
        "device": "cpu",
        "max_lora_rank": 16,
        "max_loras": 4,
        "max_model_len": 8192,
        "dtype": "auto",
        "cpu_kv_cache_gib": 4,
        "chat_template": str(DEFAULT_TEMPLATE),
        "tool_call_parser": "hermes",
        "gpu_memory_utilization": 0.85,
        "extra_args": [],
    },
    "trainer": {"config": "configs/trainer-local.yaml", "overrides": {}},
    "workflow": {"name": "math", "args": []},
    "eval": {"args": []},
    "guard": {
        "action": "rollback",
        "probe_every": 10,
        "probe_args": ["--split", "val", "--limit", "40", "--concurrency", "16"],
        "max_drop": 0.1,
        "max_cut_fraction": 0.5,
        "window": 5,
        "patience": 2,
        # the early-warning rules (issue 44), added since: on by default
        "early_window": 5,
        "early_success_fall": 0.5,
        "early_entropy_fall": 0.5,
        "early_zero_steps": 3,
        "early_shaping_only_share": 0.75,
        "early_min_success": 0.2,
    },
    "warm_start": None,  # added since (issue 46): no warm start unless a config asks for one
}


def write(tmp_path: Path, data: object, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def test_shipped_run_configs_exist() -> None:
    assert {p.name for p in RUN_CONFIGS} >= {
        "run-local.yaml",
        "run-tools.yaml",
        "run-openhands.yaml",
        "run-miniswe.yaml",
    }


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_run_config_loads_with_its_values(path: Path, tmp_path: Path) -> None:
    raw = yaml.safe_load(path.read_text())
    config = load_run_config(path)
    loaded = config.to_dict()
    for key, value in raw.items():
        if isinstance(value, dict):
            for sub, subvalue in value.items():
                expected = [str(v) for v in subvalue] if isinstance(subvalue, list) else subvalue
                assert loaded[key][sub] == expected, f"{key}.{sub}"
        else:
            assert loaded[key] == value, key
    assert config.trainer_config_path.is_file() and config.proxy_config_path.is_file()
    assert load_run_config(write(tmp_path, loaded)) == config  # to_dict() reads back to the same config


def test_empty_file_gives_the_launchers_former_defaults(tmp_path: Path) -> None:
    assert load_run_config(write(tmp_path, "")).to_dict() == LAUNCHER_DEFAULTS
    assert RunConfig().to_dict() == LAUNCHER_DEFAULTS


def test_engine_defaults_are_vllm_servers() -> None:
    server = VLLMServer(model="m")
    shared = {f.name for f in dataclasses.fields(VLLMServer)} & {f.name for f in dataclasses.fields(EngineSection)}
    assert len(shared - {"model"}) == 11
    for f in dataclasses.fields(EngineSection):
        if f.name in shared - {"model"}:
            assert getattr(EngineSection(), f.name) == _plain(getattr(server, f.name)), f.name


def _plain(value: object) -> object:
    return tuple(value) if isinstance(value, list) else value


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"sed": 2}, "unknown key 'sed' (did you mean 'seed'?)"),
        ({"budget_minute": 5, "seed": 1}, "unknown key 'budget_minute' (did you mean 'budget_minutes'?)"),
        ({"engine": {"max_lora_rnk": 8}}, "unknown key 'engine.max_lora_rnk' (did you mean 'max_lora_rank'?)"),
        ({"workflow": {"arg": []}}, "unknown key 'workflow.arg' (did you mean 'args'?)"),
        ({"eval": {"split": "test"}}, "unknown key 'eval.split' (known: args)"),
        (
            {"workflow": {"name": "tac"}, "warm_start": {"step": 2}},
            "unknown key 'warm_start.step' (did you mean 'steps'?)",
        ),
        (
            {"trainer": {"overrides": {"learning_rat": 1e-4}}},
            "unknown trainer setting 'trainer.overrides.learning_rat' (did you mean 'learning_rate'?)",
        ),
    ],
)
def test_unknown_keys_are_refused_with_a_did_you_mean_naming_the_file(
    tmp_path: Path, data: object, message: str
) -> None:
    path = write(tmp_path, data)
    with pytest.raises(RunConfigError) as err:
        load_run_config(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"seed": "one"}, "seed: expected an integer, got 'one'"),
        ({"seed": True}, "seed: expected an integer, got True"),
        ({"resume": "yes"}, "resume: expected true or false, got 'yes'"),
        ({"budget_minutes": "half"}, "budget_minutes: expected a number, got 'half'"),
        ({"engine": {"max_loras": "four"}}, "engine.max_loras: expected an integer, got 'four'"),
        ({"engine": {"device": "tpu"}}, "engine.device: unknown value 'tpu'; choose one of cpu, gpu"),
        ({"engine": ["cpu"]}, "engine: expected a mapping of settings, got ['cpu']"),
        ({"workflow": {"args": "--group-size 8"}}, "workflow.args: expected a list of strings or numbers"),
        ({"workflow": {"args": [["-o"]]}}, "workflow.args: expected a list of strings or numbers"),
        ({"trainer": {"overrides": [1]}}, "trainer.overrides: expected a mapping of names to values"),
        ({"data_dir": 3}, "data_dir: expected a string, got 3"),
        ({"engine": {"max_loras": 0}}, "engine.max_loras must be >= 1"),
        ({"budget_minutes": 0}, "budget_minutes must be > 0"),
        ({"budget_steps": 0}, "budget_steps must be >= 1 (or null)"),
        ({"budget_steps": 2.5}, "budget_steps: expected an integer, got 2.5"),
        ("- a list", "the run config: expected a mapping of settings"),
        ({"workflow": {"name": "tac"}, "warm_start": {"steps": 0}}, "warm_start.steps must be >= 1"),
        ({"workflow": {"name": "tac"}, "warm_start": {"groups": "many"}}, "warm_start.groups: expected an integer"),
        ({"workflow": {"name": "tac"}, "warm_start": {"teacher": "a b"}}, "warm_start.teacher must be a plain name"),
        ({"workflow": {"name": "tac"}, "warm_start": {"learning_rate": 0}}, "warm_start.learning_rate must be > 0"),
        ({"warm_start": {}}, "warm_start needs a workflow the scripted demonstrator can play to"),
        (
            {"workflow": {"name": "tac"}, "warm_start": {}, "trainer": {"overrides": {"warm_start_steps": 3}}},
            "set the warm start in the warm_start section, not in trainer.overrides",
        ),
    ],
)
def test_wrong_types_and_values_are_refused_naming_key_and_file(tmp_path: Path, data: object, message: str) -> None:
    path = write(tmp_path, data)
    with pytest.raises(RunConfigError) as err:
        load_run_config(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)


def test_yaml_shapes_the_launcher_accepted_keep_their_meaning(tmp_path: Path) -> None:
    config = load_run_config(
        write(
            tmp_path,
            {
                "engine": {"chat_template": "", "tool_call_parser": None, "model": "", "url": "http://127.0.0.1:8000"},
                "workflow": {"args": ["--group-size", 8, "-o", "temperature=0.7"]},
                "trainer": {"overrides": {"learning_rate": 2.0e-4, "max_steps": 2}},
                "budget_minutes": 12,
                "eval_after_slowdown": "2.5e0",
                "proxy_port": None,
            },
        )
    )
    assert config.engine.chat_template is None and config.engine.tool_call_parser is None
    assert config.engine.model is None and config.engine.url == "http://127.0.0.1:8000"
    assert config.workflow.args == ("--group-size", "8", "-o", "temperature=0.7")
    assert config.trainer.overrides == {"learning_rate": 2.0e-4, "max_steps": 2}
    assert config.budget_minutes == 12.0 and config.eval_after_slowdown == 2.5


def test_budget_steps_from_the_file_or_the_command_line(tmp_path: Path) -> None:
    config = load_run_config(write(tmp_path, {"budget_steps": 50, "seed": 2}))
    assert config.budget_steps == 50
    assert config.with_budget_steps(None) is config
    assert config.with_budget_steps(7).budget_steps == 7 and config.with_budget_steps(7).seed == 2
    with pytest.raises(RunConfigError, match="--budget-steps: invalid run config"):
        config.with_budget_steps(0)


def test_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RunConfigError, match="run config not found"):
        load_run_config(tmp_path / "nope.yaml")


def test_another_seed_is_another_run() -> None:
    config = RunConfig(seed=1)
    assert config.with_seed(None) is config and config.with_seed(1) is config
    assert config.with_seed(2) == dataclasses.replace(config, seed=2, resume=False)


def test_launcher_refuses_a_bad_config_before_starting_anything(tmp_path: Path) -> None:
    path = write(tmp_path, {"engine": {"max_lora_rnk": 8}})
    done = subprocess.run(
        [sys.executable, "-m", "deploy.local", "run", "--config", str(path), "--seed", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert f"error: {path}: unknown key 'engine.max_lora_rnk' (did you mean 'max_lora_rank'?)" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "data").exists()


def test_loop_and_stack_do_not_import_the_launcher() -> None:
    code = "import sys, deploy.loop, deploy.stack; assert 'deploy.local' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_stack_starts_vllm_and_the_proxy_as_the_config_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from deploy.stack import Stack, dashboard_hint

    monkeypatch.setenv("FLYWHEEL_ADMIN_KEY", "k" * 20)
    config = load_run_config(ROOT / "configs/run-tools.yaml")
    config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, model=str(tmp_path)))
    stack = Stack(config, data_dir=tmp_path)  # builds the children, starts nothing
    assert stack.vllm is not None and stack.proxy_url == "http://127.0.0.1:8100"
    command = " ".join(stack.vllm.command())
    assert f"--model {tmp_path} --served-model-name policy-base" in command and "--port 8000" in command
    assert "--max-lora-rank 16 --max-loras 4" in command and "--max-model-len 8192" in command
    assert f"--chat-template {DEFAULT_TEMPLATE} --enable-auto-tool-choice --tool-call-parser hermes" in command
    assert stack.vllm.env()["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert stack.proxy.env["FLYWHEEL_STORE__URL"].startswith(f"sqlite+aiosqlite:///{tmp_path.resolve()}/")

    hint = dashboard_hint(stack.proxy_url, stack.key_file)
    assert hint.startswith("dashboard: http://127.0.0.1:8100/ui/") and "$FLYWHEEL_ADMIN_KEY" in hint
    assert stack.key not in hint
    monkeypatch.delenv("FLYWHEEL_ADMIN_KEY")
    own_key = Stack(config, data_dir=tmp_path / "run")
    hint = dashboard_hint(own_key.proxy_url, own_key.key_file)
    assert f"the key in {tmp_path / 'run' / 'admin.key'}" in hint and own_key.key not in hint

    routed = dataclasses.replace(
        config, proxy_port=8123, engine=EngineSection(url="http://127.0.0.1:9000", model=str(tmp_path))
    )
    stack = Stack(routed, data_dir=tmp_path)
    assert stack.vllm is None and stack.proxy_url == "http://127.0.0.1:8123"
    assert yaml.safe_load(stack.proxy.env["FLYWHEEL_UPSTREAMS"]) == [
        {"name": "vllm-0", "url": "http://127.0.0.1:9000", "seed_rule": "drop"}
    ]


def test_warm_start_section_stands_for_the_trainers_warm_start_settings(tmp_path: Path) -> None:
    args = ["--group-size", "4", "-o", "family=40", "--option=system_prompt=short"]
    base = {"workflow": {"name": "tac", "args": args}}
    assert load_run_config(write(tmp_path, base)).warm_start is None  # absent: GRPO from the base model
    config = load_run_config(write(tmp_path, {**base, "warm_start": {"steps": 3, "learning_rate": 1e-4}}))
    warm = config.warm_start
    assert warm is not None and warm.source == "teacher:demo" and warm.groups == 16 and warm.min_reward == 1.0
    assert warm.trainer_overrides() == {
        "warm_start_steps": 3,
        "warm_start_source": "teacher:demo",
        "warm_start_episodes_per_step": 8,
        "warm_start_min_reward": 1.0,
        "warm_start_learning_rate": 1e-4,
    }
    names = {f.name for f in dataclasses.fields(TrainerConfig)}
    assert set(warm.trainer_overrides()) <= names  # every key one the trainer knows
    anyone = load_run_config(write(tmp_path, {**base, "warm_start": {"min_reward": None, "teacher": "big"}}))
    assert anyone.warm_start is not None and "warm_start_min_reward" not in anyone.warm_start.trainer_overrides()
    assert anyone.warm_start.trainer_overrides()["warm_start_source"] == "teacher:big"
    from deploy.stack import workflow_options

    assert workflow_options(config.workflow.args) == ["family=40", "system_prompt=short"]


def test_stack_starts_the_demonstrator_as_the_proxys_teacher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from deploy.stack import Stack

    monkeypatch.setenv("FLYWHEEL_ADMIN_KEY", "k" * 20)
    config = load_run_config(ROOT / "configs/run-openhands.yaml")
    engine = EngineSection(url="http://127.0.0.1:9000", model=str(tmp_path))
    stack = Stack(dataclasses.replace(config, engine=engine), data_dir=tmp_path)  # starts nothing
    [teacher] = yaml.safe_load(stack.proxy.env["FLYWHEEL_TEACHERS"])
    assert teacher == {"name": "demo", "url": stack.teacher_url, "model": "demonstrator"}
    assert config.warm_start is not None
    warm = dataclasses.replace(config.warm_start, tasks_dir="workflows/tac/tasks")
    stack = Stack(dataclasses.replace(config, engine=engine, warm_start=warm), data_dir=tmp_path)
    assert stack.demonstrator_tasks() == ROOT / "workflows/tac/tasks"
    plain = Stack(dataclasses.replace(config, engine=engine, warm_start=None), data_dir=tmp_path)
    assert "FLYWHEEL_TEACHERS" not in plain.proxy.env and plain.teacher_url is None
