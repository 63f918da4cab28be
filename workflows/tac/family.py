"""A generated family of small local tasks in TheAgentCompany's layout, each solvable in 1-4 tool calls.

    python -m workflows.tac.family generate --out DIR [--count 600] [--seed 0]

Five kinds, one generator each (``GENERATORS``), every one with its own checkpoints and TAC's
partial credit:

- ``write``: create a file with given content (one line or a few);
- ``edit``: append a line to an existing file, or change one ``key = value`` line of a config;
- ``count``: count lines, words, a word or matching lines of a file into an answer file, or copy
  the matching lines into another file;
- ``fix``: fix a wrong constant or an off-by-one in a small Python script so its own check passes
  (graded by running the check, and the function on hidden cases);
- ``query``: a count, sum or arg-max over a small table, from a SQLite database (built by
  ``init.sh`` from a ``.sql`` file) or a CSV file, answer into a file.

A task directory is a TAC task (``task.md``, ``checkpoints.md``, ``evaluator.py``,
``dependencies.yml`` = ``[]``, ``workspace/``, ``init.sh`` for SQL) plus ``spec.json``, which the
short evaluator hands to ``grade`` here, and ``solution.json``: the OpenHands tool calls that
solve it (``{"steps": [{"tool": "terminal", "arguments": {"command": ...}}, ..., {"tool":
"finish", ...}]}``, terminal commands with relative paths: the file editor needs absolute ones,
which differ per episode). ``splits.yml`` puts each task in ``train``, ``val`` or ``test`` by the
sha256 of its name (80/10/10).

Task ``i`` is drawn from ``(VERSION, seed, i)`` alone (and the tasks before it, whose instructions
it must not repeat), so a larger ``count`` keeps every earlier task and its split, and the same
arguments write the same bytes. Bump ``VERSION`` whenever the output changes: the workflow's cache
(``ensure``) is keyed by it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workflows.tac.scoring import Checkpoint, Result

VERSION = 1
"""Of the generator's output; part of the cache key (``ensure``)."""
KINDS = ("write", "edit", "count", "fix", "query")
"""Task ``i`` is of kind ``KINDS[i % 5]``, so every count holds the kinds in equal shares."""
SPLITS = (("train", 80), ("val", 90), ("test", 100))
"""A task is in the first split whose bound exceeds ``sha256(name) % 100``: 80/10/10."""
RUN_TIMEOUT_S = 20.0
"""Per run of the agent's script while grading a ``fix`` task."""

PEOPLE = (
    "ada bruno chen dana emeka farah gita hugo ines jonas kofi lena mateo nora omar priya quinn rosa sven tara".split()
)
CITIES = "oslo porto lyon cairo lima quito dakar turin bergen malmo".split()
WORDS = (
    "river stone paper light green table window garden summer winter cloud bread apple market letter "
    "silver yellow orange little happy quiet early late music simple office yard bridge road train "
    "ticket forest lamp chair coffee honey pocket rocket"
).split()
ITEMS = "milk eggs rice beans flour sugar butter cheese lemons onions carrots tomatoes pasta oats".split()
HOSTS = "alpha beta gamma delta echo kilo lima mike oscar sierra tango victor".split()
SERVICES = "auth billing cache gateway mailer search queue storage".split()
EVENTS = "started stopped retried timed out connected refused saved loaded flushed rotated".split()


@dataclass
class Draft:
    """One generated task before it is written: what the agent reads, what is checked, how to solve it."""

    kind: str
    variant: str
    instruction: str
    checkpoints: list[str]
    files: dict[str, str]
    """The workspace seed: relative path -> text."""
    spec: dict[str, Any]
    """What ``grade`` checks (``kind`` and ``variant`` are added when written)."""
    commands: list[str]
    """Terminal commands that solve the task, run in the workspace in order."""
    finish: str
    init: str | None = None
    """``init.sh``, run in the workspace before the agent starts."""


def _pick(rng: random.Random, options: list[str] | tuple[str, ...]) -> str:
    return options[rng.randrange(len(options))]


def _sed(old: str, new: str, path: str, *, whole_line: bool = False) -> str:
    """``sed -i 's/old/new/' path`` for literal text (a ``.`` in ``old`` escaped; ``^...$`` for a whole line)."""
    for text in (old, new):
        if any(c in text for c in "\\/&'[]*^$"):
            raise ValueError(f"no sed-safe literal: {text!r}")
    pattern = old.replace(".", "\\.")
    if whole_line:
        pattern = f"^{pattern}$"
    return f"sed -i 's/{pattern}/{new}/' {path}"


