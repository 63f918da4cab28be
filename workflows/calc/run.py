"""The calc workflow: a multi-turn OpenAI tool-calling agent on the calculator environment.

The agent is a plain ``openai`` client loop on the episode's base URL: real ``tools``, a
``tool_choice`` per turn, the parsed ``tool_calls`` executed, each result sent back as a
``role: tool`` message with its ``tool_call_id``. vLLM renders the tools into the prompt (the
served chat template), constrains the call to the schema and parses it (its ``hermes`` parser).

Turn plan (``tool_choice: named``, the default): the workflow knows the shape of the next action,
so it names it: one ``calculator`` call per step of the task's reference solution, then
``submit_answer``. The model decides what matters: which numbers and which operation, and which
number to submit. ``tool_choice: required`` lets the model pick the tool as well (up to
``len(steps) + 2`` calls; the episode ends at the first valid submission).

Reward = task success (the submitted answer is right); tool-call validity is reported apart.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from openai import AsyncOpenAI

from workflows.base import Endpoint, Episode, Outcome, Source, Split, Workflow
from workflows.calc.env import CALCULATOR, SUBMIT, TOOLS, CalcEnv, named
from workflows.calc.reward import Score, call_rewards, score
from workflows.calc.tasks import CHAIN, MIXES, CalcTask, generate

TIMEOUT_S = 600.0
"""Per request: on a busy CPU engine a short reply can wait minutes in the queue."""
SYSTEM_PROMPT = "Use the calculator for each step, then submit the answer."


def _demo_call(n: int, name: str, arguments: dict[str, Any], result: str) -> list[dict[str, Any]]:
    call_id = f"call_demo_{n}"
    return [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": result},
    ]


DEMO: list[dict[str, Any]] = [
    {"role": "user", "content": "What is (12 + 5) * 3 - 4?"},
    *_demo_call(0, CALCULATOR, {"a": 12, "op": "add", "b": 5}, "17"),
    *_demo_call(1, CALCULATOR, {"a": 17, "op": "multiply", "b": 3}, "51"),
    *_demo_call(2, CALCULATOR, {"a": 51, "op": "subtract", "b": 4}, "47"),
    *_demo_call(3, SUBMIT, {"answer": 47}, "submitted"),
]
"""A solved example episode before the task: real tool-call turns, as the chat template renders
them. It shows the model how a call looks and how a second step uses the first one's result (the
calculator's reply), which a 135M model does not infer from the tool schemas alone."""


@dataclass(frozen=True)
class CalcOptions:
    mix: str = "default"
    """Task mix: default (one- and two-step), one_step, two_step (see tasks.py)."""
    chain: int = 0
    """N >= 2: the long-horizon variant instead of the mix: chained tasks of N steps, each on the
    previous result, N + 1 calls an episode, the calculator answering with its tape (its last 10
    computations and the next step). chain=22: 23 calls, a context of ~5k tokens (measured 4.5k-4.9k)."""
    size: int | None = None
    """Tasks per split (default: 2000 train, 200 test)."""
    seed: int = 0
    """Seeds the draw of tasks (the split of a task never depends on it)."""
    max_tokens: int = 64
    """Completion cap per call: a calculator call is ~42 tokens in the Hermes format."""
    temperature: float = 0.7
    """Sampling temperature of training episodes (evaluation is always greedy)."""
    top_p: float = 0.9
    """Nucleus sampling of training episodes (the trainer reproduces it in its log-probs). Under the
    argument grammar the tail holds odd spellings of the forced text ('{', '"', 'name' for '{"',
    'name'); cutting it keeps calls well-formed. Merging no longer depends on it: the proxy splices
    the sampled ids of earlier turns into each follow-up prompt (``proxy/splice.py``)."""
    tool_choice: Literal["named", "required"] = "named"
    """named: the workflow names each turn's tool; required: the model picks it."""
    useful_call_reward: float = 0.0
    """Per-call reward for useful calls (call_rewards; used by the trainer with per-turn credit)."""
    system_prompt: str = SYSTEM_PROMPT
    demo: bool = True
    """Start with a solved example episode (DEMO) before the task."""

    def __post_init__(self) -> None:
        if self.mix not in MIXES:
            raise ValueError(f"mix must be one of {sorted(MIXES)}, got {self.mix!r}")
        if self.chain and (self.chain < 2 or self.mix != "default"):
            raise ValueError(f"chain must be 0 (off) or >= 2 steps, without a mix; got {self.chain}, mix {self.mix!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.size is not None and self.size < 1:
            raise ValueError(f"size must be >= 1, got {self.size}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


@dataclass
class Transcript:
    env: CalcEnv
    finish_reasons: list[str | None]
    versions: set[str]
    """The policy versions that answered (``X-Policy-Version``)."""


async def play(
    client: AsyncOpenAI, model: str, task: CalcTask, options: CalcOptions, *, temperature: float, top_p: float = 1.0
) -> Transcript:
    """Play one task with ``client``: the environment's record, each call's finish reason, the versions."""
    env = CalcEnv(task, tape=task.kind == CHAIN)
    versions: set[str] = set()
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": options.system_prompt},
        *(DEMO if options.demo else []),
        {"role": "user", "content": task.question},
    ]
    plan = [CALCULATOR] * len(task.steps) + [SUBMIT]
    turns = len(plan) if options.tool_choice == "named" else len(task.steps) + 2
    finish: list[str | None] = []
    for turn in range(turns):
        tool_choice: Any = named(plan[turn]) if options.tool_choice == "named" else "required"
        raw = await client.chat.completions.with_raw_response.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice=tool_choice,
            max_tokens=options.max_tokens,
            temperature=temperature,
            top_p=top_p,
        )
        versions.add(raw.headers.get("x-policy-version", "unknown"))
        choice = raw.parse().choices[0]
        finish.append(choice.finish_reason)
        calls = [c for c in choice.message.tool_calls or [] if getattr(c, "function", None) is not None]
        if not calls:
            env.no_call(f"no tool call (finish_reason {choice.finish_reason})")
            break
        messages.append(
            {
                "role": "assistant",
                "content": choice.message.content,
                "tool_calls": [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": c.function.arguments},  # type: ignore[union-attr]
                    }
                    for c in calls
                ],
            }
        )
        first = calls[0].function  # type: ignore[union-attr]
        result = env.execute(first.name, first.arguments, extra_calls=len(calls) - 1)
        if env.submitted or (options.tool_choice == "named" and plan[turn] == SUBMIT):
            break
        messages.append({"role": "tool", "tool_call_id": calls[0].id, "content": result.result or ""})
        messages += [
            {"role": "tool", "tool_call_id": c.id, "content": "error: one tool call per turn"} for c in calls[1:]
        ]
    return Transcript(env, finish, versions)


