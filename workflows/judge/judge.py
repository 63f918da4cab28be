"""The judge: one request scores a finished group's episodes side by side; retried, then given up.

Steps of ``Judge.judge``: read each episode from the store over HTTP (``GET /episodes/<id>``), build
its trimmed view (``view.py``), dedupe equal views (identical trajectories then share one label and
so one score), shuffle the distinct views with a seed of the group and the attempt (a judge tends
to favour a position, e.g. the first; shuffling spreads that bias over the episodes instead of
always helping the same one), ask the judge endpoint once with the JSON schema, parse and clip.
An attempt that fails (transport error, 5xx, 408/429, an answer cut at ``max_tokens``, malformed
JSON) is retried with a fresh shuffle up to ``attempts`` in all; any other 4xx (a wrong model name
or key) is not worth repeating. Then ``JudgeFailed``: the caller abandons the group's episodes
with the reason; no score is ever made up.

The judge is any OpenAI-compatible chat endpoint. By default the proxy's unrecorded
``/passthrough/v1`` with the base model (``policy-base``: the frozen base, not the policy being
trained, so the judge does not drift with it); the environment can name another one
(``FLYWHEEL_JUDGE_BASE_URL``, ``FLYWHEEL_JUDGE_API_KEY``, ``FLYWHEEL_JUDGE_MODEL``). The key is
never logged nor stored: it is left out of the config's repr and of every audit record.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from contract.client import AsyncProxyClient, ProxyError
from workflows.base import Endpoint
from workflows.judge.prompt import MalformedJudgement, label, messages, parse, response_format
from workflows.judge.view import MAX_CHARS, MAX_PROMPT_CHARS, MAX_TURNS, distinct, fit

ENV_BASE_URL = "FLYWHEEL_JUDGE_BASE_URL"
ENV_API_KEY = "FLYWHEEL_JUDGE_API_KEY"
ENV_MODEL = "FLYWHEEL_JUDGE_MODEL"
DEFAULT_MODEL = "policy-base"
"""The proxy's name of the base model (``policy.base_model``): version 0, never the trained policy."""
RETRYABLE_4XX = (408, 409, 429)


@dataclass(frozen=True)
class JudgeConfig:
    base_url: str
    """An OpenAI-compatible base URL ending in ``/v1``."""
    api_key: str = field(repr=False)
    model: str = DEFAULT_MODEL
    rubric: str | None = None
    """Extra scoring instructions shown to the judge after the task (what matters, what to penalize)."""
    attempts: int = 3
    """Judge requests per group, the first included, before its episodes are abandoned."""
    tokens_per_trajectory: int = 160
    """``max_tokens`` is this times the distinct trajectories, plus 32: a reason of up to 300 characters and a score."""
    temperature: float = 0.0
    """Greedy: the same prompt gets the same judgement; a retry differs by its shuffle."""
    retry_wait_s: float = 2.0
    """Wait before repeating a failed request (times the attempt number); a malformed answer is repeated at once."""
    timeout_s: float = 600.0
    """Per request: a shared CPU engine can queue a long prompt for minutes."""
    max_chars: int = MAX_CHARS
    """Per content of a view (``view.py``'s trim rule)."""
    max_turns: int = MAX_TURNS
    max_prompt_chars: int = MAX_PROMPT_CHARS
    """All views together: past it, the per-content limit is halved until they fit (``fit``)."""
    seed: int = 0
    """Seeds the shuffles (with the group id and the attempt number)."""

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"judge attempts must be >= 1 (got {self.attempts})")
        if self.tokens_per_trajectory < 16:
            raise ValueError(f"tokens_per_trajectory must be >= 16 (got {self.tokens_per_trajectory})")
        if self.max_chars < 16 or self.max_turns < 2:
            raise ValueError(f"max_chars must be >= 16 and max_turns >= 2 (got {self.max_chars}, {self.max_turns})")

    @classmethod
    def from_env(cls, passthrough: Endpoint, environ: Mapping[str, str] | None = None, **options: Any) -> JudgeConfig:
        """The endpoint named by ``FLYWHEEL_JUDGE_*`` where set, else the proxy's passthrough and its key."""
        env = os.environ if environ is None else environ
        base_url = env.get(ENV_BASE_URL, "").strip().rstrip("/") or passthrough.base_url
        external = base_url != passthrough.base_url
        api_key = env.get(ENV_API_KEY, "").strip() or ("" if external else passthrough.api_key)
        if external and not api_key:
            raise ValueError(f"{ENV_BASE_URL} is set but {ENV_API_KEY} is not")
        model = env.get(ENV_MODEL, "").strip() or DEFAULT_MODEL
        return cls(base_url=base_url, api_key=api_key, model=model, **options)


