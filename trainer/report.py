"""Where step metrics go besides the proxy: TensorBoard events, a step journal, the console.

On a terminal a rich progress bar shows the step count and what the trainer is doing; elsewhere
(``make run`` logs, tests) each step is one plain line on stderr. ``steps.jsonl`` records which
groups each step trained or skipped: the audit trail for "no group trained twice".
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

HEADLINE = (
    ("reward/mean", "reward {:.3f}"),
    ("reward/pass_rate", "pass {:.0%}"),
    ("loss/total", "loss {:+.4f}"),
    ("policy/entropy", "ent {:.2f}"),
    ("policy/grad_norm", "|g| {:.3f}"),
    ("data/samples", "{:.0f} samples"),
    ("perf/tokens_per_s", "{:.0f} tok/s"),
    ("proxy/published_version", "v{:.0f}"),
)


def finite(metrics: dict[str, Any]) -> dict[str, Any]:
    """JSON-safe metrics: non-finite floats become None (the proxy refuses NaN and infinity)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}


def headline(step: int, metrics: dict[str, Any]) -> str:
    parts = [f"step {step}"]
    for key, fmt in HEADLINE:
        value = metrics.get(key)
        if isinstance(value, int | float) and math.isfinite(value):
            parts.append(fmt.format(value))
    return " | ".join(parts)


class Reporter:
    def __init__(
        self, output_dir: Path, *, tensorboard: bool, progress: bool, max_steps: int | None, start_step: int
    ) -> None:
        self.journal_path = output_dir / "steps.jsonl"
        self.console = Console(stderr=True)
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(output_dir / "tensorboard"))
        self.progress: Progress | None = None
        if progress and self.console.is_terminal:
            self.progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=self.console,
            )
            self.task = self.progress.add_task("starting", total=max_steps, completed=start_step)
            self.progress.start()

    def status(self, text: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, description=text)

    def log(self, text: str) -> None:
        if self.progress is not None:
            self.progress.console.print(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def step(self, step: int, metrics: dict[str, Any]) -> None:
        if self.writer is not None:
            for key, value in metrics.items():
                if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()
        if self.progress is not None:
            self.progress.update(self.task, completed=step)
        self.log(headline(step, metrics))

    def journal_steps(self) -> set[int]:
        if not self.journal_path.exists():
            return set()
        steps = set()
        for line in self.journal_path.read_text().splitlines():
            try:
                steps.add(int(json.loads(line)["step"]))
            except (ValueError, KeyError):
                continue  # a line torn by a crash mid-append
        return steps

    def journal(self, record: dict[str, Any]) -> None:
        data = self.journal_path.read_bytes() if self.journal_path.exists() else b""
        torn = bool(data) and not data.endswith(b"\n")
        with open(self.journal_path, "a") as fh:
            fh.write(("\n" if torn else "") + json.dumps(record) + "\n")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.writer is not None:
            self.writer.close()
