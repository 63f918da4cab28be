"""``RunConfig``: what one run of a workflow does (``python -m workflows run`` builds it from its options).

Frozen and checked once, here: a bad value fails before a group is created, with how to fix it.
"""

from __future__ import annotations

from dataclasses import dataclass

from workflows.base import Split
from workflows.judge import RewardMode


@dataclass(frozen=True)
class RunConfig:
    proxy_url: str
    admin_key: str
    groups: int = 1
    """Groups to run (ignored with ``loop``)."""
    group_size: int = 4
    """Episodes per group: GRPO's G."""
    concurrency: int = 4
    """Episodes running at once, over all groups."""
    split: Split = "train"
    loop: bool = False
    model: str = "policy"
    episode_timeout_s: float | None = None
    """Default: the workflow's own ``episode_timeout_s``."""
    seed: int = 0
    """Seeds the task order."""
    max_pending: int | None = None
    passthrough_key: str | None = None
    """Key for ``/passthrough/v1`` (an agent key); default: the admin key."""
    reward: RewardMode = "verifier"
    """``verifier``: the workflow's reward; ``judge``: the LLM judge's group-relative score; ``mix``: both."""
    judge_weight: float = 0.5
    """The judge's share in ``mix``: ``(1 - w) * verifier + w * judge``."""
    admission_max_wait_s: float = 60.0
    """Longest single wait after the proxy refused a group (429 ``backlog_full``); a longer
    ``Retry-After`` is cut to this, then the runner asks again."""

    def __post_init__(self) -> None:
        if self.groups < 1 and not self.loop:
            raise ValueError(f"groups must be >= 1 (got {self.groups}), or use loop")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1 (got {self.group_size}); GRPO needs >= 2 to learn")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1 (got {self.concurrency})")
        if self.reward not in ("verifier", "judge", "mix"):
            raise ValueError(f"reward must be verifier, judge or mix (got {self.reward!r})")
        if not 0.0 <= self.judge_weight <= 1.0:
            raise ValueError(f"judge_weight must be in [0, 1] (got {self.judge_weight})")
        if not self.admission_max_wait_s > 0:
            raise ValueError(f"admission_max_wait_s must be > 0 (got {self.admission_max_wait_s})")
