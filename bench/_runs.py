"""A ``make run`` configuration made private to one benchmark arm: its own data directory, free
ports (never 8000/8100, so a user's run is untouched), the arm's seed and minutes, no resume and
no guard (every arm trains the same minutes), and the arm's own changes to the trainer or the
workflow. Shared by the benches that compare training arms (``learning_vs_trl``, ``fork_vs_flat``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

from bench._procs import free_port
from deploy.run_config import RunConfig


def private(base: RunConfig, workdir: Path, *, seed: int, **changes: object) -> RunConfig:
    """``base`` with its own directory (``workdir``), free ports and ``seed``, and any other field
    ``changes`` names; written to ``workdir/run.yaml``. The guard and budget stay as ``base`` has them."""
    proxy_config = yaml.safe_load(base.proxy_config_path.read_text())
    vllm_port, proxy_port = free_port(), free_port()
    while proxy_port == vllm_port:
        proxy_port = free_port()
    proxy_config["proxy"]["upstreams"][0]["url"] = f"http://127.0.0.1:{vllm_port}"
    (workdir / "proxy.yaml").write_text(yaml.safe_dump(proxy_config))
    config = dataclasses.replace(
        base, data_dir=str(workdir), proxy_config=str(workdir / "proxy.yaml"), proxy_port=proxy_port, seed=seed,
        **changes,  # type: ignore[arg-type]
    )  # fmt: skip
    (workdir / "run.yaml").write_text(yaml.safe_dump(config.to_dict()))
    return config


def isolated(
    base: RunConfig,
    workdir: Path,
    *,
    minutes: float,
    seed: int,
    model: str | None = None,
    trainer_overrides: Mapping[str, str] | None = None,
    workflow_args: Sequence[str] = (),
) -> RunConfig:
    """``base`` with this arm's directory, seed, budget and ports; written to ``workdir/run.yaml``."""
    return private(
        base,
        workdir,
        seed=seed,
        resume=False,
        budget_minutes=minutes,
        min_train_minutes=minutes,
        guard=dataclasses.replace(base.guard, action="off"),
        engine=dataclasses.replace(base.engine, model=model or base.engine.model),
        trainer=dataclasses.replace(base.trainer, overrides={**base.trainer.overrides, **(trainer_overrides or {})}),
        workflow=dataclasses.replace(base.workflow, args=(*base.workflow.args, *workflow_args)),
    )
