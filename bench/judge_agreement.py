"""How far the LLM judge agrees with the math verifier, and what a judgement costs per group.

One run: vLLM and the proxy start (``deploy.stack.Stack`` with ``configs/run-local.yaml``'s engine
and proxy, free ports, a temporary data directory; or the proxy in front of ``--engine-url``), the
math workflow runs ``--groups`` groups of ``--group-size`` episodes with its verifier's rewards
(``make run``'s sampling: temperature 0.7, 64 tokens), then the judge (``workflows/judge``, through
the proxy's unrecorded ``/passthrough/v1``, the base model ``policy-base``: SmolLM2-135M-Instruct
here) scores each recorded group once. Nothing the judge says is posted: the episodes keep their
verifier rewards, the judge's scores are only compared with them.

Figures:

- pairwise agreement: over the pairs of episodes of one group whose verifier rewards differ, the
  share the judge orders the same way (a judge tie counts half); chance is 0.5;
- Spearman's rho between judge scores and verifier rewards, within each group where both vary
  (mean over those groups: GRPO only uses ranks within a group), and pooled over all episodes;
- cost per group: judge requests (retries included), prompt and completion tokens, seconds.

``--reference`` judges every group a second time with the gold answer in the rubric ("the correct
final answer is 42"): how much of the gap is the judge not knowing the answer rather than not
reading the trajectories. Prints progress and one sample judgement to stderr, a table, then one
JSON object as the last line. Time: about a minute to start vLLM, ``groups x group_size`` short
episodes, then ~10-30 s per judgement on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from bench._procs import ROOT, free_port
from contract.client import AsyncProxyClient
from deploy.run_config import RunConfig, load_run_config
from deploy.stack import Stack
from workflows.base import Endpoint
from workflows.judge import Judge, JudgeConfig, JudgeFailed
from workflows.math.run import MathOptions, MathWorkflow
from workflows.runner import GroupResult, Runner
from workflows.runner import RunConfig as WorkflowRunConfig

RUN_CONFIG = ROOT / "configs" / "run-local.yaml"


def log(message: str) -> None:
    print(f"[judge_agreement] {message}", file=sys.stderr, flush=True)


# -- agreement -------------------------------------------------------------------------------------


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank (what Spearman's rho needs)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: list[float], y: list[float]) -> float | None:
    """Spearman's rho (Pearson's r of the ranks); None when either side has no variance."""
    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    return None if sxx == 0 or syy == 0 else sxy / (sxx * syy) ** 0.5


def pairs(verifier: list[float], judge: list[float]) -> tuple[int, int, int]:
    """Over pairs with different verifier rewards: (judge agrees, judge disagrees, judge ties)."""
    agree = disagree = ties = 0
    for i in range(len(verifier)):
        for j in range(i + 1, len(verifier)):
            if verifier[i] == verifier[j]:
                continue
            if judge[i] == judge[j]:
                ties += 1
            elif (verifier[i] > verifier[j]) == (judge[i] > judge[j]):
                agree += 1
            else:
                disagree += 1
    return agree, disagree, ties


def agreement(rows: list[tuple[list[float], list[float]]]) -> dict[str, Any]:
    """The figures over groups of (verifier rewards, judge scores)."""
    agree = disagree = ties = 0
    within = []
    for verifier, judge in rows:
        a, d, t = pairs(verifier, judge)
        agree, disagree, ties = agree + a, disagree + d, ties + t
        if (rho := spearman(verifier, judge)) is not None:
            within.append(rho)
    compared = agree + disagree + ties
    pooled = spearman([v for r in rows for v in r[0]], [j for r in rows for j in r[1]])
    return {
        "groups": len(rows),
        "pairs_compared": compared,
        "agree": agree,
        "disagree": disagree,
        "judge_ties": ties,
        "pairwise_agreement": round((agree + 0.5 * ties) / compared, 3) if compared else None,
        "spearman_within_mean": round(sum(within) / len(within), 3) if within else None,
        "spearman_within_groups": len(within),
        "spearman_pooled": round(pooled, 3) if pooled is not None else None,
    }


# -- the run ---------------------------------------------------------------------------------------


def stack_config(workdir: Path, engine_url: str | None) -> RunConfig:
    """``run-local.yaml`` with this run's data directory and free ports (or routed to ``engine_url``)."""
    shared = load_run_config(RUN_CONFIG)
    proxy_config = yaml.safe_load(shared.proxy_config_path.read_text())
    proxy_config["proxy"]["upstreams"][0]["url"] = f"http://127.0.0.1:{free_port()}"
    (workdir / "proxy.yaml").write_text(yaml.safe_dump(proxy_config))
    return dataclasses.replace(
        shared,
        data_dir=str(workdir),
        proxy_config=str(workdir / "proxy.yaml"),
        proxy_port=free_port(),
        resume=False,
        engine=dataclasses.replace(shared.engine, url=engine_url),
    )


