"""``python -m workflows run|eval|list``: drive episodes through the proxy, evaluate, list workflows.

Examples::

    python -m workflows run math --proxy http://127.0.0.1:8100 --groups 8 --group-size 8 --concurrency 16
    python -m workflows run tau2 --proxy URL -o domain=retail --groups 2 --group-size 2 --loop
    python -m workflows run math --proxy URL --reward mix --judge-weight 0.5 --judge-rubric @rubric.txt
    python -m workflows run tac --proxy URL --source teacher:demo --groups 4 --group-size 1
    python -m workflows eval math --proxy URL --split test --limit 100
    python -m workflows list

The admin key comes from ``FLYWHEEL_ADMIN_KEY`` or ``--admin-key-file`` (default ``data/admin.key``,
which ``python -m proxy serve`` creates). Progress goes to stderr; the final summary is one JSON
object on stdout.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Annotated, Any, cast, get_args

import typer

from contract.client import AsyncProxyClient, ProxyError
from contract.keyfile import key_file_keys
from contract.vocabulary import ForkRule
from workflows.base import Endpoint, Split, Workflow
from workflows.config import RunConfig
from workflows.forking import ForkRuleName
from workflows.judge import REWARD_MODES, Judge, JudgeConfig, RewardMode
from workflows.options import OptionError, describe, parse_options
from workflows.registry import BUILTIN, load

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm must never fetch its price list

cli = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)

ProxyOpt = Annotated[str, typer.Option("--proxy", help="the proxy's URL, e.g. http://127.0.0.1:8100")]
KeyFileOpt = Annotated[Path, typer.Option("--admin-key-file", help="used when FLYWHEEL_ADMIN_KEY is unset")]
OptionsOpt = Annotated[
    list[str] | None, typer.Option("--option", "-o", help="workflow option key=value (see `python -m workflows list`)")
]
SplitOpt = Annotated[str, typer.Option("--split", help="train, val (held out of train) or test")]
REWARD_HELP = (
    "verifier (the workflow's check), judge (an LLM judge scores each finished group side by side) or mix; "
    "the judge is the proxy's /passthrough/v1 with policy-base unless FLYWHEEL_JUDGE_BASE_URL, "
    "FLYWHEEL_JUDGE_API_KEY and FLYWHEEL_JUDGE_MODEL name another"
)


def admin_key(path: Path) -> str:
    key = os.environ.get("FLYWHEEL_ADMIN_KEY", "").strip()
    if key:
        return key
    if path.exists():
        keys = key_file_keys(path.read_text())  # the first; later lines: a rotation's old keys
        if keys:
            return keys[0]
    raise typer.BadParameter(
        f"no admin key: set FLYWHEEL_ADMIN_KEY or write it to {path}", param_hint="--admin-key-file"
    )


def build(name: str, options: list[str] | None) -> Workflow[Any, Any]:
    try:
        cls = load(name)
        return cls(parse_options(cls.options_type, options or []))
    except (ValueError, OptionError) as exc:
        raise typer.BadParameter(str(exc)) from exc


def rubric_text(rubric: str | None) -> str | None:
    """``--judge-rubric``: the text itself, or ``@path`` for a file's text."""
    if rubric is None or not rubric.startswith("@"):
        return rubric
    path = Path(rubric[1:]).expanduser()
    try:
        return path.read_text()
    except OSError as exc:
        raise typer.BadParameter(f"cannot read the rubric file {path}: {exc}", param_hint="--judge-rubric") from exc


def check_reward(reward: str) -> RewardMode:
    for mode in REWARD_MODES:
        if reward == mode:
            return cast(RewardMode, mode)
    raise typer.BadParameter(f"reward must be one of {', '.join(REWARD_MODES)}, got {reward!r}", param_hint="--reward")


def check_split(split: str) -> Split:
    for known in get_args(Split):
        if split == known:
            return cast(Split, known)
    raise typer.BadParameter(f"split must be train, val or test, got {split!r}", param_hint="--split")


