"""What the splice adds to a follow-up call's latency, at 1k to 7k tokens of context (real vLLM).

The splice (``proxy/splice.py``) serves an episode's follow-up call from the ids vLLM sampled for the
earlier one: it renders the request through vLLM's token API, splices, generates from token ids and
derenders the answer, where the ordinary route is one ``/v1/chat/completions``. This measures that
difference end to end on one real vLLM with two real proxies in front of it (``python -m proxy
serve``, SQLite): one with ``splice.enabled`` on, one with it off.

An episode here is an agent's two calls. The first: a long system message of plain text (about
``--lengths`` tokens of prompt, counted by the engine's ``/tokenize``; each episode's text opens
with its own id, so no episode reuses another's prefix cache), a question, the (strict) calculator
tool named in ``tool_choice``; up to 64 tokens at temperature 1. The follow-up: the same messages,
the assistant message as returned, a tool result; 16 tokens at temperature 1 with ``ignore_eos``
(both variants generate the same number of tokens). A first call whose sampled ids the engine's
render of the follow-up already holds is drawn again (a new episode, on both proxies alike): there
the splice has nothing to change and the splice-on proxy takes the ordinary route. Each splice-on
follow-up must be recorded as spliced (``notes.splice.changed``), each splice-off one not; the
bench fails otherwise. Only the follow-up is timed, client side: to the whole answer, and streamed
(``stream: true``) to its last byte. Per length and mode each rep makes one episode on each proxy,
first calls untimed, then both follow-ups in alternating order; the figures are medians over
``--reps``. One untimed warm-up pair first: the splice-on proxy learns the template's end-of-turn
ids once per replica, which is no per-call cost.

What the figure holds besides the splice's own work (its renders, the token generate, the
derender; per streamed chunk, a derender call): the engine's side of both routes. The spliced
prompt extends the ids the first call left in vLLM's prefix cache; the splice-off prompt differs
from them from the re-rendered assistant turn on.

Reported per length: the follow-up's median ms with the splice off and on, the added ms, and the
added time as a share of the splice-off call's own time; the goal is under 10 % at 7k tokens.

Run from the repo root (the engine takes about 90 s to start; ``FLYWHEEL_BENCH_VLLM_URL`` reuses a
running one, started with ``--enable-scale-out`` and ``--max-model-len`` 8192 as
``deploy.vllm.VLLMServer`` starts it)::

    python -m bench.splice_cost                            # 1k, 2k, 4k, 7k tokens, 5 reps
    python -m bench.splice_cost --lengths 1024,7168 --reps 2

Prints a table, PASS/MISS against the goal, and as the LAST line one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from bench._procs import ProxyUnderTest, exit_on_sigterm, free_port, load_average

GOAL_PCT = 10.0
"""The splice may add at most this share of the splice-off call's time, at the longest context."""
FIRST_TOKENS = 64
"""A named call under vLLM 0.32's grammar: ``<tool_call>`` tags around the arguments, about 50 tokens."""
DRAWS = 8
FOLLOW_TOKENS = 16
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Compute a op b.",
        "strict": True,
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["a", "op", "b"],
            "properties": {
                "a": {"type": "integer"},
                "op": {"type": "string", "enum": ["add", "multiply"]},
                "b": {"type": "integer"},
            },
        },
    },
}
"""Strict: vLLM 0.32 holds the named call's arguments to the schema (unstrict, the model rambles)."""
QUESTION = {"role": "user", "content": "What is 37 * 48? Use the calculator."}
NAMED = {"type": "function", "function": {"name": "calculator"}}


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def filler(lines: int, tag: str) -> str:
    """Plain text of ``lines`` sentences, opened by ``tag`` (the episode's own: no shared prefix cache)."""
    body = " ".join(
        f"Entry {k}: the ledger for account {k * 37 % 1009} was reconciled on day {k % 28 + 1} "
        f"with a balance of {k * 7919 % 100003} credits."
        for k in range(lines)
    )
    return f"Session {tag}. You keep the accounts below and answer questions about them.\n{body}"


