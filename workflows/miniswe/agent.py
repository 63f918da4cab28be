"""mini-swe-agent's own ``DefaultAgent`` with its ``mini`` config, its model on a Flywheel episode.

Nothing of the agent is changed: its loop (``DefaultAgent.run``), its prompt and templates
(``minisweagent/config/mini.yaml``, the config of the ``mini`` command), its model class
(``LitellmModel``: native tool calls, one ``bash`` tool, ``tool_choice`` left to the model) and
its ``LocalEnvironment`` (each command a fresh ``subprocess`` shell in the task's workspace). Only
the settings a deployment sets are ours: the model (``openai/<episode.model>`` on the episode's
base URL and key), the sampling (temperature, max tokens), the step limit, and cost tracking off
(the proxy's model has no price, so litellm cannot cost it; the step limit bounds an episode).

How it ended decides what the runner does: ``Submitted`` (the agent ran ``echo
COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``), ``LimitsExceeded`` (the step limit),
``RepeatedFormatError`` (three answers in a row without a valid ``bash`` call) and ``TimeExceeded``
are the agent's own doing and are graded; any other exception (a refused or failed model call, an
environment crash) raises ``EpisodeFailed``, so the episode is abandoned with it, as ``tac``'s
OpenHands agent does.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workflows.base import EpisodeFailed

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no internet: litellm's bundled map
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")  # its banner would go to stdout, the runner's JSON
os.environ.setdefault("MSWEA_COST_TRACKING", "ignore_errors")
# One try per call: a refused call (an abandoned episode's 409, a context overflow) is not retried
# for minutes with backoff (its default is 10 tries, 4-60 s apart); the episode is abandoned at once.
os.environ.setdefault("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1")

CONFIG = "mini.yaml"
"""The package's config of its ``mini`` command: the tool-calling prompt that matches LitellmModel."""
ENDINGS = {
    "Submitted": "submitted",
    "LimitsExceeded": "step_limit",
    "RepeatedFormatError": "format_errors",
    "TimeExceeded": "time_limit",
}
"""mini-swe-agent's exit statuses that end an episode normally (graded), by the name we record."""

log = logging.getLogger("flywheel.workflows.miniswe")


@dataclass(frozen=True)
class AgentConfig:
    model: str
    base_url: str
    """The episode's OpenAI base URL (``<proxy>/episodes/<id>/v1``)."""
    api_key: str
    """The episode's key."""
    step_limit: int = 6
    temperature: float = 1.0
    max_tokens: int = 256
    command_timeout_s: int = 30
    wall_time_limit_s: int = 0
    """0: no wall-clock limit of the agent's own (the runner's episode timeout still applies)."""


@dataclass(frozen=True)
class AgentRun:
    ending: str
    """submitted, step_limit, format_errors or time_limit."""
    exit_status: str
    """mini-swe-agent's own exit status."""
    steps: int
    """Model calls made."""
    format_errors: int
    """Answers without a valid bash tool call (the agent told the model and went on)."""
    trajectory: str
    """The agent's serialized run (``DefaultAgent.serialize``) as JSON."""


def package_config() -> dict[str, Any]:
    """mini-swe-agent's own ``mini.yaml``, as shipped."""
    import yaml  # type: ignore[import-untyped,unused-ignore]
    from minisweagent.config import get_config_path  # type: ignore[import-not-found,unused-ignore]

    loaded = yaml.safe_load(get_config_path(CONFIG).read_text(encoding="utf-8"))
    assert isinstance(loaded, dict)
    return loaded


def run_agent(instruction: str, workdir: Path, config: AgentConfig) -> AgentRun:
    """Run one mini-swe-agent episode to its end (blocking: call it in a thread)."""
    from minisweagent.agents.default import DefaultAgent  # type: ignore[import-not-found,unused-ignore]
    from minisweagent.environments.local import LocalEnvironment  # type: ignore[import-not-found,unused-ignore]
    from minisweagent.models.litellm_model import LitellmModel  # type: ignore[import-not-found,unused-ignore]

    logging.getLogger("minisweagent").setLevel(logging.WARNING)  # its RichHandler prints to stdout
    shipped = package_config()
    agent_config = copy.deepcopy(shipped["agent"])
    agent_config.pop("mode", None)  # the interactive agent's (confirm each command); DefaultAgent has none
    agent_config.update(step_limit=config.step_limit, wall_time_limit_seconds=config.wall_time_limit_s)
    model_config = copy.deepcopy(shipped["model"])
    model_config["model_kwargs"] = {
        **model_config.get("model_kwargs", {}),
        "api_base": config.base_url,
        "api_key": config.api_key,
        "temperature": config.temperature,
        "max_tokens": config.max_tokens,
        "num_retries": 0,
    }
    model = LitellmModel(model_name=f"openai/{config.model}", cost_tracking="ignore_errors", **model_config)
    env = LocalEnvironment(
        **{**shipped.get("environment", {}), "cwd": str(workdir), "timeout": config.command_timeout_s}
    )
    agent = DefaultAgent(model, env, **agent_config)
    try:
        result = agent.run(instruction)
    except Exception as exc:  # the agent re-raises what it could not handle: no graded ending
        raise EpisodeFailed(f"mini-swe-agent run failed: {type(exc).__name__}: {exc}"[:3000]) from exc
    status = str(result.get("exit_status", ""))
    if status not in ENDINGS:
        raise EpisodeFailed(f"mini-swe-agent ended with exit status {status!r}"[:3000])
    format_errors = sum(1 for m in agent.messages if (m.get("extra") or {}).get("interrupt_type") == "FormatError")
    log.info("miniswe episode ended", extra={"ending": ENDINGS[status], "steps": agent.n_calls})
    return AgentRun(
        ending=ENDINGS[status],
        exit_status=status,
        steps=agent.n_calls,
        format_errors=format_errors,
        trajectory=json.dumps(redacted(agent.serialize()), default=str),
    )


def redacted(data: dict[str, Any]) -> dict[str, Any]:
    """The serialized run without the episode's key (the model config holds it in ``model_kwargs``)."""
    kwargs = data.get("info", {}).get("config", {}).get("model", {}).get("model_kwargs")
    if isinstance(kwargs, dict) and "api_key" in kwargs:
        kwargs["api_key"] = "<redacted>"
    return data
