"""``python -m trainer run --config configs/trainer-local.yaml [key=value ...]``: GRPO on completed groups.

``python -m trainer warmstart ...``: only the warm start (supervised steps on recorded episodes,
``trainer/warmstart.py``), whose checkpoint ``run`` continues from.

On several GPUs: ``torchrun --nproc-per-node N -m trainer run ...`` (or ``accelerate launch -m``);
rank 0 talks to the proxy and writes, every rank trains its share of each step.

Overrides use the config's field names, e.g. ``max_steps=20 learning_rate=1e-4 mode=sync``
(``--key=value`` works too). ``python -m trainer config`` prints every field with its default.
Everything is checked before the model loads: the config, the model directory, the proxy and the
admin key. Exit status 2 means the trainer refused to start; the message says why.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from contract.client import ProxyClient, ProxyError, RetryRule
from trainer.config import ConfigError, TrainerConfig, load_config

cli = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="YAML config (see configs/trainer-*.yaml)")]


def _fail(message: str) -> None:
    typer.echo(f"trainer: {message}", err=True)
    raise typer.Exit(2)


def preflight(config: TrainerConfig) -> ProxyClient:
    """The cheap checks, before torch loads: model directory, admin key, proxy reachable and accepting the key."""
    model = config.model_dir
    if not str(model) or not (model / "config.json").is_file():
        raise ConfigError(
            f"model directory not found or not a Hugging Face model: {str(model)!r}; set `model:` or "
            "FLYWHEEL_MODEL_DIR (`python -m deploy.model path` prints the local SmolLM2)"
        )
    try:
        with ProxyClient(config.proxy_url, config.admin_key(), timeout_s=10.0, retry=RetryRule(attempts=3)) as probe:
            probe.policy()  # fail fast at start; the training client retries for longer
    except ProxyError as exc:
        if exc.status == 401:
            raise ConfigError(f"the proxy at {config.proxy_url} rejected the admin key ({exc.message})") from exc
        raise ConfigError(exc.message if exc.status == 0 else f"proxy check failed: {exc}") from exc
    return ProxyClient(config.proxy_url, config.admin_key(), timeout_s=config.request_timeout_s)


@cli.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run(ctx: typer.Context, config: ConfigOpt = None) -> None:
    """Train until max_steps or SIGTERM; resumes from output_dir's last checkpoint. With
    warm_start_steps > 0 a fresh run starts with the warm start (``warmstart``), a resumed one never."""
    _train(ctx, config, warm_only=False)


@cli.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def warmstart(ctx: typer.Context, config: ConfigOpt = None) -> None:
    """Only the warm start: warm_start_steps supervised steps on the recorded episodes the
    warm_start_* filters select, then a checkpoint and a published adapter that `run` continues
    from with GRPO. A filter that selects nothing stops it with exit status 2, nothing trained."""
    _train(ctx, config, warm_only=True)


def _train(ctx: typer.Context, config: Path | None, *, warm_only: bool) -> None:
    """``run`` and ``warmstart``: every check and the warm start's selection before the model loads."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: idle OpenMP threads sleep, not spin
    from trainer.checkpoint import Checkpoints
    from trainer.distributed import init_world
    from trainer.warmstart import Selection, select_episodes

    episodes = None
    try:
        cfg = load_config(config, list(ctx.args))
        if warm_only and cfg.warm_start_steps < 1:
            raise ConfigError("warmstart needs warm_start_steps >= 1 (e.g. warm_start_steps=20)")
        latest = Checkpoints(cfg.out, cfg.keep_checkpoints).latest()
        if warm_only and latest is not None:
            raise ConfigError(
                f"{cfg.out} holds checkpoint step {latest[1].step}: a warm start begins a run; use a fresh output_dir"
            )
        world = init_world(cfg.distributed_timeout_s)
        warm = cfg.warm_start_steps > 0 and latest is None
        if warm and world.distributed:
            raise ConfigError(
                "the warm start runs in one process: run `python -m trainer warmstart` first, then "
                "torchrun ... -m trainer run (it resumes from the warm start's checkpoint)"
            )
        client = preflight(cfg) if world.leader else None
        if warm and client is not None:
            episodes = select_episodes(client, Selection.of(cfg), cfg.warm_start_max_episodes)
    except ConfigError as exc:
        _fail(str(exc))
        return
    except ProxyError as exc:
        _fail(f"selecting the warm start's episodes failed: {exc}")
        return
    from trainer import memory
    from trainer.follow import follow
    from trainer.loop import Trainer
    from trainer.lora import LoraPolicy
    from trainer.report import Reporter
    from trainer.warmstart import warm_start

    try:
        policy = LoraPolicy(cfg)
    except ConfigError as exc:
        _fail(str(exc))
        return
    memory.freeze_resident()  # the model lives as long as this process: each step's collection skips it
    if client is None:
        steps = follow(cfg, policy, world)
        world.close()
        typer.echo(json.dumps({"rank": world.rank, "steps": steps}))
        return
    cfg.out.mkdir(parents=True, exist_ok=True)
    (cfg.out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    max_steps = cfg.warm_start_steps if warm_only else cfg.max_steps
    reporter = Reporter(cfg.out, tensorboard=cfg.tensorboard, progress=cfg.progress, max_steps=max_steps, start_step=0)
    trainer = Trainer(cfg, client, policy, reporter, world)
    trainer.install_signals()
    try:
        trainer.resume()
        last = trainer.step
        if episodes is not None:
            last = warm_start(trainer, episodes)
        if not warm_only and (episodes is None or last > 0):
            last = trainer.run()
    except ConfigError as exc:  # the selection held nothing trainable: no step was taken
        _fail(str(exc))
        return
    finally:
        reporter.close()
        client.close()
    world.close()
    typer.echo(json.dumps({"last_step": last, "output_dir": str(cfg.out), "ranks": world.size}))


@cli.command("config")
def show_config(config: ConfigOpt = None) -> None:
    """Print the effective configuration (defaults, YAML, overrides) as YAML-ready JSON."""
    try:
        cfg = load_config(config)
    except ConfigError as exc:
        _fail(str(exc))
        return
    for f in dataclasses.fields(cfg):
        typer.echo(f"{f.name}: {json.dumps(cfg.to_dict()[f.name])}")


def main() -> None:
    cli(prog_name=f"{Path(sys.executable).name} -m trainer")


if __name__ == "__main__":
    main()