def _numbered(checkpoints: list[str]) -> str:
    lines = [f"# Checkpoints ({len(checkpoints)} points)"]
    lines += [f"{n}. (1 pt) {text}" for n, text in enumerate(checkpoints, 1)]
    return "\n".join(lines) + "\n"


def _answer_file(rng: random.Random) -> tuple[str, str]:
    """An answer file's name and how the task asks for it."""
    name = _pick(rng, ["answer.txt", "result.txt", "count.txt", "output.txt"])
    how = _pick(rng, [f"Write only the answer to `{name}`.", f"Put just the answer in `{name}`."])
    return name, how


# ---- write ------------------------------------------------------------------------------------

LINES = [
    "{name} owns the {service} service",
    "release {a}.{b} ships on {day}",
    "{service} uptime is {n} percent",
    "remember to water the {word} plant",
    "meeting with {name} at {a} pm",
    "order {n} boxes of {item}",
    "{name} reviews the {word} report",
    "backup of {service} finished at {a}",
]
DAYS = "monday tuesday wednesday thursday friday".split()


def _line(rng: random.Random) -> str:
    return _pick(rng, LINES).format(
        name=_pick(rng, PEOPLE).title(),
        service=_pick(rng, SERVICES),
        a=rng.randint(1, 12),
        b=rng.randint(0, 9),
        day=_pick(rng, DAYS),
        n=rng.randint(10, 99),
        word=_pick(rng, WORDS),
        item=_pick(rng, ITEMS),
    )


def gen_write(rng: random.Random) -> Draft:
    name = _pick(rng, ["note.txt", "status.txt", "owner.txt", "motd.txt", "todo.txt", "memo.txt", "plan.txt"])
    variant = _pick(rng, ["line", "lines"])
    lines = [_line(rng) for _ in range(1 if variant == "line" else rng.randint(2, 3))]
    while len(set(lines)) < len(lines):
        lines[-1] = _line(rng)
    what = "exactly this line" if len(lines) == 1 else f"exactly these {len(lines)} lines"
    head = _pick(
        rng,
        [
            f"Create a file named `{name}` in the current working directory. It must contain {what}:",
            f"Write a new file `{name}` in the current working directory with {what}:",
            f"Make a file called `{name}` here (the current working directory) holding {what}:",
        ],
    )
    if len(lines) == 1:
        command = f"echo '{lines[0]}' > {name}"
    else:
        command = "printf '" + "\\n".join(lines) + f"\\n' > {name}"
    return Draft(
        kind="write",
        variant=variant,
        instruction=head + "\n\n" + "\n".join(lines),
        checkpoints=[f"`{name}` exists in the workspace.", f"It holds {what} (surrounding whitespace aside)."],
        files={},
        spec={"file": name, "lines": lines},
        commands=[command],
        finish=f"Wrote {name}.",
    )


def check_write(spec: dict[str, Any], workspace: Path) -> list[bool]:
    text = _read(workspace / spec["file"])
    return [text is not None, text is not None and _lines(text) == spec["lines"]]


# ---- edit -------------------------------------------------------------------------------------

LISTS: dict[str, Callable[[random.Random], str]] = {  # a list file and how its entries look
    "guests.txt": lambda r: f"{_pick(r, PEOPLE).title()} {_pick(r, PEOPLE).title()}son",
    "shopping.txt": lambda r: f"{r.randint(1, 9)} {_pick(r, ITEMS)}",
    "hosts.txt": lambda r: f"{_pick(r, HOSTS)}-{r.randint(1, 40)}.internal",
    "cities.txt": lambda r: f"{_pick(r, CITIES).title()} {r.randint(1, 99)}",
    "tags.txt": lambda r: f"{_pick(r, WORDS)}-{_pick(r, WORDS)}",
}
SETTINGS: dict[str, Callable[[random.Random], str]] = {
    "timeout": lambda r: str(r.randint(5, 120)),
    "retries": lambda r: str(r.randint(1, 9)),
    "port": lambda r: str(r.randint(1025, 9999)),
    "workers": lambda r: str(r.randint(1, 32)),
    "log_level": lambda r: _pick(r, ["debug", "info", "warning", "error"]),
    "mode": lambda r: _pick(r, ["fast", "safe", "batch", "strict"]),
    "cache_size": lambda r: str(r.randint(16, 512)),
    "region": lambda r: _pick(r, ["north", "south", "east", "west"]),
    "host": lambda r: f"{_pick(r, HOSTS)}.internal",
    "theme": lambda r: _pick(r, ["light", "dark", "blue"]),
}


