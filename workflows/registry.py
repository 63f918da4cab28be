"""Workflow names to their classes, imported only when asked for (each may need its own packages)."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from workflows.base import Workflow

BUILTIN = {
    "math": "workflows.math.run:MathWorkflow",
    "calc": "workflows.calc.run:CalcWorkflow",
    "tau2": "workflows.tau2.run:Tau2Workflow",
    "tac": "workflows.tac.run:TACWorkflow",
    "miniswe": "workflows.miniswe.run:MiniSweWorkflow",
}


def load(name: str) -> type[Workflow[Any, Any]]:
    """A built-in name (``math``, ``calc``, ``tau2``, ``tac``) or ``package.module:Class`` for your own workflow."""
    target = BUILTIN.get(name, name)
    module_name, sep, attr = target.partition(":")
    if not sep:
        raise ValueError(f"unknown workflow {name!r}: use one of {', '.join(BUILTIN)} or package.module:Class")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise ValueError(f"workflow {name!r}: no module {module_name}") from exc
        raise ValueError(
            f"workflow {name!r} needs module {exc.name!r}, which is not installed here; "
            "the agent workflows run in the agents venv (.venv-agents)"
        ) from exc
    except AttributeError:
        raise ValueError(f"module {module_name} has no {attr}") from None
    if not (isinstance(cls, type) and issubclass(cls, Workflow)):
        raise ValueError(f"{target} is not a workflows.base.Workflow subclass")
    missing = [pkg for pkg in cls.requires if importlib.util.find_spec(pkg) is None]
    if missing:
        raise ValueError(
            f"workflow {name!r} needs {', '.join(missing)}, not installed here; "
            "the agent workflows run in the agents venv (.venv-agents/bin/python)"
        )
    return cls