class JudgeFailed(Exception):
    """No usable judgement after the allowed attempts; the message says why (for the abandon reason)."""

    def __init__(self, reason: str, attempts: int = 0) -> None:
        super().__init__(reason)
        self.attempts = attempts
        """Judge requests made before giving up."""


@dataclass(frozen=True)
class Verdict:
    score: float
    reason: str
    label: str
    """The episode's trajectory label in the accepted attempt's prompt."""
    clipped: bool


@dataclass(frozen=True)
class Judgement:
    """A group's scores and everything needed to audit them."""

    verdicts: dict[str, Verdict]
    """By episode id."""
    model: str
    prompt: list[dict[str, str]]
    answer: str
    latency_s: float
    """Of the accepted request."""
    attempts: int
    failures: list[str]
    """Why each earlier attempt was refused."""
    usage: dict[str, int]

    def audit(self, episode_id: str) -> dict[str, Any]:
        """What to store with one episode's reward: its verdict and the whole exchange behind it."""
        verdict = self.verdicts[episode_id]
        return {
            **asdict(verdict),
            "model": self.model,
            "latency_s": round(self.latency_s, 3),
            "attempts": self.attempts,
            "failures": self.failures,
            "usage": self.usage,
            "prompt": self.prompt,
            "answer": self.answer,
        }


