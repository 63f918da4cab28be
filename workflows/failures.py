"""An episode function that failed: whose doing it was, and the reason stored with its abandon.

The runner never makes up a reward: an episode whose function raised, timed out or returned no
usable ``Outcome`` (``check_outcome``) is abandoned with ``describe_error``'s reason and
``cause_of``'s cause. Failures of the proxy or the engine are ``infrastructure`` (never penalized,
``workflows.base.INFRASTRUCTURE``); everything else is the agent's.
"""

from __future__ import annotations

import math
import traceback
from typing import Any

from contract.vocabulary import AbandonCause
from workflows.base import INFRASTRUCTURE, EpisodeFailed, Outcome
from workflows.judge import RewardMode


def _infrastructure(exc: BaseException) -> bool:
    """A model call that failed on the proxy or the engine (5xx, connection, transport timeout), not the agent."""
    status = getattr(exc, "status_code", None)
    name = type(exc).__name__
    return (
        (isinstance(status, int) and status >= 500)
        or isinstance(exc, ConnectionError)
        or name in ("APIConnectionError", "APITimeoutError", "ConnectError", "ReadError", "RemoteProtocolError")
    )


def cause_of(exc: BaseException) -> AbandonCause:
    """Whose doing an episode's error was: the proxy's or engine's (never penalized), else the agent's."""
    return "infrastructure" if _infrastructure(exc) else "agent"


def describe_error(exc: BaseException) -> str:
    """A reason to store with an abandoned episode: the error and where it came from."""
    if isinstance(exc, TimeoutError):
        return "timeout: the episode ran past its time limit"
    if _infrastructure(exc):
        return INFRASTRUCTURE + f"{type(exc).__name__}: {exc}"[:2000]
    if isinstance(exc, EpisodeFailed):
        return str(exc) or "EpisodeFailed"
    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    where = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in reversed(frames))
    return f"{type(exc).__name__}: {exc}" + (f" [at {where}]" if where else "")


def check_outcome(outcome: Any, reward: RewardMode) -> None:
    """``EpisodeFailed`` unless the episode function returned an ``Outcome`` this run can reward."""
    if not isinstance(outcome, Outcome):
        raise EpisodeFailed(f"episode function returned {type(outcome).__name__}, not an Outcome")
    if outcome.reward is None:
        if reward != "judge":
            raise EpisodeFailed(
                f"the workflow has no verifier reward for this task; run with --reward judge, not {reward}"
            )
    elif not math.isfinite(outcome.reward):
        raise EpisodeFailed(f"episode function returned a non-finite reward ({outcome.reward})")
