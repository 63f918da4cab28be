"""The OpenHands SDK agent, with its LLM on a Flywheel episode.

The LLM is ``openai/<model>`` on the proxy's ``/v1`` with the episode's key; the conversation id is
the episode id, so OpenHands also sends ``x-litellm-session-id: <episode id>`` on every call. Either
one files the call under the episode. Calls are not streamed, tools are called natively (vLLM's
hermes parser), and each episode works in its own ``LocalWorkspace`` directory.

How a run ends decides what the runner does with it: ``FINISHED`` (the agent stopped), ``STUCK``
(OpenHands' loop detector) and the iteration budget running out are the agent's own doing and get
evaluated; any other error (a refused or overflowing LLM call, a crashed tool) raises, so the
episode is abandoned with that error.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from workflows.base import EpisodeFailed

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("OPENHANDS_SUPPRESS_BANNER", "1")
os.environ.setdefault("LOG_LEVEL", "WARNING")  # OpenHands logs every step at INFO otherwise
# OpenHands refuses windows under 16k tokens; SmolLM2 serves 8k, and its prompt plus tools (~6.3k
# tokens) fit, leaving room for a few short steps. The workflow keeps max_iterations small for that.
os.environ.setdefault("ALLOW_SHORT_CONTEXT_WINDOWS", "true")

BUDGET_ENDINGS = {"MaxIterationsReached", "MaxBudgetReached"}
SHORT_SYSTEM_PROMPT = (
    "You are a careful software agent working in a Linux shell. Use the tools to inspect files, run "
    "commands and edit files until the task is done, then call the finish tool. Keep commands short."
)
"""For small-context models: OpenHands' own system prompt is ~3.5k tokens before the tools' ~2.7k."""


@dataclass(frozen=True)
class AgentConfig:
    model: str
    base_url: str
    """The proxy's OpenAI base URL (``<proxy>/v1``)."""
    api_key: str
    """The episode's key."""
    conversation_id: str
    """The episode id."""
    max_iterations: int = 6
    temperature: float = 1.0
    max_output_tokens: int = 256
    max_input_tokens: int = 8192
    max_message_chars: int = 4000
    """Longest tool output put back into the prompt (OpenHands truncates the middle)."""
    system_prompt: Literal["openhands", "short"] = "openhands"
    file_editor: bool = True
    terminal_params: dict[str, Any] | None = None
    timeout_s: int = 600


@dataclass(frozen=True)
class AgentRun:
    status: str
    ending: str
    """finished, stuck, or the budget code (MaxIterationsReached)."""
    events: int
    trajectory: str
    """The conversation's events as a JSON list (what TAC evaluators read)."""


def run_agent(instruction: str, workdir: Path, config: AgentConfig) -> AgentRun:
    """Run one OpenHands conversation to its end (blocking: call it in a thread)."""
    import openhands.tools.file_editor  # noqa: F401 - registers the tool
    import openhands.tools.terminal  # noqa: F401
    from openhands.sdk import LLM, Agent, Conversation, Tool
    from openhands.sdk.conversation.exceptions import ConversationRunError
    from openhands.sdk.event.conversation_error import ConversationErrorEvent
    from openhands.sdk.workspace import LocalWorkspace
    from pydantic import SecretStr

    llm = LLM(
        model=f"openai/{config.model}",
        base_url=config.base_url,
        api_key=SecretStr(config.api_key),
        api_mode="chat",
        reasoning_effort=None,
        native_tool_calling=True,
        stream=False,
        temperature=config.temperature,
        max_output_tokens=config.max_output_tokens,
        max_input_tokens=config.max_input_tokens,
        max_message_chars=config.max_message_chars,
        num_retries=0,
        timeout=config.timeout_s,
        caching_prompt=False,
        usage_id="flywheel-agent",
    )
    tools = [Tool(name="terminal", params=config.terminal_params or {})]
    if config.file_editor:
        tools.append(Tool(name="file_editor"))
    extra: dict[str, Any] = {"system_prompt": SHORT_SYSTEM_PROMPT} if config.system_prompt == "short" else {}
    agent = Agent(llm=llm, tools=tools, **extra)
    # Conversation is a factory whose overloads mypy cannot follow: hold it as Any.
    conversation: Any = Conversation(
        agent=agent,
        workspace=LocalWorkspace(working_dir=str(workdir)),
        conversation_id=uuid.UUID(config.conversation_id),
        max_iteration_per_run=config.max_iterations,
        visualizer=None,
    )
    try:
        conversation.send_message(instruction)
        try:
            conversation.run()
        except ConversationRunError as exc:
            raise EpisodeFailed(f"OpenHands run failed: {exc.__cause__ or exc}"[:3000]) from exc
        state = conversation.state
        status = str(getattr(state.execution_status, "value", state.execution_status))
        events = list(state.events)
        errors = [e for e in events if isinstance(e, ConversationErrorEvent)]
        if status == "error":
            code = errors[-1].code if errors else "unknown"
            if code not in BUDGET_ENDINGS:
                raise EpisodeFailed(f"OpenHands ended in error {code}: {errors[-1].detail if errors else ''}"[:3000])
            ending = code
        else:
            ending = status
        trajectory = json.dumps([json.loads(e.model_dump_json()) for e in events])
        return AgentRun(status=status, ending=ending, events=len(events), trajectory=trajectory)
    finally:
        conversation.close()
