"""How each agent harness is pointed at an episode, unchanged: its command line, environment and config files.

One place for what ``tests/integration/test_harnesses.py`` runs on every ``make test`` (the pinned
Claude Code, Codex CLI and Gemini CLI) and what ``python -m bench.harnesses_check`` runs against
the newest releases (those three, opencode and mini-swe-agent). A harness gets the episode's base
URL (``.../episodes/<id>/v1``), its key and a fresh home directory; nothing of the harness is
patched. Each one's way to learn the served window (so that it compacts before the engine's
context runs out) is set where the harness reads it: ``window``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import orjson

ROOT = Path(__file__).resolve().parents[1]
PINNED_BIN = ROOT / "deploy" / "harnesses" / "node_modules" / ".bin"
"""The npm harnesses ``make setup`` installs at the versions ``deploy/harnesses/package-lock.json`` pins."""
AGENTS_BIN = ROOT / ".venv-agents" / "bin"
"""The agents venv (``make setup``): mini-swe-agent at the version ``pyproject.toml``'s ``agents`` extra pins."""

STEPS_TASK = "create one.txt and two.txt, then both.txt holding both"
COMMANDS = ["printf one > one.txt && yes one | head -n 1500", "printf two > two.txt", "cat one.txt two.txt > both.txt"]
"""Run in turn by every harness; the first prints 1,500 lines (3k tokens), so that Claude Code's
prompt passes its compaction threshold after it and drops under it once compacted."""
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
"""mini-swe-agent ends an episode when a command's output starts with this line, not on a final answer."""


@dataclass(frozen=True, slots=True)
class Harness:
    name: str
    title: str
    registry: Literal["npm", "pypi"]
    package: str
    binary: str
    api: Literal["messages", "responses", "gemini", "chat"]
    route: str
    """How the harness's model requests end (the route the proxy records them on)."""
    submit: str | None = None
    """A last command the harness needs to end its episode (None: it ends on a final answer)."""


HARNESSES = (
    Harness("claude", "Claude Code", "npm", "@anthropic-ai/claude-code", "claude", "messages", "/v1/messages"),
    Harness("codex", "Codex CLI", "npm", "@openai/codex", "codex", "responses", "/v1/responses"),
    Harness("gemini", "Gemini CLI", "npm", "@google/gemini-cli", "gemini", "gemini", ":streamGenerateContent"),
    Harness("opencode", "opencode", "npm", "opencode-ai", "opencode", "chat", "/chat/completions"),
    Harness("miniswe", "mini-swe-agent", "pypi", "mini-swe-agent", "mini", "chat", "/chat/completions", SUBMIT),
)
BY_NAME = {h.name: h for h in HARNESSES}


def commands_for(harness: Harness) -> list[str]:
    """The scripted engine's commands for ``harness``: the task's, then its submit command if it has one."""
    return [*COMMANDS, *([harness.submit] if harness.submit else [])]


def launch(
    harness: Harness,
    bin_dir: Path,
    base_url: str,
    api_key: str,
    home: Path,
    task: str,
    *,
    window: int | None = None,
    extra: dict[str, str] | None = None,
    model: str | None = "policy",
) -> tuple[list[str], dict[str, str]]:
    """The argv and the environment (beyond ``PATH`` and ``HOME``) that run ``harness`` on ``task``
    against an episode at ``base_url`` (``.../episodes/<id>/v1``) with its key; config files are
    written under ``home``. ``window``: the served context length, told the harness its own way;
    ``model`` None: Claude Code and Codex ask for their own default model name."""
    root = base_url.removesuffix("/v1")  # the Anthropic and Google SDKs append their own version
    env = {"HOME": str(home), "LITELLM_LOCAL_MODEL_COST_MAP": "True", **(extra or {})}
    binary = str(bin_dir / harness.binary)
    if harness.name == "claude":
        env |= {"ANTHROPIC_BASE_URL": root, "ANTHROPIC_API_KEY": api_key, "IS_SANDBOX": "1"}  # root may skip asking
        if window is not None:
            env.setdefault("CLAUDE_CODE_MAX_CONTEXT_TOKENS", str(window))
        named = ["--model", model] if model else []
        return [binary, "-p", task, *named, "--dangerously-skip-permissions"], env
    if harness.name == "gemini":
        env |= {"GOOGLE_GEMINI_BASE_URL": root, "GEMINI_API_KEY": api_key}
        gemini_settings(home, window)
        return [binary, "-p", task, "--model", "policy", "--approval-mode", "yolo"], env
    if harness.name == "codex":
        env |= {"CODEX_HOME": str(codex_home(home, base_url, window, model)), "FLYWHEEL_EPISODE_KEY": api_key}
        return [binary, "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", task], env
    if harness.name == "opencode":
        env |= {"OPENCODE_CONFIG": str(opencode_config(home, base_url, window)), "FLYWHEEL_EPISODE_KEY": api_key}
        return [binary, "run", "--model", "flywheel/policy", task], env
    if harness.name == "miniswe":
        env |= {"MSWEA_CONFIGURED": "true", "MSWEA_COST_TRACKING": "ignore_errors"}
        config = [
            "mini.yaml",  # its shipped config, which a -c otherwise replaces
            f"model.model_kwargs.api_base={base_url}",
            f"model.model_kwargs.api_key={api_key}",
            "model.cost_tracking=ignore_errors",
            "agent.step_limit=12",
        ]
        argv = [
            binary,
            "-m",
            "openai/policy",
            "-t",
            task,
            "--yolo",
            "--exit-immediately",
            "-o",
            str(home / "traj.json"),
        ]
        return [*argv, *(a for c in config for a in ("-c", c))], env
    raise ValueError(f"unknown harness {harness.name!r}")


