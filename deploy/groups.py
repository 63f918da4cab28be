"""What became of a run's groups, for ``make run``'s report: generated, trained, dropped and why.

Sources, each read through the contract's client (``contract/client.py``) or from a child's output
(never from the store directly): ``GET /trainer/admission`` (every group in the store by outcome,
and the proxy's admission refusals), ``GET /groups/skips`` (the groups never trained, counted by
their typed ``train_reason`` in one query), ``GET /groups?train_reason=other`` (the notes of a few
groups skipped without a reason), the trainer's step metrics (the calls of the episodes it trained)
and the workflow's final summary line (its admission waits).

Skips are counted from the store, not from step metrics: a claim whose groups are all skipped
(every reward equal, say) is acked without a step, so no step's metrics ever count it.

``stale_fraction`` is stale groups over generated ones: the share of rollouts thrown away because
the trainer reached them only after they fell more than ``max_staleness`` versions behind.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from contract.client import ProxyClient, ProxyError, RetryRule
from contract.schemas import AdmissionOut
from contract.vocabulary import SkipCount

R = TypeVar("R")
ONCE = RetryRule(attempts=1)
"""The report asks once: a proxy that cannot answer leaves its figures unknown (None), never waits."""
OTHER_NOTES = 5
"""Distinct notes of groups skipped without a reason the report quotes, so ``other`` can be looked into."""


@dataclass(frozen=True)
class Skips:
    """The groups never trained, by reason (``GET /groups/skips``), and a few notes of those under ``other``."""

    counts: dict[str, int]
    """A ``SkipCount`` key each; a reason without groups is absent."""
    other_notes: list[str]

    def count(self, reason: SkipCount) -> int:
        return self.counts.get(reason, 0)


def _ask(proxy_url: str, admin_key: str, call: Callable[[ProxyClient], R]) -> R | None:
    """One call's answer, or None when the proxy cannot answer (the report then says so)."""
    try:
        with ProxyClient(proxy_url, admin_key, timeout_s=60, retry=ONCE) as client:
            return call(client)
    except (ProxyError, ValueError):  # no answer, an error answer, or one that does not read
        return None


def admission_state(proxy_url: str, admin_key: str) -> AdmissionOut | None:
    """``GET /trainer/admission``, or None when the proxy cannot answer."""
    return _ask(proxy_url, admin_key, lambda client: client.admission())


def skips(proxy_url: str, admin_key: str) -> Skips | None:
    """The groups never trained, counted by their typed reason, or None when unreadable."""

    def read(client: ProxyClient) -> Skips:
        counts = client.skip_counts()
        other = client.groups(train_reason="other", limit=100) if counts.get("other") else []
        notes = sorted({g.train_note or "" for g in other})[:OTHER_NOTES]
        return Skips(counts, notes)

    return _ask(proxy_url, admin_key, read)


skip_notes = skips
"""The name ``deploy/loop.py`` calls it by."""


def workflow_summary(log_path: Path) -> dict[str, Any]:
    """The workflow's final summary (the last JSON object line of its log), or {} if it wrote none."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                found = json.loads(line)
            except ValueError:
                continue
            if isinstance(found, dict) and "groups" in found:
                return found
    return {}


def calls_per_trained_episode(steps: list[dict[str, Any]]) -> float | None:
    """Calls of the episodes the trainer trained on, per such episode (None: no step counted them).
    Over trained episodes only: the calls of groups skipped in the same step are not counted."""
    calls = sum(s["metrics"].get("data/calls_trained") or 0 for s in steps)
    episodes = sum(s["metrics"].get("data/episodes_trained") or 0 for s in steps)
    return round(calls / episodes, 3) if episodes else None


def group_counts(admission: AdmissionOut | None, skipped_by: Skips | None, workflow: dict[str, Any]) -> dict[str, Any]:
    """The report's ``groups`` section. None where a source was missing (never a made-up zero).
    ``skipped_*``: groups never trained, by their stored reason (``other``: skipped without one);
    ``skipped_other_notes``: a few of those groups' notes, verbatim, so that ``other`` can be looked into."""
    by_outcome = admission.groups if admission is not None else None
    generated = sum(by_outcome.values()) if by_outcome is not None else None

    def count(key: str) -> int | None:
        return None if by_outcome is None else int(by_outcome.get(key, 0))

    def skipped(reason: SkipCount) -> int | None:
        return None if skipped_by is None else skipped_by.count(reason)

    stale = count("stale")
    return {
        "generated": generated,
        "trained": count("trained"),
        "skipped": count("skipped"),
        "skipped_stale": stale,
        "skipped_equal": skipped("equal"),
        "skipped_shaping_only": skipped("shaping_only"),
        "skipped_few": skipped("few"),
        "skipped_empty": skipped("empty"),
        "skipped_nonfinite": skipped("nonfinite"),
        "skipped_teacher": skipped("teacher"),
        "skipped_late": skipped("late"),
        "skipped_other": skipped("other"),
        "skipped_other_notes": [] if skipped_by is None else skipped_by.other_notes,
        "failed": count("failed"),
        "left_pending": count("pending"),
        "left_open": count("open"),
        "stale_fraction": round(stale / generated, 4) if stale is not None and generated else None,
        "admission_limit": None if admission is None else admission.limit,
        "admission_refusals": None if admission is None else admission.refused,
        "admission_waits": workflow.get("admission_waits"),
        "admission_wait_s": workflow.get("admission_wait_s"),
    }


def summary(groups: dict[str, Any], calls_per_episode: float | None) -> str:
    """The lines ``make run`` prints about its groups: the same numbers as ``report.json``."""
    return (
        f"groups: {groups['generated']} generated, {groups['trained']} trained "
        f"({calls_per_episode} calls per trained episode), {groups['skipped_stale']} skipped stale "
        f"(fraction {groups['stale_fraction']}), {groups['skipped']} skipped by the trainer: "
        f"{groups['skipped_equal']} equal rewards, {groups['skipped_shaping_only']} equal outcomes (shaping "
        f"alone), {groups['skipped_few']} too few members, "
        f"{groups['skipped_empty']} no trainable tokens, {groups['skipped_nonfinite']} non-finite gradient, "
        f"{groups['skipped_teacher']} teacher demonstrations, {groups['skipped_late']} late past the age limit, "
        f"{groups['skipped_other']} other; "
        f"{groups['failed']} failed, {groups['left_pending']} left pending, "
        f"{groups['left_open']} left open\n"
        f"admission: {groups['admission_refusals']} refusals (limit {groups['admission_limit']}), "
        f"{groups['admission_waits']} runner waits ({groups['admission_wait_s']} s)"
    )
