"""The sweep spec: loading and validation, before anything is submitted. The search space, samplers, pruners and the
study itself are Optuna's (:mod:`cluster.sweeps.study`)."""

from __future__ import annotations

import json
import math
import re
import shlex
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.core.errors import UserError
from trainer.core.files import load_yaml
from trainer.core.legacy import LEGACY


def fmt(value: Any) -> str:
    """A value as YAML spells a scalar (the trials' overrides, and the status table)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


METRICS = ("test_accuracy", "test_loss", "train_samples_per_s", "train_time_s", "global_step")
"""Numeric keys of a run's result.json that a sweep can rank trials by."""

METHODS = ("tpe", "random", "grid", "cmaes")
"""Optuna samplers: TPE and CMA-ES adapt to the results so far; random and grid are planned at submission."""

PRUNERS = ("none", "median", "asha", "hyperband")
"""Optuna pruners (asha: successive halving), fed by the trials' intermediate values."""

TYPES = ("float", "int", "categorical")
"""Optuna's distributions, spelled as in its ``suggest_*`` calls."""

OLD = {"uniform": ("float", False), "log_uniform": ("float", True), "int_uniform": ("int", False)}
"""The distributions of earlier specs ({distribution: …, min: …, max: …}), read as Optuna's."""

MAX_TRIALS = 1000
"""A bound on one sweep's trials (each has its own run folder)."""

PER_TRIAL = ("run.dir", "run.name", "tracking.group")
"""Trainer keys the sweep sets for every trial itself (the run folder as RUN_DIR)."""


@dataclass
class SweepSpec:
    name: str = ""
    """Sweep name (letters, digits, '.', '_' and '-'); default: the spec file's stem. Also the Slurm job name."""
    cluster: str = "dev"
    """Cluster profile: a name in cluster/profiles or a YAML path (relative to the current folder)."""
    profile: dict[str, Any] = field(default_factory=dict)
    """Profile overrides for every trial, e.g. {nodes: 1}; `--set KEY=VALUE` overrides these."""
    method: str = "grid"
    """The sampler: tpe or cmaes (adaptive), random (``trials`` seeded draws), grid (every combination of lists)."""
    trials: int | None = None
    """How many trials to run (1-1000); a grid runs each combination once (default: all of them)."""
    seed: int = 0
    """Sampling seed: random and grid trials are planned once from it (no duplicates across workers)."""
    max_parallel: int = 4
    """Workers: array tasks that each run one trial after another, asking the study, until ``trials`` are done."""
    metric: str = "test_accuracy"
    """Key of result.json that the study optimises: test_<metric> (test_accuracy, test_loss, or any metric the task's
    eval_step returns), train_samples_per_s, train_time_s, global_step."""
    mode: str = "max"
    """max (higher metric is better) or min."""
    pruner: str = "none"
    """Stops trials whose intermediate values (reported at each evaluation) trail: none, median, asha, hyperband."""
    sampler_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the Optuna sampler, e.g. {n_startup_trials: 4} for tpe."""
    pruner_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the Optuna pruner, e.g. {min_resource: 2, reduction_factor: 2} for asha."""
    storage: str = "journal"
    """Where the study lives: journal (a file in the sweep folder, on storage every node shares) or an RDB URL
    (mysql+pymysql://user:password@host/db, postgresql://…)."""
    args: list[str] = field(default_factory=list)
    """Trainer overrides (key=value) shared by all trials."""
    command: str | None = None
    """Instead of the built-in trainer, this command (shell words, e.g. "python train.py --epochs 2"): a swept
    parameter fills its ``{name}`` placeholders, or else is appended as ``--name value``. RUN_DIR is the trial's folder."""
    parameters: dict[str, Any] = field(default_factory=dict)
    """Trainer key → a list of values (categorical), or {type: float|int, low: …, high: …, log: true, step: …}, or
    {type: categorical, choices: […]}."""


def bad(key: str, message: str, hint: str) -> UserError:
    """A bad sweep spec: the field is named ``sweep.KEY``."""
    return UserError(f"sweep.{key}" if key else "sweep", message, hint)


def _arg(key: str, value: Any) -> str:
    """``key=value`` that the trainer's parser (YAML, via OmegaConf's dotlist) reads back as exactly ``value``.

    A string YAML would read as something else ("yes" → true, "0x10" → 16, "a #b" → "a") goes double-quoted.
    """
    plain = f"{key}={fmt(value)}"
    if not isinstance(value, str):
        return plain
    try:
        back = OmegaConf.select(OmegaConf.from_dotlist([plain]), key)
    except OmegaConfBaseException:
        back = None
    return plain if isinstance(back, str) and back == value else f"{key}={json.dumps(value)}"


