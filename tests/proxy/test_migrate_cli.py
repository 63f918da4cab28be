"""``python -m proxy migrate``: Alembic upgrades the store to the revision asked for."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from proxy.__main__ import cli
from proxy.store.db import alembic_config


def _stored_revision(path: Path) -> str:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        (revision,) = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    return str(revision)


def test_migrate_stops_at_the_revision_asked_for_then_goes_on_to_head(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from alembic.script import ScriptDirectory

    path = tmp_path / "flywheel.db"
    url = f"sqlite+aiosqlite:///{path}"
    monkeypatch.setenv("FLYWHEEL_STORE__URL", url)
    scripts = ScriptDirectory.from_config(alembic_config(url))
    base, head = scripts.get_base(), scripts.get_current_head()
    assert base is not None and head is not None and base != head
    runner = CliRunner()

    first = runner.invoke(cli, ["migrate", "--revision", base])
    assert first.exit_code == 0, first.output
    assert first.output.strip() == f"schema at {base}"
    assert _stored_revision(path) == base

    rest = runner.invoke(cli, ["migrate"])
    assert rest.exit_code == 0, rest.output
    assert _stored_revision(path) == head


def test_migration_0008_gives_existing_abandons_their_cause_from_the_old_reason_prefixes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "flywheel.db"
    monkeypatch.setenv("FLYWHEEL_STORE__URL", f"sqlite+aiosqlite:///{path}")
    runner = CliRunner()
    assert runner.invoke(cli, ["migrate", "--revision", "0007"]).exit_code == 0
    reasons = {
        "reaped": ("abandoned", "no reward within 900s"),
        "stopped": ("abandoned", "interrupted: the runner stopped mid-episode"),
        "engine": ("abandoned", "infrastructure: APIConnectionError: boom"),
        "crashed": ("abandoned", "agent crashed 100%_of the time"),
        "open": ("open", None),
    }
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.executemany(
            "INSERT INTO episodes (id, metadata, status, abandon_reason, created_at) VALUES (?, '{}', ?, ?, 0)",
            [(k, status, reason) for k, (status, reason) in reasons.items()],
        )
    assert runner.invoke(cli, ["migrate"]).exit_code == 0
    with contextlib.closing(sqlite3.connect(path)) as conn:
        causes = dict(conn.execute("SELECT id, abandon_cause FROM episodes").fetchall())
    assert causes == {
        "reaped": "deadline",
        "stopped": "interrupted",
        "engine": "infrastructure",
        "crashed": "agent",
        "open": None,
    }
