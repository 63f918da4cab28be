"""An LLM judge for workflows without a verifier: a finished group's episodes scored side by side.

``view`` (an episode as trimmed text), ``prompt`` (messages, JSON schema, parsing, clipping),
``judge`` (the endpoint, retries, audit), ``compose`` (verifier, judge or mix; post or abandon).
"""

from __future__ import annotations

from workflows.judge.compose import (
    JUDGE_FAILED,
    REWARD_MODES,
    JudgedGroup,
    RewardMode,
    Settled,
    abandon,
    combine,
    reward_group,
)
from workflows.judge.judge import Judge, JudgeConfig, JudgeFailed, Judgement, JudgeStats, Verdict

__all__ = [
    "JUDGE_FAILED",
    "REWARD_MODES",
    "Judge",
    "JudgeConfig",
    "JudgeFailed",
    "JudgeStats",
    "JudgedGroup",
    "Judgement",
    "RewardMode",
    "Settled",
    "Verdict",
    "abandon",
    "combine",
    "reward_group",
]