class Prompts:
    """First-call messages of about a given number of prompt tokens, as the engine counts them."""

    def __init__(self, vllm_url: str) -> None:
        self.vllm_url = vllm_url
        self.lines: dict[int, int] = {}

    def render(self, messages: list[dict[str, Any]]) -> list[int]:
        """The engine's render of ``messages`` (what the ordinary route sends it as)."""
        response = httpx.post(
            f"{self.vllm_url}/tokenize",
            json={"model": "policy-base", "messages": messages, "tools": [CALCULATOR], "add_generation_prompt": True},
            timeout=120,
        )
        response.raise_for_status()
        return list(response.json()["tokens"])

    def count(self, messages: list[dict[str, Any]]) -> int:
        return len(self.render(messages))

    def _messages(self, lines: int, tag: str) -> list[dict[str, Any]]:
        return [{"role": "system", "content": filler(lines, tag)}, QUESTION]

    def calibrate(self, target: int) -> int:
        """The number of filler lines whose prompt is closest to ``target`` tokens."""
        if target not in self.lines:
            tag = uuid.uuid4().hex
            base, probe = self.count(self._messages(0, tag)), 100
            per_line = (self.count(self._messages(probe, tag)) - base) / probe
            lines = max(0, round((target - base) / per_line))
            while lines > 0 and self.count(self._messages(lines, tag)) > target:
                lines -= 1
            self.lines[target] = lines
        return self.lines[target]

    def first(self, target: int) -> list[dict[str, Any]]:
        return self._messages(self.calibrate(target), uuid.uuid4().hex)


