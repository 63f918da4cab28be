"""Step checkpoints and the pending-lease journal on disk: an exact round trip, ``latest()`` naming
only a checkpoint that was completely written, and what a kill -9 at each point of ``save`` leaves.

A kill is reproduced by leaving the files exactly as ``save`` had them at that instant (a half
filled temporary directory, a renamed directory that ``LATEST`` does not name yet, a half written
``LATEST``), then reading with a fresh ``Checkpoints`` as a restarted trainer does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer.checkpoint import (
    ADAPTER,
    OPTIMIZER,
    STATE,
    Checkpoints,
    CheckpointState,
    LeaseRecord,
    write_json_atomic,
)


def adapter(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "base_model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 16, generator=generator),
        "base_model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(16, 4, generator=generator).to(
            torch.bfloat16
        ),
    }


def optimizer_state(weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A real AdamW state after one step over ``weights``."""
    params = [torch.nn.Parameter(w.float().clone()) for w in weights.values()]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    torch.stack([p.square().sum() for p in params]).sum().backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    return optimizer.state_dict()


def state(step: int, **over: Any) -> CheckpointState:
    fields: dict[str, Any] = {"step": step, "version_base": 3, "leases": [], "metrics": {"loss": 0.5 / step}}
    fields.update(over)
    return CheckpointState(**fields)


def save(checkpoints: Checkpoints, step: int) -> Path:
    weights = adapter(step)
    return checkpoints.save(adapter=weights, optimizer=optimizer_state(weights), state=state(step))


def test_save_then_load_returns_exactly_what_was_saved(tmp_path: Path) -> None:
    weights = adapter(1)
    optim = optimizer_state(weights)
    leases = [
        LeaseRecord("lease-a", ["g1", "g2"], expires_at=12.5, trained=["g1"], skipped={"g2": "equal rewards"}),
        LeaseRecord("lease-b", ["g3"]),
    ]
    saved = state(7, leases=leases, metrics={"loss": 0.25, "reward/mean": [0.5, 1.0]})
    directory = Checkpoints(tmp_path, keep=2).save(adapter=weights, optimizer=optim, state=saved)

    found = Checkpoints(tmp_path, keep=2).latest()  # a restarted trainer
    assert found is not None and found[0] == directory == tmp_path / "checkpoints" / "step-00000007"
    assert found[1] == saved
    loaded, loaded_optim = Checkpoints.load_tensors(directory)
    assert loaded.keys() == weights.keys()
    for name, tensor in weights.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)
    assert loaded_optim["param_groups"] == optim["param_groups"]
    for index, entry in optim["state"].items():
        assert all(torch.equal(loaded_optim["state"][index][k], v) for k, v in entry.items())


def test_nothing_saved_is_no_checkpoint(tmp_path: Path) -> None:
    assert Checkpoints(tmp_path, keep=2).latest() is None
    (tmp_path / "checkpoints").mkdir()
    assert Checkpoints(tmp_path, keep=2).latest() is None


def test_latest_is_the_last_step_saved_and_only_keep_are_kept(tmp_path: Path) -> None:
    checkpoints = Checkpoints(tmp_path, keep=2)
    for step in (1, 2, 3, 4):
        save(checkpoints, step)
        found = checkpoints.latest()
        assert found is not None and found[1].step == step
    assert sorted(p.name for p in checkpoints.root.iterdir()) == ["LATEST", "step-00000003", "step-00000004"]
    assert json.loads((checkpoints.root / "LATEST").read_text()) == {"step": 4, "dir": "step-00000004"}


def test_steps_order_by_number_past_nine(tmp_path: Path) -> None:
    checkpoints = Checkpoints(tmp_path, keep=1)
    for step in (9, 10):
        save(checkpoints, step)
    assert sorted(p.name for p in checkpoints.root.glob("step-*")) == ["step-00000010"]


# -- a kill -9 at each point of save() --------------------------------------------------------------


