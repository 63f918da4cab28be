"""Config: YAML plus overrides, and start-up refusals that say how to fix them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.services import ROOT, free_port
from trainer.config import ConfigError, TrainerConfig, load_config


def test_local_config_loads_with_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYWHEEL_MODEL_DIR", "/models/smol")
    cfg = load_config(
        ROOT / "configs/trainer-local.yaml",
        ["max_steps=3", "--learning_rate=2e-5", "mode=sync", "max_staleness=null", "lora_target_modules=q_proj,v_proj"],
    )
    assert cfg.model == "/models/smol" and cfg.max_steps == 3 and cfg.learning_rate == 2e-5
    assert cfg.staleness_bound == 0 and cfg.lora_target_modules == ("q_proj", "v_proj")
    assert cfg.epsilon_upper == 0.28 and cfg.lora_r <= 16


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["loss_type=ppo"], "unknown loss_type 'ppo'; choose one of grpo, bnpo, dr_grpo, dapo"),
        (["scale_rewards=stdev"], "unknown scale_rewards 'stdev'; choose one of group, batch, none"),
        (["learning_rat=1e-4"], "unknown trainer setting 'learning_rat' (did you mean 'learning_rate'?)"),
        (["lora_r=32"], "lora_r=32 exceeds max_lora_rank=16"),
        (["mode=sync", "max_staleness=2"], "mode=sync trains only on groups from the current version"),
        (["max_seq_len=4096"], "micro_batch_tokens=2048 must be >= max_seq_len=4096"),
        (["lora_target_modules=lm_head"], "must not include lm_head"),
        (["groups_per_step=many"], "groups_per_step: expected an integer, got 'many'"),
        (["max_steps"], "expected key=value"),
        (["mmap_threshold_kb=1"], "mmap_threshold_kb must be 4 to 32768"),
    ],
)
def test_bad_settings_are_refused_with_a_fix(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value)


def test_admin_key_from_env_then_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key_file = tmp_path / "admin.key"
    key_file.write_text("from-file-0123456789\n")
    cfg = TrainerConfig(admin_key_file=str(key_file))
    monkeypatch.delenv("FLYWHEEL_ADMIN_KEY", raising=False)
    assert cfg.admin_key() == "from-file-0123456789"
    monkeypatch.setenv("FLYWHEEL_ADMIN_KEY", "from-env-0123456789")
    assert cfg.admin_key() == "from-env-0123456789"
    monkeypatch.delenv("FLYWHEEL_ADMIN_KEY")
    with pytest.raises(ConfigError, match="no admin key"):
        TrainerConfig(admin_key_file=str(tmp_path / "missing")).admin_key()


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainer", "run", *args], cwd=ROOT, env=env, text=True, capture_output=True, timeout=120
    )


def test_cli_refuses_to_start_with_clear_errors(tmp_path: Path, vllm_model_dir: str) -> None:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "FLYWHEEL_ADMIN_KEY": "k" * 20}
    config = ["--config", str(ROOT / "configs/trainer-local.yaml"), f"output_dir={tmp_path}"]

    missing = run_cli(*config, env=env)  # FLYWHEEL_MODEL_DIR unset: ${FLYWHEEL_MODEL_DIR} stays unresolved
    assert missing.returncode == 2
    assert "model directory not found" in missing.stderr and "FLYWHEEL_MODEL_DIR" in missing.stderr

    unreachable = run_cli(*config, f"model={vllm_model_dir}", f"proxy_url=http://127.0.0.1:{free_port()}", env=env)
    assert unreachable.returncode == 2
    assert "cannot reach the proxy" in unreachable.stderr

    bad_loss = run_cli(*config, "loss_type=grpoo", env=env)
    assert bad_loss.returncode == 2 and "unknown loss_type 'grpoo'" in bad_loss.stderr
    assert "Traceback" not in missing.stderr + unreachable.stderr + bad_loss.stderr
