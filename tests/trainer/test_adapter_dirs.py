"""``adapters/vN`` is reused only when it holds exactly the adapter being published as version N.

The restart case must keep working: a crash after the adapter was saved but before the proxy
published it restarts from the checkpoint of the same step, whose adapter is the one in ``vN``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from trainer.checkpoint import Checkpoints, CheckpointState
from trainer.config import TrainerConfig
from trainer.lora import LoraPolicy
from trainer.publish import Publisher, PublishError


@pytest.fixture(scope="module")
def policy(vllm_model_dir: str) -> Iterator[LoraPolicy]:
    yield LoraPolicy(TrainerConfig(model=vllm_model_dir))


def nudge(policy: LoraPolicy, seed: int) -> dict[str, torch.Tensor]:
    """Give the adapter new weights (as a training step would) and return them."""
    generator = torch.Generator().manual_seed(seed)
    state = {
        k: v + 0.01 * torch.randn(v.shape, generator=generator, dtype=v.dtype)
        for k, v in policy.adapter_state().items()
    }
    policy.load_adapter_state(state)
    return state


def test_restart_reuses_the_directory_of_the_same_adapter(policy: LoraPolicy, tmp_path: Path) -> None:
    publisher = Publisher(client=None, output_dir=tmp_path, keep=3)  # save needs no proxy
    trained = nudge(policy, 1)
    checkpoints = Checkpoints(tmp_path, keep=1)
    checkpoints.save(adapter=trained, optimizer={}, state=CheckpointState(step=2, version_base=0, leases=[]))
    directory = publisher.save(policy, 2)
    written = (directory / "adapter_model.safetensors").stat().st_mtime_ns

    nudge(policy, 2)  # the process moves on, then dies before the proxy published v2 ...
    latest = checkpoints.latest()
    assert latest is not None
    policy.load_adapter_state(checkpoints.load_tensors(latest[0])[0])  # ... and restarts from step 2's checkpoint
    assert publisher.save(policy, 2) == directory
    assert (directory / "adapter_model.safetensors").stat().st_mtime_ns == written  # reused as it was


def test_a_directory_left_by_another_run_is_never_published(policy: LoraPolicy, tmp_path: Path) -> None:
    earlier = Publisher(client=None, output_dir=tmp_path, keep=3)
    nudge(policy, 3)
    stale = earlier.save(policy, 1)
    before = (stale / "adapter_model.safetensors").read_bytes()

    nudge(policy, 4)  # this run's own version 1
    with pytest.raises(
        PublishError,
        match=r"adapters/v1 already exists but does not hold this trainer's adapter "
        r"for version 1 \(different values in \d+ of \d+ tensors\)",
    ):
        Publisher(client=None, output_dir=tmp_path, keep=3).save(policy, 1)
    assert (stale / "adapter_model.safetensors").read_bytes() == before  # left alone for the user to look at

    (stale / "adapter_model.safetensors").write_bytes(b"torn")
    with pytest.raises(PublishError, match="unreadable adapter_model.safetensors"):
        earlier.save(policy, 1)