def overrides_text(overrides: dict[str, Any]) -> str:
    """``key=value …`` as a line shows them."""
    return " ".join(f"{k}={fmt(v)}" for k, v in overrides.items())


def trial_args(spec: SweepSpec, params: dict[str, Any], sweep_id: str, number: int) -> list[str]:
    """A trial's arguments: the trainer's (fixed args, its values, its W&B group and run name), or the command's argv."""
    if spec.command is not None:
        return command_argv(spec.command, params)
    return [*spec.args, *(_arg(k, params[k]) for k in spec.parameters if k in params),
            f"tracking.group={sweep_id}", f"run.name={sweep_id}-{number}"]


def load_spec(path: str | Path) -> SweepSpec:
    """Read and validate a sweep spec; every problem is a UserError naming the ``sweep.<field>``."""
    path = Path(path)
    loaded = load_yaml(path, "SWEEP", "pass a YAML file, e.g. SWEEP=cluster/sweeps/example.yaml")
    for key, kind in (("profile", DictConfig), ("parameters", DictConfig), ("args", ListConfig),
                      ("sampler_args", DictConfig), ("pruner_args", DictConfig)):
        # OmegaConf raises a bare TypeError (no key) when a list meets a mapping field, or the reverse.
        if loaded.get(key) is not None and not isinstance(loaded.get(key), kind):
            shape = "a mapping (key: value lines)" if kind is DictConfig else "a list (- item lines)"
            raise bad(key, f"must be {shape}, got {loaded.get(key)!r}", "see cluster/sweeps/example.yaml")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(SweepSpec(name=path.stem)), loaded)
        spec: SweepSpec = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        key = str(getattr(exc, "full_key", None) or "")
        valid = ", ".join(f.name for f in fields(SweepSpec))
        raise bad(key, str(exc).splitlines()[0].replace("Key ", "key ").rstrip("."),
                   f"check {path}; valid keys: {valid}") from None
    validate(spec)
    return spec


def parameter(spec: SweepSpec, key: str, value: Any) -> dict[str, Any]:
    """One parameter as Optuna's terms: {type, low, high, log, step} or {type: categorical, choices}; checked."""
    where = f"parameters.{key}"
    if isinstance(value, list):
        value = {"type": "categorical", "choices": value}
    if not isinstance(value, dict):
        raise bad(where, f"must be a list of values or a distribution, got {value!r}", f"e.g. {key}: [{value}]")
    if "distribution" in value:  # an earlier spec's spelling
        kind, log = OLD.get(value["distribution"], (None, False))
        if kind is None:
            raise bad(f"{where}.distribution", f"must be one of {', '.join(OLD)}, got {value['distribution']!r}",
                       f"or Optuna's spelling: {key}: {{type: float, low: 0.001, high: 0.1, log: true}}")
        value = {"type": kind, "log": log, **{("low" if k == "min" else "high" if k == "max" else k): v
                                              for k, v in value.items() if k != "distribution"}}
    if "type" not in value and any(isinstance(v, list | dict) for v in value.values()):
        raise bad(where, "is a group of keys, not one key", f"write the dotted trainer key: {key}.{next(iter(value))}: [a, b]")
    kind = value.get("type")
    if kind not in TYPES:
        raise bad(f"{where}.type", f"must be one of {', '.join(TYPES)}, got {kind!r}",
                   f"e.g. {key}: {{type: float, low: 0.001, high: 0.1, log: true}}, or a list of values")
    if kind == "categorical":
        return {"type": kind, "choices": _choices(where, key, value)}
    return _range(where, key, kind, value)


def _choices(where: str, key: str, value: dict[str, Any]) -> list[Any]:
    unknown = sorted(set(value) - {"type", "choices"})
    if unknown:
        raise bad(f"{where}.{unknown[0]}", "unknown key", f"a categorical parameter has choices: {key}: [a, b]")
    choices = value.get("choices")
    if not isinstance(choices, list) or not choices:
        raise bad(where, "has no values", f"list one or more: {key}: [value1, value2]")
    for v in choices:
        if isinstance(v, list | dict):
            raise bad(where, f"values must be single values, got {v!r}", f"list them flat: {key}: [value1, value2]")
    if len({json.dumps(float(v) if is_number(v) else v) for v in choices}) != len(choices):  # 1 and 1.0 are one value
        raise bad(where, f"lists a value twice: {choices}", "list each value once (a repeat is a duplicate trial)")
    return choices


