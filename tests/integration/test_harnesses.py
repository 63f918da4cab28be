"""Claude Code, Codex CLI and Gemini CLI, the real harnesses at their pinned versions, run unchanged through the proxy.

``make setup`` installs them from the npm registry (``deploy/harnesses``: exact versions in its
``package-lock.json``). Each runs non-interactively on one task against an episode of a real
``proxy serve`` whose upstream is the named fake engine in its scripted mode
(``bench/fake_script.py``: a call of the harness's shell tool, then a final answer): their system
prompts and tools (10-17k tokens) do not fit SmolLM2's context; on a GPU deployment they run on
vLLM. A TCP tee between harness and proxy (``bench/_tee.py``) keeps what the harness sent
and received, so each run checks, without trusting the proxy's own account:

- the harness exits 0 and the file its tool call wrote holds what the task asked;
- every model call is stored with status 200, its prompt and sampled ids and log-probs exactly
  what the engine sampled (the engine's answer log), its ``client_request`` the body as sent;
- the answer the harness received (its events, assembled) is the recorded answer.

In ``compat.mode: strict`` each harness is refused with a 400 naming a field it always sends, and
every refusal is on the episode as a refused call.

With splicing on: each harness runs a task of three shell commands in turn (tool results between)
against ``bench/fake_tokens.py``, a scripted test double of vLLM with a real token path (SmolLM2's
tokenizer and the served tool template; vLLM's render, generate and derender routes); Claude Code
also hands it to a sub-agent, and compacts. Every follow-up is spliced (the earlier prompt and
sampled ids, then the new messages' render) or, where the harness rewrote its history, recorded
with why not; the trainer's samples built from the store (one per lineage: main agent, sub-agent,
compaction summary, post-compaction) train each sampled id exactly once and nothing else.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson
import pytest

from bench._procs import FakeUpstreamProcess, TokenEngineProcess
from bench._tee import Exchange, Tee
from bench.fake_tokens import CONTEXT, DELEGATE
from bench.harnesses import BY_NAME, COMMANDS, PINNED_BIN, STEPS_TASK, launch
from contract.client import Episode
from tests.support.services import ProxyProcess, episode_record, grammar_masker, model_dir, new_episode
from trainer.data import DataStats, episode_samples

BIN = PINNED_BIN
TASK = "create hello.txt containing hello"
COMMAND = "printf hello > hello.txt"
CLAUDE_DEFAULT_MODEL = "claude-opus-5-5"
"""The model name Claude Code 2.1.332 asks for without ``--model``: served as the policy by listing
it in ``policy.aliases`` (the token stack's proxy does)."""
TIMEOUT_S = 600
"""A guard against a hung harness (a run takes seconds; this machine may be shared and loaded)."""

if shutil.which("node") is None:  # make setup installs Debian's nodejs where it can; only without it, a skip
    pytest.skip(
        "node is not installed: the agent harnesses cannot run (make setup installs it)", allow_module_level=True
    )


@dataclass
class Stack:
    upstream: FakeUpstreamProcess
    answers: Path
    lenient: ProxyProcess
    strict: ProxyProcess


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    for name in ("claude", "codex", "gemini"):
        assert (BIN / name).exists(), f"{BIN / name} is missing: run make setup (deploy/bootstrap.py harnesses)"
    tmp = tmp_path_factory.mktemp("harnesses")
    answers = tmp / "answers.jsonl"
    upstream = FakeUpstreamProcess.start(script=COMMAND, answer_log=answers)
    proxies = [
        ProxyProcess(
            upstream.url, f"sqlite+aiosqlite:///{tmp / mode}.db", tmp / mode, extra_env={"FLYWHEEL_COMPAT__MODE": mode}
        )
        for mode in ("lenient", "strict")
    ]
    try:
        for proxy in proxies:
            proxy.start()
        yield Stack(upstream, answers, *proxies)
    finally:
        for proxy in proxies:
            proxy.stop()
        upstream.stop()


@dataclass
class TokenStack:
    """The token engine (``bench/fake_tokens.py``) scripting ``COMMANDS``, and a proxy splicing on it."""

    engine: TokenEngineProcess
    answers: Path
    proxy: ProxyProcess


@pytest.fixture(scope="module")
def token_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TokenStack]:
    tmp = tmp_path_factory.mktemp("harnesses-tokens")
    answers = tmp / "answers.jsonl"
    engine = TokenEngineProcess.start(model_dir(), COMMANDS, answers)
    # The default splice.depth (32): at 4, the sub-agent's four calls pushed the main agent's call out
    # of the newest four searched, and its follow-up went the ordinary way ("no earlier call ... continued")
    aliases = {"FLYWHEEL_POLICY__ALIASES": orjson.dumps(["policy", CLAUDE_DEFAULT_MODEL]).decode()}
    proxy = ProxyProcess(engine.url, f"sqlite+aiosqlite:///{tmp / 'tokens'}.db", tmp / "tokens", extra_env=aliases)
    try:
        proxy.start()
        yield TokenStack(engine, answers, proxy)
    finally:
        proxy.stop()
        engine.stop()


