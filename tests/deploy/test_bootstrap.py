"""The agent harnesses' pins and their install (``deploy/bootstrap.py harnesses``), without npm."""

from __future__ import annotations

import json
import re

import pytest

from deploy import bootstrap

EXACT = re.compile(r"^\d+\.\d+\.\d+$")


def test_the_harnesses_are_pinned_exactly_by_the_committed_lock() -> None:
    package = json.loads((bootstrap.HARNESSES / "package.json").read_text())
    lock = json.loads((bootstrap.HARNESSES / "package-lock.json").read_text())
    wanted = package["dependencies"]
    assert set(wanted) == {"@anthropic-ai/claude-code", "@openai/codex", "@google/gemini-cli"}
    assert all(EXACT.match(version) for version in wanted.values()), wanted  # no ranges
    assert lock["packages"][""]["dependencies"] == wanted
    for name, version in wanted.items():
        entry = lock["packages"][f"node_modules/{name}"]
        assert entry["version"] == version and entry["integrity"].startswith("sha512-")


def test_without_node_the_setup_says_why_and_installs_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bootstrap.shutil, "which", lambda name: None)
    monkeypatch.setattr(bootstrap, "apt_install", lambda packages, why: "no apt-get")
    assert bootstrap.ensure_harnesses() is None
    assert "node/npm missing (no apt-get): the harness tests will skip" in capsys.readouterr().err
