"""The ``val`` split: a fixed share of each workflow's train tasks, held out of training for probes."""

from __future__ import annotations

import pytest
import typer

from workflows.__main__ import check_split
from workflows.base import VAL_EVERY, VAL_MIN_TRAIN, Workflow, in_val
from workflows.calc.run import CalcOptions, CalcWorkflow
from workflows.math.run import MathOptions, MathWorkflow


@pytest.mark.parametrize("workflow", [MathWorkflow(MathOptions()), CalcWorkflow(CalcOptions())], ids=["math", "calc"])
def test_val_is_held_out_of_train_and_the_same_everywhere(workflow: Workflow[object, object]) -> None:
    train, val, test = (workflow.split_tasks(s) for s in ("train", "val", "test"))  # type: ignore[arg-type]
    ids = {s: [workflow.task_id(t) for t in tasks] for s, tasks in (("train", train), ("val", val), ("test", test))}
    assert not set(ids["train"]) & set(ids["val"])  # never trained on
    assert sorted(ids["train"] + ids["val"]) == sorted(workflow.task_id(t) for t in workflow.tasks("train"))
    assert ids["test"] == [workflow.task_id(t) for t in workflow.tasks("test")]  # the final evaluation is untouched
    assert 0.5 / VAL_EVERY < len(val) / (len(train) + len(val)) < 2.0 / VAL_EVERY
    assert all(in_val(i) for i in ids["val"]) and len(val) >= 40  # enough for a probe of 40 tasks


def test_a_small_train_split_holds_nothing_out() -> None:
    workflow = MathWorkflow(MathOptions(size=VAL_MIN_TRAIN - 1))
    assert len(workflow.split_tasks("train")) == VAL_MIN_TRAIN - 1 and workflow.split_tasks("val") == []
    assert any(in_val(workflow.task_id(t)) for t in workflow.split_tasks("train"))  # a share would have gone


def test_the_command_line_takes_the_three_splits() -> None:
    assert [check_split(s) for s in ("train", "val", "test")] == ["train", "val", "test"]
    with pytest.raises(typer.BadParameter, match="split must be train, val or test, got 'dev'"):
        check_split("dev")