def gen_edit(rng: random.Random) -> Draft:
    if rng.random() < 0.5:
        name = _pick(rng, sorted(LISTS))
        size, entries = rng.randint(4, 7), dict[str, None]()
        while len(entries) < size:  # distinct entries, the last one to be added
            entries[LISTS[name](rng)] = None
        *original, line = entries
        instruction = _pick(
            rng,
            [
                f"Add `{line}` as a new last line of `{name}` in the current working directory. "
                "Keep every line that is already there.",
                f"Append the line `{line}` to the end of `{name}` (current working directory); "
                "do not change the existing lines.",
            ],
        )
        return Draft(
            kind="edit",
            variant="append",
            instruction=instruction,
            checkpoints=[
                f"The lines already in `{name}` are all still there, in order, at the top.",
                f"`{line}` is the one new line, at the end.",
            ],
            files={name: "\n".join(original) + "\n"},
            spec={"file": name, "original": original, "lines": [*original, line]},
            commands=[f"echo '{line}' >> {name}"],
            finish=f"Appended {line} to {name}.",
        )
    name = _pick(rng, ["settings.ini", "app.conf", "server.cfg", "service.conf"])
    keys = rng.sample(sorted(SETTINGS), rng.randint(4, 6))
    sep = _pick(rng, [" = ", "="])
    values = {k: SETTINGS[k](rng) for k in keys}
    key = _pick(rng, keys)
    new = SETTINGS[key](rng)
    while new == values[key]:
        new = SETTINGS[key](rng)
    original = [f"{k}{sep}{v}" for k, v in values.items()]
    old_line, new_line = f"{key}{sep}{values[key]}", f"{key}{sep}{new}"
    instruction = _pick(
        rng,
        [
            f"In `{name}` (current working directory), change `{key}` from `{values[key]}` to `{new}`. "
            "Leave every other line as it is.",
            f"Set `{key}` to `{new}` in `{name}` in the current working directory (the line now reads "
            f"`{old_line}`). Keep the other lines unchanged.",
        ],
    )
    return Draft(
        kind="edit",
        variant="replace",
        instruction=instruction,
        checkpoints=[
            f"Every other line of `{name}` is unchanged, in the same order.",
            f"The `{key}` line is now exactly `{new_line}`.",
        ],
        files={name: "\n".join(original) + "\n"},
        spec={"file": name, "original": original, "index": keys.index(key), "line": new_line},
        commands=[_sed(old_line, new_line, name, whole_line=True)],
        finish=f"Set {key} to {new} in {name}.",
    )


def check_edit(spec: dict[str, Any], workspace: Path) -> list[bool]:
    text = _read(workspace / spec["file"])
    lines = _lines(text) if text is not None else []
    original: list[str] = spec["original"]
    if spec["variant"] == "append":
        return [lines[: len(original)] == original, lines == spec["lines"]]
    index = spec["index"]
    kept = len(lines) == len(original) and all(lines[j] == line for j, line in enumerate(original) if j != index)
    return [kept, len(lines) > index and lines[index] == spec["line"]]


# ---- count ------------------------------------------------------------------------------------


def _prose(rng: random.Random, word: str | None = None) -> list[str]:
    """4-8 lines of 3-7 words; ``word``, when given, planted one to four times."""
    lines = [[_pick(rng, WORDS) for _ in range(rng.randint(3, 7))] for _ in range(rng.randint(4, 8))]
    if word is not None:
        for _ in range(rng.randint(1, 4)):
            line = lines[rng.randrange(len(lines))]
            line[rng.randrange(len(line))] = word
    return [" ".join(line) for line in lines]


def _log(rng: random.Random, level: str) -> list[str]:
    """5-9 log lines ``LEVEL service event``; ``level`` on at least two and not on all."""
    n = rng.randint(5, 9)
    marked = set(rng.sample(range(n), rng.randint(2, n - 2)))
    others = [lv for lv in ("INFO", "WARN", "ERROR", "DEBUG") if lv != level]
    return [
        f"{level if i in marked else _pick(rng, others)} {_pick(rng, SERVICES)} {_pick(rng, EVENTS)}" for i in range(n)
    ]