def _range(where: str, key: str, kind: str, value: dict[str, Any]) -> dict[str, Any]:
    example = (f"{key}: {{type: int, low: 16, high: 128, step: 16}}" if kind == "int"
               else f"{key}: {{type: float, low: 0.001, high: 0.1, log: true}}")
    unknown = sorted(set(value) - {"type", "low", "high", "log", "step"})
    if unknown:
        raise bad(f"{where}.{unknown[0]}", "unknown key", f"a range has low, high and optionally log or step: {example}")
    for k in ("low", "high"):
        v = value.get(k)
        if v is None:
            raise bad(f"{where}.{k}", "is required", f"e.g. {example}")
        if not is_number(v) or (kind == "int" and not isinstance(v, int)):
            raise bad(f"{where}.{k}", f"must be {'a whole number' if kind == 'int' else 'a number'}, got {v!r}",
                       f"e.g. {example}")
    low, high, log, step = value["low"], value["high"], bool(value.get("log", False)), value.get("step")
    if low >= high:
        raise bad(where, f"is an empty range: low ({low}) must be below high ({high})", f"e.g. {example}")
    if log and low <= 0:
        raise bad(f"{where}.low", f"a log range needs low > 0, got {low}", f"e.g. {example}")
    if step is not None and (log or not is_number(step) or step <= 0 or (kind == "int" and not isinstance(step, int))):
        raise bad(f"{where}.step", f"must be a positive {'whole ' if kind == 'int' else ''}number without log, "
                   f"got {step!r}{' with log: true' if log else ''}", f"e.g. {example}")
    return {"type": kind, "low": low, "high": high, "log": log, **({"step": step} if step is not None else {})}


def _check_args(spec: SweepSpec) -> None:
    """The spec's fixed trainer arguments: key=value strings, none set per trial, swept, or of an earlier version."""
    for arg in spec.args:
        if not isinstance(arg, str):
            raise bad("args", f"items must be key=value strings, got {arg!r}", "e.g. args: [train.epochs=2, optim.lr=0.1]")
        key = arg.split("=", 1)[0]
        if key in LEGACY:
            raise bad("args", f"{key} is no longer a key ({LEGACY[key][1]})", f"remove {arg!r} from args")
        if key in PER_TRIAL:
            raise bad("args", f"{key} is set per trial by the sweep", f"remove {arg!r} from args")
        if key in spec.parameters:
            raise bad("args", f"{key} is also a swept parameter", f"remove {arg!r} from args (the swept values would win)")