class Variant:
    """One proxy (splice on or off) and the calls an episode makes through it."""

    def __init__(self, name: str, proxy: ProxyUnderTest) -> None:
        self.name = name
        self.proxy = proxy
        self.admin = {"authorization": f"Bearer {proxy.admin_key}"}
        self.client = httpx.Client(timeout=600)

    def episode(self) -> dict[str, Any]:
        response = self.client.post(f"{self.proxy.url}/episodes", json={"task_id": "splice-cost"}, headers=self.admin)
        if response.status_code != 201:
            raise RuntimeError(f"POST /episodes answered {response.status_code}: {response.text}")
        return dict(response.json())

    def start(self, prompts: Prompts, target: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """A new episode and its follow-up's messages, after its first call (untimed). Drawn again
        (a new episode) while the engine's render of the follow-up holds the sampled ids as they
        are: the splice has nothing to change there, and the splice-on proxy takes the ordinary
        route. Both variants draw alike, so their follow-ups have the same shape."""
        for _ in range(DRAWS):
            episode = self.episode()
            messages = prompts.first(target)
            answer = self._post(
                episode,
                {
                    "model": "policy",
                    "messages": messages,
                    "tools": [CALCULATOR],
                    "tool_choice": NAMED,
                    "temperature": 1.0,
                    "max_tokens": FIRST_TOKENS,
                },
            )
            message = answer["choices"][0]["message"]
            calls = message.get("tool_calls") or []
            if not calls:
                raise RuntimeError(f"{self.name}: the named tool call came back without a tool call: {message}")
            turn = {"role": "assistant", "content": message.get("content"), "tool_calls": calls}
            follow = [*messages, turn, {"role": "tool", "tool_call_id": calls[0]["id"], "content": "1776"}]
            (first,) = self.calls(episode["id"])
            sampled = first["prompt_token_ids"] + first["choices"][0]["token_ids"]
            if prompts.render(follow)[: len(sampled)] != sampled:
                return episode, follow
        raise RuntimeError(f"{self.name}: {DRAWS} first calls all re-rendered as sampled: nothing to splice")

    def follow_up(self, episode: dict[str, Any], messages: list[dict[str, Any]], *, stream: bool) -> float:
        """The timed follow-up: ms to the whole answer (streamed: to its last byte)."""
        body = {
            "model": "policy",
            "messages": messages,
            "tools": [CALCULATOR],
            "temperature": 1.0,
            "max_tokens": FOLLOW_TOKENS,
            "ignore_eos": True,
            "stream": stream,
        }
        url, headers = f"{episode['base_url']}/chat/completions", {"authorization": f"Bearer {episode['api_key']}"}
        started = time.perf_counter()
        if stream:
            with self.client.stream("POST", url, json=body, headers=headers) as response:
                tail = b""
                for chunk in response.iter_bytes():
                    tail = (tail + chunk)[-256:]
                elapsed = time.perf_counter() - started
            if response.status_code != 200 or b"data: [DONE]" not in tail:
                raise RuntimeError(f"{self.name}: streamed follow-up ended badly ({response.status_code}): {tail!r}")
        else:
            response = self.client.post(url, json=body, headers=headers)
            elapsed = time.perf_counter() - started
            if response.status_code != 200:
                raise RuntimeError(f"{self.name}: follow-up answered {response.status_code}: {response.text[:500]}")
        return elapsed * 1000

    def _post(self, episode: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        response = self.client.post(
            f"{episode['base_url']}/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {episode['api_key']}"},
        )
        if response.status_code != 200:
            raise RuntimeError(f"{self.name}: first call answered {response.status_code}: {response.text[:500]}")
        return dict(response.json())

    def calls(self, episode_id: str) -> list[dict[str, Any]]:
        """The episode's stored calls, in order."""
        response = self.client.get(f"{self.proxy.url}/episodes/{episode_id}", headers=self.admin)
        response.raise_for_status()
        return sorted(response.json()["calls"], key=lambda c: c["ordinal"])

    def recorded(self, episode_id: str) -> dict[str, Any]:
        """The follow-up's stored record, checked: spliced on the splice-on proxy, not on the other."""
        calls = self.calls(episode_id)
        if len(calls) != 2 or calls[1]["status_code"] != 200:
            raise RuntimeError(f"{self.name}: episode {episode_id} recorded {[c['status_code'] for c in calls]}")
        second = calls[1]
        note = (second.get("notes") or {}).get("splice")
        if self.name == "on" and not (isinstance(note, dict) and note.get("changed") is True):
            raise RuntimeError(f"splice on, but the follow-up of episode {episode_id} was not spliced: {note}")
        if self.name == "off" and note is not None:
            raise RuntimeError(f"splice off, yet the follow-up of episode {episode_id} notes a splice: {note}")
        if len(second["choices"][0]["token_ids"]) != FOLLOW_TOKENS:
            raise RuntimeError(f"{self.name}: follow-up sampled {len(second['choices'][0]['token_ids'])} tokens")
        return dict(second)


def measure(variants: dict[str, Variant], prompts: Prompts, target: int, *, stream: bool, reps: int) -> dict[str, Any]:
    """Median follow-up ms per variant at about ``target`` prompt tokens."""
    times: dict[str, list[float]] = {"off": [], "on": []}
    tokens = []
    for rep in range(reps):
        episodes, follows = {}, {}
        for name, variant in variants.items():
            episodes[name], follows[name] = variant.start(prompts, target)
        for name in ("on", "off") if rep % 2 == 0 else ("off", "on"):
            times[name].append(variants[name].follow_up(episodes[name], follows[name], stream=stream))
        for name, variant in variants.items():
            record = variant.recorded(episodes[name]["id"])
            if name == "on":
                tokens.append(len(record["prompt_token_ids"]))
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    return {
        "target_tokens": target,
        "follow_up_prompt_tokens": round(statistics.median(tokens)),
        "stream": stream,
        "off_ms": round(off, 1),
        "on_ms": round(on, 1),
        "added_ms": round(on - off, 1),
        "added_pct": round((on - off) / off * 100, 1),
        "off_runs_ms": [round(t, 1) for t in times["off"]],
        "on_runs_ms": [round(t, 1) for t in times["on"]],
    }


@contextmanager
def engine(workdir: Path) -> Iterator[str]:
    """vLLM's URL: ``FLYWHEEL_BENCH_VLLM_URL``'s engine, else one started here (``deploy.vllm``)."""
    if os.environ.get("FLYWHEEL_BENCH_VLLM_URL"):
        yield os.environ["FLYWHEEL_BENCH_VLLM_URL"].rstrip("/")
        return
    from deploy.model import fetch
    from deploy.vllm import VLLMServer

    model = os.environ.get("FLYWHEEL_MODEL_DIR") or str(fetch())
    server = VLLMServer(model=model, port=free_port(), log_path=workdir / "vllm.log", cpu_kv_cache_gib=2)
    log("starting vLLM (about 90 s)")
    server.start()
    try:
        server.wait_healthy(timeout=900)
        yield server.url
    finally:
        server.stop()


@contextmanager
def proxies(vllm_url: str, workdir: Path) -> Iterator[dict[str, Variant]]:
    """Two proxies on the engine, each with its own store: splice on and splice off."""
    started: dict[str, Variant] = {}
    upstreams = f'[{{"name": "vllm-0", "url": "{vllm_url}"}}]'
    try:
        for name, enabled in (("on", "true"), ("off", "false")):
            (workdir / name).mkdir()
            proxy = ProxyUnderTest.start(
                vllm_url,
                workdir / name,
                extra_env={"FLYWHEEL_UPSTREAMS": upstreams, "FLYWHEEL_SPLICE__ENABLED": enabled},
            )
            started[name] = Variant(name, proxy)
        yield started
    finally:
        for variant in started.values():
            variant.client.close()
            variant.proxy.stop()


def report(rows: list[dict[str, Any]], printer: Callable[[str], None] = print) -> None:
    printer(f"{'tokens':>7} {'mode':<9} {'off ms':>8} {'on ms':>8} {'added ms':>9} {'added %':>8}")
    for r in rows:
        mode = "streamed" if r["stream"] else "plain"
        printer(
            f"{r['follow_up_prompt_tokens']:>7} {mode:<9} {r['off_ms']:>8.1f} {r['on_ms']:>8.1f} "
            f"{r['added_ms']:>9.1f} {r['added_pct']:>7.1f}%"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="1024,2048,4096,7168", help="first-call prompt tokens, comma-separated")
    parser.add_argument("--reps", type=int, default=5, help="episodes per variant, length and mode (median)")
    parser.add_argument("--modes", default="plain,streamed", help="plain, streamed or both")
    opts = parser.parse_args()
    exit_on_sigterm()  # SIGTERM runs the finally blocks that stop vLLM and the proxies
    lengths = [int(x) for x in opts.lengths.split(",")]
    modes = [m.strip() == "streamed" for m in opts.modes.split(",")]
    print(f"load average before: {load_average()} (2 cores, shared with other work)", flush=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-splice-") as tmp, engine(Path(tmp)) as vllm_url:
        with proxies(vllm_url, Path(tmp)) as variants:
            prompts = Prompts(vllm_url)
            log("warm-up: one untimed episode per proxy")
            measure(variants, prompts, min(lengths), stream=False, reps=1)
            for target in lengths:
                for stream in modes:
                    log(f"~{target} tokens, {'streamed' if stream else 'plain'}: {opts.reps} reps")
                    rows.append(measure(variants, prompts, target, stream=stream, reps=opts.reps))
                    report(rows[-1:], log)
    print(f"load average after: {load_average()}")
    report(rows)
    longest = max(lengths)
    verdicts = {}
    for r in rows:
        if r["target_tokens"] == longest:
            mode = "streamed" if r["stream"] else "plain"
            verdicts[mode] = "PASS" if r["added_pct"] < GOAL_PCT else "MISS"
            print(
                f"goal: splice adds < {GOAL_PCT:.0f}% at {longest} tokens ({mode}): {r['added_pct']}% {verdicts[mode]}"
            )
    summary = {"reps": opts.reps, "goal_pct": GOAL_PCT, "rows": rows, "verdicts": verdicts, "load": load_average()}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