@dataclass
class JudgeStats:
    """Counters over a run: they go into the runner's summary, so retries and give-ups show."""

    judged: int = 0
    """Groups scored."""
    failed: int = 0
    """Groups given up on (their episodes abandoned)."""
    requests: int = 0
    retries: int = 0
    malformed: int = 0
    clipped: int = 0
    """Scores outside the range, clipped."""
    duplicates: int = 0
    """Episodes whose view equalled an earlier one's in their group (scored once, shared)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "seconds": round(self.seconds, 2)}


def shuffled(n: int, *, seed: int, group_id: str, attempt: int) -> list[int]:
    """The order the judge sees ``n`` distinct views in: ``order[i]`` is the view shown as trajectory i.

    Seeded by the run's seed, the group and the attempt: reproducible, different from group to
    group (the position bias falls on different episodes) and from one retry to the next."""
    order = list(range(n))
    random.Random(f"{seed}/{group_id}/{attempt}").shuffle(order)
    return order


class _AttemptFailed(Exception):
    def __init__(self, reason: str, *, retry: bool = True) -> None:
        super().__init__(reason)
        self.retry = retry


class Judge:
    """Scores groups through one OpenAI-compatible endpoint; ``transport`` replaces the network in tests."""

    def __init__(self, config: JudgeConfig, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        self.stats = JudgeStats()
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(config.timeout_s, connect=10.0), transport=transport)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def judge(
        self, client: AsyncProxyClient, *, group_id: str, task: str, episode_ids: Sequence[str]
    ) -> Judgement:
        """Score ``episode_ids`` (finished episodes of one group) on ``task``; ``JudgeFailed`` if it cannot."""
        started = time.monotonic()
        try:
            return await self._judge(client, group_id=group_id, task=task, episode_ids=episode_ids)
        except JudgeFailed:
            self.stats.failed += 1
            raise
        finally:
            self.stats.seconds += time.monotonic() - started

    async def _judge(
        self, client: AsyncProxyClient, *, group_id: str, task: str, episode_ids: Sequence[str]
    ) -> Judgement:
        if not episode_ids:
            raise ValueError("no episodes to judge")
        cfg = self.config
        try:
            episodes = await asyncio.gather(*(client.episode(e) for e in episode_ids))
        except ProxyError as exc:
            raise JudgeFailed(f"could not read the group's episodes: {exc}") from exc
        views = fit(episodes, max_chars=cfg.max_chars, max_turns=cfg.max_turns, budget=cfg.max_prompt_chars)
        texts, index = distinct(views)
        self.stats.duplicates += len(views) - len(texts)
        failures: list[str] = []
        for attempt in range(1, cfg.attempts + 1):
            order = shuffled(len(texts), seed=cfg.seed, group_id=group_id, attempt=attempt)
            prompt = messages(task, [texts[j] for j in order], cfg.rubric)
            self.stats.retries += attempt > 1
            try:
                answer, usage, latency = await self._ask(prompt, len(texts))
                scores = parse(answer, len(texts))
            except MalformedJudgement as exc:
                self.stats.malformed += 1
                failures.append(f"attempt {attempt}: malformed answer: {exc}")
                continue
            except _AttemptFailed as exc:
                failures.append(f"attempt {attempt}: {exc}")
                if not exc.retry:
                    break
                if attempt < cfg.attempts:  # a busy or restarting endpoint: give it a moment
                    await asyncio.sleep(cfg.retry_wait_s * attempt)
                continue
            position = {j: i for i, j in enumerate(order)}
            verdicts = {}
            for episode_id in episode_ids:
                i = position[index[episode_id]]
                verdicts[episode_id] = Verdict(scores[i].score, scores[i].reason, label(i), scores[i].clipped)
            self.stats.clipped += sum(s.clipped for s in scores)
            self.stats.judged += 1
            return Judgement(verdicts, cfg.model, prompt, answer, latency, attempt, failures, usage)
        raise JudgeFailed(
            f"no valid judgement after {len(failures)} attempt(s): " + "; ".join(failures)[:3000], len(failures)
        )

    async def _ask(self, prompt: list[dict[str, str]], n: int) -> tuple[str, dict[str, int], float]:
        """One request: the answer's text, its token usage and latency; ``_AttemptFailed`` or ``MalformedJudgement``."""
        cfg = self.config
        body = {
            "model": cfg.model,
            "messages": prompt,
            "temperature": cfg.temperature,
            "max_tokens": cfg.tokens_per_trajectory * n + 32,
            "response_format": response_format(n),
        }
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.stats.requests += 1
        started = time.monotonic()
        try:
            response = await self._http.post(f"{cfg.base_url}/chat/completions", json=body, headers=headers)
        except httpx.TransportError as exc:
            raise _AttemptFailed(f"judge endpoint unreachable: {type(exc).__name__}: {exc}") from exc
        except (httpx.HTTPError, httpx.InvalidURL) as exc:  # e.g. a base URL without a scheme: no retry helps
            raise _AttemptFailed(f"cannot ask the judge endpoint: {type(exc).__name__}: {exc}", retry=False) from exc
        latency = time.monotonic() - started
        if response.status_code >= 400:
            retry = response.status_code >= 500 or response.status_code in RETRYABLE_4XX
            raise _AttemptFailed(f"judge endpoint answered {response.status_code}: {response.text[:300]}", retry=retry)
        try:
            data = response.json()
            choice = data["choices"][0]
            content = choice["message"]["content"]
            finish = choice.get("finish_reason")
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise MalformedJudgement(f"not a chat completion: {response.text[:200]!r}") from exc
        raw_usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
        usage = {
            k: int(v)
            for k, v in raw_usage.items()
            if k in ("prompt_tokens", "completion_tokens") and isinstance(v, int)
        }
        self.stats.prompt_tokens += usage.get("prompt_tokens", 0)
        self.stats.completion_tokens += usage.get("completion_tokens", 0)
        if finish == "length":
            raise MalformedJudgement(f"answer cut at max_tokens ({body['max_tokens']})")
        if content is not None and not isinstance(content, str):
            raise MalformedJudgement(f"message content is {type(content).__name__}, not text")
        return content or "", usage, latency