@cli.command()
def run(
    name: Annotated[str, typer.Argument(help="math, tau2, tac, or package.module:Class")],
    proxy: ProxyOpt,
    groups: Annotated[int, typer.Option(help="groups to run (ignored with --loop)")] = 1,
    group_size: Annotated[int, typer.Option(help="episodes per group (GRPO's G)")] = 4,
    concurrency: Annotated[int, typer.Option(help="episodes running at once")] = 4,
    split: SplitOpt = "train",
    loop: Annotated[bool, typer.Option(help="keep producing groups until interrupted")] = False,
    model: Annotated[str, typer.Option(help="model the agents ask for")] = "policy",
    timeout: Annotated[float | None, typer.Option(help="seconds per episode (default: the workflow's)")] = None,
    seed: Annotated[int, typer.Option(help="seeds the task order")] = 0,
    max_pending: Annotated[
        int | None, typer.Option(help="with --loop: wait while the trainer has this many complete groups unclaimed")
    ] = None,
    reward: Annotated[str, typer.Option(help=REWARD_HELP)] = "verifier",
    judge_weight: Annotated[float, typer.Option(help="the judge's share with --reward mix, in [0, 1]")] = 0.5,
    judge_rubric: Annotated[
        str | None, typer.Option(help="extra scoring instructions for the judge, or @file to read them from")
    ] = None,
    focus: Annotated[
        float, typer.Option(help="share of task draws that go where groups are likely to disagree (0: seeded order)")
    ] = 0.0,
    fork_share: Annotated[
        float, typer.Option(help="fork mode: share of the groups that fork a finished group (0: none)")
    ] = 0.0,
    fork_rule: Annotated[str, typer.Option(help="where to fork: uniform, failure or entropy")] = "failure",
    fork_size: Annotated[int | None, typer.Option(help="episodes per fork group (default: --group-size)")] = None,
    fork_on_divergence: Annotated[
        str, typer.Option(help="a fork whose agent's request differs from the replayed one: sample or abandon")
    ] = "sample",
    source: Annotated[
        str | None,
        typer.Option(
            help="who answers the agents: teacher:<name> (a teacher the proxy serves, e.g. teacher:demo, the "
            "scripted demonstrator) records demonstrations for a warm start, never trained on-policy; "
            "default: the policy"
        ),
    ] = None,
    option: OptionsOpt = None,
    admin_key_file: KeyFileOpt = Path("data/admin.key"),
) -> None:
    """Create groups of episodes for a workflow's tasks, run its agents, post rewards."""

    workflow = build(name, option)
    try:
        config = RunConfig(
            proxy_url=proxy,
            admin_key=admin_key(admin_key_file),
            groups=groups,
            group_size=group_size,
            concurrency=concurrency,
            split=check_split(split),
            loop=loop,
            model=model,
            episode_timeout_s=timeout,
            seed=seed,
            max_pending=max_pending,
            passthrough_key=os.environ.get("FLYWHEEL_AGENT_KEY") or None,
            reward=check_reward(reward),
            judge_weight=judge_weight,
            focus=focus,
            fork_share=fork_share,
            fork_rule=cast(ForkRuleName, fork_rule),
            fork_size=fork_size,
            fork_on_divergence=cast(ForkRule, fork_on_divergence),
            source=source,
        )
        passthrough = Endpoint(
            f"{config.proxy_url.rstrip('/')}/passthrough/v1", config.passthrough_key or config.admin_key
        )
        judge_config = (
            None
            if config.reward == "verifier"
            else JudgeConfig.from_env(passthrough, rubric=rubric_text(judge_rubric), seed=seed)
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc

    async def main() -> dict[str, Any]:
        return await _drive(workflow, config, judge_config, expected=None if loop else groups * group_size)

    try:
        summary = asyncio.run(main())
    except ProxyError as exc:
        typer.echo(f"workflows: {exc}", err=True)
        raise typer.Exit(2) from exc
    except asyncio.CancelledError:
        typer.echo("workflows: interrupted; running episodes were abandoned", err=True)
        raise typer.Exit(130) from None
    typer.echo(json.dumps(summary))


async def _drive(
    workflow: Workflow[Any, Any], config: RunConfig, judge_config: JudgeConfig | None, *, expected: int | None
) -> dict[str, Any]:
    """Run the groups with progress on stderr; the first Ctrl-C (or SIGTERM) stops new groups, the
    second abandons the running episodes. Returns the run's summary."""
    from workflows.progress import RunProgress
    from workflows.runner import Runner

    client = AsyncProxyClient(config.proxy_url, config.admin_key, timeout_s=60.0)
    judge = Judge(judge_config) if judge_config is not None else None
    with RunProgress(expected) as progress:
        runner = Runner(
            workflow,
            config,
            client,
            on_episode=progress.episode,
            on_group=progress.group,
            on_admission_wait=progress.admission_wait,
            judge=judge,
        )
        job = asyncio.current_task()

        def interrupt() -> None:
            if runner.stopping and job is not None:
                job.cancel()  # second signal: abandon what is still running
            else:
                progress.console.log("stopping: no new groups; Ctrl-C again to abandon running episodes")
                runner.stop()

        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, interrupt)
        try:
            stats = await runner.run()
        finally:
            await client.aclose()
            if judge is not None:
                await judge.aclose()
    return {"workflow": workflow.name, "split": config.split, **stats.summary()}


@cli.command("eval")
def evaluate(
    name: Annotated[str, typer.Argument(help="a workflow with an evaluation (math)")],
    proxy: ProxyOpt,
    split: SplitOpt = "test",
    limit: Annotated[int | None, typer.Option(help="first K problems of the split")] = None,
    concurrency: Annotated[int, typer.Option(help="requests at once")] = 16,
    model: Annotated[str, typer.Option(help="model to evaluate")] = "policy",
    output: Annotated[Path | None, typer.Option(help="also write the JSON report here")] = None,
    option: OptionsOpt = None,
    admin_key_file: KeyFileOpt = Path("data/admin.key"),
) -> None:
    """Evaluate the current policy through the unrecorded passthrough route; prints a JSON report."""
    workflow = build(name, option)
    key = os.environ.get("FLYWHEEL_AGENT_KEY") or admin_key(admin_key_file)
    endpoint = Endpoint(f"{proxy.rstrip('/')}/passthrough/v1", key)
    try:
        report = asyncio.run(
            workflow.evaluate(endpoint, split=check_split(split), limit=limit, concurrency=concurrency, model=model)
        )
    except NotImplementedError as exc:
        raise typer.BadParameter(f"workflow {name!r} has no evaluation") from exc
    text = json.dumps(report)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text + "\n")
    typer.echo(text)


@cli.command("list")
def list_workflows() -> None:
    """The built-in workflows and their -o options."""
    for name in BUILTIN:
        try:
            cls = load(name)
        except ValueError as exc:
            typer.echo(f"{name}: unavailable here ({exc})")
            continue
        typer.echo(f"{name}: {(cls.__doc__ or '').strip().splitlines()[0]}")
        for field, default, doc in describe(cls.options_type):
            typer.echo(f"  -o {field}=... (default {default}) {doc}")


if __name__ == "__main__":
    sys.exit(cli())
