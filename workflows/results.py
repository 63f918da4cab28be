"""What a run reports: each episode's end, each group's, and the run's counters and summary.

The runner (``runner.py``) fills ``RunStats`` as episodes and groups end; ``python -m workflows
run`` prints its ``summary()``, and ``progress.py`` shows each result as it arrives.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from workflows.forking import ForkPoint
from workflows.judge import JudgeStats

Status = Literal["rewarded", "abandoned", "error"]


@dataclass(frozen=True)
class EpisodeResult:
    episode_id: str
    group_id: str
    task_id: str
    status: Status
    reward: float | None
    error: str | None
    seconds: float
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GroupResult:
    group_id: str
    task_id: str
    status: str
    """The proxy's view once every episode ended: complete, failed (too few rewarded) or open."""
    episodes: list[EpisodeResult]
    judge_attempts: int | None = None
    """Judge requests this group took (None: not judged); its failures are its episodes' errors."""
    fork: ForkPoint | None = None
    """Set on a fork group: the episode it forked and where (``workflows/forking.py``)."""
    diverged: int = 0
    """Fork episodes whose agent sent a request the source never sent before the fork point."""
    kind: str | None = None
    """The task's kind (``Workflow.kind``): the summary's signal is also given per kind."""


@dataclass
class RunStats:
    groups: list[GroupResult] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    judge: JudgeStats | None = None
    """The judge's counters (requests, retries, malformed answers, groups given up on, tokens)."""
    admission_waits: int = 0
    """Group creations the proxy refused (429 ``backlog_full``), each followed by a wait and a retry."""
    admission_wait_s: float = 0.0
    """Seconds spent in those waits."""
    groups_not_created: int = 0
    """Tasks whose group was still refused when the run stopped (never created, not lost unseen)."""
    create_unanswered: int = 0
    """Group creations the proxy did not answer, each asked again after a pause."""
    recalled_groups: int = 0
    """With ``focus``: finished groups of this workflow read back from the store at the start."""
    focused_draws: int = 0
    """Task draws made by the chance a task's group disagrees (``focus``), not the seeded order."""
    forks_skipped: dict[str, int] = field(default_factory=dict)
    """Fork mode: finished groups that were due a fork and got none, by why."""

    @property
    def episodes(self) -> list[EpisodeResult]:
        return [e for g in self.groups for e in g.episodes]

    def signal(self) -> dict[str, Any]:
        """Plain groups with two or more rewards, and the share whose rewards differ: the groups GRPO
        can train on (the trainer skips the others); ``focused_draws`` went by that chance."""
        by_kind: dict[str, list[bool]] = {}
        for g in self.groups:
            rewards = [e.reward for e in g.episodes if e.reward is not None]
            if g.fork is None and len(rewards) >= 2:
                by_kind.setdefault(g.kind or "-", []).append(max(rewards) > min(rewards))
        judged = [d for kind in by_kind.values() for d in kind]
        return {
            "groups": len(judged),
            "disagreed": sum(judged),
            "share": round(sum(judged) / len(judged), 4) if judged else None,
            "by_kind": {k: {"groups": len(d), "disagreed": sum(d)} for k, d in sorted(by_kind.items())},
            "focused_draws": self.focused_draws,
            "recalled_groups": self.recalled_groups,
        }

    def forks(self) -> dict[str, Any]:
        """Fork groups made, their episodes, how many diverged before the fork point, and skips."""
        forks = [g for g in self.groups if g.fork is not None]
        episodes = sum(len(g.episodes) for g in forks)
        diverged = sum(g.diverged for g in forks)
        return {
            "groups": len(forks),
            "episodes": episodes,
            "diverged": diverged,
            "reached_fork_point": round(1 - diverged / episodes, 4) if episodes else None,
            "skipped": dict(self.forks_skipped),
        }

    def summary(self) -> dict[str, Any]:
        episodes = self.episodes
        rewards = [e.reward for e in episodes if e.reward is not None]
        by_status = {s: sum(e.status == s for e in episodes) for s in ("rewarded", "abandoned", "error")}
        return {
            "groups": len(self.groups),
            "groups_by_status": {
                s: sum(g.status == s for g in self.groups) for s in sorted({g.status for g in self.groups})
            },
            "episodes": len(episodes),
            **by_status,
            "mean_reward": sum(rewards) / len(rewards) if rewards else None,
            "episode_seconds_mean": (sum(e.seconds for e in episodes) / len(episodes)) if episodes else None,
            "wall_seconds": round(time.monotonic() - self.started, 2),
            "admission_waits": self.admission_waits,
            "admission_wait_s": round(self.admission_wait_s, 2),
            "groups_not_created": self.groups_not_created,
            "create_unanswered": self.create_unanswered,
            "signal": self.signal(),
            "forks": self.forks(),
            "errors": [
                {"episode_id": e.episode_id, "error": (e.error or "")[:300]} for e in episodes if e.status != "rewarded"
            ][:20],
            **({"judge": self.judge.as_dict()} if self.judge is not None else {}),
        }