async def judge_groups(
    client: AsyncProxyClient, judge: Judge, workflow: MathWorkflow, groups: list[GroupResult], tasks: dict[str, Any]
) -> tuple[list[tuple[list[float], list[float]]], list[dict[str, Any]], dict[str, Any] | None]:
    """Each group judged once, one after another (so its seconds are its own)."""
    rows, costs = [], []
    sample: dict[str, Any] | None = None
    for group in groups:
        rewarded = [e for e in group.episodes if e.status == "rewarded" and e.reward is not None]
        if len(rewarded) < 2:
            continue
        before = dataclasses.replace(judge.stats)
        started = time.monotonic()
        try:
            judgement = await judge.judge(
                client,
                group_id=group.group_id,
                task=workflow.describe_task(tasks[group.task_id]),
                episode_ids=[e.episode_id for e in rewarded],
            )
        except JudgeFailed as exc:
            log(f"group {group.group_id}: the judge gave up: {exc}")
            costs.append(_cost(judge, before, time.monotonic() - started, failed=True))
            continue
        costs.append(_cost(judge, before, time.monotonic() - started, failed=False))
        verifier = [float(e.reward or 0.0) for e in rewarded]
        scores = [judgement.verdicts[e.episode_id].score for e in rewarded]
        rows.append((verifier, scores))
        log(f"group {group.task_id}: verifier {verifier} judge {scores}")
        if sample is None and len(set(verifier)) > 1:
            by_label = {judgement.verdicts[e.episode_id].label: e.reward for e in rewarded}
            sample = {"prompt": judgement.prompt[1]["content"], "answer": judgement.answer, "verifier": by_label}
    return rows, costs, sample


def _cost(judge: Judge, before: Any, seconds: float, *, failed: bool) -> dict[str, Any]:
    now = judge.stats
    return {
        "requests": now.requests - before.requests,
        "prompt_tokens": now.prompt_tokens - before.prompt_tokens,
        "completion_tokens": now.completion_tokens - before.completion_tokens,
        "seconds": seconds,
        "failed": failed,
    }


def per_group(costs: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(costs)
    if not n:
        return {"groups": 0}
    return {
        "groups": n,
        "failed": sum(c["failed"] for c in costs),
        **{k: round(sum(c[k] for c in costs) / n, 2) for k in ("requests", "prompt_tokens", "completion_tokens")},
        "seconds": round(sum(c["seconds"] for c in costs) / n, 2),
    }


async def measure(stack: Stack, opts: argparse.Namespace) -> dict[str, Any]:
    workflow = MathWorkflow(MathOptions(temperature=opts.temperature, max_tokens=opts.max_tokens))
    tasks = {workflow.task_id(t): t for t in workflow.tasks("train")}
    config = WorkflowRunConfig(
        proxy_url=stack.proxy_url,
        admin_key=stack.key,
        groups=opts.groups,
        group_size=opts.group_size,
        concurrency=opts.group_size * 2,
        seed=opts.seed,
    )
    passthrough = Endpoint(f"{stack.proxy_url}/passthrough/v1", stack.key)
    out: dict[str, Any] = {}
    async with AsyncProxyClient(stack.proxy_url, stack.key) as client:
        started = time.monotonic()
        stats = await Runner(workflow, config, client).run()
        out["episodes"] = {**{k: v for k, v in stats.summary().items() if k != "errors"}}
        log(f"{opts.groups} groups played in {time.monotonic() - started:.1f} s; judging")
        for name in ["blind", "reference"] if opts.reference else ["blind"]:
            judge = Judge(JudgeConfig.from_env(passthrough, seed=opts.seed))
            rows: list[tuple[list[float], list[float]]] = []
            costs: list[dict[str, Any]] = []
            sample: dict[str, Any] | None = None
            for group in stats.groups:
                if name == "reference":  # the gold answer differs per group: one rubric each
                    gold = tasks[group.task_id].answer
                    judge.config = dataclasses.replace(judge.config, rubric=f"The correct final answer is {gold}.")
                r, c, s = await judge_groups(client, judge, workflow, [group], tasks)
                rows, costs, sample = rows + r, costs + c, sample or s
            await judge.aclose()
            out[name] = {
                "agreement": agreement(rows),
                "cost_per_group": per_group(costs),
                "judge": judge.stats.as_dict(),
                "sample": sample,
            }
    return out


def table(result: dict[str, Any]) -> str:
    lines = [
        "| judge | groups | pairs | agreement | Spearman within (groups) | pooled | requests | prompt tok | "
        "completion tok | s/group |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in ("blind", "reference"):
        if name not in result:
            continue
        a, c = result[name]["agreement"], result[name]["cost_per_group"]
        lines.append(
            f"| {name} | {a['groups']} | {a['pairs_compared']} | {a['pairwise_agreement']} | "
            f"{a['spearman_within_mean']} ({a['spearman_within_groups']}) | {a['spearman_pooled']} | "
            f"{c.get('requests')} | {c.get('prompt_tokens')} | {c.get('completion_tokens')} | {c.get('seconds')} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reference", action="store_true", help="also judge with the gold answer in the rubric")
    parser.add_argument("--engine-url", help="route to this running vLLM instead of starting one")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (store, logs)")
    opts = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="judge-agreement-"))
    stack = Stack(stack_config(workdir, opts.engine_url), data_dir=workdir)
    failed = True
    try:
        stack.start()
        result = asyncio.run(measure(stack, opts))
        failed = False
    finally:
        stack.stop()
        if opts.keep or failed:
            log(f"work directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    for name in ("blind", "reference"):
        if name in result and result[name]["sample"]:
            sample = result[name]["sample"]
            log(f"sample judgement ({name}), verifier rewards {sample['verifier']}:")
            print(sample["prompt"][-1500:], "\n--- answer ---\n", sample["answer"], file=sys.stderr)
    print(table(result))
    print(json.dumps({"config": vars(opts), **result}))


if __name__ == "__main__":
    main()
