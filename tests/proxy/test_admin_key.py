"""The admin key file: born 0600 (never readable by others, not even for an instant), and proxies
starting together end up with one key."""

from __future__ import annotations

import multiprocessing
import os
import secrets
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from proxy.__main__ import ensure_admin_key


@pytest.fixture(autouse=True)
def no_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither variable set, and both back as they were after the test (``ensure_admin_key`` sets them)."""
    for name in ("FLYWHEEL_ADMIN_KEY", "FLYWHEEL_ADMIN_KEY_FILE"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_key_file_is_0600_from_birth_even_under_umask_0(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "data" / "admin.key"
    linked: list[tuple[int, str]] = []
    real_link = os.link

    def spying_link(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        linked.append((stat.S_IMODE(os.stat(src).st_mode), Path(src).read_text()))  # what gets the name
        real_link(src, dst, *args, **kwargs)

    def no_chmod(*_: Any, **__: Any) -> None:
        raise AssertionError("the key must be created 0600, not chmod-ed after it was written")

    monkeypatch.setattr(os, "link", spying_link)
    monkeypatch.setattr(os, "chmod", no_chmod)
    monkeypatch.setattr(Path, "chmod", no_chmod)
    old_umask = os.umask(0)  # a plain write would create the file 0666
    try:
        ensure_admin_key(path)
    finally:
        os.umask(old_umask)
    key = os.environ["FLYWHEEL_ADMIN_KEY"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == key + "\n" and len(key) >= 40
    assert linked == [(0o600, key + "\n")]  # complete and 0600 before it had its name
    assert [p.name for p in path.parent.iterdir()] == ["admin.key"]  # no temporary file left

    os.environ.pop("FLYWHEEL_ADMIN_KEY")
    ensure_admin_key(path)  # a second start reads the same key
    assert os.environ["FLYWHEEL_ADMIN_KEY"] == key


def _start(path: str, index: int, barrier: Any, out: Any) -> None:
    """One proxy start. Both generate their key only after both found no key file; the second then
    waits, so without an exclusive create its key would overwrite the first one's after it was read."""
    os.environ.pop("FLYWHEEL_ADMIN_KEY", None)
    token = secrets.token_urlsafe

    def racing_token(n: int) -> str:
        barrier.wait(timeout=30)
        if index:
            time.sleep(0.3)
        return token(n)

    secrets.token_urlsafe = racing_token  # type: ignore[assignment]
    ensure_admin_key(Path(path))
    out.put((index, os.environ["FLYWHEEL_ADMIN_KEY"]))


def test_two_proxies_starting_together_agree_on_one_key(tmp_path: Path) -> None:
    path = tmp_path / "admin.key"
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_start, args=(str(path), i, barrier, out)) for i in range(2)]
    for proc in procs:
        proc.start()
    keys = dict(out.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join(timeout=30)
        assert proc.exitcode == 0
    assert keys[0] == keys[1] == path.read_text().strip()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
