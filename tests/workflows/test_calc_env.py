"""The calc environment without a model: task generation, tool schemas and execution, reward."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from workflows.calc.env import CALCULATOR, SUBMIT, TAPE_LINES, TOOLS, CalcEnv, check_arguments, named
from workflows.calc.reward import call_rewards, score
from workflows.calc.run import CalcOptions, CalcWorkflow
from workflows.calc.tasks import CHAIN, CHAIN_MAX, MIXES, CalcTask, Step, apply, generate
from workflows.registry import load


def calc(a: int, op: str, b: int) -> str:
    return json.dumps({"a": a, "op": op, "b": b})


def submit(answer: int) -> str:
    return json.dumps({"answer": answer})


TWO_STEP = CalcTask(
    id="t", kind="expr2", question="What is (12 + 30) * 4?", steps=(Step(12, "+", 30), Step(42, "*", 4))
)


# -- tasks -----------------------------------------------------------------------------------------


def test_generation_is_deterministic_and_sized() -> None:
    train, test = generate("train"), generate("test")
    assert train == generate("train") and test == generate("test")
    assert (len(train), len(test)) == (2000, 200)
    assert len({t.id for t in train}) == 2000 and len({t.id for t in test}) == 200
    assert generate("train", seed=1) != train
    assert generate("test", size=7) == test[:7]


def test_held_out_tasks_are_never_trained_on_whatever_the_seed() -> None:
    test_ids = {t.id for seed in (0, 1, 2) for t in generate("test", seed=seed)}
    train_ids = {t.id for seed in (0, 1, 2) for t in generate("train", seed=seed)}
    assert not test_ids & train_ids


def test_the_default_mix_follows_its_weights() -> None:
    assert Counter(t.kind for t in generate("test")) == {"mul": 40, "word1": 80, "expr2": 40, "word2": 40}
    assert {t.kind for t in generate("test", mix="two_step", size=10)} == {"expr2", "word2"}
    with pytest.raises(ValueError, match="unknown calc mix 'nope'"):
        generate("train", mix="nope")


def test_reference_solutions_chain_and_reach_the_answer() -> None:
    for task in generate("train", size=400):
        assert len(task.steps) == (2 if task.kind in {"expr2", "word2"} else 1)
        for first, second in zip(task.steps, task.steps[1:], strict=False):
            assert second.a == first.value  # the second step works on the first one's result
        numbers = [
            int(w)
            for w in task.question.replace("?", " ")
            .replace(".", " ")
            .replace(",", " ")
            .replace("(", " ")
            .replace(")", " ")
            .split()
            if w.isdigit()
        ]
        operands = [task.steps[0].a, task.steps[0].b] + [s.b for s in task.steps[1:]]
        assert numbers == operands, task  # every operand is in the question, in order
        assert task.answer == task.steps[-1].value >= 0


def test_chained_tasks_feed_each_result_into_the_next_step() -> None:
    chains = generate("train", size=50, chain=12)
    assert chains == CalcWorkflow(CalcOptions(chain=12, size=50)).tasks("train")
    assert len({t.id for t in chains}) == 50 and {t.kind for t in chains} == {CHAIN}
    assert not {t.id for t in chains} & {t.id for t in generate("test", size=50, chain=12)}
    for task in chains:
        assert len(task.steps) == 12
        for first, second in zip(task.steps, task.steps[1:], strict=False):
            assert second.a == first.value
        assert all(0 <= s.value and (s.op != "*" or s.a * 5 < CHAIN_MAX) for s in task.steps)
        said = task.question.removeprefix(f"Start with {task.steps[0].a}. ").removesuffix(". What is the result?")
        words = {"add": "+", "subtract": "-", "multiply": "*"}
        assert [(words[w.split()[0].lower()], int(w.split()[-1])) for w in said.split(", ")] == [
            (s.op, s.b) for s in task.steps
        ], task.question
    with pytest.raises(ValueError, match="chain must be 0"):
        generate("train", chain=1)
    with pytest.raises(ValueError, match="chain must be 0"):
        CalcOptions(chain=8, mix="two_step")


def test_the_tape_shows_the_last_computations_and_the_next_step() -> None:
    (task,) = generate("train", size=1, chain=TAPE_LINES + 3)
    env, plain = CalcEnv(task, tape=True), CalcEnv(task)
    for k, step in enumerate(task.steps):
        call = calc(step.a, {"+": "add", "-": "subtract", "*": "multiply"}[step.op], step.b)
        reply = env.execute(CALCULATOR, call).result or ""
        assert plain.execute(CALCULATOR, call).result == str(step.value)  # no tape: the bare result
        lines = reply.split("\n")
        assert lines[-2] == f"{k + 1}. {step.a} {step.op} {step.b} = {step.value}"
        assert len(lines) == min(k + 1, TAPE_LINES) + 1 and lines[0].startswith(f"{max(1, k + 2 - TAPE_LINES)}. ")
        if k + 1 < len(task.steps):
            assert (
                lines[-1] == "next: " + task.question.split(", ")[k + 1].removesuffix(". What is the result?").lower()
            )
        else:
            assert lines[-1] == "next: submit the answer"
    assert env.execute(CALCULATOR, '{"a": 1}').result == "error: arguments must be exactly ['a', 'b', 'op'], got ['a']"


def test_word_problems_say_their_operation() -> None:
    ops = {
        t.question.split(" and ")[1].split()[0] if t.steps[0].op != "*" else "boxes": t.steps[0].op
        for t in generate("train", mix="one_step", size=300)
        if t.kind == "word1"
    }
    assert ops == {"gets": "+", "gives": "-", "boxes": "*"}


# -- tools -----------------------------------------------------------------------------------------


def test_tool_schemas_are_strict_and_short() -> None:
    assert [t["function"]["name"] for t in TOOLS] == [CALCULATOR, SUBMIT]
    for tool in TOOLS:
        fn = tool["function"]
        params = fn["parameters"]
        assert fn["strict"] is True and params["additionalProperties"] is False
        assert params["required"] == list(params["properties"]) and len(params["properties"]) <= 3
    assert TOOLS[0]["function"]["parameters"]["properties"]["op"]["enum"] == ["add", "subtract", "multiply"]
    assert named(SUBMIT) == {"type": "function", "function": {"name": "submit_answer"}}


@pytest.mark.parametrize(
    ("tool", "arguments", "error"),
    [
        (CALCULATOR, '{"a": 1, "op": "add"}', "arguments must be exactly ['a', 'b', 'op']"),
        (CALCULATOR, '{"a": 1, "op": "add", "b": 2, "c": 3}', "arguments must be exactly"),
        (CALCULATOR, '{"a": 1.5, "op": "add", "b": 2}', "a must be an integer"),
        (CALCULATOR, '{"a": true, "op": "add", "b": 2}', "a must be an integer"),
        (CALCULATOR, '{"a": 1, "op": "+", "b": 2}', "op must be one of ['add', 'subtract', 'multiply']"),
        (CALCULATOR, '{"a": 1, "op": 2, "b": 2}', "op must be a string"),
        (CALCULATOR, '{"a": 10000000000000, "op": "add", "b": 2}', "a is too large"),
        (CALCULATOR, "[1, 2]", "not a JSON object"),
        (CALCULATOR, '{"a": 1,', "not JSON"),
        (SUBMIT, '{"answer": "12"}', "answer must be an integer"),
        ("weather", "{}", "unknown tool 'weather'"),
    ],
)
def test_arguments_are_checked_against_the_schema(tool: str, arguments: str, error: str) -> None:
    args, why = check_arguments(tool, arguments)
    assert args is None and why is not None and error in why


def test_the_calculator_computes_and_marks_reference_steps_useful() -> None:
    env = CalcEnv(TWO_STEP)
    first = env.execute(CALCULATOR, calc(30, "add", 12))  # + commutes: still the reference step
    assert (first.valid, first.result, first.useful) == (True, "42", True)
    second = env.execute(CALCULATOR, calc(42, "add", 4))
    assert (second.valid, second.result, second.useful) == (True, "46", False)
    third = env.execute(CALCULATOR, calc(4, "multiply", 42))
    assert (third.result, third.useful) == ("168", True)
    assert env.execute(CALCULATOR, calc(30, "subtract", 12)).useful is False  # - does not commute
    assert not env.submitted


def test_an_invalid_call_answers_with_the_error_and_changes_nothing() -> None:
    env = CalcEnv(TWO_STEP)
    call = env.execute(SUBMIT, '{"answer": 168, "note": "sure"}')
    assert not call.valid and call.result is not None and call.result.startswith("error: arguments must be exactly")
    assert not env.submitted
    several = env.execute(SUBMIT, submit(168), extra_calls=1)
    assert not several.valid and not env.submitted and several.error == "one tool call per turn, got 2"


# -- reward ----------------------------------------------------------------------------------------


def test_reward_is_task_success_only_and_validity_is_reported_apart() -> None:
    solved = CalcEnv(TWO_STEP)
    solved.execute(CALCULATOR, calc(12, "add", 30))
    solved.execute(CALCULATOR, calc(42, "multiply", 4))
    solved.execute(SUBMIT, submit(168))
    result = score(solved)
    assert (result.reward, result.success, result.all_valid, result.useful_calls) == (1.0, True, True, 3)

    well_formed_but_wrong = CalcEnv(TWO_STEP)
    well_formed_but_wrong.execute(CALCULATOR, calc(12, "add", 30))
    well_formed_but_wrong.execute(CALCULATOR, calc(42, "add", 30))
    well_formed_but_wrong.execute(SUBMIT, submit(72))
    result = score(well_formed_but_wrong)
    assert (result.reward, result.all_valid, result.valid_calls, result.useful_calls) == (0.0, True, 3, 1)

    lucky_but_malformed = CalcEnv(TWO_STEP)
    lucky_but_malformed.execute(CALCULATOR, '{"x": 1}')
    lucky_but_malformed.no_call("no tool call (finish_reason length)")
    lucky_but_malformed.execute(SUBMIT, submit(168))
    result = score(lucky_but_malformed)
    assert (result.reward, result.all_valid, result.valid_calls, result.calls) == (1.0, False, 1, 3)

    silent = CalcEnv(TWO_STEP)
    silent.no_call("no tool call (finish_reason length)")
    assert (score(silent).reward, score(silent).answer, score(silent).all_valid) == (0.0, None, False)


def test_call_rewards_go_to_useful_calls_by_ordinal() -> None:
    env = CalcEnv(TWO_STEP)
    env.execute(CALCULATOR, calc(12, "add", 30))
    env.execute(CALCULATOR, calc(42, "add", 30))
    env.execute(SUBMIT, submit(168))
    assert call_rewards(env, 0.1) == {0: 0.1, 2: 0.1}
    assert call_rewards(env, 0.0) is None


def test_apply_and_options() -> None:
    assert (apply(7, "+", 5), apply(7, "-", 5), apply(7, "*", 5)) == (12, 2, 35)
    with pytest.raises(ValueError, match="unknown operation"):
        apply(1, "/", 2)
    with pytest.raises(ValueError, match="mix must be one of"):
        CalcOptions(mix="nope")
    with pytest.raises(ValueError, match="top_p must be in"):
        CalcOptions(top_p=0.0)
    assert set(MIXES) == {"default", "one_step", "two_step"}


def test_registered_as_an_agent_workflow() -> None:
    cls = load("calc")
    assert cls.name == "calc" and cls.abandoned == "penalize"