def test_a_kill_while_writing_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    checkpoints = Checkpoints(tmp_path, keep=2)
    save(checkpoints, 1)
    torn = checkpoints.root / ".tmp-step-00000002"  # killed with the adapter written, nothing else
    torn.mkdir()
    (torn / ADAPTER).write_bytes(b"\x00" * 10)

    restarted = Checkpoints(tmp_path, keep=2)
    found = restarted.latest()
    assert found is not None and found[1].step == 1
    save(restarted, 2)  # the re-run step writes over the torn directory
    found = restarted.latest()
    assert found is not None and found[1].step == 2 and not torn.exists()
    assert sorted(p.name for p in (found[0]).iterdir()) == sorted([ADAPTER, OPTIMIZER, STATE])


def test_a_kill_between_rename_and_latest_resumes_from_the_step_before(tmp_path: Path) -> None:
    """``LATEST`` is the commit point: a complete directory it does not name is not a checkpoint."""
    checkpoints = Checkpoints(tmp_path, keep=3)
    save(checkpoints, 1)
    pointer = (checkpoints.root / "LATEST").read_text()
    save(checkpoints, 2)
    (checkpoints.root / "LATEST").write_text(pointer)  # as if killed before LATEST moved to step 2

    restarted = Checkpoints(tmp_path, keep=3)
    found = restarted.latest()
    assert found is not None and found[1].step == 1
    weights = adapter(20)  # step 2 re-run trains other tensors: they replace the orphan
    restarted.save(adapter=weights, optimizer=optimizer_state(weights), state=state(2, metrics={"rerun": True}))
    found = restarted.latest()
    assert found is not None and found[1].step == 2 and found[1].metrics == {"rerun": True}
    assert all(torch.equal(t, weights[k]) for k, t in Checkpoints.load_tensors(found[0])[0].items())


def test_a_kill_while_writing_latest_leaves_the_old_pointer(tmp_path: Path) -> None:
    checkpoints = Checkpoints(tmp_path, keep=2)
    save(checkpoints, 1)
    (checkpoints.root / ".LATEST.tmp").write_text('{"step": 2, "di')  # the half-written replacement
    found = Checkpoints(tmp_path, keep=2).latest()
    assert found is not None and found[1].step == 1
    save(checkpoints, 2)
    assert not (checkpoints.root / ".LATEST.tmp").exists()


def test_write_json_atomic_replaces_whole_or_not_at_all(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "state.json"
    write_json_atomic(path, {"a": 1})
    write_json_atomic(path, {"a": [2, 3]})
    assert json.loads(path.read_text()) == {"a": [2, 3]}
    assert os.listdir(path.parent) == ["state.json"]  # no temporary left behind


# -- the journal of leases claimed since the last checkpoint -----------------------------------------


def test_pending_leases_round_trip_and_clear(tmp_path: Path) -> None:
    checkpoints = Checkpoints(tmp_path, keep=2)
    assert checkpoints.pending() == []
    leases = [LeaseRecord("lease-a", ["g1"], expires_at=99.0), LeaseRecord("lease-b", ["g2", "g3"], trained=["g2"])]
    checkpoints.set_pending(leases)
    assert Checkpoints(tmp_path, keep=2).pending() == leases  # a restarted trainer reads them back
    checkpoints.set_pending([])
    assert checkpoints.pending() == [] and not checkpoints.pending_path.exists()
    checkpoints.set_pending([])  # clearing twice is fine


def test_the_journal_survives_checkpoints_being_pruned(tmp_path: Path) -> None:
    checkpoints = Checkpoints(tmp_path, keep=1)
    checkpoints.set_pending([LeaseRecord("lease-a", ["g1"])])
    for step in (1, 2):
        save(checkpoints, step)
    assert [lease.lease_id for lease in checkpoints.pending()] == ["lease-a"]


def test_a_state_without_leases_loads(tmp_path: Path) -> None:
    """``state.json`` from a step that trained under no lease (nothing claimed) still loads."""
    loaded = CheckpointState.from_json({"step": 1, "version_base": 0, "metrics": {}, "created_at": 1.0})
    assert loaded.leases == [] and loaded.step == 1


@pytest.mark.parametrize("keep", [1, 3])
def test_pruning_never_removes_the_checkpoint_latest_names(tmp_path: Path, keep: int) -> None:
    checkpoints = Checkpoints(tmp_path, keep=keep)
    for step in range(1, 6):
        save(checkpoints, step)
        found = checkpoints.latest()
        assert found is not None and found[0].is_dir()
    assert len(list(checkpoints.root.glob("step-*"))) == keep
