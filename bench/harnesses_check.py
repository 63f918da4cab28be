"""The harness sentinel (``make harnesses-check``): today's newest releases of the agent harnesses
against the scripted engine, one compatibility matrix and the request fields that changed.

Agent harnesses ship weekly, and each release may send a field, a tool form or a route the proxy has
not seen: peers' users met exactly this (a re-templating that multiplied samples, a "validated" run
that never called a tool). This installs the newest release of each harness (npm: Claude Code,
Codex CLI, Gemini CLI, opencode; PyPI: mini-swe-agent) beside the pinned ones ``make setup``
installed, and runs each, pinned and newest, unchanged, on the same three-command task through a
real proxy (splicing on, as on a GPU deployment) in front of ``bench/fake_tokens.py``, the scripted
test double of vLLM with SmolLM2's real token path. A TCP tee (``bench/_tee.py``) keeps what the
harness sent, so nothing rests on the proxy's own account. Per run it reports:

- the exit code and whether the task's file holds what it should;
- model requests and their statuses, calls recorded, follow-ups spliced or not (with the reason);
- requests on routes the proxy does not serve (404/405, also counted by the proxy in
  ``flywheel_unserved_routes``);
- the request fields (JSON paths of the bodies, tool schemas cut at the schema) and tool names,
  and for a newest release the fields and tools added or gone since the pinned one.

Run: ``python -m bench.harnesses_check [--only claude codex ...] [--pinned-only] [--out DIR]``.
Needs the npm registry and PyPI (a newest release is installed under ``$FLYWHEEL_CACHE``, keyed by
its version); ``--pinned-only`` runs offline. Exits 1 when a run fails its task, a request is
refused or unserved, or a follow-up is neither spliced nor recorded with its reason.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson

from bench._procs import ProxyUnderTest, TokenEngineProcess, _stop
from bench._tee import Exchange, Tee
from bench.fake_tokens import CONTEXT
from bench.harnesses import AGENTS_BIN, HARNESSES, PINNED_BIN, ROOT, STEPS_TASK, Harness, commands_for, launch

CACHE = Path(os.environ.get("FLYWHEEL_CACHE", Path.home() / ".cache" / "flywheel")) / "harnesses-newest"
SCHEMA_KEYS = frozenset({"properties", "input_schema", "parameters", "parametersJsonSchema", "schema", "$defs"})
"""Where a field path stops: below these is a tool's own argument schema, not the API's fields."""
TIMEOUT_S = 600


@dataclass
class Row:
    harness: str
    title: str
    label: str
    """``pinned`` or ``newest`` (``newest = pinned`` when they are the same release)."""
    version: str
    exit_code: int | None = None
    task_done: bool = False
    model_requests: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    recorded: int = 0
    spliced: int = 0
    follow_ups: int = 0
    not_spliced: list[str] = field(default_factory=list)
    unserved: list[str] = field(default_factory=list)
    unserved_counted: int = 0
    fields: list[str] = field(default_factory=list)
    tools: list[str] = field(default_factory=list)
    error: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        refused = any(status != "200" for status in self.statuses)
        return (
            not self.error
            and self.exit_code == 0
            and self.task_done
            and not refused
            and not self.unserved
            and self.recorded == self.model_requests > 0
            and self.spliced + len(self.not_spliced) == self.follow_ups
        )


def field_paths(value: Any, prefix: str = "") -> set[str]:
    """The JSON paths of ``value`` (``a.b``, list items as ``[]``), not below a tool's argument schema."""
    out: set[str] = set()
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            out.add(path)
            if key not in SCHEMA_KEYS:
                out |= field_paths(item, path)
    elif isinstance(value, list):
        for item in value:
            out |= field_paths(item, f"{prefix}[]")
    return out


def tool_names(body: dict[str, Any]) -> set[str]:
    """The names of the tools a request offers, in any of the four APIs' forms."""
    names: set[str] = set()
    for tool in body.get("tools") or ():
        if not isinstance(tool, dict):
            continue
        for declared in tool.get("functionDeclarations") or ():  # Gemini
            names.add(str(declared.get("name")))
        name = tool.get("name") or (tool.get("function") or {}).get("name")  # Messages/Responses, chat
        if name:
            names.add(str(name))
        elif "functionDeclarations" not in tool and tool.get("type"):
            names.add(f"<{tool['type']}>")  # a hosted or typed tool without a name
    return names


