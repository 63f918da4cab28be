"""The trainer's skips as typed values (issue 48): each kind ``build_batch`` skips a group for, and
the loop's non-finite gradient, acked with its ``reason`` (``contract.vocabulary.TrainerSkip``)
beside its note through ``trainer/leases.py`` to a real proxy process, and counted in the step's
``data/groups_skipped_*``; and a step's ``data/samples`` counting the samples trained, not the
``DataStats`` counter of the samples built (skipped groups' included)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import get_args

import pytest

from contract.client import ProxyClient
from contract.vocabulary import TrainerSkip
from tests.support.services import ADMIN_KEY, serving_proxy
from tests.trainer.test_data import FAILED_ALIKE, group, shaped, untrainable_group
from tests.trainer.test_late import timed_group
from trainer.checkpoint import CheckpointState, LeaseRecord
from trainer.counters import DataStats
from trainer.data import Late, SkipKind, build_batch
from trainer.learner import StepStats
from trainer.leases import Leases, skip_trained, take_step
from trainer.members import Rules
from trainer.metrics import STEP_METRICS, step_metrics

NO_ENGINE = "http://127.0.0.1:9"
"""Nothing listens there: no model call is made."""
NONFINITE = "non-finite gradient (grad_norm=nan)"


@pytest.fixture
def client(tmp_path: Path) -> Iterator[ProxyClient]:
    with serving_proxy(NO_ENGINE, tmp_path) as proxy, ProxyClient(proxy.url, ADMIN_KEY) as client:
        yield client


def _complete_groups(client: ProxyClient, n: int) -> list[str]:
    """``n`` complete groups of two episodes rewarded 1 and 0, oldest first (no calls: none is needed)."""
    ids = []
    for _ in range(n):
        created = client.create_group("t", 2)
        for key, reward in zip(created.episode_keys, (1.0, 0.0), strict=True):
            client.reward(key.id, reward)
        ids.append(created.id)
    return ids


def test_each_skip_is_acked_with_its_typed_reason_and_its_note(client: ProxyClient) -> None:
    ids = _complete_groups(client, 6)
    claim = client.claim(trainer_id="t", max_groups=6, lease_s=60, max_staleness=None)
    assert [g.id for g in claim.groups] == ids
    equal, shaping, few, empty, late, poisoned = ids
    groups = [
        group(equal, [1.0, 1.0, 1.0]),
        shaped(shaping, FAILED_ALIKE),
        group(few, [1.0], abandoned=1),
        untrainable_group(empty),
        timed_group(late, version=0, started_at=0.0, awaited=True),  # its reward came late, a version behind
        group(poisoned, [1.0, 0.0]),
    ]
    # The others lag one version, within the bound; the late group is past late_max_versions 0.
    rule = Late(current_version=1, staleness_bound=1, after_s=float("inf"), max_versions=0)
    batch = build_batch(groups, rules=Rules(turn_credit="discounted"), late=rule)
    kinds: dict[str, SkipKind] = {
        equal: "equal",
        shaping: "shaping_only",
        few: "few",
        empty: "empty",
        late: "late",
    }
    assert batch.trained == [poisoned] and batch.reasons == kinds
    metrics = step_metrics(batch, groups, StepStats(), current=0, stale=0, wait_s=0.0, pass_threshold=1.0)
    assert {kind: metrics[f"data/groups_skipped_{kind}"] for kind in get_args(SkipKind)} == dict.fromkeys(
        get_args(SkipKind), 1
    )

    lease = LeaseRecord(lease_id=claim.lease_id, group_ids=ids)
    take_step(lease, batch.trained, batch.skipped, batch.reasons)
    skip_trained(lease, "nonfinite", NONFINITE)  # the step's gradient was not finite: trained nothing
    # What the checkpoint keeps of it, read back as a restarted trainer acks it.
    lease = CheckpointState.from_json({"step": 1, "version_base": 0, "leases": [dataclasses.asdict(lease)]}).leases[0]
    Leases(client, 60, print).ack(lease, step=1)

    acked = {gid: client.group(gid) for gid in ids}
    assert {gid: g.train_reason for gid, g in acked.items()} == {**kinds, poisoned: "nonfinite"}
    assert set(get_args(TrainerSkip)) == {g.train_reason for g in acked.values()}  # every kind there is
    assert {gid: g.train_note for gid, g in acked.items()} == {**batch.skipped, poisoned: NONFINITE}
    assert all((g.train_status, g.trained_step) == ("skipped", 1) for g in acked.values())
    assert client.skip_counts() == dict.fromkeys(get_args(TrainerSkip), 1)


def test_a_skip_from_a_checkpoint_without_reasons_is_acked_without_one(client: ProxyClient) -> None:
    """A checkpoint written before reasons were typed holds notes only: its skips still ack, as ``other``."""
    [gid] = _complete_groups(client, 1)
    claim = client.claim(trainer_id="t", max_groups=1, lease_s=60, max_staleness=None)
    old = {"lease_id": claim.lease_id, "group_ids": [gid], "skipped": {gid: "all 2 rewards equal (1): no signal"}}
    [lease] = CheckpointState.from_json({"step": 1, "version_base": 0, "leases": [old]}).leases
    Leases(client, 60, print).ack(lease, step=1)
    stored = client.group(gid)
    assert (stored.train_status, stored.train_reason, stored.train_note) == (
        "skipped",
        None,
        "all 2 rewards equal (1): no signal",
    )
    assert client.skip_counts() == {"other": 1}


def test_data_samples_counts_the_samples_trained_not_those_built() -> None:
    """The ``DataStats`` counter of samples built (skipped groups' too) used to overwrite the step's
    ``data/samples`` under the same name: a step that trained 2 samples reported 5."""
    groups = [group("g-signal", [1.0, 0.0]), group("g-equal", [1.0, 1.0, 1.0])]
    batch = build_batch(groups, max_seq_len=64)
    assert batch.trained == ["g-signal"] and len(batch.samples) == 2
    metrics = step_metrics(batch, groups, StepStats(), current=0, stale=0, wait_s=0.0, pass_threshold=1.0)
    assert (metrics["data/samples"], metrics["data/samples_built"]) == (2, 5)


def test_no_data_counter_shares_a_name_with_a_step_metric() -> None:
    counters = {f"data/{f.name}" for f in dataclasses.fields(DataStats)}
    assert counters.isdisjoint(STEP_METRICS)