def gen_count(rng: random.Random) -> Draft:
    variant = _pick(rng, ["lines", "words", "word", "matching", "extract"])
    answer, how = _answer_file(rng)
    if variant in ("lines", "words", "word"):
        name = f"{_pick(rng, WORDS)}.txt"
        word = _pick(rng, WORDS) if variant == "word" else None
        lines = _prose(rng, word)
        text = "\n".join(lines) + "\n"
        if variant == "lines":
            question, value = f"How many lines does `{name}` have (as `wc -l` counts them)?", len(lines)
            command = f"wc -l < {name} > {answer}"
        elif variant == "words":
            question, value = f"How many words are in `{name}` (as `wc -w` counts them)?", len(text.split())
            command = f"wc -w < {name} > {answer}"
        else:
            question = f"How many times does the word `{word}` occur in `{name}`?"
            value = text.split().count(word or "")
            command = f"grep -ow {word} {name} | wc -l > {answer}"
    else:
        name = f"{_pick(rng, SERVICES)}.log"
        level = _pick(rng, ["INFO", "WARN", "ERROR", "DEBUG"])
        lines = _log(rng, level)
        text = "\n".join(lines) + "\n"
        matching = [line for line in lines if level in line.split()]
        if variant == "extract":
            out = _pick(rng, ["matches.txt", f"{level.lower()}s.txt", "selected.txt", f"{level.lower()}-lines.txt"])
            return Draft(
                kind="count",
                variant=variant,
                instruction=f"Copy every line of `{name}` (current working directory) that contains `{level}` "
                f"into a new file `{out}`, keeping their order. Do not change `{name}`.",
                checkpoints=[
                    f"`{out}` exists.",
                    f"Every line of `{out}` is a `{level}` line of `{name}` (and there is at least one).",
                    f"`{out}` holds exactly the {len(matching)} `{level}` lines, in order.",
                ],
                files={name: text},
                spec={"file": out, "lines": matching},
                commands=[f"grep {level} {name} > {out}"],
                finish=f"Copied the {level} lines of {name} to {out}.",
            )
        question, value = f"How many lines of `{name}` contain `{level}`?", len(matching)
        command = f"grep -c {level} {name} > {answer}"
    return Draft(
        kind="count",
        variant=variant,
        instruction=f"{question} The file is in the current working directory. {how}",
        checkpoints=[f"`{answer}` exists and holds one whole number.", f"The number is {value}."],
        files={name: text},
        spec={"file": answer, "answer": str(value)},
        commands=[command],
        finish=f"The answer is {value}.",
    )


def check_count(spec: dict[str, Any], workspace: Path) -> list[bool]:
    text = _read(workspace / spec["file"])
    if spec["variant"] == "extract":
        lines = _lines(text) if text is not None else []
        wanted: list[str] = spec["lines"]
        return [text is not None, bool(lines) and all(line in wanted for line in lines), lines == wanted]
    number = text.strip() if text is not None else ""
    return [re.fullmatch(r"-?\d+", number) is not None, number == spec["answer"]]


# ---- fix --------------------------------------------------------------------------------------

