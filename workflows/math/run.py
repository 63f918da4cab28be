"""The math workflow: one chat call per episode, rewarded by checking the final answer.

The agent is a plain OpenAI client on the episode's base URL with the episode's key, which is all
any agent needs to become a data source. ``evaluate`` asks the same prompts greedily through the
unrecorded passthrough route and reports accuracy and format compliance separately.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

from workflows.base import Endpoint, Episode, Outcome, Source, Split, Workflow
from workflows.math.reward import check
from workflows.math.tasks import MIXES, MathProblem, generate, load_jsonl

TIMEOUT_S = 600.0
"""Per request: on a busy CPU engine a 96-token reply can wait minutes in the queue."""
SYSTEM_PROMPT = "Solve the problem. End your reply with a line 'Answer: <number>'."


@dataclass(frozen=True)
class MathOptions:
    mix: str = "basic"
    """Bundled task mix: basic (one-digit arithmetic and one-step word problems) or hard (two-digit)."""
    train_jsonl: Path | None = None
    """GSM8K-format JSONL ({"question", "answer": "... #### 42"}) used instead of the bundled train split."""
    test_jsonl: Path | None = None
    """GSM8K-format JSONL used instead of the bundled test split."""
    size: int | None = None
    """Use only the first N tasks of a split."""
    max_tokens: int = 96
    """Completion cap: CPU vLLM makes ~100 tokens/s in total, and the answers are short."""
    temperature: float = 1.0
    """Sampling temperature of training episodes (evaluation is always greedy)."""
    format_weight: float = 0.1
    """Reward = (1 - w) * correct + w * ends-with-'Answer: <number>'; 0 rewards correctness only."""
    system_prompt: str = SYSTEM_PROMPT
    """The same for training and evaluation, so their numbers compare."""

    def __post_init__(self) -> None:
        if self.mix not in MIXES:
            raise ValueError(f"mix must be one of {sorted(MIXES)}, got {self.mix!r}")
        if not 0.0 <= self.format_weight <= 1.0:
            raise ValueError(f"format_weight must be in [0, 1], got {self.format_weight}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        for path in (self.train_jsonl, self.test_jsonl):
            if path is not None and not path.is_file():
                raise ValueError(f"no such JSONL file: {path}")


class MathWorkflow(Workflow[MathProblem, MathOptions]):
    """Arithmetic and word problems (bundled generator or GSM8K JSONL); reward from the final answer."""

    name = "math"
    options_type = MathOptions
    episode_timeout_s = 300.0
    abandoned = "skip"
    """One chat call per episode: it can only fail on the proxy or the engine, never by the agent's doing."""

    def tasks(self, split: Source) -> Sequence[MathProblem]:
        path = self.options.train_jsonl if split == "train" else self.options.test_jsonl
        problems = load_jsonl(path, split) if path is not None else generate(split, mix=self.options.mix)
        return problems[: self.options.size] if self.options.size is not None else problems

    def task_id(self, task: MathProblem) -> str:
        return task.id

    def kind(self, task: MathProblem) -> str:
        """The generator's kind (``add1``, ``word1``, ...; ``jsonl`` for a file): pooled by ``--focus``.
        Not a stratum: the generated list is already interleaved by kind, and the order stays as measured."""
        return task.kind

    def task_metadata(self, task: MathProblem) -> dict[str, Any]:
        return {"kind": task.kind, "question": task.question, "answer": task.answer}

    def describe_task(self, task: MathProblem) -> str:
        return f"Solve this problem; the reply must end with a line 'Answer: <number>'.\n\n{task.question}"

    def messages(self, task: MathProblem) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.options.system_prompt}, {"role": "user", "content": task.question}]

    async def run_episode(self, task: MathProblem, episode: Episode) -> Outcome:
        # A client per episode (its own connection pool): openai 2.x and 3.x take different httpx clients.
        async with AsyncOpenAI(base_url=episode.base_url, api_key=episode.api_key, timeout=TIMEOUT_S) as client:
            response = await client.chat.completions.create(
                model=episode.model,
                messages=self.messages(task),  # type: ignore[arg-type]
                max_tokens=self.options.max_tokens,
                temperature=self.options.temperature,
            )
        choice = response.choices[0]
        result = check(choice.message.content or "", task.answer)
        return Outcome(
            reward=result.reward(self.options.format_weight),
            metadata={
                "answer": result.answer,
                "gold": task.answer,
                "correct": result.correct,
                "formatted": result.formatted,
                "finish_reason": choice.finish_reason,
            },
        )

    async def evaluate(
        self, endpoint: Endpoint, *, split: Split, limit: int | None, concurrency: int, model: str
    ) -> dict[str, Any]:
        """Greedy (temperature 0) answers to the split's first ``limit`` problems, unrecorded.

        Accuracy counts a right final answer in any format; format compliance is reported apart.
        A request that still fails after the client's retries fails the evaluation: a report
        never silently drops problems.
        """
        problems = self.split_tasks(split)[:limit]
        if not problems:
            raise ValueError(f"no {split} problems to evaluate")
        slots = asyncio.Semaphore(concurrency)
        versions: set[str] = set()
        started = time.monotonic()
        async with AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, timeout=TIMEOUT_S) as client:

            async def one(task: MathProblem) -> tuple[MathProblem, bool, bool]:
                async with slots:
                    raw = await client.chat.completions.with_raw_response.create(
                        model=model,
                        messages=self.messages(task),  # type: ignore[arg-type]
                        max_tokens=self.options.max_tokens,
                        temperature=0.0,
                    )
                versions.add(raw.headers.get("x-policy-version", "unknown"))
                result = check(raw.parse().choices[0].message.content or "", task.answer)
                return task, result.correct, result.formatted

            results = await asyncio.gather(*(one(p) for p in problems))
        by_kind: dict[str, list[tuple[bool, bool]]] = defaultdict(list)
        for task, correct, formatted in results:
            by_kind[task.kind].append((correct, formatted))
        return {
            "workflow": self.name,
            "split": split,
            "model": model,
            "n": len(results),
            "accuracy": sum(c for _, c, _ in results) / len(results),
            "format_rate": sum(f for _, _, f in results) / len(results),
            "policy_versions": sorted(versions),
            "by_kind": {
                k: {
                    "n": len(v),
                    "accuracy": sum(c for c, _ in v) / len(v),
                    "format_rate": sum(f for _, f in v) / len(v),
                }
                for k, v in sorted(by_kind.items())
            },
            "max_tokens": self.options.max_tokens,
            "seconds": round(time.monotonic() - started, 2),
        }
