"""Workflow options from ``-o key=value`` pairs, typed by the workflow's options dataclass.

Values are converted to the field's type (int, float, bool, str, Path, a Literal's choices,
``X | None`` with ``none``, ``list[str]`` comma-separated); an unknown key or a bad value is an
error that names the valid keys or choices. ``describe`` reads each field's docstring (the string
literal under it) for ``python -m workflows list``.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints


class OptionError(ValueError):
    pass


def _convert(raw: str, hint: Any, key: str) -> Any:
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        if raw.lower() in {"none", "null", ""} and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(raw, inner[0], key)
    if origin is Literal:
        for choice in args:
            if str(choice) == raw:
                return choice
        raise OptionError(f"option {key}={raw!r}: choose one of {', '.join(map(str, args))}")
    if origin is list:
        return [_convert(part.strip(), args[0], key) for part in raw.split(",") if part.strip()]
    if hint is bool:
        if raw.lower() in {"1", "true", "yes", "on"}:
            return True
        if raw.lower() in {"0", "false", "no", "off"}:
            return False
        raise OptionError(f"option {key}={raw!r}: expected true or false")
    if hint in (int, float):
        try:
            return hint(raw)
        except ValueError:
            raise OptionError(f"option {key}={raw!r}: expected {hint.__name__}") from None
    if hint is Path:
        return Path(raw).expanduser()
    return raw


def parse_options(cls: type[Any], pairs: list[str]) -> Any:
    """Build ``cls`` (a dataclass) from ``key=value`` strings; defaults fill the rest."""
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep:
            raise OptionError(f"option {pair!r}: expected key=value")
        if key not in names:
            raise OptionError(f"unknown option {key!r}; valid options: {', '.join(names) or '(none)'}")
        values[key] = _convert(raw.strip(), hints[key], key)
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise OptionError(str(exc)) from exc


def describe(cls: type[Any]) -> list[tuple[str, str, str]]:
    """(name, default, docstring) for each field of an options dataclass."""
    docs: dict[str, str] = {}
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, nxt in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    except (OSError, TypeError, SyntaxError):
        pass
    out = []
    for f in dataclasses.fields(cls):
        default = (
            f.default
            if f.default is not dataclasses.MISSING
            else (f.default_factory() if f.default_factory is not dataclasses.MISSING else "(required)")
        )
        out.append((f.name, str(default), docs.get(f.name, "")))
    return out