CONSTANTS = [  # files, function, argument, constant, expression, what the constant means, its values
    (("boxes.py", "packing.py"), "boxes_needed", "items", "BOX_SIZE", "(items + BOX_SIZE - 1) // BOX_SIZE",
     "a box holds {v} items", range(6, 25)),
    (("pricing.py", "shop.py"), "cost_cents", "qty", "PRICE_CENTS", "qty * PRICE_CENTS",
     "one item costs {v} cents", range(50, 999)),
    (("fees.py", "billing.py"), "with_fee", "amount", "FEE", "amount + FEE", "the flat fee is {v}", range(2, 60)),
    (("timer.py", "durations.py"), "to_seconds", "minutes", "SECONDS_PER_MINUTE", "minutes * SECONDS_PER_MINUTE",
     "a minute has {v} seconds", range(60, 61)),
    (("weights.py", "convert.py"), "to_grams", "kilos", "GRAMS_PER_KILO", "kilos * GRAMS_PER_KILO",
     "a kilo has {v} grams", range(1000, 1001)),
    (("weeks.py", "schedule.py"), "days_in", "weeks", "DAYS_PER_WEEK", "weeks * DAYS_PER_WEEK",
     "a week has {v} days", range(7, 8)),
    (("seats.py", "venue.py"), "rows_needed", "guests", "SEATS_PER_ROW",
     "(guests + SEATS_PER_ROW - 1) // SEATS_PER_ROW", "a row has {v} seats", range(8, 30)),
    (("points.py", "loyalty.py"), "points_for", "visits", "POINTS_PER_VISIT", "visits * POINTS_PER_VISIT",
     "each visit earns {v} points", range(3, 40)),
]  # fmt: skip
OFF_BY_ONE = [  # files, function names, arguments, buggy body, its sed-safe fix (old, new), what it must do, inputs
    (("sums.py", "totals.py"), ("sum_to", "total_upto"), "n", "return sum(range(1, n))",
     ("range(1, n)", "range(1, n + 1)"), "add the numbers from 1 to n, n included", "int"),
    (("squares.py", "powers.py"), ("squares", "square_list"), "n", "return [i * i for i in range(1, n)]",
     ("range(1, n)", "range(1, n + 1)"), "list the squares of 1 to n, n included", "int"),
    (("evens.py", "numbers.py"), ("evens_upto", "even_numbers"), "n", "return list(range(0, n, 2))",
     ("range(0, n, 2)", "range(0, n + 1, 2)"), "list the even numbers from 0 to n, n included when it is even", "int"),
    (("countdown.py", "launch.py"), ("countdown", "count_down"), "n", "return list(range(n, 1, -1))",
     ("range(n, 1, -1)", "range(n, 0, -1)"), "count down from n to 1, 1 included", "int"),
    (("lists.py", "head.py"), ("first", "take"), "items, k", "return items[:k - 1]", (":k - 1", ":k"),
     "return the first k items", "list"),
    (("recent.py", "tail.py"), ("last", "latest"), "items, k", "return items[len(items) - k - 1:]",
     ("len(items) - k - 1", "len(items) - k"), "return the last k items", "list"),
    (("bars.py", "chart.py"), ("bar", "hashes"), "n", 'return "#" * (n - 1)', ("(n - 1)", "n"),
     "return a bar of n # signs", "int"),
    (("ranges.py", "spans.py"), ("between", "span"), "a, b", "return list(range(a, b))",
     ("range(a, b)", "range(a, b + 1)"), "list the numbers from a to b, b included", "pair"),
]  # fmt: skip


def _arguments(rng: random.Random, kind: str) -> list[Any]:
    if kind == "int":
        return [rng.randint(2, 12)]
    if kind == "pair":
        a = rng.randint(0, 9)
        return [a, a + rng.randint(1, 6)]
    items = rng.sample(range(1, 50), rng.randint(4, 7))
    return [items, rng.randint(1, len(items) - 1)]


def _script(constant: str, function: str, args: str, body: str, checks: list[tuple[str, Any]]) -> str:
    """The script: an optional constant, the function, and its check under ``__main__``."""
    asserts = "".join(f"    assert {function}({call}) == {want!r}\n" for call, want in checks)
    head = f"{constant}\n\n\n" if constant else ""
    return (
        f'"""{function}() and its check: python3 runs the check."""\n\n{head}def {function}({args}):\n    {body}\n\n\n'
        f'if __name__ == "__main__":\n{asserts}    print("check passed")\n'
    )


def _call(args: list[Any]) -> str:
    return ", ".join(repr(a) for a in args)