def _engine_answers(stack: Stack | TokenStack) -> list[dict[str, Any]]:
    text = stack.answers.read_text() if stack.answers.exists() else ""
    return [orjson.loads(line) for line in text.splitlines()]


@dataclass
class Run:
    episode: dict[str, Any]
    done: subprocess.CompletedProcess[str]
    exchanges: list[Exchange]
    workdir: Path
    engine: list[dict[str, Any]]
    """What the engine sampled during this run."""


def _run(
    stack: Stack | TokenStack,
    proxy: ProxyProcess,
    tmp: Path,
    harness: str,
    task: str = TASK,
    model: str | None = "policy",
    **extra: str,
) -> Run:
    episode = new_episode(proxy, f"harness-{harness}")
    path = urlsplit(episode["base_url"]).path  # /episodes/<id>/v1
    workdir, home = tmp / "work", tmp / "home"
    workdir.mkdir()
    home.mkdir()
    before = len(_engine_answers(stack))
    with Tee(proxy.port) as tee:
        argv, env = launch(
            BY_NAME[harness], BIN, tee.url + path, episode["api_key"], home, task, extra=extra, model=model
        )
        env["PATH"] = os.environ["PATH"]
        done = subprocess.run(
            argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL
        )
        exchanges = tee.exchanges()
    return Run(episode, done, exchanges, workdir, _engine_answers(stack)[before:])


def _events(raw: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line[5:]) for line in raw.split(b"\n") if line.startswith(b"data:") and line[5:].strip()]


def _received_message(raw: bytes) -> dict[str, Any]:
    """A Messages stream as the harness assembled it: id, text, tool calls (name, id, input)."""
    out: dict[str, Any] = {"text": "", "tools": []}
    partial: dict[int, str] = {}
    for event in _events(raw):
        if event["type"] == "message_start":
            out["id"] = event["message"]["id"]
        elif event["type"] == "content_block_start" and event["content_block"]["type"] == "tool_use":
            block = event["content_block"]
            out["tools"].append((block["name"], block["id"], event["index"]))
        elif event["type"] == "content_block_delta":
            delta = event["delta"]
            if delta["type"] == "text_delta":
                out["text"] += delta["text"]
            elif delta["type"] == "input_json_delta":
                partial[event["index"]] = partial.get(event["index"], "") + delta["partial_json"]
    out["tools"] = [(name, ident, orjson.loads(partial.get(i) or "{}")) for name, ident, i in out["tools"]]
    return out


