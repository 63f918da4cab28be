"""Late groups (issue 50): a group whose reward came late, or older than the staleness bound or
``late_after_s``, is trained on its recorded log-probs (the bounded importance weight applies as to
any sample) and counted; past ``late_max_versions`` or ``late_max_age_s`` it is skipped with the
typed reason ``late``, counted in the step's ``data/groups_skipped_late``: never silently lost."""

from __future__ import annotations

import time

import pytest

from contract.client import Episode, Group
from tests.trainer.test_data import EOS, SYSTEM, call
from trainer.config import ConfigError, TrainerConfig
from trainer.data import Late, build_batch, late_rule
from trainer.learner import StepStats
from trainer.metrics import step_metrics

HOUR_S = 3600.0
NOW = 1_800_000_000.0


def timed_group(gid: str, *, version: int, started_at: float, awaited: bool = False) -> Group:
    """Two rewarded episodes (1 and 0) of one call each, served by ``version`` at ``started_at``."""
    episodes = [
        Episode(
            id=f"{gid}-{i}",
            status="rewarded",
            reward=reward,
            awaiting_since=started_at + 60 if awaited and i == 0 else None,
            calls=[call(0, SYSTEM + [i], [20 + i, EOS], version=version, started_at=started_at)],
        )
        for i, reward in enumerate((1.0, 0.0))
    ]
    return Group(id=gid, task_id="t", status="complete", created_at=started_at, episodes=episodes)


def rule(**limits: float | int | None) -> Late:
    return Late(current_version=10, staleness_bound=1, after_s=HOUR_S, now=NOW, **limits)  # type: ignore[arg-type]


def test_late_groups_train_within_the_limits_and_are_skipped_past_them_counted() -> None:
    groups = [
        timed_group("fresh", version=10, started_at=NOW - 60),
        timed_group("awaited", version=10, started_at=NOW - 60, awaited=True),  # a late reward, recent calls
        timed_group("old", version=10, started_at=NOW - 2 * 86400),  # two days: older than after_s
        timed_group("behind", version=4, started_at=NOW - 60),  # 6 versions behind the bound of 1
        timed_group("far", version=1, started_at=NOW - 60),  # 9 behind: past late_max_versions
    ]
    batch = build_batch(groups, max_seq_len=64, late=rule(max_versions=8))
    assert batch.trained == ["fresh", "awaited", "old", "behind"]
    assert batch.reasons == {"far": "late"} and "9 versions behind v10" in batch.skipped["far"]
    assert (batch.late, batch.skipped_late) == (3, 1)
    metrics = step_metrics(batch, groups, StepStats(), current=10, stale=0, wait_s=0.0, pass_threshold=1.0)
    assert (metrics["data/groups_late"], metrics["data/groups_skipped_late"]) == (3, 1)
    # The late samples keep the engine's recorded log-probs: the learner's importance weight reads them.
    behind = [s for s in batch.samples if s.episode_id.startswith("behind")]
    assert behind and all(s.min_version == 4 for s in behind)


def test_the_age_limit_skips_an_old_late_group() -> None:
    groups = [
        timed_group("old", version=10, started_at=NOW - 2 * 86400),
        timed_group("new", version=10, started_at=NOW),
    ]
    batch = build_batch(groups, max_seq_len=64, late=rule(max_age_s=86400.0))
    assert batch.trained == ["new"] and batch.reasons == {"old": "late"}
    assert "172800s old" in batch.skipped["old"] and (batch.late, batch.skipped_late) == (0, 1)


def test_without_a_rule_nothing_is_judged_late() -> None:
    batch = build_batch([timed_group("far", version=0, started_at=0.0)], max_seq_len=64)
    assert batch.trained == ["far"] and (batch.late, batch.skipped_late) == (0, 0)


def test_the_config_builds_the_rule_and_refuses_bad_limits() -> None:
    config = TrainerConfig(mode="async", max_staleness=2, late_after_s=600.0, late_max_versions=5)
    late = late_rule(config, 7)
    assert (late.current_version, late.staleness_bound, late.after_s, late.max_versions, late.max_age_s) == (
        7,
        2,
        600.0,
        5,
        None,
    )
    assert abs(late.now - time.time()) < 60
    with pytest.raises(ConfigError, match="late_max_age_s"):
        TrainerConfig(late_max_age_s=0.0)
    with pytest.raises(ConfigError, match="late_max_versions"):
        TrainerConfig(late_max_versions=-1)