def gen_fix(rng: random.Random) -> Draft:
    for _ in range(100):  # draw until the bug fails the script's check and at least one hidden case
        if rng.random() < 0.5:
            files, function, args, const, expr, meaning, values = CONSTANTS[rng.randrange(len(CONSTANTS))]
            right = _pick(rng, [str(v) for v in values])
            wrong = str(max(1, int(right) + rng.choice([-3, -2, -1, 1, 2, 5, 10])))
            variant, what, body = "constant", meaning.format(v=right), f"return {expr}"
            bad, diff = f"{const} = {wrong}", (f"{const} = {wrong}", f"{const} = {right}")
            calls = [[rng.randint(1, 60)] for _ in range(6)]
        else:
            files, names, args, body, diff, what, arg_kind = OFF_BY_ONE[rng.randrange(len(OFF_BY_ONE))]
            function, variant, bad = _pick(rng, names), "off_by_one", ""
            calls = [_arguments(rng, arg_kind) for _ in range(6)]
        if len({_call(c) for c in calls}) < len(calls):
            continue
        name = _pick(rng, list(files))
        source = _script(bad, function, args, body, [])
        # Run our own two versions of the script (no check yet) to know the right and the buggy answers.
        fixed_ns: dict[str, Any] = {}
        buggy_ns: dict[str, Any] = {}
        exec(source.replace(*diff), fixed_ns)
        exec(source, buggy_ns)
        want = [fixed_ns[function](*c) for c in calls]
        got = [buggy_ns[function](*c) for c in calls]
        if want[:2] == got[:2] or want[2:] == got[2:]:
            continue
        source = _script(bad, function, args, body, [(_call(c), w) for c, w in zip(calls[:2], want, strict=False)])
        if source.count(diff[0]) != 1:
            continue
        if variant == "constant":
            task = f"The check in `{name}` fails because `{const}` has the wrong value: {what}. "
        else:
            task = (
                f"`{function}()` in `{name}` has an off-by-one bug: it must {what} "
                f"(`{function}({_call(calls[0])})` must return `{want[0]!r}`). "
            )
        cases = [[c, w] for c, w in zip(calls[2:], want[2:], strict=True)]
        return Draft(
            kind="fix",
            variant=variant,
            instruction=task + f"Fix it so that `python3 {name}` (in the current working directory) prints "
            "`check passed`. Do not change the checks at the bottom of the file.",
            checkpoints=[
                f"`python3 {name}` runs its check and prints `check passed`.",
                f"`{function}()` is right on hidden cases too (the check was not edited away).",
            ],
            files={name: source},
            spec={"file": name, "function": function, "cases": cases},
            commands=[_sed(*diff, name), f"python3 {name}"],
            finish=f"Fixed {function}() in {name}; the check passes.",
        )
    raise RuntimeError("gen_fix drew no usable task in 100 tries")