def _received_response(raw: bytes) -> dict[str, Any]:
    """A Responses stream's final ``response.completed``: id, text, function calls (name, id, input)."""
    (final,) = [e["response"] for e in _events(raw) if e["type"] == "response.completed"]
    text = "".join(p["text"] for item in final["output"] if item["type"] == "message" for p in item["content"])
    calls = [item for item in final["output"] if item["type"] == "function_call"]
    return {
        "id": final["id"],
        "text": text,
        "tools": [(c["name"], c["call_id"], orjson.loads(c["arguments"])) for c in calls],
    }


def _received_gemini(raw: bytes) -> dict[str, Any]:
    """A Gemini stream as the harness assembled it: the response id, text, function calls (name, id, args)."""
    out: dict[str, Any] = {"text": "", "tools": []}
    for event in _events(raw):
        out["id"] = event["responseId"]
        for part in event["candidates"][0]["content"]["parts"]:
            if "functionCall" in part:
                call = part["functionCall"]
                out["tools"].append((call["name"], call["id"], call["args"]))
            elif not part.get("thought"):
                out["text"] += part["text"]
    return out


def _recorded(call: dict[str, Any]) -> dict[str, Any]:
    (choice,) = call["choices"]
    calls = choice["tool_calls"] or ()
    tools = [(t["function"]["name"], t["id"], orjson.loads(t["function"]["arguments"])) for t in calls]
    return {"id": call["response_id"], "text": choice["text"], "tools": tools}


def _check_recorded(run: Run, proxy: ProxyProcess, api: str, route: str) -> None:
    seen = [(e.method, e.path, e.status) for e in run.exchanges], run.done.stdout[-1000:], run.done.stderr[-1000:]
    assert run.done.returncode == 0, seen
    assert (run.workdir / "hello.txt").read_text() == "hello"
    posts = [e for e in run.exchanges if e.method == "POST" and urlsplit(e.path).path.endswith(route)]
    calls = episode_record(proxy, run.episode["id"])["calls"]
    assert [c["status_code"] for c in calls] == [e.status for e in posts] == [200] * len(posts), seen
    assert len(calls) == len(run.engine) >= 2  # the tool call, then the final answer
    assert calls[0]["choices"][0]["tool_calls"] and not calls[-1]["choices"][0]["tool_calls"]
    received = {"messages": _received_message, "responses": _received_response, "gemini": _received_gemini}[api]
    for call, post, sampled in zip(calls, posts, run.engine, strict=True):
        assert (call["api"], call["exact_ids"]) == (api, True)
        assert call["prompt_token_ids"] == sampled["prompt_token_ids"]
        assert call["choices"][0]["token_ids"] == sampled["token_ids"]
        assert call["choices"][0]["logprobs"] == sampled["logprobs"]
        assert call["client_request"] == orjson.loads(post.body)
        assert received(post.answer) == _recorded(call)
    probes = [e for e in run.exchanges if e.method in ("HEAD", "GET")]
    assert all(e.status == 200 for e in probes), [(e.method, e.path, e.status) for e in probes]


def _check_refused(run: Run, proxy: ProxyProcess, route: str, field: str) -> None:
    seen = [(e.method, e.path, e.status) for e in run.exchanges], run.done.stdout[-1000:], run.done.stderr[-1000:]
    assert run.done.returncode != 0, seen
    assert field in run.done.stdout + run.done.stderr, seen
    posts = [e for e in run.exchanges if e.method == "POST" and urlsplit(e.path).path.endswith(route)]
    calls = episode_record(proxy, run.episode["id"])["calls"]
    assert posts and [e.status for e in posts] == [c["status_code"] for c in calls] == [400] * len(posts), seen
    assert {(c["error"]["param"], c["notes"]["refused"]) for c in calls} == {(field, "compat_strict")}
    assert run.engine == []  # nothing reached the engine


def test_claude_code_runs_unchanged_and_every_call_is_recorded_exactly(stack: Stack, tmp_path: Path) -> None:
    run = _run(stack, stack.lenient, tmp_path, "claude")
    _check_recorded(run, stack.lenient, "messages", "/v1/messages")
    assert any(e.method == "HEAD" for e in run.exchanges)  # its connectivity probe, answered 200


