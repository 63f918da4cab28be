"""Where a TAC task runs: ``local`` (a temp workspace on this host) or ``docker`` (the official image).

Both give the agent a working directory, an instruction and terminal settings, then grade the
result with the task's evaluator into TAC's result file, read by ``scoring.read_result``.

``local``: tasks without service dependencies. The workspace seed is copied into a fresh temp
directory, ``init.sh`` runs there, the agent works there (OpenHands' LocalWorkspace: commands run
on this host, unsandboxed, so run it on a disposable machine or container), and the evaluator
runs in a subprocess (``python -m workflows.tac.evaluate``) with a time limit.

``docker``: hosts with a Docker engine and TAC's services up (``SERVER_HOSTNAME``). It starts the
task image with ``/outputs`` mounted, runs ``/utils/init.sh`` with the environment LLM's settings,
gives the agent a terminal inside the container (``docker exec -it ... bash`` as the shell of
OpenHands' subprocess terminal; the file editor is off, since it would edit host files), and
grades with ``/utils/eval.py`` (``DECRYPTION_KEY`` from ``$TAC_DECRYPTION_KEY``, as TAC's own
harness sets it). Written to TAC's published contract; it could not be run here (no Docker).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workflows.base import Endpoint
from workflows.tac.scoring import Result, read_result
from workflows.tac.task import TACTask

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Prepared:
    """A task made ready for one episode."""

    task: TACTask
    workdir: Path
    """The agent's working directory on this host (OpenHands' LocalWorkspace)."""
    outputs: Path
    """Trajectory and result files (outside the agent's working directory)."""
    instruction: str
    terminal_params: dict[str, Any] = field(default_factory=dict)
    file_editor: bool = True
    container: str | None = None


def _run(cmd: list[str], *, timeout: float, what: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{what} timed out after {timeout:.0f}s") from exc
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed with exit code {done.returncode}: {(done.stderr or done.stdout)[-1500:]}")
    return done


class Runtime(ABC):
    @abstractmethod
    def prepare(self, task: TACTask, episode_id: str) -> Prepared: ...

    @abstractmethod
    def evaluate(self, prepared: Prepared, trajectory: str) -> Result: ...

    @abstractmethod
    def cleanup(self, prepared: Prepared) -> None: ...


class LocalRuntime(Runtime):
    def __init__(
        self, *, root: Path | None = None, keep: bool = False, init_timeout_s: float = 120, eval_timeout_s: float = 120
    ) -> None:
        self.root = root
        self.keep = keep
        self.init_timeout_s = init_timeout_s
        self.eval_timeout_s = eval_timeout_s

    def prepare(self, task: TACTask, episode_id: str) -> Prepared:
        if task.dependencies:
            raise ValueError(
                f"TAC task {task.name} needs services {list(task.dependencies)}; "
                "the local runtime runs only tasks without them (use runtime=docker)"
            )
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)
        base = Path(tempfile.mkdtemp(prefix=f"tac-{task.name}-{episode_id[:8]}-", dir=self.root))
        workdir, outputs = base / "workspace", base / "outputs"
        outputs.mkdir()
        if task.workspace_seed is not None:
            shutil.copytree(task.workspace_seed, workdir)
        else:
            workdir.mkdir()
        # The agent's terminal is bash without the host's rc files: an interactive shell that sources
        # ~/.bashrc runs whatever the host put there (here `pyenv init`, whose rehash under load delayed
        # the prompt until OpenHands took an episode's first command as finished before it ran), so
        # the same task behaved differently by host. The subprocess backend, not tmux (whose shell
        # reads them too), so the shell is this one on every host.
        shell = outputs / "shell.sh"
        shell.write_text('#!/bin/sh\nexec bash --norc --noprofile "$@"\n')
        shell.chmod(0o755)
        prepared = Prepared(
            task=task,
            workdir=workdir,
            outputs=outputs,
            instruction=task.instruction,
            terminal_params={"terminal_type": "subprocess", "shell_path": str(shell)},
        )
        if task.init_script is not None:
            try:
                _run(
                    ["bash", str(task.init_script)],
                    cwd=workdir,
                    timeout=self.init_timeout_s,
                    what=f"{task.name} init.sh",
                )
            except RuntimeError:
                self.cleanup(prepared)
                raise
        return prepared

    def evaluate(self, prepared: Prepared, trajectory: str) -> Result:
        traj, result = prepared.outputs / "trajectory.json", prepared.outputs / "eval.json"
        traj.write_text(trajectory)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        _run(
            [
                sys.executable,
                "-m",
                "workflows.tac.evaluate",
                "--task-dir",
                str(prepared.task.path),
                "--workspace",
                str(prepared.workdir),
                "--trajectory_path",
                str(traj),
                "--result_path",
                str(result),
            ],
            cwd=prepared.outputs,
            env=env,
            timeout=self.eval_timeout_s,
            what=f"{prepared.task.name} evaluator",
        )
        return read_result(result)

    def cleanup(self, prepared: Prepared) -> None:
        if not self.keep:
            shutil.rmtree(prepared.workdir.parent, ignore_errors=True)


class DockerRuntime(Runtime):
    """TAC's official task images (see the module docstring)."""

    def __init__(
        self,
        *,
        server_hostname: str,
        env_llm: Endpoint,
        env_model: str,
        docker: str = "docker",
        keep: bool = False,
        init_timeout_s: float = 900,
        eval_timeout_s: float = 600,
    ) -> None:
        self.server_hostname = server_hostname
        self.env_llm = env_llm
        self.env_model = env_model
        self.docker = docker
        self.keep = keep
        self.init_timeout_s = init_timeout_s
        self.eval_timeout_s = eval_timeout_s

    def _llm_env(self) -> list[str]:
        """``-e`` flags giving the task's NPCs and LLM-based checks their LLM (TAC reads LITELLM_*)."""
        pairs = {
            "LITELLM_API_KEY": self.env_llm.api_key,
            "LITELLM_BASE_URL": self.env_llm.base_url,
            "LITELLM_MODEL": f"openai/{self.env_model}",
            "SERVER_HOSTNAME": self.server_hostname,
        }
        return [flag for k, v in pairs.items() for flag in ("-e", f"{k}={v}")]

    def prepare(self, task: TACTask, episode_id: str) -> Prepared:
        if shutil.which(self.docker) is None:
            raise RuntimeError(f"runtime=docker needs the {self.docker!r} command and a Docker engine")
        base = Path(tempfile.mkdtemp(prefix=f"tac-{task.name}-{episode_id[:8]}-"))
        workdir, outputs = base / "host", base / "outputs"
        workdir.mkdir()
        outputs.mkdir()
        outputs.chmod(0o777)  # the container may write as another user
        name = f"flywheel-tac-{episode_id}"
        shell = outputs / "container-shell.sh"
        shell.write_text(f'#!/bin/sh\nexec {shlex.quote(self.docker)} exec -it -w /workspace {name} bash "$@"\n')
        shell.chmod(0o755)
        prepared = Prepared(
            task=task,
            workdir=workdir,
            outputs=outputs,
            instruction="",
            container=name,
            terminal_params={"terminal_type": "subprocess", "shell_path": str(shell)},
            file_editor=False,
        )
        try:
            _run(
                [
                    self.docker,
                    "run",
                    "-d",
                    "--name",
                    name,
                    "--network",
                    "host",
                    "-v",
                    f"{outputs}:/outputs",
                    "--entrypoint",
                    "tail",
                    task.image,
                    "-f",
                    "/dev/null",
                ],
                timeout=600,
                what=f"docker run {task.image}",
            )
            _run([self.docker, "exec", name, "mkdir", "-p", "/workspace"], timeout=60, what="mkdir /workspace")
            _run(
                [self.docker, "exec", *self._llm_env(), name, "bash", "-c", "umask 0022 && bash /utils/init.sh"],
                timeout=self.init_timeout_s,
                what=f"{task.name} /utils/init.sh",
            )
            deps = _run(
                [self.docker, "exec", name, "cat", "/utils/dependencies.yml"],
                timeout=60,
                what="read /utils/dependencies.yml",
            ).stdout
        except RuntimeError:
            self.cleanup(prepared)
            raise
        instruction = "Complete the task in /instruction/task.md"
        if "gitlab" in deps:
            instruction += "\n\nGitlab username is 'root' and password is 'theagentcompany'"
        prepared.instruction = instruction
        return prepared

    def evaluate(self, prepared: Prepared, trajectory: str) -> Result:
        key = os.environ.get("TAC_DECRYPTION_KEY")
        if not key:
            raise RuntimeError("TAC's evaluators are encrypted: set TAC_DECRYPTION_KEY (TAC's harness documents it)")
        (prepared.outputs / "traj.json").write_text(trajectory)
        assert prepared.container is not None
        _run(
            [
                self.docker,
                "exec",
                *self._llm_env(),
                "-e",
                f"DECRYPTION_KEY={key}",
                prepared.container,
                "python_default",
                "/utils/eval.py",
                "--trajectory_path",
                "/outputs/traj.json",
                "--result_path",
                "/outputs/eval.json",
            ],
            timeout=self.eval_timeout_s,
            what="/utils/eval.py",
        )
        return read_result(prepared.outputs / "eval.json")

    def cleanup(self, prepared: Prepared) -> None:
        if prepared.container and not self.keep:
            subprocess.run([self.docker, "rm", "-f", prepared.container], capture_output=True, timeout=120)
        if not self.keep:
            shutil.rmtree(prepared.outputs.parent, ignore_errors=True)
