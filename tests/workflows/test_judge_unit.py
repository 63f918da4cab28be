"""The judge's pure parts: trimming, episode views, dedupe, prompt, JSON schema, parsing, clipping,
the seeded shuffle, reward composition and the endpoint configuration (no engine, no proxy)."""

from __future__ import annotations

import json
import math
from typing import Any

import jsonschema
import pytest

from contract.client import Episode
from workflows.base import Endpoint
from workflows.judge import JudgeConfig, combine
from workflows.judge.judge import DEFAULT_MODEL, ENV_API_KEY, ENV_BASE_URL, ENV_MODEL, shuffled
from workflows.judge.prompt import (
    REASON_CHARS,
    SCORE_MAX,
    SCORE_MIN,
    SYSTEM_PROMPT,
    MalformedJudgement,
    clip,
    label,
    messages,
    parse,
    response_format,
    schema,
)
from workflows.judge.view import MIN_CHARS, Turn, distinct, fit, trim, view


def episode(calls: list[dict[str, Any]], episode_id: str = "e1") -> Episode:
    return Episode.model_validate({"id": episode_id, "status": "open", "calls": calls})


def call(ordinal: int, messages: list[dict[str, Any]], text: str = "", **choice: Any) -> dict[str, Any]:
    return {
        "ordinal": ordinal,
        "request": {"model": "policy", "messages": messages},
        "choices": [{"index": 0, "text": text, "finish_reason": "stop", **choice}],
    }


# -- trim and views --------------------------------------------------------------------------------


def test_trim_keeps_short_text_and_cuts_long_text_to_head_and_tail() -> None:
    assert trim("short", 10) == "short"
    text = "".join(chr(ord("a") + i % 26) for i in range(1000))
    cut = trim(text, 90)
    assert cut.startswith(text[:60]) and cut.endswith(text[-30:])
    assert "[... 910 chars trimmed ...]" in cut
    assert len(cut) < 90 + 40


def test_view_reads_the_last_successful_call_without_system_messages() -> None:
    conversation = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Add 2 and 3."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"a":2}'}}],
        },
        {"role": "tool", "name": "calc", "content": [{"type": "text", "text": "5"}]},
    ]
    failed = {"ordinal": 2, "status_code": 500, "request": {"messages": conversation + [{"role": "user"}]}}
    ep = episode([call(0, conversation[:2], "thinking"), call(1, conversation, "The answer is 5."), failed])
    turns = view(ep).turns
    assert turns == (
        Turn("user", "Add 2 and 3."),
        Turn("assistant", 'calls calc({"a":2})'),
        Turn("tool calc", "5"),
        Turn("assistant", "The answer is 5."),
    )
    assert view(ep).render().splitlines()[0] == "[user] Add 2 and 3."


def test_view_notes_a_cut_reply_tool_calls_in_the_answer_and_no_calls() -> None:
    answer = call(0, [{"role": "user", "content": "go"}], "partial", finish_reason="length")
    answer["choices"][0]["tool_calls"] = [{"function": {"name": "submit", "arguments": '{"x": 1}'}}]
    (_, last) = view(episode([answer])).turns
    assert last.content == 'partial\ncalls submit({"x": 1})\n(cut off: the reply hit its token limit)'
    assert view(episode([])).turns == (Turn("note", "(the agent made no successful model call)"),)


def test_view_keeps_the_first_turn_and_the_last_ones() -> None:
    conversation = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(20)]
    turns = view(episode([call(0, conversation, "final")]), max_turns=4, max_chars=50).turns
    assert [t.content for t in turns] == ["m0", "[... 17 turns trimmed ...]", "m18", "m19", "final"]


def test_identical_trajectories_share_one_view() -> None:
    same = [{"role": "user", "content": "q"}]
    views = [
        view(episode([call(0, same, "A")], "e1")),
        view(episode([call(0, same, "B")], "e2")),
        view(episode([call(0, same, "A")], "e3")),
    ]
    texts, index = distinct(views)
    assert len(texts) == 2 and index == {"e1": 0, "e2": 1, "e3": 0}