def test_claude_code_in_strict_mode_is_refused_naming_the_field(stack: Stack, tmp_path: Path) -> None:
    run = _run(stack, stack.strict, tmp_path, "claude")
    _check_refused(run, stack.strict, "/v1/messages", "metadata")


def test_codex_runs_unchanged_and_every_call_is_recorded_exactly(stack: Stack, tmp_path: Path) -> None:
    run = _run(stack, stack.lenient, tmp_path, "codex")
    _check_recorded(run, stack.lenient, "responses", "/v1/responses")


def test_codex_in_strict_mode_is_refused_naming_the_field(stack: Stack, tmp_path: Path) -> None:
    run = _run(stack, stack.strict, tmp_path, "codex")
    _check_refused(run, stack.strict, "/v1/responses", "prompt_cache_key")


def test_gemini_cli_runs_unchanged_and_every_call_is_recorded_exactly(stack: Stack, tmp_path: Path) -> None:
    run = _run(stack, stack.lenient, tmp_path, "gemini")
    _check_recorded(run, stack.lenient, "gemini", ":streamGenerateContent")
    first, second = [orjson.loads(e.body) for e in run.exchanges if e.method == "POST"]
    call = episode_record(stack.lenient, run.episode["id"])["calls"][0]
    sampled = call["choices"][0]["tool_calls"][0]  # the call the engine made, answered by the harness by its id
    (answered,) = [p["functionResponse"] for p in second["contents"][-1]["parts"]]
    assert (answered["name"], answered["id"]) == (sampled["function"]["name"], sampled["id"]), second["contents"]
    assert all(urlsplit(e.path).query == "alt=sse" for e in run.exchanges if e.method == "POST")


def test_gemini_cli_in_strict_mode_is_refused_naming_the_field(stack: Stack, tmp_path: Path) -> None:
    run = _run(stack, stack.strict, tmp_path, "gemini")
    _check_refused(run, stack.strict, ":streamGenerateContent", "generationConfig.thinkingConfig.includeThoughts")


def _lineages(calls: list[dict[str, Any]], not_spliced: str | None) -> list[list[dict[str, Any]]]:
    """The episode's calls by lineage, as the splice chained them (what the trainer's merge makes of
    them): a call without an assistant turn starts one (no ``notes.splice``), and so does a call not
    spliced, whose reason must hold ``not_spliced``; a spliced call joins the lineage of the call it
    continues when that call is the lineage's newest, else (a branch: Claude Code's compaction
    request continues the turn before the newest) starts one that holds the earlier ids as context."""
    out: list[list[dict[str, Any]]] = []
    of: dict[int, list[dict[str, Any]]] = {}
    for call in calls:
        note = (call["notes"] or {}).get("splice")
        if note is not None and "skipped" in note:
            assert not_spliced is not None and not_spliced in note["skipped"], note
        if note is None or "skipped" in note or of[note["from"]][-1]["ordinal"] != note["from"]:
            out.append([])
            line = out[-1]
        else:
            line = of[note["from"]]
        line.append(call)
        of[call["ordinal"]] = line
    return out


