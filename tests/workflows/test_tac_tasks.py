"""TheAgentCompany scoring and the bundled local tasks, graded on scripted good and bad solutions.

Each scripted solution runs in a fresh local runtime workspace (seed copied, init.sh run), then the
task's evaluator grades it in its subprocess, exactly as after an agent's run.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from workflows.tac.runtime import LocalRuntime
from workflows.tac.scoring import Checkpoint, Result, read_result, score
from workflows.tac.task import BUNDLED, load_task, load_tasks


@pytest.mark.parametrize(
    ("total", "result", "expected"),
    [(2, 0, 0.0), (2, 1, 0.25), (2, 2, 1.0), (3, 1, 1 / 6), (3, 2, 1 / 3), (3, 3, 1.0), (1, 1, 1.0)],
)
def test_score_is_half_partial_half_all_or_nothing(total: int, result: int, expected: float) -> None:
    assert score(Checkpoint(total, result)) == pytest.approx(expected)


def test_checkpoints_sum_into_the_final_score() -> None:
    result = Result([Checkpoint(1, 1), Checkpoint(2, 1)])
    assert result.final_score == Checkpoint(3, 2)
    assert result.to_json() == {
        "checkpoints": [{"total": 1, "result": 1}, {"total": 2, "result": 1}],
        "final_score": {"total": 3, "result": 2},
    }
    with pytest.raises(ValueError, match="0 <= result <= total"):
        Checkpoint(1, 2)


def test_result_files(tmp_path: Path) -> None:
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({"checkpoints": [{"total": 2, "result": 1}], "final_score": {"total": 2, "result": 2}}))
    assert read_result(path).final_score == Checkpoint(2, 2)  # an evaluator's bonus strategy is trusted
    path.write_text('{"checkpoints": []}')
    with pytest.raises(ValueError, match="has no checkpoints"):
        read_result(path)
    path.write_text("not json")
    with pytest.raises(ValueError, match="is unreadable"):
        read_result(path)


GOOD = {
    "hello-file": "echo 'hello flywheel' > greeting.txt",
    "sql-shop": "printf 'top_customer: Emeka Obi\\nmarch_orders: 4\\n' > answers.txt",
    "csv-report": "printf 'region,total\\nEast,245.25\\nNorth,440.00\\nSouth,226.00\\nWest,160.00\\n' > report.csv",
    "fix-median": (
        "python3 - <<'EOF'\nimport re\nsrc = open('stats.py').read()\n"
        "src = src.replace('    return ordered[middle]', '    if len(ordered) % 2:\\n"
        "        return ordered[middle]\\n    return (ordered[middle - 1] + ordered[middle]) / 2')\n"
        "open('stats.py', 'w').write(src)\nEOF"
    ),
    "json-config": 'sed -i \'s/"debug": true/"debug": false/; s/"port": 5000/"port": 8080/\' config.json',
    "word-count": 'echo "{\\"lines\\": $(wc -l < notes.txt), \\"words\\": $(wc -w < notes.txt)}" > counts.json',
}
BAD = [  # (task, script, checkpoints passed)
    ("hello-file", "true", [0, 0]),
    ("hello-file", "echo 'hello world' > greeting.txt", [1, 0]),
    ("sql-shop", "printf 'top_customer: Ada Park\\nmarch_orders: 4\\n' > answers.txt", [0, 1]),
    ("sql-shop", "rm shop.db", [0, 0]),
    ("csv-report", "printf 'region,total\\nNorth,440\\nEast,245.25\\nSouth,226\\nWest,160\\n' > report.csv", [1, 1, 0]),
    ("csv-report", "printf 'region,sum\\nEast,245.25\\n' > report.csv", [0, 0, 0]),
    ("fix-median", "true", [1, 0, 1]),
    ("fix-median", "echo 'def median(:' > stats.py", [0, 0, 0]),
    ("json-config", 'sed -i \'s/"port": 5000/"port": "8080"/\' config.json', [1, 0, 0]),
    ("json-config", 'echo \'{"debug": false, "port": 8080}\' > config.json', [0, 1, 1]),
    ("word-count", 'echo \'{"lines": 5, "words": 17}\' > counts.json', [1, 0]),
    ("word-count", "echo 'lines=5 words=18' > counts.json", [0, 0]),
]


def play(task_name: str, script: str, root: Path) -> Result:
    runtime = LocalRuntime(root=root)
    prepared = runtime.prepare(load_task(BUNDLED / task_name), "00000000-scripted")
    try:
        subprocess.run(["bash", "-c", script], cwd=prepared.workdir, check=True, timeout=60)
        return runtime.evaluate(prepared, trajectory="[]")
    finally:
        runtime.cleanup(prepared)


@pytest.mark.parametrize("task_name", sorted(GOOD))
def test_a_good_solution_scores_one(task_name: str, tmp_path: Path) -> None:
    result = play(task_name, GOOD[task_name], tmp_path)
    assert all(c.result == c.total for c in result.checkpoints)
    assert score(result.final_score) == 1.0


@pytest.mark.parametrize(("task_name", "script", "passed"), BAD)
def test_a_bad_solution_scores_its_checkpoints(task_name: str, script: str, passed: list[int], tmp_path: Path) -> None:
    result = play(task_name, script, tmp_path)
    assert [c.result for c in result.checkpoints] == passed
    final = result.final_score
    assert final == Checkpoint(len(passed), sum(passed))
    assert score(final) == pytest.approx(0.5 * sum(passed) / len(passed))  # never all-or-nothing here
    assert not list(tmp_path.iterdir())  # the workspace is gone after cleanup


def test_every_bundled_task_has_a_good_solution() -> None:
    names = {t.name for t in load_tasks(BUNDLED, "train")} | {t.name for t in load_tasks(BUNDLED, "test")}
    assert names == set(GOOD)
    assert not {t.name for t in load_tasks(BUNDLED, "train")} & {t.name for t in load_tasks(BUNDLED, "test")}


def test_local_runtime_refuses_tasks_with_services(tmp_path: Path) -> None:
    task_dir = tmp_path / "needs-gitlab"
    task_dir.mkdir()
    (task_dir / "task.md").write_text("Clone the repo.")
    (task_dir / "evaluator.py").write_text("")
    (task_dir / "dependencies.yml").write_text("- gitlab\n")
    with pytest.raises(ValueError, match=r"needs services \['gitlab'\].*runtime=docker"):
        LocalRuntime(root=tmp_path / "ws").prepare(load_task(task_dir), "00000000-x")


def test_a_crashing_evaluator_is_an_error_not_a_score(tmp_path: Path) -> None:
    task_dir = tmp_path / "broken"
    task_dir.mkdir()
    (task_dir / "task.md").write_text("Anything.")
    (task_dir / "evaluator.py").write_text(
        "def grade_checkpoints(trajectory, workspace):\n    raise KeyError('boom')\n"
    )
    runtime = LocalRuntime(root=tmp_path / "ws")
    prepared = runtime.prepare(load_task(task_dir), "00000000-x")
    with pytest.raises(RuntimeError, match=r"(?s)broken evaluator failed with exit code 1: .*KeyError: 'boom'"):
        runtime.evaluate(prepared, "[]")
    runtime.cleanup(prepared)


def test_a_task_without_evaluator_is_ungraded_and_one_without_task_md_is_named(tmp_path: Path) -> None:
    (tmp_path / "open").mkdir()
    (tmp_path / "open" / "task.md").write_text("Write a haiku about the sea into poem.txt.")
    task = load_task(tmp_path / "open")
    assert (task.graded, task.instruction) == (False, "Write a haiku about the sea into poem.txt.")
    assert all(t.graded for t in load_tasks(BUNDLED, "train"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="TAC task empty: missing task.md"):
        load_task(tmp_path / "empty")


def test_the_agents_terminal_is_bash_without_the_hosts_rc_files(tmp_path: Path) -> None:
    """An rc file that sets a variable (as ``pyenv init`` does and more) never reaches the agent's
    shell: the terminal is the subprocess backend on the runtime's own clean bash, on every host."""
    home = tmp_path / "home"
    home.mkdir()
    for rc in (".bashrc", ".bash_profile", ".profile"):
        (home / rc).write_text("export FROM_RC=sourced\n")
    runtime = LocalRuntime(root=tmp_path / "ws")
    prepared = runtime.prepare(load_task(BUNDLED / "hello-file"), "00000000-x")
    try:
        params = prepared.terminal_params
        assert params["terminal_type"] == "subprocess"
        shell = params["shell_path"]
        # OpenHands starts it as `<shell> -i` (interactive: bash would read ~/.bashrc)
        run = subprocess.run(
            [shell, "-i", "-c", 'echo "rc=${FROM_RC:-none}"'],
            env={"HOME": str(home), "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        assert "rc=none" in run.stdout
        plain = subprocess.run(
            ["bash", "-i", "-c", 'echo "rc=${FROM_RC:-none}"'],
            env={"HOME": str(home), "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        assert "rc=sourced" in plain.stdout  # the host's bash would have read it
    finally:
        runtime.cleanup(prepared)
