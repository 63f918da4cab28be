"""The per-episode fidelity audit the trainer sends with its acks (trainer/audit.py)."""

from __future__ import annotations

import pytest

from contract.client import Episode, Group
from tests.trainer.test_data import EOS, SYSTEM, call, multi_turn_episode
from trainer.audit import group_audits
from trainer.data import Rules, build_batch
from trainer.learner import EpisodeGap


def test_each_episode_gets_its_own_counters_tokens_and_engine_gap() -> None:
    plain = Episode(id="ep-2", group_id="g-1", status="rewarded", reward=0.0, calls=[call(0, SYSTEM, [20, 21, EOS])])
    group = Group(id="g-1", task_id="t", status="complete", episodes=[multi_turn_episode(), plain])
    equal = Group(
        id="g-2",
        task_id="t",
        status="complete",
        episodes=[
            Episode(id=f"eq-{i}", group_id="g-2", status="rewarded", reward=1.0, calls=[call(0, SYSTEM, [30, EOS])])
            for i in range(2)
        ],
    )
    batch = build_batch([group, equal], rules=Rules(scale_rewards="none"))
    gaps = {"ep-1": EpisodeGap(total=0.3, tokens=3, max=0.2)}

    audits = group_audits(batch, [group, equal], gaps, step=7)

    assert list(audits) == ["g-1"]  # a group skipped for equal rewards was not trained: no audit
    one, two = audits["g-1"]["ep-1"], audits["g-1"]["ep-2"]
    # multi_turn_episode: a retry dropped, a greedy and an inexact call kept out of the loss, two
    # merges and a break into two samples trained on 5 + 2 tokens.
    assert (one.step, one.calls, one.calls_failed, one.calls_deduped, one.calls_context_only) == (7, 8, 1, 1, 2)
    assert (one.calls_merged, one.breaks, one.samples, one.tokens_trained) == (2, 1, 2, 7)
    assert one.gap_mean == pytest.approx(0.1) and one.gap_max == 0.2 and one.gap_tokens == 3
    assert (two.calls, two.calls_merged, two.breaks, two.samples, two.tokens_trained) == (1, 0, 0, 1, 3)
    assert two.gap_mean is None and two.gap_tokens == 0  # nothing compared: unknown, not 0
    # the step's counters hold every claimed episode; the audits those of the trained groups
    assert batch.stats.calls == 8 + 1 + 2 and sum(s.calls for s in batch.episodes.values()) == 8 + 1