def test_fit_halves_the_content_limit_until_the_group_fits_its_budget() -> None:
    long = [episode([call(0, [{"role": "user", "content": "q"}], str(i) * 5000)], f"e{i}") for i in range(4)]
    assert sum(len(v.render()) for v in fit(long, max_chars=1200, budget=100_000)) > 4 * 1200
    fitted = fit(long, max_chars=1200, budget=2000)
    assert sum(len(v.render()) for v in fitted) <= 2000  # 1200 -> 600 -> 300: ~370 characters each
    assert "[... 4700 chars trimmed ...]" in fitted[0].render()
    floor = fit(long, max_chars=1200, budget=10)  # cannot fit: stops at the floor
    assert f"[... {5000 - MIN_CHARS} chars trimmed ...]" in floor[0].render()


# -- prompt, schema, parsing -----------------------------------------------------------------------


def test_messages_hold_the_task_rubric_and_labelled_trajectories() -> None:
    system, user = messages("Add 2 and 3.", ["[assistant] 5", "[assistant] 6"], rubric="Only the number counts.")
    assert system == {"role": "system", "content": SYSTEM_PROMPT}
    text = user["content"]
    assert text.index("# Task\nAdd 2 and 3.") < text.index("# Rubric\nOnly the number counts.")
    assert text.index("## trajectory_1\n[assistant] 5") < text.index("## trajectory_2\n[assistant] 6")
    assert "# Rubric" not in messages("t", ["x"])[1]["content"]


def test_schema_requires_every_label_and_accepts_only_well_formed_answers() -> None:
    s = schema(3)
    assert s["required"] == ["trajectory_1", "trajectory_2", "trajectory_3"] == list(s["properties"])
    assert s["additionalProperties"] is False
    item = s["properties"]["trajectory_1"]
    assert list(item["properties"]) == ["reason", "score"]  # the reason comes before the score
    good = {label(i): {"reason": "ok", "score": 0.5} for i in range(3)}
    jsonschema.validate(good, s)
    for bad in (
        {label(i): {"reason": "ok", "score": 0.5} for i in range(2)},
        {**good, "trajectory_4": {"reason": "", "score": 0}},
        {**good, "trajectory_1": {"reason": "ok", "score": 2}},
        {**good, "trajectory_1": {"reason": "x" * (REASON_CHARS + 1), "score": 0}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, s)
    fmt = response_format(3)
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["schema"] == s


def test_parse_reads_scores_in_label_order_and_clips() -> None:
    answer = json.dumps(
        {"trajectory_2": {"reason": "wrong", "score": -0.5}, "trajectory_1": {"reason": "right", "score": 1.7}}
    )
    first, second = parse(answer, 2)
    assert (first.score, first.reason, first.clipped) == (SCORE_MAX, "right", True)
    assert (second.score, second.clipped) == (SCORE_MIN, True)
    assert clip(0.25) == (0.25, False)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "empty answer"),
        ('{"trajectory_1": {"reason": "ok", "score": 0.5}', "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"trajectory_2": {"reason": "ok", "score": 0.5}}', "no object for trajectory_1"),
        ('{"trajectory_1": {"reason": "ok", "score": "high"}}', "is not a finite number"),
        ('{"trajectory_1": {"reason": "ok", "score": true}}', "is not a finite number"),
        ('{"trajectory_1": {"reason": "ok", "score": NaN}}', "is not a finite number"),
        ('{"trajectory_1": {"reason": "ok", "score": 1e999}}', "is not a finite number"),
        ('{"trajectory_1": {"reason": "ok", "score": ' + "9" * 400 + "}}", "is not a finite number"),
        ('{"trajectory_1": {"reason": 3, "score": 1}}', "reason 3 is not a string"),
    ],
)
def test_parse_refuses_malformed_answers(content: str, message: str) -> None:
    with pytest.raises(MalformedJudgement, match=message):
        parse(content, 1)


