"""Atomic step checkpoints and the journal of claimed-but-untrained leases.

A checkpoint is a directory ``checkpoints/step-NNNNNNNN`` holding the adapter (safetensors), the
optimizer state and ``state.json`` (step, the leases and groups the step trained, the policy
version numbering, the step's metrics). It is written under a temporary name, fsynced, renamed,
and only then named in ``checkpoints/LATEST`` (itself replaced atomically), so a kill -9 at any
instant leaves either the previous checkpoint or the new one, never a torn one. Under FSDP the
adapter and optimizer state saved are the whole ones, gathered from the shards after each update
(``trainer.distributed``), in the layout one process saves: rank 0 writes them.

``pending.json`` lists leases claimed since the last checkpoint. After a crash, each is renewed:
a lease still held (valid, or lapsed with nobody claiming its groups since) is resumed, its groups
re-fetched and trained under it, instead of waiting for it to expire; a lost one is handed back
and forgotten (the proxy offers its groups again).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from contract.vocabulary import TrainerSkip

ADAPTER = "adapter_model.safetensors"
OPTIMIZER = "optimizer.pt"
STATE = "state.json"


@dataclass
class LeaseRecord:
    lease_id: str
    group_ids: list[str]
    expires_at: float = 0.0
    trained: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    """Skipped group id -> its note."""
    skip_reasons: dict[str, TrainerSkip] = field(default_factory=dict)
    """Skipped group id -> its typed reason (absent in a checkpoint written before it: acked without one)."""
    audits: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    """Trained group id -> episode id -> fidelity audit (``trainer/audit.py``), sent with the ack."""


@dataclass
class CheckpointState:
    step: int
    version_base: int
    """Proxy policy version when this run started: step N publishes version base + N."""
    leases: list[LeaseRecord]
    metrics: dict[str, Any] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CheckpointState:
        leases = [LeaseRecord(**lease) for lease in data.pop("leases", [])]
        return cls(leases=leases, **data)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class Checkpoints:
    def __init__(self, output_dir: Path, keep: int) -> None:
        self.root = output_dir / "checkpoints"
        self.keep = keep
        self.pending_path = output_dir / "pending.json"

    def save(self, *, adapter: dict[str, torch.Tensor], optimizer: dict[str, Any], state: CheckpointState) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step-{state.step:08d}"
        tmp = self.root / f".tmp-step-{state.step:08d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_file(adapter, str(tmp / ADAPTER))
        torch.save(optimizer, tmp / OPTIMIZER)
        (tmp / STATE).write_text(json.dumps(asdict(state), indent=1))
        for name in (ADAPTER, OPTIMIZER, STATE):
            with open(tmp / name, "rb") as fh:
                os.fsync(fh.fileno())
        if final.exists():  # a step re-run after a crash that beat LATEST: the new one replaces it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        write_json_atomic(self.root / "LATEST", {"step": state.step, "dir": final.name})
        self._prune()
        return final

    def _prune(self) -> None:
        done = sorted(p for p in self.root.glob("step-*") if p.is_dir())
        for old in done[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def latest(self) -> tuple[Path, CheckpointState] | None:
        pointer = self.root / "LATEST"
        if not pointer.exists():
            return None
        directory = self.root / json.loads(pointer.read_text())["dir"]
        return directory, CheckpointState.from_json(json.loads((directory / STATE).read_text()))

    @staticmethod
    def load_tensors(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return load_file(str(directory / ADAPTER)), torch.load(directory / OPTIMIZER, weights_only=True)

    # -- leases claimed since the last checkpoint ------------------------------------------------

    def pending(self) -> list[LeaseRecord]:
        if not self.pending_path.exists():
            return []
        return [LeaseRecord(**lease) for lease in json.loads(self.pending_path.read_text())]

    def set_pending(self, leases: list[LeaseRecord]) -> None:
        if leases:
            write_json_atomic(self.pending_path, [asdict(lease) for lease in leases])
        elif self.pending_path.exists():
            self.pending_path.unlink()
