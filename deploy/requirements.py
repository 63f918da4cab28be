"""The project's dependencies plus named extras of ``pyproject.toml``; and the image's lock file.

``python deploy/requirements.py postgres agents`` prints the requirement lines the Docker image
installs, so the image and the venvs built by ``deploy/bootstrap.py`` read the same single list.
``python deploy/requirements.py --lock --python python3.12 postgres agents train`` resolves that
list with pip for the given interpreter (``pip install --dry-run --report``, nothing installed)
and prints pins for ``deploy/constraints.txt``: every image build then gets the same versions,
whatever PyPI serves that day. Stdlib only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
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


def lock(extras: list[str], python: str) -> list[str]:
    """Resolve with ``python``'s pip (a throwaway venv of that interpreter) and return ``name==version`` pins."""
    with tempfile.TemporaryDirectory() as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        reqs = Path(tmp) / "requirements.txt"
        reqs.write_text("\n".join(requirements(extras)) + "\n")
        report = Path(tmp) / "report.json"
        subprocess.run(
            [
                str(venv / "bin" / "python"),
                "-m",
                "pip",
                "install",
                "--quiet",
                "--dry-run",
                "--ignore-installed",
                "--report",
                str(report),
                "-r",
                str(reqs),
            ],
            check=True,
            stdout=sys.stderr,
        )
        data = json.loads(report.read_text())
    env = data["environment"]
    header = [
        f"# pip's resolution of: {' '.join(extras)} (python {env['python_version']}, "
        f"{env['sys_platform']} {env['platform_machine']})",
        f"# regenerate: python deploy/requirements.py --lock --python python3.12 {' '.join(extras)} "
        "> deploy/constraints.txt",
    ]
    pins = sorted(f"{item['metadata']['name'].lower()}=={item['metadata']['version']}" for item in data["install"])
    return header + pins


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python deploy/requirements.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("extras", nargs="*", help="extras of pyproject.toml (postgres, agents, train, ...)")
    parser.add_argument("--lock", action="store_true", help="print resolved pins instead of the requirements")
    parser.add_argument("--python", default=sys.executable, help="with --lock: the interpreter to resolve for")
    args = parser.parse_args(argv)
    print("\n".join(lock(args.extras, args.python) if args.lock else requirements(args.extras)))


if __name__ == "__main__":
    main()
