"""The project's dependencies plus named extras of ``pyproject.toml``, for the Docker image.

``python deploy/requirements.py postgres agents`` prints the requirement lines the Docker image
installs, so the image and the venvs built by ``deploy/bootstrap.py`` read the same single list;
the image installs them with ``deploy/locks/agents.txt`` as constraints (``deploy/lock.py``
compiles it). Stdlib only.
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def requirements(extras: list[str], pyproject: Path = PYPROJECT) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [name for name in extras if name not in optional]
    if unknown:
        raise SystemExit(f"unknown extra(s) {', '.join(unknown)}; pyproject.toml has {', '.join(sorted(optional))}")
    return list(project["dependencies"]) + [req for name in extras for req in optional[name]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python deploy/requirements.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("extras", nargs="*", help="extras of pyproject.toml (postgres, agents, train, ...)")
    args = parser.parse_args(argv)
    print("\n".join(requirements(args.extras)))


if __name__ == "__main__":
    main()