_CASES = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("agent_script", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print(json.dumps([getattr(module, sys.argv[2])(*args) for args in json.loads(sys.argv[3])]))
"""


def _python(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None


def check_fix(spec: dict[str, Any], workspace: Path) -> list[bool]:
    script = workspace / spec["file"]
    if not script.is_file():
        return [False, False]
    run = _python([str(script)], workspace)
    passed = run is not None and run.returncode == 0 and "check passed" in run.stdout
    cases = _python(["-c", _CASES, str(script), spec["function"], json.dumps([c for c, _ in spec["cases"]])], workspace)
    try:
        got = json.loads(cases.stdout) if cases is not None and cases.returncode == 0 else None
    except ValueError:
        got = None
    return [passed, got == [w for _, w in spec["cases"]]]


# ---- query ------------------------------------------------------------------------------------

TABLES = [  # table, database, entity column, group column, value column, groups, entities, value range
    ("orders", "shop", "customer", "city", "amount", CITIES, PEOPLE, (5, 400)),
    ("tickets", "support", "assignee", "status", "hours", ["open", "closed", "blocked"], PEOPLE, (1, 40)),
    ("products", "store", "product", "category", "stock", ["tools", "toys", "food", "garden"], ITEMS, (0, 300)),
    ("players", "league", "player", "team", "score", ["red", "blue", "green"], PEOPLE, (0, 100)),
    ("trips", "fleet", "driver", "region", "km", ["north", "south", "east", "west"], PEOPLE, (10, 900)),
]


def gen_query(rng: random.Random) -> Draft:
    table, db, ent, grp, val, groups, pool, (lo, hi) = TABLES[rng.randrange(len(TABLES))]
    source, question = _pick(rng, ["sql", "csv"]), _pick(rng, ["count", "sum", "max"])
    n = rng.randint(5, 9)
    present = rng.sample(groups, min(len(groups), rng.randint(2, 4)))
    target = _pick(rng, present)
    rows = [(e, _pick(rng, present), rng.randint(lo, hi)) for e in rng.sample(pool, n)]
    rows[0] = (rows[0][0], target, rows[0][2])
    top = max(v for _, _, v in rows)
    if [v for _, _, v in rows].count(top) > 1:  # one clear winner
        i = rng.randrange(n)
        rows[i] = (rows[i][0], rows[i][1], top + rng.randint(1, 9))
    answer, how = _answer_file(rng)
    matching = [r for r in rows if r[1] == target]
    if question == "count":
        text, value = f"How many rows have `{grp}` equal to `{target}`?", str(len(matching))
        sql, csv_cmd = f"SELECT COUNT(*) FROM {table} WHERE {grp} = '{target}'", f"grep -c ',{target},' {table}.csv"
    elif question == "sum":
        text = f"What is the total `{val}` of the rows whose `{grp}` is `{target}`?"
        value = str(sum(r[2] for r in matching))
        sql = f"SELECT SUM({val}) FROM {table} WHERE {grp} = '{target}'"
        csv_cmd = f"awk -F, '$2 == \"{target}\" {{s += $3}} END {{print s}}' {table}.csv"
    else:
        text, value = f"Which `{ent}` has the largest `{val}`?", max(rows, key=lambda r: r[2])[0]
        sql = f"SELECT {ent} FROM {table} ORDER BY {val} DESC LIMIT 1"
        csv_cmd = f"tail -n +2 {table}.csv | sort -t, -k3 -n -r | head -1 | cut -d, -f1"
    if source == "sql":
        inserts = ",\n  ".join(f"({i}, '{e}', '{g}', {v})" for i, (e, g, v) in enumerate(rows, 1))
        files = {
            f"{db}.sql": f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, {ent} TEXT NOT NULL, {grp} TEXT NOT NULL, "
            f"{val} INTEGER NOT NULL);\nINSERT INTO {table} VALUES\n  {inserts};\n"
        }
        intro = (
            f"The SQLite database `{db}.db` in the current working directory has a table "
            f"`{table}(id, {ent}, {grp}, {val})` (Python's `sqlite3` module can read it)."
        )
        command = (
            "python3 -c 'import sqlite3, sys; print(sqlite3.connect(sys.argv[1]).execute(sys.argv[2]).fetchone()[0])' "
            f'{db}.db "{sql}" > {answer}'
        )
        init = (
            "#!/usr/bin/env bash\n# Build the task's SQLite database from its SQL text.\nset -euo pipefail\n"
            f"python3 -c \"import sqlite3; c = sqlite3.connect('{db}.db'); c.executescript(open('{db}.sql').read()); "
            'c.commit()"\n'
        )
    else:
        files = {f"{table}.csv": f"{ent},{grp},{val}\n" + "".join(f"{e},{g},{v}\n" for e, g, v in rows)}
        intro = f"`{table}.csv` in the current working directory has the columns `{ent},{grp},{val}`."
        command, init = f"{csv_cmd} > {answer}", None
    return Draft(
        kind="query",
        variant=f"{source}_{question}",
        instruction=f"{intro} {text} {how}",
        checkpoints=[f"`{answer}` exists and holds one line.", f"The answer is `{value}`."],
        files=files,
        spec={"file": answer, "answer": value},
        commands=[command],
        finish=f"The answer is {value}.",
        init=init,
    )


def check_query(spec: dict[str, Any], workspace: Path) -> list[bool]:
    text = _read(workspace / spec["file"])
    lines = _lines(text) if text is not None else []
    one = len(lines) == 1 and bool(lines[0].strip())
    return [one, one and lines[0].strip().lower() == str(spec["answer"]).lower()]


# ---- the family -------------------------------------------------------------------------------

GENERATORS: dict[str, Callable[[random.Random], Draft]] = {
    "write": gen_write,
    "edit": gen_edit,
    "count": gen_count,
    "fix": gen_fix,
    "query": gen_query,
}
CHECKS: dict[str, Callable[[dict[str, Any], Path], list[bool]]] = {
    "write": check_write,
    "edit": check_edit,
    "count": check_count,
    "fix": check_fix,
    "query": check_query,
}
EVALUATOR = '''"""Generated by workflows.tac.family: spec.json says what to check, the family's checks grade it."""

from pathlib import Path

from workflows.tac.family import grade
from workflows.tac.scoring import Result


def grade_checkpoints(trajectory: str, workspace: Path) -> Result:
    return grade(Path(__file__).resolve().parent, workspace)
'''


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace") if path.is_file() else None
    except OSError:
        return None


def _lines(text: str) -> list[str]:
    """The lines of a file, trailing whitespace and blank lines at either end ignored."""
    return [line.rstrip() for line in text.strip().splitlines()]


def grade(task_dir: Path, workspace: Path) -> Result:
    """Grade ``workspace`` against ``task_dir/spec.json``: one point per checkpoint of its kind."""
    spec = json.loads((task_dir / "spec.json").read_text())
    return Result([Checkpoint(1, int(ok)) for ok in CHECKS[spec["kind"]](spec, workspace)])


def split_of(name: str) -> str:
    """``train``, ``val`` or ``test``, by the sha256 of the task's name (80/10/10)."""
    bucket = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % 100
    return next(split for split, bound in SPLITS if bucket < bound)


@dataclass(frozen=True)
class FamilyTask:
    name: str
    kind: str
    variant: str
    split: str
    files: dict[str, str]
    """The task directory's files: relative path -> text."""


def _render(name: str, draft: Draft) -> FamilyTask:
    steps = [{"tool": "terminal", "arguments": {"command": c}} for c in draft.commands]
    steps.append({"tool": "finish", "arguments": {"message": draft.finish}})
    spec = {"kind": draft.kind, "variant": draft.variant, **draft.spec}
    files = {
        "task.md": draft.instruction + "\n",
        "checkpoints.md": _numbered(draft.checkpoints),
        "evaluator.py": EVALUATOR,
        "dependencies.yml": "[]\n",
        "spec.json": json.dumps(spec, indent=1, sort_keys=True) + "\n",
        "solution.json": json.dumps({"steps": steps}, indent=1) + "\n",
        **{f"workspace/{path}": text for path, text in draft.files.items()},
    }
    if draft.init is not None:
        files["init.sh"] = draft.init
    return FamilyTask(name=name, kind=draft.kind, variant=draft.variant, split=split_of(name), files=files)


def generate(count: int = 600, seed: int = 0) -> list[FamilyTask]:
    """``count`` tasks, task ``i`` of kind ``KINDS[i % 5]``, drawn from ``(VERSION, seed, i)``; no two
    share an instruction (task ``i`` draws again while it repeats an earlier one)."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    tasks: list[FamilyTask] = []
    seen: set[str] = set()
    for i in range(count):
        kind = KINDS[i % len(KINDS)]
        for attempt in range(100):
            rng = random.Random(f"flywheel-tac-family:{VERSION}:{seed}:{i}:{attempt}")
            draft = GENERATORS[kind](rng)
            if draft.instruction not in seen:  # a demonstrator knows a task by its instruction
                break
        else:
            raise RuntimeError(f"task {i} ({kind}) repeats an earlier task's instruction in 100 draws")
        seen.add(draft.instruction)
        tasks.append(_render(f"s{seed}-{i:04d}-{kind}", draft))
    return tasks


def write(out: Path, *, count: int = 600, seed: int = 0) -> list[FamilyTask]:
    """Write the family into ``out`` (absent or empty): a directory per task, ``splits.yml``, ``family.json``."""
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty: generate into a new directory")
    tasks = generate(count, seed)
    for task in tasks:
        for path, text in task.files.items():
            target = out / task.name / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
    lines = [f"# workflows.tac.family version {VERSION}, seed {seed}, {count} tasks: split by sha256 of the name."]
    for split, _ in SPLITS:
        names = [t.name for t in tasks if t.split == split]
        lines += [f"{split}:" + ("" if names else " []"), *(f"  - {n}" for n in names)]
    (out / "splits.yml").write_text("\n".join(lines) + "\n")
    kinds = {k: sum(t.kind == k for t in tasks) for k in KINDS}
    manifest = {"version": VERSION, "seed": seed, "count": count, "kinds": kinds}
    (out / "family.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return tasks


def ensure(count: int, seed: int = 0) -> Path:
    """The family's directory under ``$FLYWHEEL_CACHE/tac-family``, keyed by version, seed and count;
    generated once (into a staging directory, then renamed, so a reader never sees half of it)."""
    cache = Path(os.environ.get("FLYWHEEL_CACHE", Path.home() / ".cache" / "flywheel")) / "tac-family"
    path = cache / f"v{VERSION}-seed{seed}-n{count}"
    if (path / "family.json").is_file():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=cache))
    try:
        write(staging, count=count, seed=seed)
        staging.rename(path)
    except OSError:
        if not (path / "family.json").is_file():  # another process did not finish it either
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workflows.tac.family", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="write the family's task directories and splits.yml")
    gen.add_argument("--out", type=Path, required=True, help="a new (or empty) directory")
    gen.add_argument("--count", type=int, default=600, help="number of tasks (default 600)")
    gen.add_argument("--seed", type=int, default=0, help="seed of the draw (default 0)")
    args = parser.parse_args(argv)
    try:
        tasks = write(args.out, count=args.count, seed=args.seed)
    except ValueError as exc:
        parser.error(str(exc))
    splits = {s: sum(t.split == s for t in tasks) for s, _ in SPLITS}
    print(f"{len(tasks)} tasks in {args.out} ({', '.join(f'{s} {n}' for s, n in splits.items())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
