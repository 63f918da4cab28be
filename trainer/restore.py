"""The adapter and optimizer state a step starts from: the newest checkpoint's, or the fresh start's.

Loaded at resume, put back when a step is rolled back (a lost lease, a non-finite gradient: the
step changed nothing that may be kept), and sent to the follower ranks either way, so every rank
starts each step from the same state. Under FSDP too: each rank cuts its shards out of the whole
state it holds (``LoraPolicy.load_adapter_state``), so the leader loads before the followers
receive it, as without FSDP.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from trainer.checkpoint import Checkpoints, CheckpointState
from trainer.distributed import World, to_cpu
from trainer.learner import Learner
from trainer.lora import LoraPolicy

RESTORE = "restore"
"""The leader's message to followers: load this adapter and optimizer state (a step was rolled back)."""


class Restore:
    def __init__(self, checkpoints: Checkpoints, policy: LoraPolicy, learner: Learner, world: World) -> None:
        self.checkpoints = checkpoints
        self.policy = policy
        self.learner = learner
        self.world = world
        self._initial: tuple[dict[str, Any], dict[str, Any]] | None = None
        """Adapter and optimizer state at a fresh start: what a rollback before the first checkpoint restores."""

    def load(self) -> tuple[Path, CheckpointState] | None:
        """Load the newest checkpoint into the policy and optimizer; None at a fresh start (whose
        state is kept for a rollback)."""
        latest = self.checkpoints.latest()
        if latest is None:
            self._initial = (
                {k: v.clone() for k, v in self.policy.adapter_state().items()},
                copy.deepcopy(self.learner.optimizer_state()),
            )
            return None
        adapter, optimizer = self.checkpoints.load_tensors(latest[0])
        self.policy.load_adapter_state(adapter)
        self.learner.load_optimizer_state(optimizer)
        return latest

    def share(self) -> None:
        """Followers start from the leader's adapter and optimizer state."""
        if self.world.distributed:
            self.world.broadcast((self.policy.adapter_state(), to_cpu(self.learner.optimizer_state())))

    def roll_back(self, version: int) -> None:
        """Put the adapter and optimizer back to the last checkpoint (on every rank): the state before
        this step, which is policy ``version``."""
        latest = self.checkpoints.latest()
        if latest is not None:
            adapter, optimizer = self.checkpoints.load_tensors(latest[0])
        else:
            assert self._initial is not None, "resume() runs before the first step"
            adapter, optimizer = self._initial[0], copy.deepcopy(self._initial[1])
        self.policy.load_adapter_state(adapter)
        self.learner.load_optimizer_state(optimizer)
        if version in self.learner.snapshots:  # the weights are that served version
            self.learner.weights_version = version
        if self.world.distributed:
            self.world.broadcast((RESTORE, adapter, to_cpu(optimizer)))