def validate(spec: SweepSpec) -> None:
    """Reject a spec no sweep can run (the trainer checks each trial's values later, in ``check_trials``)."""
    if not re.fullmatch(r"[A-Za-z0-9._-]+", spec.name):
        raise bad("name", f"{spec.name!r} has characters Slurm and shells treat specially",
                   "use letters, digits, '.', '_' and '-', e.g. name: lr-batch")
    if spec.method not in METHODS:
        raise bad("method", f"must be one of {', '.join(METHODS)}, got {spec.method!r}",
                   "method: tpe (adapts to results), random, grid (every combination) or cmaes")
    if spec.mode not in ("max", "min"):
        raise bad("mode", f"must be max or min, got {spec.mode!r}", "mode: max for accuracy, min for a loss")
    # A command's result.json and reports hold what it writes: any name goes (a trial that lacks it fails, saying so).
    if spec.command is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_./-]*", spec.metric):
        raise bad("metric", f"{spec.metric!r} cannot be a key of result.json", "e.g. metric: val_loss")
    if spec.command is None and spec.metric not in METRICS and not (spec.metric.startswith("test_")
                                                                    and len(spec.metric) > 5):
        raise bad("metric", f"{spec.metric!r} is not a metric of result.json",
                   f"use one of: {', '.join(METRICS)}, or test_<name> for any metric your task's eval_step returns")
    if spec.max_parallel < 1:
        raise bad("max_parallel", f"must be >= 1, got {spec.max_parallel}", "e.g. max_parallel: 4")
    if spec.pruner not in PRUNERS:
        raise bad("pruner", f"must be one of {', '.join(PRUNERS)}, got {spec.pruner!r}", "e.g. pruner: asha")
    if spec.pruner != "none" and spec.command is None and not spec.metric.startswith("test_"):
        raise bad("pruner", f"needs intermediate values of the metric, and {spec.metric} has none: trials report "
                   "their evaluation (test_*) metrics as they train", "rank by a test_* metric, or pruner: none")
    if spec.pruner == "none" and spec.pruner_args:
        raise bad("pruner_args", "are set but pruner is none", "choose a pruner (e.g. pruner: asha) or remove pruner_args")
    if spec.trials is not None and not 1 <= spec.trials <= MAX_TRIALS:
        raise bad("trials", f"must be 1-{MAX_TRIALS}, got {spec.trials}", "e.g. trials: 16")
    if spec.trials is None and spec.method != "grid":
        raise bad("trials", f"method: {spec.method} needs trials >= 1 (none given)", "e.g. trials: 16")
    if not spec.parameters:
        raise bad("parameters", "is empty: nothing to sweep", "e.g. parameters: {optim.lr: [0.01, 0.1]}")
    if spec.command is not None:
        _check_command(spec)
    for key, value in spec.parameters.items():
        if key in LEGACY and spec.command is None:
            raise bad(f"parameters.{key}", f"is no longer a key ({LEGACY[key][1]})", "remove it from parameters")
        if key in PER_TRIAL and spec.command is None:
            raise bad(f"parameters.{key}", "is set per trial by the sweep", "remove it from parameters")
        shape = parameter(spec, key, value)
        if spec.method == "grid" and shape["type"] != "categorical":
            raise bad(f"parameters.{key}", "a range needs an adaptive or random method (a grid lists its values)",
                       f"list the grid's values, e.g. {key}: [value1, value2], or set method: tpe and trials: N")
    _check_args(spec)
    space = _space(spec)
    if spec.trials and spec.trials > space:
        raise bad("trials", f"{spec.trials} distinct trials cannot be drawn: the parameters allow only {space}",
                   f"use trials: {space} or fewer, or widen the ranges")
    if spec.method == "grid" and space > MAX_TRIALS:
        raise bad("parameters", f"the grid has {space} trials; a sweep runs at most {MAX_TRIALS}",
                   f"list fewer values, split the sweep, or use method: tpe with trials: {MAX_TRIALS} or fewer")


def _check_command(spec: SweepSpec) -> None:
    """A command sweep: words that split, no trainer args, parameter names that make --name flags, known placeholders."""
    try:
        words = shlex.split(spec.command or "")
    except ValueError as exc:
        raise bad("command", f"cannot split {spec.command!r} into words ({exc})", "close every quote") from None
    if not words:
        raise bad("command", "is empty", 'e.g. command: "python train.py --epochs 2"')
    if spec.args:
        raise bad("args", "are trainer overrides; this sweep runs a command", "put fixed arguments in command:")
    for key in spec.parameters:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", key):
            raise bad(f"parameters.{key}", "is not a plain name (it becomes --name or fills {name})", "e.g. lr, batch-size")
    for name in re.findall(r"\{([^{}]*)\}", spec.command or ""):
        if name not in spec.parameters:
            raise bad("command", f"{{{name}}} names no parameter", f"parameters are: {', '.join(spec.parameters)}")


def _space(spec: SweepSpec) -> float:
    """How many distinct trials the parameters allow (lists and int ranges are finite; real ranges are not)."""
    sizes: list[float] = []
    for key, value in spec.parameters.items():
        p = parameter(spec, key, value)
        if p["type"] == "categorical":
            sizes.append(len(p["choices"]))
        elif p["type"] == "int" and not p["log"]:
            sizes.append((p["high"] - p["low"]) // p.get("step", 1) + 1)
        else:
            sizes.append(math.inf)
    return math.prod(sizes)


def grid(spec: SweepSpec) -> list[dict[str, Any]]:
    """Every combination of a grid's lists, the last parameter varying fastest, in the spec's order."""
    import itertools

    keys = list(spec.parameters)
    lists = [parameter(spec, k, spec.parameters[k])["choices"] for k in keys]
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*lists)]


def command_argv(command: str, values: dict[str, Any]) -> list[str]:
    """The command's words with ``{name}`` placeholders filled; values without a placeholder follow as --name value."""
    words, unused = shlex.split(command), dict(values)
    for key, value in values.items():
        if any(f"{{{key}}}" in w for w in words):
            words = [w.replace(f"{{{key}}}", fmt(value)) for w in words]
            del unused[key]
    return [*words, *(a for k, v in unused.items() for a in (f"--{k}", fmt(v)))]
