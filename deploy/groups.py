"""What became of a run's groups, for ``make run``'s report: generated, trained, dropped and why.

Sources, each read over HTTP or from a child's output (never from the store directly):
``GET /trainer/admission`` (every group in the store by outcome, and the proxy's admission refusals),
the trainer's step metrics (``data/groups_skipped_equal``: groups whose rewards were all equal, so
GRPO's advantages are zero) and the workflow's final summary line (its admission waits).

``stale_fraction`` is stale groups over generated ones: the share of rollouts thrown away because
the trainer reached them only after they fell more than ``max_staleness`` versions behind.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx


def admission_state(proxy_url: str, admin_key: str) -> dict[str, Any]:
    """``GET /trainer/admission``, or {} when the proxy cannot answer (the report then says so)."""
    try:
        response = httpx.get(
            f"{proxy_url}/trainer/admission", headers={"authorization": f"Bearer {admin_key}"}, timeout=10
        )
        return dict(response.json()) if response.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}


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


def group_counts(admission: dict[str, Any], steps: list[dict[str, Any]], workflow: dict[str, Any]) -> dict[str, Any]:
    """The report's ``groups`` section. None where a source was missing (never a made-up zero).
    ``skipped_other``: groups acked skipped for another reason (too few members, no tokens, a
    non-finite gradient)."""
    by_outcome: dict[str, int] | None = admission.get("groups")
    generated = sum(by_outcome.values()) if by_outcome is not None else None

    def count(key: str) -> int | None:
        return None if by_outcome is None else int(by_outcome.get(key, 0))

    stale, skipped = count("stale"), count("skipped")
    equal = int(sum(s["metrics"].get("data/groups_skipped_equal") or 0 for s in steps))
    return {
        "generated": generated,
        "trained": count("trained"),
        "skipped_stale": stale,
        "skipped_equal": equal,
        "skipped_other": None if skipped is None else max(0, skipped - equal),
        "failed": count("failed"),
        "left_pending": count("pending"),
        "left_open": count("open"),
        "stale_fraction": round(stale / generated, 4) if stale is not None and generated else None,
        "admission_limit": admission.get("limit"),
        "admission_refusals": admission.get("refused"),
        "admission_waits": workflow.get("admission_waits"),
        "admission_wait_s": workflow.get("admission_wait_s"),
    }
