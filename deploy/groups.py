"""What became of a run's groups, for ``make run``'s report: generated, trained, dropped and why.

Sources, each read over HTTP or from a child's output (never from the store directly):
``GET /trainer/admission`` (every group in the store by outcome, and the proxy's admission refusals),
``GET /groups?train_status=skipped`` (each skipped group's note: why the trainer skipped it), the
trainer's step metrics (the calls of the episodes it trained) and the workflow's final summary line
(its admission waits).

Skips are counted from the store's notes, not from step metrics: a claim whose groups are all
skipped (every reward equal, say) is acked without a step, so no step's metrics ever count it.

``stale_fraction`` is stale groups over generated ones: the share of rollouts thrown away because
the trainer reached them only after they fell more than ``max_staleness`` versions behind.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

SKIP_REASONS = {
    "equal": re.compile(r"^all \d+ rewards equal\b"),
    "shaping_only": re.compile(r"^all \d+ outcomes equal\b.*\bshaping alone\b"),
    # stores written before the trainer's threshold became MIN_MEMBERS say "< min_rewarded N"
    "few": re.compile(r"\brewarded episodes\b.*(< min_rewarded \d+|GRPO compares at least \d+)$"),
    "empty": re.compile(r"^no trainable calls\b"),
    "nonfinite": re.compile(r"^non-finite gradient\b"),
}
"""The trainer's skip notes (``trainer/data.py`` ``build_batch``, ``trainer/loop.py``), by reason:
rewards all equal, outcomes all equal with returns that differ by shaping alone (``shaping: gated``),
too few members, no trainable tokens, a non-finite gradient."""
PAGE = 1000
"""Groups per ``GET /groups`` page (the route's maximum)."""


def _get(proxy_url: str, admin_key: str, path: str, **params: Any) -> Any:
    """One admin GET's JSON body, or None when the proxy cannot answer (the report then says so)."""
    try:
        response = httpx.get(
            f"{proxy_url}{path}", params=params, headers={"authorization": f"Bearer {admin_key}"}, timeout=60
        )
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def admission_state(proxy_url: str, admin_key: str) -> dict[str, Any]:
    """``GET /trainer/admission``, or {} when the proxy cannot answer."""
    found = _get(proxy_url, admin_key, "/trainer/admission")
    return dict(found) if isinstance(found, dict) else {}


def skip_notes(proxy_url: str, admin_key: str) -> list[str] | None:
    """The note of every group the trainer acked ``skipped`` ("" where none), or None when unreadable."""
    notes: list[str] = []
    while True:
        page = _get(proxy_url, admin_key, "/groups", train_status="skipped", limit=PAGE, offset=len(notes))
        if not isinstance(page, dict):
            return None
        notes += [str(g.get("train_note") or "") for g in page["data"]]
        if len(page["data"]) < PAGE:
            return notes


def skip_reason(note: str) -> str:
    """A skip note's reason (a key of ``SKIP_REASONS``), else ``other``. A note that joins several
    reasons (a trainer before one note per group wrote its lease's reasons into every group's note)
    counts under their reason only if all of them agree."""
    kinds = set()
    for part in note.split("; "):
        kinds.add(next((kind for kind, pattern in SKIP_REASONS.items() if pattern.search(part)), "other"))
    return kinds.pop() if len(kinds) == 1 else "other"


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


def group_counts(admission: dict[str, Any], notes: list[str] | None, workflow: dict[str, Any]) -> dict[str, Any]:
    """The report's ``groups`` section. None where a source was missing (never a made-up zero).
    ``skipped_*``: groups acked skipped, by the reason in their note; ``skipped_other_notes``: the
    notes no reason matched (a few, verbatim), so that a count under ``other`` can be looked into."""
    by_outcome: dict[str, int] | None = admission.get("groups")
    generated = sum(by_outcome.values()) if by_outcome is not None else None

    def count(key: str) -> int | None:
        return None if by_outcome is None else int(by_outcome.get(key, 0))

    reasons = Counter(skip_reason(n) for n in notes) if notes is not None else None

    def skipped(reason: str) -> int | None:
        return None if reasons is None else reasons[reason]

    stale = count("stale")
    unmatched = sorted({n for n in notes or [] if skip_reason(n) == "other"})
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
        "skipped_other": skipped("other"),
        "skipped_other_notes": unmatched[:5],
        "failed": count("failed"),
        "left_pending": count("pending"),
        "left_open": count("open"),
        "stale_fraction": round(stale / generated, 4) if stale is not None and generated else None,
        "admission_limit": admission.get("limit"),
        "admission_refusals": admission.get("refused"),
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
        f"{groups['skipped_other']} other; {groups['failed']} failed, {groups['left_pending']} left pending, "
        f"{groups['left_open']} left open\n"
        f"admission: {groups['admission_refusals']} refusals (limit {groups['admission_limit']}), "
        f"{groups['admission_waits']} runner waits ({groups['admission_wait_s']} s)"
    )
