"""``RunConfig``: what one run of a workflow does (``python -m workflows run`` builds it from its options).

Frozen and checked once, here: a bad value fails before a group is created, with how to fix it.
"""

from __future__ import annotations

from dataclasses import dataclass

from contract.vocabulary import TEACHER_PREFIX, ForkRule
from workflows.base import Split
from workflows.forking import FORK_RULES, ForkRuleName
from workflows.judge import RewardMode


@dataclass(frozen=True)
class RunConfig:
    """One run of a workflow, as ``python -m workflows run`` builds it from its options and the environment."""

    proxy_url: str
    """The proxy's base URL (``--proxy``)."""
    admin_key: str
    """The admin key that creates groups and posts rewards (``FLYWHEEL_ADMIN_KEY``, else ``--admin-key-file``)."""
    groups: int = 1
    """Groups to run (ignored with ``loop``)."""
    group_size: int = 4
    """Episodes per group: GRPO's G."""
    concurrency: int = 4
    """Episodes running at once, over all groups."""
    split: Split = "train"
    """The tasks drawn from: ``train``, ``val`` (held out of train) or ``test``."""
    loop: bool = False
    """Keep producing groups until stopped (``groups`` is ignored)."""
    model: str = "policy"
    """The model name the agents ask for; ``policy`` routes to the latest published adapter."""
    episode_timeout_s: float | None = None
    """Default: the workflow's own ``episode_timeout_s``."""
    seed: int = 0
    """Seeds the task order."""
    max_pending: int | None = None
    """With ``loop``: no new group while the trainer has this many complete groups unclaimed; None: no pause."""
    passthrough_key: str | None = None
    """Key for ``/passthrough/v1`` (an agent key); default: the admin key."""
    reward: RewardMode = "verifier"
    """``verifier``: the workflow's reward; ``judge``: the LLM judge's group-relative score; ``mix``: both."""
    judge_weight: float = 0.5
    """The judge's share in ``mix``: ``(1 - w) * verifier + w * judge``."""
    admission_max_wait_s: float = 60.0
    """Longest single wait after the proxy refused a group (429 ``backlog_full``); a longer
    ``Retry-After`` is cut to this, then the runner asks again."""
    focus: float = 0.0
    """The share of task draws that go where groups are likely to disagree (``workflows/picking.py``);
    the rest follow the seeded order over every task. 0: the order alone."""
    fork_share: float = 0.0
    """Fork mode: the share of the groups the run makes that are forks of its finished groups
    (``POST /episodes/{id}/fork``); 0: none."""
    fork_rule: ForkRuleName = "failure"
    """Where a finished group is forked (``workflows/forking.py``): uniform, failure or entropy."""
    fork_size: int | None = None
    """Episodes per fork group (default: ``group_size``)."""
    fork_on_divergence: ForkRule = "sample"
    """A fork whose agent sends a request the source never sent: sample from there, or abandon."""
    source: str | None = None
    """Who answers the agents' calls, written as ``metadata.source`` on each group and episode:
    None, the policy; ``teacher:<name>``, a teacher the proxy serves (``proxy/teachers.py``; e.g.
    ``teacher:demo`` for the scripted demonstrator, ``workflows/tac/demonstrator.py``): demonstrations
    for a warm start, never trained on-policy, never on the test split."""

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
        if not 0.0 <= self.focus <= 1.0:
            raise ValueError(f"focus must be in [0, 1] (got {self.focus})")
        if not 0.0 <= self.fork_share < 1.0:
            raise ValueError(f"fork_share must be in [0, 1) (got {self.fork_share})")
        if self.fork_rule not in FORK_RULES:
            raise ValueError(f"fork_rule must be one of {', '.join(FORK_RULES)} (got {self.fork_rule!r})")
        if self.fork_size is not None and self.fork_size < 2:
            raise ValueError(f"fork_size must be >= 2: siblings are compared (got {self.fork_size})")
        if self.fork_on_divergence not in ("sample", "abandon"):
            raise ValueError(f"fork_on_divergence must be sample or abandon (got {self.fork_on_divergence!r})")
        if self.source is not None and not self.source:
            raise ValueError("source must be a non-empty string (e.g. teacher:demo), or None for the policy")
        if self.source is not None and self.source.startswith(TEACHER_PREFIX):
            if self.split == "test":
                raise ValueError(f"source {self.source}: a teacher never demonstrates the test split")
            if self.fork_share > 0:
                raise ValueError(f"source {self.source}: fork mode compares the policy's samples; use fork_share 0")
        if not self.admission_max_wait_s > 0:
            raise ValueError(f"admission_max_wait_s must be > 0 (got {self.admission_max_wait_s})")
