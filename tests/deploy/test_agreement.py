"""deploy/agreement.py: values several processes of a run must agree on are checked before any starts,
and a disagreement names both values and where each was set."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from deploy.agreement import check, disagreements, shared_overrides
from deploy.run_config import ROOT, RunConfig, RunConfigError, load_run_config

RUN_CONFIGS = sorted(p.relative_to(ROOT) for p in (ROOT / "configs").glob("run-*.yaml"))


def with_overrides(config: RunConfig, **overrides: object) -> RunConfig:
    trainer = dataclasses.replace(config.trainer, overrides={**config.trainer.overrides, **overrides})
    return dataclasses.replace(config, trainer=trainer)


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    (tmp_path / "model").mkdir()
    return str(tmp_path / "model")


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=str)
def test_every_shipped_run_config_agrees_with_itself(path: Path, model_dir: str) -> None:
    assert disagreements(load_run_config(ROOT / path), model_dir, environ={}) == []


def test_a_lora_rank_above_the_engines_names_both(model_dir: str) -> None:
    config = with_overrides(load_run_config(ROOT / "configs/run-tools.yaml"), lora_r=32)
    (error,) = disagreements(config, model_dir, environ={}, run_file="configs/run-tools.yaml")
    assert "lora_r=32 exceeds max_lora_rank=16" in error  # the trainer's own rule, on the engine's value
    assert "engine.max_lora_rank = 16" in error and "(configs/run-tools.yaml)" in error
    with pytest.raises(RunConfigError, match="disagree"):
        check(config, model_dir)


def test_a_value_every_process_takes_from_the_run_config_cannot_be_overridden_apart(model_dir: str) -> None:
    config = with_overrides(load_run_config(ROOT / "configs/run-local.yaml"), max_lora_rank=8, seed=7)
    errors = disagreements(config, model_dir, environ={})
    assert any("trainer.overrides.max_lora_rank = 8" in e and "engine.max_lora_rank = 16" in e for e in errors)
    assert any("trainer.overrides.seed = 7" in e and "seed = 1" in e for e in errors)
    assert shared_overrides(config) == {"seed": 1, "max_lora_rank": 16}


def test_a_trainer_on_another_model_than_the_engine_serves_names_both(model_dir: str, tmp_path: Path) -> None:
    other = tmp_path / "other-model"
    other.mkdir()
    config = with_overrides(load_run_config(ROOT / "configs/run-local.yaml"), model=str(other))
    (error,) = disagreements(config, model_dir, environ={})
    assert f"trainer model = {str(other)!r}" in error and f"the engine serves, {model_dir!r}" in error


def test_a_proxy_routing_the_base_policy_to_a_name_vllm_does_not_serve_names_both(
    model_dir: str, tmp_path: Path
) -> None:
    base = load_run_config(ROOT / "configs/run-local.yaml")
    proxy = yaml.safe_load(base.proxy_config_path.read_text())
    proxy["proxy"]["policy"]["base_model"] = "smollm2-base"
    (tmp_path / "proxy.yaml").write_text(yaml.safe_dump(proxy))
    config = dataclasses.replace(base, proxy_config=str(tmp_path / "proxy.yaml"))
    (error,) = disagreements(config, model_dir, environ={})
    assert "proxy policy.base_model = 'smollm2-base'" in error and "engine.served_name = 'policy-base'" in error


def test_an_engine_someone_else_runs_is_not_held_to_the_launchers_served_name(model_dir: str, tmp_path: Path) -> None:
    base = load_run_config(ROOT / "configs/run-local.yaml")
    proxy = yaml.safe_load(base.proxy_config_path.read_text())
    proxy["proxy"]["policy"]["base_model"] = "smollm2-base"
    (tmp_path / "proxy.yaml").write_text(yaml.safe_dump(proxy))
    engine = dataclasses.replace(base.engine, url="http://127.0.0.1:8000")
    config = dataclasses.replace(base, proxy_config=str(tmp_path / "proxy.yaml"), engine=engine)
    assert disagreements(config, model_dir, environ={}) == []
