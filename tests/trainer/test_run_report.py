"""The trainer's skip acks and ``make run``'s report on a real store: a real proxy in front of the
real vLLM, groups of real sampled calls with known rewards, and the real trainer claiming them.

A claim whose groups are all skipped (every reward equal, too few members) is acked without a
step, so no step's metrics count it: the report counts skips by the typed reason the store keeps,
and each skipped group's note holds its own reason only (a trainer that wrote its lease's reasons into every
note gave one group "all 3 rewards equal (0): no signal; all 3 rewards equal (1): no signal; ...").
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from contract.client import ProxyClient
from deploy import groups as report
from tests.support.services import ADMIN_KEY
from tests.trainer.conftest import TrainerProxy
from trainer.config import TrainerConfig
from trainer.loop import Trainer
from trainer.lora import LoraPolicy
from trainer.report import Reporter

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def policy(vllm_model_dir: str) -> Iterator[LoraPolicy]:
    yield LoraPolicy(TrainerConfig(model=vllm_model_dir))


def _record(proxy: TrainerProxy, rewards: list[float | None]) -> str:
    """A group of one real sampled call per episode, then ``rewards`` (None: abandoned)."""
    return proxy.record_group(rewards, question="2+2?", temperature=None)


def test_each_skipped_group_keeps_its_own_reason_and_the_report_counts_them_as_the_store_holds_them(
    trainer_proxy: TrainerProxy, tmp_path: Path, policy: LoraPolicy, vllm_model_dir: str
) -> None:
    config = trainer_proxy.one_step_config(vllm_model_dir, tmp_path / "run", groups_per_step=4, tensorboard=False)
    reporter = Reporter(config.out, tensorboard=False, progress=False, max_steps=1, start_step=0)
    ones, zeros, few = (
        _record(trainer_proxy, [1, 1, 1]),
        _record(trainer_proxy, [0, 0, 0]),
        _record(trainer_proxy, [1]),  # a lone episode: complete for the proxy, nothing to compare for GRPO
    )
    with ProxyClient(trainer_proxy.url, ADMIN_KEY) as client:
        trainer = Trainer(config, client, policy, reporter)
        trainer.resume()
        assert trainer.run_once() and trainer.step == 0  # all three skipped: acked, no step taken
        trained, equal = _record(trainer_proxy, [1, 0, 1]), _record(trainer_proxy, [1, 1, 1])
        assert trainer.run_once() and trainer.step == 1  # one trained, one skipped in the step
    reporter.close()

    notes = {gid: trainer_proxy.get(f"/groups/{gid}")["train_note"] for gid in (ones, zeros, few, equal)}
    reasons = {gid: trainer_proxy.get(f"/groups/{gid}")["train_reason"] for gid in (ones, zeros, few, equal)}
    assert reasons == {ones: "equal", zeros: "equal", few: "few", equal: "equal"}
    assert notes == {
        ones: "all 3 rewards equal (1): no signal",
        zeros: "all 3 rewards equal (0): no signal",
        few: "1 rewarded episodes (or penalized abandons, or rewarded choices): GRPO compares at least 2",
        equal: "all 3 rewards equal (1): no signal",
    }
    assert trainer_proxy.get(f"/groups/{trained}")["train_status"] == "trained"
    steps = trainer_proxy.get("/trainer/steps")["data"]
    assert [s["metrics"]["data/groups_skipped_equal"] for s in steps] == [1]  # the skip-only claim has no step

    counts = report.group_counts(
        report.admission_state(trainer_proxy.url, ADMIN_KEY), report.skips(trainer_proxy.url, ADMIN_KEY), {}
    )
    assert (counts["generated"], counts["trained"], counts["skipped"]) == (5, 1, 4)
    assert (counts["skipped_equal"], counts["skipped_few"], counts["skipped_other"]) == (3, 1, 0)
    assert report.calls_per_trained_episode(steps) == 1.0
    with sqlite3.connect(tmp_path / "flywheel.db") as db:
        stored = [n for (n,) in db.execute("select train_note from groups where train_status = 'skipped'")]
        calls, episodes = db.execute(
            "select count(c.id), count(distinct e.id) from episodes e join groups g on g.id = e.group_id "
            "join calls c on c.episode_id = e.id where g.train_status = 'trained' and e.status = 'rewarded'"
        ).fetchone()
    assert sorted(stored) == sorted(notes.values())
    assert calls / episodes == report.calls_per_trained_episode(steps)
