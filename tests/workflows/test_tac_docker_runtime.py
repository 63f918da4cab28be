"""The docker runtime's commands, checked against ``fake_docker`` (this host has no Docker engine).

``fake_docker`` records each command line and plays the parts of a TAC task container the
runtime relies on: ``dependencies.yml`` and ``eval.py`` writing its result file into the mounted
``/outputs``. What this proves is the command sequence and the result parsing; a run against the
real images needs a Docker host (see workflows/tac/README.md).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from workflows.base import Endpoint
from workflows.tac.runtime import DockerRuntime
from workflows.tac.scoring import Checkpoint
from workflows.tac.task import TACTask

FAKE_DOCKER = f"""#!{sys.executable}
import json, os, pathlib, sys
log = pathlib.Path(os.environ["FAKE_DOCKER_LOG"])
args = sys.argv[1:]
with log.open("a") as f:
    f.write(json.dumps(args) + "\\n")
mount = log.with_suffix(".mount")
if args[0] == "run":
    mount.write_text(args[args.index("-v") + 1].split(":")[0])
    print("c0ffee")
elif args[0] == "exec" and args[-1] == "/utils/dependencies.yml":
    print("- gitlab\\n- rocketchat")
elif args[0] == "exec" and "/utils/eval.py" in args:
    outputs = pathlib.Path(mount.read_text())
    assert json.loads((outputs / "traj.json").read_text()) == [{{"kind": "scripted"}}]
    (outputs / "eval.json").write_text(json.dumps({{"checkpoints": [{{"total": 2, "result": 1}}],
                                                    "final_score": {{"total": 2, "result": 1}}}}))
"""


@pytest.fixture
def fake_docker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    script = tmp_path / "fake_docker"
    script.write_text(FAKE_DOCKER)
    script.chmod(0o755)
    log = tmp_path / "docker.log"
    monkeypatch.setenv("FAKE_DOCKER_LOG", str(log))
    return str(script), log


def test_setup_grading_and_cleanup_follow_tacs_contract(
    fake_docker: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    docker, log = fake_docker
    monkeypatch.setenv("TAC_DECRYPTION_KEY", "key-from-the-environment")
    task = TACTask(
        name="sde-fix-issue",
        path=Path("/nonexistent"),
        instruction="(inside the image)",
        dependencies=(),
        image="ghcr.io/theagentcompany/sde-fix-issue-image:1.0.0",
    )
    runtime = DockerRuntime(
        server_hostname="tac.example",
        env_llm=Endpoint("http://proxy/passthrough/v1", "k"),
        env_model="policy-base",
        docker=docker,
    )
    episode_id = "12345678-aaaa-bbbb-cccc-1234567890ab"
    prepared = runtime.prepare(task, episode_id)
    name = f"flywheel-tac-{episode_id}"
    assert prepared.instruction == (
        "Complete the task in /instruction/task.md\n\nGitlab username is 'root' and password is 'theagentcompany'"
    )
    assert prepared.file_editor is False and prepared.terminal_params["terminal_type"] == "subprocess"
    shell = Path(prepared.terminal_params["shell_path"]).read_text()
    assert f'exec {docker} exec -it -w /workspace {name} bash "$@"' in shell

    result = runtime.evaluate(prepared, trajectory=json.dumps([{"kind": "scripted"}]))
    assert result.final_score == Checkpoint(2, 1)
    runtime.cleanup(prepared)
    assert not prepared.outputs.exists()

    calls = [json.loads(line) for line in log.read_text().splitlines()]
    llm_env = [
        "-e",
        "LITELLM_API_KEY=k",
        "-e",
        "LITELLM_BASE_URL=http://proxy/passthrough/v1",
        "-e",
        "LITELLM_MODEL=openai/policy-base",
        "-e",
        "SERVER_HOSTNAME=tac.example",
    ]
    assert calls == [
        [
            "run",
            "-d",
            "--name",
            name,
            "--network",
            "host",
            "-v",
            f"{prepared.outputs}:/outputs",
            "--entrypoint",
            "tail",
            task.image,
            "-f",
            "/dev/null",
        ],
        ["exec", name, "mkdir", "-p", "/workspace"],
        ["exec", *llm_env, name, "bash", "-c", "umask 0022 && bash /utils/init.sh"],
        ["exec", name, "cat", "/utils/dependencies.yml"],
        [
            "exec",
            *llm_env,
            "-e",
            "DECRYPTION_KEY=key-from-the-environment",
            name,
            "python_default",
            "/utils/eval.py",
            "--trajectory_path",
            "/outputs/traj.json",
            "--result_path",
            "/outputs/eval.json",
        ],
        ["rm", "-f", name],
    ]


def test_grading_needs_the_decryption_key(fake_docker: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    docker, _ = fake_docker
    monkeypatch.delenv("TAC_DECRYPTION_KEY", raising=False)
    task = TACTask(name="t", path=Path("/nonexistent"), instruction="", dependencies=(), image="img")
    runtime = DockerRuntime(server_hostname="h", env_llm=Endpoint("u", "k"), env_model="m", docker=docker)
    prepared = runtime.prepare(task, "12345678-0000-0000-0000-000000000000")
    with pytest.raises(RuntimeError, match="set TAC_DECRYPTION_KEY"):
        runtime.evaluate(prepared, "[]")
    runtime.cleanup(prepared)


def test_no_docker_is_a_clear_error() -> None:
    runtime = DockerRuntime(
        server_hostname="h", env_llm=Endpoint("u", "k"), env_model="m", docker="/nonexistent/docker"
    )
    task = TACTask(name="t", path=Path("/nonexistent"), instruction="", dependencies=(), image="img")
    with pytest.raises(RuntimeError, match="needs the '/nonexistent/docker' command and a Docker engine"):
        runtime.prepare(task, "12345678-0000-0000-0000-000000000000")