class CalcWorkflow(Workflow[CalcTask, CalcOptions]):
    """Arithmetic with a calculator tool over OpenAI tool calling; reward = the submitted answer is right."""

    name = "calc"
    options_type = CalcOptions
    episode_timeout_s = 600.0
    abandoned = "penalize"
    """An agent workflow: an episode that crashes or times out is the agent's failure."""

    def tasks(self, split: Source) -> Sequence[CalcTask]:
        options = self.options
        return generate(split, mix=options.mix, size=options.size, seed=options.seed, chain=options.chain)

    def task_id(self, task: CalcTask) -> str:
        return task.id

    def task_metadata(self, task: CalcTask) -> dict[str, Any]:
        return {
            "kind": task.kind,
            "question": task.question,
            "answer": task.answer,
            "steps": [f"{s.a} {s.op} {s.b}" for s in task.steps],
        }

    def stratum(self, task: CalcTask) -> str:
        return task.kind

    async def run_episode(self, task: CalcTask, episode: Episode) -> Outcome:
        # No client retries: a retried call would take a call ordinal of its own and shift call_rewards.
        async with AsyncOpenAI(
            base_url=episode.base_url, api_key=episode.api_key, timeout=TIMEOUT_S, max_retries=0
        ) as client:
            played = await play(
                client,
                episode.model,
                task,
                self.options,
                temperature=self.options.temperature,
                top_p=self.options.top_p,
            )
        result = score(played.env)
        return Outcome(
            reward=result.reward,
            call_rewards=call_rewards(played.env, self.options.useful_call_reward),
            metadata={
                **_summary(result),
                "finish_reasons": played.finish_reasons,
                "errors": [c.error for c in played.env.calls if c.error],
            },
        )

    async def evaluate(
        self, endpoint: Endpoint, *, split: Split, limit: int | None, concurrency: int, model: str
    ) -> dict[str, Any]:
        """Greedy episodes on the split's first ``limit`` tasks through ``endpoint`` (unrecorded).

        ``accuracy`` is task success; ``format_rate`` the share of episodes whose every call was a
        valid tool call, and ``call_validity`` the share of valid calls: a format-only gain shows
        there and not in ``accuracy``. A request that fails after the client's retries fails the
        evaluation: a report never silently drops tasks.
        """
        tasks = self.split_tasks(split)[:limit]
        if not tasks:
            raise ValueError(f"no {split} tasks to evaluate")
        slots = asyncio.Semaphore(concurrency)
        started = time.monotonic()
        async with AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, timeout=TIMEOUT_S) as client:
            versions: set[str] = set()

            async def one(task: CalcTask) -> tuple[CalcTask, Score]:
                async with slots:
                    played = await play(client, model, task, self.options, temperature=0.0)
                versions.update(played.versions)
                return task, score(played.env)

            results = await asyncio.gather(*(one(t) for t in tasks))
        by_kind: dict[str, list[Score]] = defaultdict(list)
        for task, result in results:
            by_kind[task.kind].append(result)
        return {
            "workflow": self.name,
            "split": split,
            "model": model,
            "n": len(results),
            **_rates([r for _, r in results]),
            "policy_versions": sorted(versions),
            "by_kind": {k: {"n": len(v), **_rates(v)} for k, v in sorted(by_kind.items())},
            "tool_choice": self.options.tool_choice,
            "max_tokens": self.options.max_tokens,
            "seconds": round(time.monotonic() - started, 2),
        }


def _summary(result: Score) -> dict[str, Any]:
    return {
        "success": result.success,
        "answer": result.answer,
        "gold": result.gold,
        "calls": result.calls,
        "valid_calls": result.valid_calls,
        "useful_calls": result.useful_calls,
        "all_valid": result.all_valid,
    }


def _rates(results: list[Score]) -> dict[str, float]:
    calls = sum(r.calls for r in results)
    return {
        "accuracy": sum(r.success for r in results) / len(results),
        "format_rate": sum(r.all_valid for r in results) / len(results),
        "call_validity": sum(r.valid_calls for r in results) / calls if calls else 0.0,
        "useful_call_rate": sum(r.useful_calls for r in results) / calls if calls else 0.0,
        "calls_per_episode": calls / len(results),
    }