# -- shuffle, composition, configuration -----------------------------------------------------------


def test_shuffle_is_seeded_per_group_and_attempt() -> None:
    first = shuffled(8, seed=0, group_id="g1", attempt=1)
    assert sorted(first) == list(range(8))
    assert first == shuffled(8, seed=0, group_id="g1", attempt=1)
    others = [shuffled(8, seed=0, group_id="g1", attempt=2), shuffled(8, seed=0, group_id="g2", attempt=1)]
    others.append(shuffled(8, seed=1, group_id="g1", attempt=1))
    assert all(o != first for o in others)
    positions = {shuffled(4, seed=0, group_id=f"g{i}", attempt=1).index(0) for i in range(40)}
    assert positions == {0, 1, 2, 3}  # over groups, episode 0 is not always shown first


def test_combine_takes_the_verifier_the_judge_or_their_weighted_mix() -> None:
    assert combine("verifier", verifier=1.0, judge=None, weight=0.5) == 1.0
    assert combine("judge", verifier=None, judge=0.25, weight=0.5) == 0.25
    assert math.isclose(combine("mix", verifier=1.0, judge=0.2, weight=0.25), 0.8)
    assert combine("mix", verifier=None, judge=0.2, weight=1.0) == 0.2
    with pytest.raises(ValueError, match="needs the workflow's verifier reward"):
        combine("mix", verifier=None, judge=0.2, weight=0.5)
    with pytest.raises(ValueError, match="needs a judge score"):
        combine("judge", verifier=1.0, judge=None, weight=0.5)


def test_config_defaults_to_the_passthrough_and_hides_the_key() -> None:
    passthrough = Endpoint("http://proxy:8100/passthrough/v1", "admin-secret")
    cfg = JudgeConfig.from_env(passthrough, {})
    assert (cfg.base_url, cfg.api_key, cfg.model) == (passthrough.base_url, "admin-secret", DEFAULT_MODEL)
    assert "admin-secret" not in repr(cfg)
    env = {ENV_BASE_URL: "https://judge.example/v1/", ENV_API_KEY: "sk-judge", ENV_MODEL: "big-judge"}
    external = JudgeConfig.from_env(passthrough, env, attempts=2)
    assert (external.base_url, external.api_key, external.model, external.attempts) == (
        "https://judge.example/v1",
        "sk-judge",
        "big-judge",
        2,
    )
    with pytest.raises(ValueError, match=f"{ENV_BASE_URL} is set but {ENV_API_KEY} is not"):
        JudgeConfig.from_env(passthrough, {ENV_BASE_URL: "https://judge.example/v1"})
    with pytest.raises(ValueError, match="attempts must be >= 1"):
        JudgeConfig.from_env(passthrough, {}, attempts=0)


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--reward", "vibes"], {}, "reward must be one of verifier, judge, mix"),
        (["--reward", "mix", "--judge-weight", "1.5"], {}, "judge_weight must be in [0, 1]"),
        (["--reward", "judge"], {ENV_BASE_URL: "https://judge.example/v1"}, f"{ENV_API_KEY} is not"),
        (["--reward", "judge", "--judge-rubric", "@/nonexistent/rubric.txt"], {}, "cannot read the rubric file"),
    ],
)
def test_run_refuses_bad_reward_options(args: list[str], env: dict[str, str], message: str) -> None:
    from typer.testing import CliRunner

    from workflows.__main__ import cli

    done = CliRunner().invoke(
        cli,
        ["run", "math", "--proxy", "http://127.0.0.1:9", *args],
        env={"FLYWHEEL_ADMIN_KEY": "k", ENV_BASE_URL: "", ENV_API_KEY: "", **env},
    )
    assert done.exit_code == 2
    assert message in " ".join(done.output.replace("│", " ").split())
