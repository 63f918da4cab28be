"""Live progress of a run on stderr: episodes done, mean reward, errors, groups, policy version."""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from workflows.results import EpisodeResult, GroupResult


class RunProgress:
    def __init__(self, total_episodes: int | None, *, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[line]}"),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )
        self._task = self._progress.add_task("episodes", total=total_episodes, line="")
        self._rewards: list[float] = []
        self._abandoned = 0
        self._errors = 0
        self._groups = 0
        self._complete = 0
        self._judge_retries: int | None = None
        self._admission_waits = 0

    def __enter__(self) -> RunProgress:
        self._progress.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._progress.stop()

    def episode(self, result: EpisodeResult) -> None:
        if result.status == "rewarded" and result.reward is not None:
            self._rewards.append(result.reward)
        elif result.status == "abandoned":
            self._abandoned += 1
            self.console.log(f"[yellow]abandoned[/] {result.episode_id} ({result.task_id}): {result.error}")
        else:
            self._errors += 1
            self.console.log(f"[red]error[/] {result.episode_id} ({result.task_id}): {result.error}")
        self._refresh(advance=1)

    def group(self, result: GroupResult) -> None:
        self._groups += 1
        self._complete += result.status == "complete"
        if result.judge_attempts is not None:
            self._judge_retries = (self._judge_retries or 0) + max(0, result.judge_attempts - 1)
        self._refresh(advance=0)

    def admission_wait(self, seconds: float) -> None:
        """The proxy refused a group (its backlog ahead of the trainer is full): the runner waits ``seconds``."""
        self._admission_waits += 1
        self._refresh(advance=0)

    def _refresh(self, advance: int) -> None:
        mean = f"{sum(self._rewards) / len(self._rewards):.3f}" if self._rewards else "-"
        line = (
            f"mean reward {mean} · abandoned {self._abandoned} · errors {self._errors} · "
            f"groups {self._complete}/{self._groups} complete"
        )
        if self._admission_waits:  # 429 backlog_full from POST /groups: waited, then asked again
            line += f" · admission waits {self._admission_waits}"
        if self._judge_retries is not None:  # requests past the first of each judged group
            line += f" · judge retries {self._judge_retries}"
        self._progress.update(self._task, advance=advance, line=line)
