"""The import graph between the packages: processes talk over HTTP, so their code must not lean on each other.

Every ``.py`` file under the packages is parsed (never imported: a walk sees the agents venv's
workflows and the trainer's torch code alike) and every import in it, at module level or inside a
function, is checked against the rules below. ``contract`` is the one declaration of what crosses
a process boundary; the proxy serves it, the trainer and the workflows use it, and neither side is
built on the other. A migration is history: it keeps private copies of what it runs
(``migrations/frozen_layout.py``), so it does not change when today's code does.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("contract", "proxy", "trainer", "workflows", "deploy")
CHECKED = (*PACKAGES, "migrations")

FORBIDDEN: dict[str, frozenset[str]] = {
    # The shared declarations: what every side imports cannot depend on any side.
    "contract": frozenset({"proxy", "trainer", "workflows", "deploy"}),
    # Clients of the proxy over HTTP, each in its own process (and venv): contract only.
    "trainer": frozenset({"proxy", "deploy", "workflows"}),
    "workflows": frozenset({"proxy", "deploy", "trainer"}),
    # The server knows nothing of its clients or of how it is launched.
    "proxy": frozenset({"trainer", "workflows", "deploy"}),
    # The launcher starts the proxy as a process (``python -m proxy serve``); it may import the
    # trainer's and the workflows' configuration to launch them, and of the proxy only ALLOWED.
    "deploy": frozenset({"proxy"}),
    # Migrations run today's schema forward from history: none of the live packages.
    "migrations": frozenset({"proxy", "trainer", "workflows", "deploy"}),
}

ALLOWED: dict[tuple[str, str], str] = {
    # (file, imported module): why this crossing stays. Keep it short; every entry must be in use.
    ("migrations/env.py", "proxy.store.models"): "Alembic's environment, not a revision: autogenerate "
    "diffs today's models (target_metadata) against the database, so it must see the live ones",
    ("migrations/env.py", "proxy.store.rows"): "the engine it builds writes JSON columns with json_text, "
    "the text every live writer stores, so rows a migration writes read back as the proxy's own",
    ("deploy/agreement.py", "proxy.settings"): "before anything starts, the launcher reads the proxy's file "
    "with the proxy's own loader to check its policy.base_model is the name vLLM serves; read, never served",
    ("deploy/docs.py", "proxy.settings"): "the docs' reference pages are generated from the code: the "
    "proxy's settings classes (and its env_overrides, to check each variable named), read, never served",
    ("deploy/docs.py", "proxy.app"): "the HTTP API page is the app's OpenAPI schema: create_app builds "
    "the app, its lifespan (store, upstreams) never runs",
    ("deploy/docs.py", "proxy.metrics"): "the metrics page lists the Prometheus metrics the proxy declares",
}


def module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in ``tree``, however deeply nested: ``import``,
    ``from ... import`` and ``importlib.import_module("...")`` with a literal name. Relative imports
    are left out: they cannot leave their own top-level package."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                yield node.lineno, node.module
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.lineno, node.args[0].value


def crossings(package: str, path: str, source: str) -> list[tuple[str, int, str]]:
    """(file, line, module) of each import in ``source`` that ``FORBIDDEN[package]`` rules out."""
    forbidden = FORBIDDEN[package]
    return [
        (path, line, module)
        for line, module in imported(ast.parse(source, filename=path))
        if module.split(".")[0] in forbidden
    ]


def walk() -> Iterator[tuple[str, Path]]:
    for package in CHECKED:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield package, path


def all_crossings() -> list[tuple[str, int, str]]:
    found = []
    for package, path in walk():
        found += crossings(package, path.relative_to(ROOT).as_posix(), path.read_text())
    return found


def test_the_packages_are_there() -> None:
    """A renamed or moved package would make every rule pass vacuously."""
    for package in CHECKED:
        assert any((ROOT / package).rglob("*.py")), package
    assert (ROOT / "contract" / "__init__.py").is_file()


def test_no_package_imports_across_a_process_boundary() -> None:
    bad = [f"{path}:{line} imports {module}" for path, line, module in all_crossings() if (path, module) not in ALLOWED]
    assert not bad, "forbidden imports (tests/test_imports.py says why):\n" + "\n".join(bad)


def test_every_allowed_crossing_is_still_used() -> None:
    """An entry whose import is gone goes too: the list only ever shrinks."""
    used = {(path, module) for path, _, module in all_crossings()}
    assert not set(ALLOWED) - used, f"stale ALLOWED entries: {sorted(set(ALLOWED) - used)}"


@pytest.mark.parametrize(
    ("package", "source"),
    [
        ("trainer", "from proxy.settings import Settings"),
        ("trainer", "import proxy"),
        ("workflows", "def f():\n    import trainer.data as d\n    return d"),
        ("contract", "class C:\n    def m(self):\n        from deploy import stack"),
        ("proxy", "import importlib\nimportlib.import_module('workflows.runner')"),
        ("migrations", "if True:\n    from proxy.store.delta import pack"),
    ],
)
def test_the_walk_sees_every_kind_of_import(package: str, source: str) -> None:
    """The rules can fail: module-level, nested and dynamic imports are each found."""
    assert crossings(package, "x.py", source)


@pytest.mark.parametrize(
    ("package", "source"),
    [
        ("trainer", "from contract.client import ProxyClient"),
        ("proxy", "from . import errors\nfrom .store import db"),
        ("deploy", "from trainer.config import TrainerConfig"),
        ("workflows", "import proxyish"),
    ],
)
def test_the_walk_lets_allowed_imports_pass(package: str, source: str) -> None:
    assert not crossings(package, "x.py", source)