def _check_spliced(
    run: Run, proxy: ProxyProcess, api: str, route: str, not_spliced: str | None = None
) -> list[list[dict[str, Any]]]:
    """The task ran, every call is recorded as the engine sampled it, every follow-up was spliced onto
    the call it continues (or not, for the reason ``not_spliced``), and the trainer builds one sample
    per lineage that trains exactly the sampled ids, each once. The lineages, in the order they began."""
    seen = [(e.method, e.path, e.status) for e in run.exchanges], run.done.stdout[-1000:], run.done.stderr[-1000:]
    assert run.done.returncode == 0, seen
    assert (run.workdir / "both.txt").read_text() == "onetwo", seen
    posts = [e for e in run.exchanges if e.method == "POST" and urlsplit(e.path).path.endswith(route)]
    raw = episode_record(proxy, run.episode["id"])
    calls = sorted(raw["calls"], key=lambda c: c["ordinal"])
    assert [c["status_code"] for c in calls] == [e.status for e in posts] == [200] * len(posts), seen
    assert len(calls) == len(run.engine), seen
    made = [orjson.loads(e["tool_call"]["arguments"]) for e in run.engine if e["tool_call"]]
    assert [m.get("command", m.get("cmd")) for m in made if "command" in m or "cmd" in m] == COMMANDS
    received = {"messages": _received_message, "responses": _received_response, "gemini": _received_gemini}[api]
    for call, post, sampled in zip(calls, posts, run.engine, strict=True):
        assert (call["api"], call["exact_ids"]) == (api, True)
        assert call["prompt_token_ids"] == sampled["prompt_token_ids"]
        assert call["choices"][0]["token_ids"] == sampled["token_ids"]
        assert call["choices"][0]["logprobs"] == sampled["logprobs"]
        assert received(post.answer) == _recorded(call)
        # a call not spliced goes vLLM's chat route; a spliced one generates on the spliced ids
        note = (call["notes"] or {}).get("splice") or {"skipped": "nothing sampled before it"}
        assert sampled["route"] == ("chat" if "skipped" in note else "generate"), (call["ordinal"], note)
        if "skipped" in note:
            continue
        before = next(c for c in calls if c["ordinal"] == note["from"])
        # the engine tokenized the call's parts apart: vLLM's render of the history is not what it sampled
        assert note["changed"] is True and note["rendered_tokens"] < note["prompt_tokens"], note
        assert note["shadow"] == {"checked": True, "mismatch": None, "at": None}, note
        earlier = [*before["prompt_token_ids"], *before["choices"][0]["token_ids"]]
        assert call["prompt_token_ids"][: len(earlier)] == earlier
    lineages = _lineages(calls, not_spliced)
    stats = DataStats()
    samples = episode_samples(
        Episode.model_validate(raw), group_id="g", max_seq_len=CONTEXT, stats=stats, masker=grammar_masker()
    )
    assert len(samples) == len(lineages) and stats.breaks == len(lineages) - 1, stats
    for line in lineages:
        last = line[-1]
        (sample,) = [s for s in samples if s.input_ids == [*last["prompt_token_ids"], *last["choices"][0]["token_ids"]]]
        mask = [0] * len(sample.input_ids)
        for call in line:  # each sampled span where its call put it
            start = len(call["prompt_token_ids"])
            ids = call["choices"][0]["token_ids"]
            assert sample.input_ids[start : start + len(ids)] == ids
            mask[start : start + len(ids)] = [1] * len(ids)
        assert sample.loss_mask == mask  # its lineage's sampled ids trained, each once; nothing else
        trained = [lp for lp, m in zip(sample.behaviour_logprobs, mask, strict=True) if m]
        assert trained == pytest.approx([lp for call in line for lp in call["choices"][0]["logprobs"]])
    return lineages


def _tools(line: list[dict[str, Any]]) -> list[str | None]:
    """The tool each call of a lineage called (None: a final answer)."""
    return [(c["choices"][0]["tool_calls"] or [{"function": {"name": None}}])[0]["function"]["name"] for c in line]


def test_claude_code_runs_three_commands_with_every_follow_up_spliced(token_stack: TokenStack, tmp_path: Path) -> None:
    run = _run(token_stack, token_stack.proxy, tmp_path, "claude", STEPS_TASK)
    (main,) = _check_spliced(run, token_stack.proxy, "messages", "/v1/messages")
    assert _tools(main) == ["Bash"] * len(COMMANDS) + [None]