def codex_home(home: Path, base_url: str, window: int | None = None, model: str | None = "policy") -> Path:
    """Codex's provider block: the episode's base URL and key, the Responses API (its only wire API);
    with a window, ``model_context_window`` and an auto-compact limit at 80 % of it (Codex assumes a
    window of its own for a model name it does not know)."""
    codex = home / ".codex"
    codex.mkdir(exist_ok=True)
    limits = (
        ""
        if window is None
        else f"model_context_window = {window}\nmodel_auto_compact_token_limit = {window * 4 // 5}\n"
    )
    (codex / "config.toml").write_text(
        (f'model = "{model}"\n' if model else "")
        + f'model_provider = "flywheel"\n{limits}\n[model_providers.flywheel]\nname = "Flywheel"\n'
        f'base_url = "{base_url}"\nenv_key = "FLYWHEEL_EPISODE_KEY"\nwire_api = "responses"\n'
    )
    return codex


GEMINI_ASSUMED_WINDOW = 1_048_576
"""Gemini CLI's window for a model name it does not know (``tokenLimit``'s default in its
``tokenLimits.ts``, 0.61.0): its compression threshold is a fraction of this."""


def gemini_settings(home: Path, window: int | None = None) -> None:
    """Gemini CLI's settings: the API-key auth (the key and base URL from the environment) chosen
    up front, and nothing that calls Google's servers (usage statistics, telemetry, update checks);
    with a window, ``model.compressionThreshold`` set so it compresses at 80 % of that window."""
    (home / ".gemini").mkdir(exist_ok=True)
    settings: dict[str, object] = {
        "security": {"auth": {"selectedType": "gemini-api-key"}, "folderTrust": {"enabled": False}},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
        "general": {"enableAutoUpdate": False, "enableAutoUpdateNotification": False},
    }
    if window is not None:
        settings["model"] = {"compressionThreshold": round(0.8 * window / GEMINI_ASSUMED_WINDOW, 6)}
    (home / ".gemini" / "settings.json").write_bytes(orjson.dumps(settings))


def opencode_config(home: Path, base_url: str, window: int | None = None) -> Path:
    """opencode's config: an OpenAI-compatible provider at the episode's base URL, the key from the
    environment, the policy as both its model and its small model (the title call), every tool
    allowed, no sharing or updates; with a window, the model's ``limit`` (opencode compacts by it; a
    custom model without one is never compacted)."""
    model: dict[str, object] = {"name": "policy"}
    if window is not None:
        model["limit"] = {"context": window, "output": min(4096, window // 4)}
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "flywheel": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "Flywheel",
                "options": {"baseURL": base_url, "apiKey": "{env:FLYWHEEL_EPISODE_KEY}"},
                "models": {"policy": model},
            }
        },
        "model": "flywheel/policy",
        "small_model": "flywheel/policy",
        "permission": {"edit": "allow", "bash": "allow", "webfetch": "deny"},
        "share": "disabled",
        "autoupdate": False,
    }
    path = home / "opencode.json"
    path.write_bytes(orjson.dumps(config))
    return path
