"""The harness sentinel's own logic (``bench/harnesses_check.py``) and each harness's launch line
(``bench/harnesses.py``), without running a harness: ``tests/integration/test_harnesses.py`` runs the
pinned ones through the same ``launch``, and ``make harnesses-check`` the newest."""

from __future__ import annotations

import tomllib
from pathlib import Path

import orjson
import pytest

from bench._tee import Exchange
from bench.harnesses import BY_NAME, COMMANDS, GEMINI_ASSUMED_WINDOW, SUBMIT, commands_for, launch
from bench.harnesses_check import Row, diff, field_paths, matrix, summarize, tool_names

BASE = "http://127.0.0.1:9/episodes/e1/v1"


def test_field_paths_stop_at_a_tools_argument_schema() -> None:
    body = {
        "model": "policy",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "e"}}]}],
        "tools": [{"name": "Bash", "input_schema": {"properties": {"command": {"type": "string"}}}}],
    }
    assert field_paths(body) == {
        "model",
        "messages",
        "messages[].role",
        "messages[].content",
        "messages[].content[].type",
        "messages[].content[].text",
        "messages[].content[].cache_control",
        "messages[].content[].cache_control.type",
        "tools",
        "tools[].name",
        "tools[].input_schema",
    }


def test_tool_names_in_each_apis_form() -> None:
    assert tool_names({"tools": [{"name": "Bash"}, {"type": "web_search_20250305", "name": "web_search"}]}) == {
        "Bash",
        "web_search",
    }
    assert tool_names({"tools": [{"type": "function", "function": {"name": "bash"}}]}) == {"bash"}
    assert tool_names({"tools": [{"type": "web_search"}]}) == {"<web_search>"}
    assert tool_names({"tools": [{"functionDeclarations": [{"name": "run_shell_command"}, {"name": "ls"}]}]}) == {
        "run_shell_command",
        "ls",
    }


def _post(path: str, body: dict[str, object], status: int = 200) -> Exchange:
    return Exchange(0.0, "POST", path, {}, orjson.dumps(body), status)


def test_summarize_counts_requests_splices_and_unserved_routes() -> None:
    harness = BY_NAME["claude"]
    exchanges = [
        Exchange(0.0, "HEAD", "/episodes/e1", {}, b"", 200),
        _post("/episodes/e1/v1/messages?beta=true", {"model": "policy", "tools": [{"name": "Bash"}]}),
        _post("/episodes/e1/v1/messages", {"model": "policy", "stream": True}),
        _post("/episodes/e1/v1/messages/count_tokens", {"model": "policy"}, 404),
    ]
    calls = [
        {"ordinal": 2, "notes": {"splice": {"from": 1, "changed": True}}},
        {"ordinal": 1, "notes": None},
    ]
    row = summarize(Row("claude", "Claude Code", "pinned", "1"), harness, exchanges, calls)
    assert (row.model_requests, row.statuses, row.recorded) == (2, {"200": 2}, 2)
    assert (row.spliced, row.follow_ups, row.not_spliced) == (1, 1, [])
    assert row.unserved == ["POST /episodes/e1/v1/messages/count_tokens 404"]
    assert row.tools == ["Bash"] and "stream" in row.fields
    row.exit_code, row.task_done = 0, True
    assert not row.ok  # an unserved route fails the row
    row.unserved = []
    assert row.ok
    row.not_spliced, row.follow_ups = [], 2  # a follow-up neither spliced nor recorded with its reason
    assert not row.ok


def test_a_follow_up_not_spliced_counts_with_its_reason() -> None:
    calls = [{"ordinal": 1, "notes": {}}, {"ordinal": 2, "notes": {"splice": {"skipped": "history rewritten"}}}]
    exchanges = [_post("/v1/chat/completions", {"messages": []}), _post("/v1/chat/completions", {"messages": []})]
    row = summarize(Row("opencode", "opencode", "newest", "1"), BY_NAME["opencode"], exchanges, calls)
    row.exit_code, row.task_done = 0, True
    assert (row.follow_ups, row.spliced, row.not_spliced) == (1, 0, ["history rewritten"]) and row.ok


def test_diff_and_matrix_name_what_changed_since_the_pinned_release() -> None:
    pinned = Row("codex", "Codex CLI", "pinned", "0.169.0", fields=["model", "input"], tools=["shell"])
    newest = Row("codex", "Codex CLI", "newest", "0.171.0", fields=["model", "input", "reasoning.context"])
    changed = diff(pinned, newest)
    assert changed == {
        "fields_added": ["reasoning.context"],
        "fields_gone": [],
        "tools_added": [],
        "tools_gone": ["shell"],
    }
    table = matrix([pinned, newest], {"codex": changed})
    assert "| Codex CLI | newest 0.171.0 | NO |" in table and "fields +1/-0, tools +0/-1" in table


def test_each_harness_is_told_the_served_window_where_it_reads_it(tmp_path: Path) -> None:
    window = 32_768
    _, env = launch(BY_NAME["claude"], tmp_path, BASE, "k", tmp_path, "t", window=window)
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "32768" and env["ANTHROPIC_BASE_URL"] == BASE.removesuffix("/v1")
    _, env = launch(BY_NAME["codex"], tmp_path, BASE, "k", tmp_path, "t", window=window)
    codex = tomllib.loads((Path(env["CODEX_HOME"]) / "config.toml").read_text())
    assert (codex["model_context_window"], codex["model_auto_compact_token_limit"]) == (32768, 26214)
    assert codex["model_providers"]["flywheel"]["base_url"] == BASE
    launch(BY_NAME["gemini"], tmp_path, BASE, "k", tmp_path, "t", window=window)
    gemini = orjson.loads((tmp_path / ".gemini" / "settings.json").read_bytes())
    assert gemini["model"]["compressionThreshold"] * GEMINI_ASSUMED_WINDOW == pytest.approx(0.8 * window, rel=1e-4)
    _, env = launch(BY_NAME["opencode"], tmp_path, BASE, "k", tmp_path, "t", window=window)
    opencode = orjson.loads(Path(env["OPENCODE_CONFIG"]).read_bytes())
    assert opencode["provider"]["flywheel"]["models"]["policy"]["limit"]["context"] == window
    assert opencode["provider"]["flywheel"]["options"]["baseURL"] == BASE
    argv, _ = launch(BY_NAME["miniswe"], tmp_path, BASE, "k", tmp_path, "t")
    assert f"model.model_kwargs.api_base={BASE}" in argv and argv[argv.index("-c") + 1] == "mini.yaml"


def test_only_mini_swe_agent_ends_on_a_command() -> None:
    assert commands_for(BY_NAME["miniswe"]) == [*COMMANDS, SUBMIT]
    assert all(commands_for(BY_NAME[name]) == COMMANDS for name in ("claude", "codex", "gemini", "opencode"))