def test_claude_code_under_its_default_model_name_is_served_as_the_policy(
    token_stack: TokenStack, tmp_path: Path
) -> None:
    """Run without ``--model``, Claude Code asks for its own default model and sends ``output_config``
    on the system message inside ``messages`` (as Anthropic accepts it there): with that name in
    ``policy.aliases``, every call is answered, spliced, and served by a policy version (trainable)."""
    run = _run(token_stack, token_stack.proxy, tmp_path, "claude", STEPS_TASK, model=None)
    (main,) = _check_spliced(run, token_stack.proxy, "messages", "/v1/messages")
    asked = [orjson.loads(e.body) for e in run.exchanges if e.method == "POST" and e.status == 200]
    assert {body["model"] for body in asked} == {CLAUDE_DEFAULT_MODEL}, "the pinned release's default name moved"
    assert any("output_config" in m for body in asked for m in body["messages"])  # where it used to be refused
    assert all(c["policy_version"] is not None and c["model_requested"] == CLAUDE_DEFAULT_MODEL for c in main)


def test_claude_code_sub_agent_is_a_lineage_of_its_own(token_stack: TokenStack, tmp_path: Path) -> None:
    """The main agent hands the task to a sub-agent (its ``Agent`` tool), which runs the commands in a
    conversation of its own inside the same episode: two lineages, two samples, each spliced."""
    run = _run(token_stack, token_stack.proxy, tmp_path, "claude", f"{DELEGATE} {STEPS_TASK}")
    main, sub = _check_spliced(run, token_stack.proxy, "messages", "/v1/messages")
    assert _tools(main) == ["Agent", None] and _tools(sub) == ["Bash"] * len(COMMANDS) + [None]
    assert main[0]["ordinal"] < sub[0]["ordinal"] < sub[-1]["ordinal"] < main[-1]["ordinal"]  # it waited


def test_claude_code_compacts_and_the_summary_and_what_follows_are_lineages_of_their_own(
    token_stack: TokenStack, tmp_path: Path
) -> None:
    """Claude Code told the served window (``CLAUDE_CODE_MAX_CONTEXT_TOKENS``) compacts once a prompt
    passes 12 % of it less its output reserve: between the prompt after the first command's output
    (15k tokens) and the prompts after compaction (12.4k). Its summary request continues the first
    call (a branch: the second call continued it too), spliced; the conversation after it starts
    from the summary, its history rewritten, so its first call goes the ordinary way, saying why, and
    begins the post-compaction lineage. Three samples: main, summary, post-compaction; each sampled
    id trained once (the first call's in main only: the summary's sample holds them as context)."""
    window = {"CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(CONTEXT), "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE": "12"}
    run = _run(token_stack, token_stack.proxy, tmp_path, "claude", STEPS_TASK, **window)
    rewritten = "is continued by these messages"
    main, summary, after = _check_spliced(run, token_stack.proxy, "messages", "/v1/messages", rewritten)
    assert _tools(main) == ["Bash", "Bash"] and _tools(summary) == [None] and _tools(after) == ["Bash", None]
    assert summary[0]["choices"][0]["text"] == "<summary>COMPACTED: 1 commands ran.</summary>"
    assert summary[0]["notes"]["splice"]["from"] == main[0]["ordinal"]
    assert rewritten in after[0]["notes"]["splice"]["skipped"]


def test_codex_runs_three_commands_with_every_follow_up_spliced(token_stack: TokenStack, tmp_path: Path) -> None:
    run = _run(token_stack, token_stack.proxy, tmp_path, "codex", STEPS_TASK)
    (main,) = _check_spliced(run, token_stack.proxy, "responses", "/v1/responses")
    assert len(main) == len(COMMANDS) + 1


def test_gemini_cli_runs_three_commands_with_every_follow_up_spliced(token_stack: TokenStack, tmp_path: Path) -> None:
    run = _run(token_stack, token_stack.proxy, tmp_path, "gemini", STEPS_TASK)
    (main,) = _check_spliced(run, token_stack.proxy, "gemini", ":streamGenerateContent")
    assert len(main) == len(COMMANDS) + 1