def summarize(row: Row, harness: Harness, exchanges: list[Exchange], calls: list[dict[str, Any]]) -> Row:
    """Fill ``row`` from what crossed the tee and what the proxy recorded."""
    posts = [e for e in exchanges if e.method == "POST" and urlsplit(e.path).path.endswith(harness.route)]
    row.model_requests = len(posts)
    row.statuses = dict(Counter(str(e.status) for e in posts))
    fields: set[str] = set()
    tools: set[str] = set()
    for post in posts:
        try:
            body = orjson.loads(post.body)
        except orjson.JSONDecodeError:
            continue
        if isinstance(body, dict):
            fields |= field_paths(body)
            tools |= tool_names(body)
    row.fields, row.tools = sorted(fields), sorted(tools)
    row.unserved = [f"{e.method} {urlsplit(e.path).path} {e.status}" for e in exchanges if e.status in (404, 405)]
    row.recorded = len(calls)
    for call in sorted(calls, key=lambda c: c["ordinal"]):
        note = (call.get("notes") or {}).get("splice")
        if note is None:
            continue  # nothing sampled before it in its conversation: a first call
        row.follow_ups += 1
        if "skipped" in note:
            row.not_spliced.append(str(note["skipped"])[:160])
        else:
            row.spliced += 1
    return row


def diff(pinned: Row, newest: Row) -> dict[str, list[str]]:
    return {
        "fields_added": sorted(set(newest.fields) - set(pinned.fields)),
        "fields_gone": sorted(set(pinned.fields) - set(newest.fields)),
        "tools_added": sorted(set(newest.tools) - set(pinned.tools)),
        "tools_gone": sorted(set(pinned.tools) - set(newest.tools)),
    }


# --- versions and installs -------------------------------------------------------------------------


def pinned_version(harness: Harness) -> str | None:
    if harness.registry == "npm":
        lock = orjson.loads((ROOT / "deploy" / "harnesses" / "package-lock.json").read_bytes())
        entry = lock.get("packages", {}).get(f"node_modules/{harness.package}")
        return None if entry is None else str(entry["version"])
    python = AGENTS_BIN / "python"
    if not python.exists():
        return None
    done = subprocess.run(
        [str(python), "-c", f"import importlib.metadata as m; print(m.version({harness.package!r}))"],
        capture_output=True,
        text=True,
    )
    return done.stdout.strip() if done.returncode == 0 else None


def newest_version(harness: Harness) -> str:
    if harness.registry == "npm":
        done = subprocess.run(["npm", "view", harness.package, "version"], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"npm view {harness.package}: {done.stderr.strip()[-300:]}")
        return done.stdout.strip().splitlines()[-1]
    answer = httpx.get(f"https://pypi.org/pypi/{harness.package}/json", timeout=60)
    answer.raise_for_status()
    return str(answer.json()["info"]["version"])


def install(harness: Harness, version: str) -> Path:
    """The newest release's binaries' directory, installed once per version under ``CACHE``."""
    where = CACHE / f"{harness.name}-{version}"
    bin_dir = where / ("node_modules/.bin" if harness.registry == "npm" else "bin")
    if (bin_dir / harness.binary).exists():
        return bin_dir
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    if harness.registry == "npm":
        argv = ["npm", "install", "--prefix", str(where), "--no-audit", "--no-fund", f"{harness.package}@{version}"]
    else:  # a venv of the agents venv's Python (3.12), then the release
        subprocess.run([str(AGENTS_BIN / "python"), "-m", "venv", str(where)], check=True, capture_output=True)
        argv = [str(where / "bin" / "python"), "-m", "pip", "install", "-q", f"{harness.package}=={version}"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if done.returncode != 0 or not (bin_dir / harness.binary).exists():
        raise RuntimeError(f"installing {harness.package}@{version} failed: {(done.stderr or done.stdout)[-500:]}")
    return bin_dir


# --- one run -------------------------------------------------------------------------------------


def _tiny_model_dir() -> str:
    if os.environ.get("FLYWHEEL_TINY_MODEL_DIR"):
        return os.environ["FLYWHEEL_TINY_MODEL_DIR"]
    from deploy.model import fetch_tiny

    return str(fetch_tiny())


def _unserved_counted(proxy: ProxyUnderTest) -> int:
    text = httpx.get(f"{proxy.url}/metrics", headers={"authorization": f"Bearer {proxy.admin_key}"}, timeout=30).text
    lines = [line for line in text.splitlines() if line.startswith("flywheel_unserved_routes_total{")]
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in lines))


