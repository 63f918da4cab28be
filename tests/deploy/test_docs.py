"""``python -m deploy.docs``: the reference pages cover every setting with its docstring, every route of
the proxy's OpenAPI schema, every step metric and every command-line entry point; an undocumented
setting fails the generation."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import pytest
import typer
from pydantic import BaseModel

from deploy import docs
from deploy.run_config import RunConfig as LauncherConfig
from proxy.settings import Settings
from trainer.config import TrainerConfig
from workflows.config import RunConfig as WorkflowConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("reference")
    docs.main(["--out", str(out)])
    assert sorted(p.name for p in out.iterdir()) == sorted(docs.PAGES)
    return {name: (out / name).read_text() for name in docs.PAGES}


def flat(text: str) -> str:
    """Markdown text as the docstring reads: escapes undone, whitespace collapsed."""
    return " ".join(text.replace("\\|", "|").replace("&lt;", "<").split())


def own_docstrings(cls: type) -> dict[str, str]:
    """Field -> the string literal after it, over the class and its bases in this repository."""
    found: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            if not Path(inspect.getsourcefile(klass) or "").resolve().is_relative_to(ROOT):
                continue
            node = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0]
        except (OSError, TypeError):
            continue
        assert isinstance(node, ast.ClassDef)
        for stmt, after in zip(node.body, node.body[1:], strict=False):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                    found[stmt.target.id] = str(after.value.value)
    return found


def class_docstring(cls: type) -> str:
    node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(node, ast.ClassDef)
    return ast.get_docstring(node) or ""


def nested(hint: Any) -> tuple[type | None, bool]:
    args = get_args(hint)
    if get_origin(hint) is list and args and isinstance(args[0], type):
        inner, many = args[0], True
    else:
        inner, many = hint, False
    is_config = isinstance(inner, type) and (issubclass(inner, BaseModel) or dataclasses.is_dataclass(inner))
    return (inner, many) if is_config else (None, False)


def settings(cls: type, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(dotted key, docstring) of every field, nested sections included; a section field without a
    docstring of its own is documented by its class's."""
    docstrings = own_docstrings(cls)
    if issubclass(cls, BaseModel):
        hints = {name: info.annotation for name, info in cls.model_fields.items()}
        described = {name: info.description for name, info in cls.model_fields.items()}
    else:
        types = get_type_hints(cls)
        hints = {f.name: types[f.name] for f in dataclasses.fields(cls)}
        described = {}
    for name, hint in hints.items():
        key = prefix + name
        section, many = nested(hint)
        doc = docstrings.get(name) or described.get(name) or (class_docstring(section) if section else "")
        yield key, doc
        if section is not None:
            yield from settings(section, key + ("[]." if many else "."))


@pytest.mark.parametrize(
    "config", [TrainerConfig, Settings, LauncherConfig, WorkflowConfig], ids=lambda c: f"{c.__module__}"
)
def test_every_setting_appears_with_its_docstring(pages: dict[str, str], config: type) -> None:
    page = flat(pages["settings.md"])
    fields = list(settings(config))
    assert len(fields) >= 15
    for key, doc in fields:
        assert doc.strip(), f"{key} has no docstring"
        assert f"`{key}`" in page, key
        assert flat(doc) in page, f"{key}: its docstring is not on the page"


def test_the_proxy_settings_name_their_environment_variables(pages: dict[str, str]) -> None:
    page = pages["settings.md"]
    for name in ("FLYWHEEL_PORT", "FLYWHEEL_POLICY__KEEP_VERSIONS", "FLYWHEEL_STORE__URL", "FLYWHEEL_ADMIN_KEY"):
        assert f"`{name}`" in page, name


@dataclasses.dataclass(frozen=True)
class Partly:
    documented: int = 1
    """This one says what it is."""
    bare: int = 2


def test_an_undocumented_setting_fails_the_generation(monkeypatch: pytest.MonkeyPatch) -> None:
    import trainer.config

    monkeypatch.setattr(trainer.config, "TrainerConfig", Partly)
    with pytest.raises(docs.DocsError) as failure:
        docs.settings_page()
    assert "Partly.bare" in str(failure.value)
    assert "Partly.documented" not in str(failure.value)


def test_every_openapi_operation_appears(pages: dict[str, str]) -> None:
    page = pages["http-api.md"]
    operations = [(method.upper(), path) for path, item in docs.openapi_schema()["paths"].items() for method in item]
    assert len(operations) >= 30
    for method, path in operations:
        assert f"`{method} {path}`" in page, (method, path)
    assert "### `POST /groups`" in page
    assert "### `GroupCreate`" in page  # a request body's schema, described on the page


def test_every_link_stays_on_its_page(pages: dict[str, str]) -> None:
    for name, text in pages.items():
        targets = re.findall(r"\]\(([^)]*)\)", text)
        assert all(t.startswith("#") for t in targets), (name, [t for t in targets if not t.startswith("#")])


def test_every_step_metric_and_prometheus_metric_appears(pages: dict[str, str]) -> None:
    page = pages["metrics.md"]
    meanings, keys = docs.step_metric_keys()
    assert set(keys) == set(meanings) and "reward/mean" in keys
    for key in keys:
        assert f"`{key}`" in page and flat(meanings[key]) in flat(page), key
    for name in ("data/calls_failed", "policy/engine_logp_diff_mean{suffix}", "perf/rss_gb", "flywheel_requests_total"):
        assert f"`{name}`" in page, name


def entry_modules() -> list[str]:
    """Every ``python -m`` target under the packages: ``__main__.py`` files and main-guarded modules."""
    found = []
    for package in docs.CLI_PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "node_modules" in path.parts:
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            if path.name == "__main__.py":
                found.append(".".join(parts[:-1]))
            elif re.search(r"^if __name__ == .__main__.:", path.read_text(), re.MULTILINE):
                found.append(".".join(parts))
    return found


def test_every_entry_point_appears_with_its_commands(pages: dict[str, str]) -> None:
    page = pages["cli.md"]
    modules = entry_modules()
    assert {"proxy", "trainer", "workflows", "deploy.local", "deploy.model"} <= set(modules)
    for module in modules:
        assert f"## `python -m {module}`" in page, module
    import proxy.__main__
    import trainer.__main__
    import workflows.__main__

    for module, app in (
        ("proxy", proxy.__main__.cli),
        ("trainer", trainer.__main__.cli),
        ("workflows", workflows.__main__.cli),
    ):
        commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
        assert commands, module
        for name in commands:
            assert f"### `python -m {module} {name}`" in page, (module, name)
            assert f"Usage: python -m {module} {name} [OPTIONS]" in page, (module, name)
    assert "### `python -m deploy.vllm serve`" in page  # an argparse subcommand
    assert "usage: python -m deploy.local" in page
