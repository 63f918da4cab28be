"""The values several processes of one run must agree on, checked before any of them starts.

``make run`` starts vLLM, the proxy, the trainer and a workflow from three files: the run config
(launcher and engine), the proxy's YAML, and the trainer's YAML with the run config's
``trainer.overrides``. A few values describe one thing in more than one of them, and a disagreement
shows late or never: a LoRA rank above vLLM's ``--max-lora-rank`` is refused at the first publish,
minutes in; a proxy routing the base policy to a name vLLM does not serve fails every call; a
trainer loading another model than the engine serves scores other log-probs than the ones sampled
and trains on a silently wrong importance ratio. Each such pair is checked here, and every
disagreement is named with both values and where each was set. Values one process can take from
another (the seed, the model directory, the proxy's address, vLLM's ``--max-lora-rank``) are passed
by the launcher instead (``shared_overrides``), so they are declared once.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from deploy.run_config import RunConfig, RunConfigError


def shared_overrides(config: RunConfig) -> dict[str, Any]:
    """Trainer settings the run config declares for every process: passed to the trainer as overrides
    (after its own file, before ``trainer.overrides``, which ``disagreements`` then checks)."""
    return {"seed": config.seed, "max_lora_rank": config.engine.max_lora_rank}


def disagreements(
    config: RunConfig, model_dir: str, *, environ: dict[str, str] | None = None, run_file: str = "the run config"
) -> list[str]:
    """What the run's processes would disagree on, one message each naming both sides; [] when none.

    ``model_dir`` is the model the engine serves (``engine.model`` or the converted default), which
    the trainer's file reaches through ``FLYWHEEL_MODEL_DIR``; ``environ`` is the launcher's
    environment the proxy and trainer inherit (default ``os.environ``).
    """
    from proxy.settings import load_settings
    from trainer.config import ConfigError, load_config

    env = dict(os.environ if environ is None else environ, FLYWHEEL_MODEL_DIR=model_dir)
    trainer_file = f"{config.trainer.config} with trainer.overrides of {run_file}"
    errors: list[str] = []

    explicit = config.trainer.overrides
    for key, value in shared_overrides(config).items():
        if key in explicit and str(explicit[key]) != str(value):
            run_key = "seed" if key == "seed" else f"engine.{key}"
            errors.append(
                f"trainer.overrides.{key} = {explicit[key]!r} ({run_file}) disagrees with {run_key} = {value!r} "
                f"({run_file}), which every process of the run uses; drop the override"
            )

    saved = dict(os.environ)
    try:  # the trainer's file expands ${FLYWHEEL_MODEL_DIR} as the trainer process will
        os.environ.clear()
        os.environ.update(env)
        overrides = {**shared_overrides(config), **explicit}
        trainer = load_config(config.trainer_config_path, [f"{k}={v}" for k, v in overrides.items()])
    except ConfigError as exc:  # e.g. lora_r above the engine's max_lora_rank, which it now holds
        errors.append(
            f"the trainer ({trainer_file}) with engine.max_lora_rank = {config.engine.max_lora_rank} and seed = "
            f"{config.seed} ({run_file}): {exc}"
        )
        trainer = None
    finally:
        os.environ.clear()
        os.environ.update(saved)
    if trainer is not None and _resolved(trainer.model) != _resolved(model_dir):
        where = f"engine.model = {config.engine.model!r}" if config.engine.model else "the converted default model"
        errors.append(
            f"trainer model = {trainer.model!r} ({trainer_file}) is not the model the engine serves, {model_dir!r} "
            f"({where}, {run_file}): the trainer would score another model's log-probs than the ones sampled"
        )

    # The stack gives the proxy its admin key; a stand-in lets the rest of its file validate here.
    proxy = load_settings(config.proxy_config_path, environ={"FLYWHEEL_ADMIN_KEY": secrets.token_urlsafe(), **env})
    # (an engine someone else runs, engine.url, serves whatever it serves: the proxy's name is the one)
    if config.engine.url is None and proxy.policy.base_model != config.engine.served_name:
        errors.append(
            f"proxy policy.base_model = {proxy.policy.base_model!r} ({config.proxy_config}) is not "
            f"engine.served_name = {config.engine.served_name!r} ({run_file}): the proxy would route the "
            "base policy to a name vLLM does not serve"
        )
    return errors


def check(config: RunConfig, model_dir: str) -> None:
    """``disagreements`` as one ``RunConfigError`` (the launcher's start refuses the run)."""
    errors = disagreements(config, model_dir)
    if errors:
        raise RunConfigError("the run's processes disagree:\n  - " + "\n  - ".join(errors))


def _resolved(path: str) -> str:
    """A model directory compared by where it is (a hub name, not a directory, as it is written)."""
    candidate = Path(path).expanduser()
    return str(candidate.resolve()) if candidate.exists() else path
