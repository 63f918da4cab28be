"""TheAgentCompany task layout, read from a directory.

A task directory holds what a TAC image keeps under ``/instruction`` and ``/utils``:

- ``task.md``: the instruction given to the agent;
- ``checkpoints.md``: the checkpoints in words (for people; the evaluator is the authority);
- ``evaluator.py``: ``grade_checkpoints(trajectory: str, workspace: Path) -> Result`` (local tasks
  get their workspace path; TAC's own evaluators read fixed paths inside their container). A task
  without one has no checkpoints: only the LLM judge can reward it (``--reward judge``);
- ``dependencies.yml``: the services the task needs (gitlab, rocketchat, owncloud, plane); local
  tasks need none;
- ``workspace/`` (optional): files copied into the agent's fresh working directory;
- ``init.sh`` (optional): run in the working directory before the agent starts;
- ``spec.json`` (generated tasks, ``family.py``): what the shared checks grade; its ``kind`` is the
  task's kind;
- ``solution.json`` (optional): OpenHands tool calls that solve the task (``{"steps": [{"tool",
  "arguments"}, ...]}``, ending with ``finish``), for scripted demonstrations and tests.

A directory of tasks may carry ``splits.yml`` (``train: [...]``, ``test: [...]``, optionally
``val: [...]``); without one, every task is in both splits. A task for the docker runtime names its
image in ``image.txt`` (default ``ghcr.io/theagentcompany/<name>-image:1.0.0``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml  # type: ignore[import-untyped,unused-ignore]

BUNDLED = Path(__file__).resolve().parent / "tasks"
"""Self-contained local tasks written for Flywheel (no services)."""
SERVICES = {"gitlab", "rocketchat", "owncloud", "plane"}


@dataclass(frozen=True)
class TACTask:
    name: str
    path: Path
    instruction: str
    dependencies: tuple[str, ...]
    image: str
    kind: str | None = None
    """A generated task's kind (``spec.json``); None for hand-written ones."""

    @property
    def evaluator(self) -> Path:
        return self.path / "evaluator.py"

    @property
    def graded(self) -> bool:
        """The task has checkpoints (an evaluator); without them only the judge can reward a run."""
        return self.evaluator.is_file()

    @property
    def workspace_seed(self) -> Path | None:
        seed = self.path / "workspace"
        return seed if seed.is_dir() else None

    @property
    def init_script(self) -> Path | None:
        script = self.path / "init.sh"
        return script if script.is_file() else None


def load_task(path: Path) -> TACTask:
    """Read one task directory; a missing piece is an error naming the file."""
    path = path.resolve()
    if not (path / "task.md").is_file():
        raise ValueError(f"TAC task {path.name}: missing task.md in {path}")
    deps_file = path / "dependencies.yml"
    deps = yaml.safe_load(deps_file.read_text()) if deps_file.is_file() else []
    if not isinstance(deps, list | type(None)) or any(not isinstance(d, str) for d in deps or []):
        raise ValueError(f"TAC task {path.name}: dependencies.yml must be a list of service names")
    image_file = path / "image.txt"
    default_image = f"ghcr.io/theagentcompany/{path.name}-image:1.0.0"
    image = image_file.read_text().strip() if image_file.is_file() else default_image
    spec_file = path / "spec.json"
    kind = json.loads(spec_file.read_text()).get("kind") if spec_file.is_file() else None
    return TACTask(
        name=path.name,
        path=path,
        instruction=(path / "task.md").read_text().strip(),
        dependencies=tuple(deps or ()),
        image=image,
        kind=kind if isinstance(kind, str) else None,
    )


def split_names(root: Path) -> set[str]:
    """The splits ``root/splits.yml`` lists (none without one)."""
    splits_file = root / "splits.yml"
    splits = yaml.safe_load(splits_file.read_text()) if splits_file.is_file() else None
    return set(splits) if isinstance(splits, dict) else set()


def load_tasks(root: Path, split: str) -> list[TACTask]:
    """The tasks of ``split`` under ``root`` (sorted by name, or in splits.yml's order)."""
    if not root.is_dir():
        raise ValueError(f"no TAC task directory {root}")
    names = sorted(p.name for p in root.iterdir() if (p / "task.md").is_file())
    splits_file = root / "splits.yml"
    if splits_file.is_file():
        splits = yaml.safe_load(splits_file.read_text()) or {}
        chosen = splits.get(split)
        if not isinstance(chosen, list):
            raise ValueError(f"{splits_file}: no list for split {split!r}")
        unknown = set(chosen) - set(names)
        if unknown:
            raise ValueError(f"{splits_file}: {split} names unknown tasks {sorted(unknown)}")
        names = list(chosen)
    return [load_task(root / name) for name in names]