def run_one(harness: Harness, label: str, version: str, bin_dir: Path, work: Path, model_dir: str) -> Row:
    """``harness`` from ``bin_dir`` on the task, against its own scripted engine and proxy."""
    row = Row(harness.name, harness.title, label, version)
    work.mkdir(parents=True)
    started = datetime.datetime.now()
    engine = TokenEngineProcess.start(model_dir, commands_for(harness), work / "answers.jsonl")
    try:
        proxy = ProxyUnderTest.start(engine.url, work)
        try:
            (episode,) = proxy.create_group(1, f"harnesses-check-{harness.name}")
            workdir, home = work / "task", work / "home"
            workdir.mkdir()
            home.mkdir()
            with Tee(urlsplit(proxy.url).port or 80) as tee:
                path = urlsplit(episode["base_url"]).path
                argv, env = launch(
                    harness, bin_dir, tee.url + path, episode["api_key"], home, STEPS_TASK, window=CONTEXT
                )
                env["PATH"] = f"{bin_dir}:{os.environ['PATH']}"
                try:
                    done = subprocess.run(
                        argv,
                        cwd=workdir,
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=TIMEOUT_S,
                        stdin=subprocess.DEVNULL,
                    )
                    row.exit_code = done.returncode
                    (work / "harness.log").write_text(f"{done.stdout}\n--- stderr ---\n{done.stderr}")
                except subprocess.TimeoutExpired:
                    row.error = f"no exit after {TIMEOUT_S} s"
                exchanges = tee.exchanges()
            both = workdir / "both.txt"
            row.task_done = both.exists() and both.read_text() == "onetwo"
            record = httpx.get(
                f"{proxy.url}/episodes/{episode['id']}",
                headers={"authorization": f"Bearer {proxy.admin_key}"},
                timeout=30,
            ).json()
            summarize(row, harness, exchanges, record.get("calls") or [])
            row.unserved_counted = _unserved_counted(proxy)
        finally:
            _stop(proxy.proc)
    except Exception as exc:  # a failure to start is a row, not a crash: the other harnesses still run
        row.error = row.error or f"{type(exc).__name__}: {exc}"[:300]
    finally:
        engine.stop()
    row.seconds = (datetime.datetime.now() - started).total_seconds()
    return row


# --- the matrix ------------------------------------------------------------------------------------


def matrix(rows: list[Row], diffs: dict[str, dict[str, list[str]]]) -> str:
    out = [
        "| harness | release | ok | exit | task | model requests (status) | recorded | spliced / follow-ups | "
        "not spliced | unserved routes | fields, tools since pinned |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        statuses = ", ".join(f"{n}x {s}" for s, n in sorted(row.statuses.items())) or "-"
        change = "-"
        if row.label == "newest" and row.harness in diffs:
            d = diffs[row.harness]
            fields, tools = (f"+{len(d[f'{k}_added'])}/-{len(d[f'{k}_gone'])}" for k in ("fields", "tools"))
            change = f"fields {fields}, tools {tools}"
        elif row.label == "newest":
            change = "no pin"
        elif row.label == "newest = pinned":
            change = "same release"
        out.append(
            f"| {row.title} | {row.label} {row.version} | {'yes' if row.ok else 'NO'} | {row.exit_code} | "
            f"{'done' if row.task_done else 'not done'} | {row.model_requests} ({statuses}) | {row.recorded} | "
            f"{row.spliced} / {row.follow_ups} | {'; '.join(sorted(set(row.not_spliced))) or '-'} | "
            f"{', '.join(row.unserved) or '-'} | {change} |"
        )
        if row.error:
            out.append(f"|  | error: {row.error.replace('|', '/')} | | | | | | | | | |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", choices=[h.name for h in HARNESSES], help="these harnesses only")
    parser.add_argument("--pinned-only", action="store_true", help="the pinned releases only (offline)")
    parser.add_argument("--out", type=Path, help="keep the runs' logs and matrix.json here (default: a temp dir)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="harnesses-check-"))
    out.mkdir(parents=True, exist_ok=True)
    model_dir = _tiny_model_dir()
    rows: list[Row] = []
    diffs: dict[str, dict[str, list[str]]] = {}
    for harness in [h for h in HARNESSES if not args.only or h.name in args.only]:
        pinned = pinned_version(harness)
        plan: list[tuple[str, str, Path]] = []
        if pinned is not None:
            plan.append(("pinned", pinned, PINNED_BIN if harness.registry == "npm" else AGENTS_BIN))
        if not args.pinned_only:
            try:
                newest = newest_version(harness)
                if newest == pinned and plan:
                    plan[0] = ("newest = pinned", newest, plan[0][2])
                else:
                    plan.append(("newest", newest, install(harness, newest)))
            except Exception as exc:
                rows.append(Row(harness.name, harness.title, "newest", "?", error=f"{type(exc).__name__}: {exc}"[:300]))
        for label, version, bin_dir in plan:
            print(f"[harnesses-check] {harness.title} {version} ({label})", file=sys.stderr, flush=True)
            rows.append(run_one(harness, label, version, bin_dir, out / f"{harness.name}-{version}", model_dir))
        ran = {r.label: r for r in rows if r.harness == harness.name and not r.error}
        if "pinned" in ran and "newest" in ran:
            diffs[harness.name] = diff(ran["pinned"], ran["newest"])
    table = matrix(rows, diffs)
    print(f"harnesses against the scripted engine (bench/fake_tokens.py), {datetime.date.today()}:\n")
    print(table)
    for name, d in diffs.items():
        print(f"\n{name}, newest against pinned:")
        for key, values in d.items():
            print(f"  {key}: {', '.join(values) or '-'}")
    report = {"rows": [asdict(r) | {"ok": r.ok} for r in rows], "diffs": diffs}
    (out / "matrix.json").write_text(json.dumps(report, indent=2))
    print(f"\nruns and matrix.json in {out}")
    sys.exit(0 if rows and all(r.ok for r in rows) else 1)


if __name__ == "__main__":
    main()
