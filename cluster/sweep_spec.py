"""The sweep spec: loading, validation, trial planning."""

from __future__ import annotations

import itertools
import json
import math
import random
import re
import shlex
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from cluster.trials import fmt, is_number
from trainer.core.errors import UserError
from trainer.core.files import load_yaml
from trainer.core.legacy import LEGACY

METRICS = ("test_accuracy", "test_loss", "train_samples_per_s", "train_time_s", "global_step")
"""Numeric keys of a run's result.json that a sweep can rank trials by."""

DISTRIBUTIONS = ("uniform", "log_uniform", "int_uniform")
"""Distributions a random sweep samples a parameter from (besides a list of choices)."""

MAX_TRIALS = 1000
"""Slurm's default MaxArraySize is 1001 (indexes 0-1000): larger arrays are refused at submission."""

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
    """grid (every combination of the listed values) or random (``trials`` seeded samples)."""
    trials: int | None = None
    """random only: number of trials to sample (1-1000)."""
    seed: int = 0
    """random only: sampling seed; the same seed gives the same trials."""
    max_parallel: int = 4
    """Trials running at once (the Slurm array's %N throttle)."""
    metric: str = "test_accuracy"
    """Key of result.json that ranks the trials: test_<metric> (test_accuracy, test_loss, or any metric the task's
    eval_step returns), train_samples_per_s, train_time_s, global_step."""
    mode: str = "max"
    """max (higher metric is better) or min."""
    args: list[str] = field(default_factory=list)
    """Trainer overrides (key=value) shared by all trials."""
    command: str | None = None
    """Instead of the built-in trainer, this command (shell words, e.g. "python train.py --epochs 2"): a swept
    parameter fills its ``{name}`` placeholders, or else is appended as ``--name value``. RUN_DIR is the trial's folder."""
    parameters: dict[str, Any] = field(default_factory=dict)
    """Trainer key → list of values (grid axis, or random choice), or for random
    {distribution: uniform|log_uniform|int_uniform, min: …, max: …}."""


@dataclass
class Trial:
    """One training run of a sweep."""

    index: int
    """Array task index (0-based)."""
    overrides: dict[str, Any]
    """The swept parameters' values, in the spec's parameter order."""
    args: list[str]
    """Trainer arguments: the spec's fixed args, then the overrides as key=value (a command sweep: its argv)."""
    command: bool = False
    """The spec runs a command, not the built-in trainer."""

    def task_args(self, sweep_dir: Path) -> list[str]:
        """The trial's full trainer arguments, as TrainTask gets them: ``args``, then its W&B group and run name (its
        run folder is RUN_DIR, which the array's batch script sets per task). A command gets ``args`` as they are."""
        if self.command:
            return list(self.args)
        return [*self.args, f"tracking.group={sweep_dir.name}", f"run.name={sweep_dir.name}-{self.index}"]


def _err(key: str, message: str, hint: str) -> UserError:
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


def _kv(overrides: dict[str, Any]) -> str:
    return " ".join(f"{k}={fmt(v)}" for k, v in overrides.items())


def load_spec(path: str | Path) -> SweepSpec:
    """Read and validate a sweep spec; every problem is a UserError naming the ``sweep.<field>``."""
    path = Path(path)
    loaded = load_yaml(path, "SWEEP", "pass a YAML file, e.g. SWEEP=cluster/sweeps/example.yaml")
    for key, kind in (("profile", DictConfig), ("parameters", DictConfig), ("args", ListConfig)):
        # OmegaConf raises a bare TypeError (no key) when a list meets a mapping field, or the reverse.
        if loaded.get(key) is not None and not isinstance(loaded.get(key), kind):
            shape = "a mapping (key: value lines)" if kind is DictConfig else "a list (- item lines)"
            raise _err(key, f"must be {shape}, got {loaded.get(key)!r}", "see cluster/sweeps/example.yaml")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(SweepSpec(name=path.stem)), loaded)
        spec: SweepSpec = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        key = str(getattr(exc, "full_key", None) or "")
        valid = ", ".join(f.name for f in fields(SweepSpec))
        raise _err(key, str(exc).splitlines()[0].replace("Key ", "key ").rstrip("."),
                   f"check {path}; valid keys: {valid}") from None
    validate(spec)
    return spec


def _check_parameter(spec: SweepSpec, key: str, value: Any) -> None:
    where = f"parameters.{key}"
    if isinstance(value, list):
        if not value:
            raise _err(where, "has no values", f"list one or more: {key}: [value1, value2]")
        for v in value:
            if isinstance(v, list | dict):
                raise _err(where, f"values must be single values, got {v!r}", f"list them flat: {key}: [value1, value2]")
        if len({json.dumps(float(v) if is_number(v) else v) for v in value}) != len(value):  # 1 and 1.0 are one value
            raise _err(where, f"lists a value twice: {value}", "list each value once (a repeat is a duplicate trial)")
        return
    if not isinstance(value, dict):
        raise _err(where, f"must be a list of values or a distribution, got {value!r}", f"e.g. {key}: [{value}]")
    if "distribution" not in value and any(isinstance(v, list | dict) for v in value.values()):
        sub = next(iter(value))
        raise _err(where, "is a group of keys, not one key", f"write the dotted trainer key: {key}.{sub}: [value1, value2]")
    if spec.method == "grid":
        raise _err(where, "a distribution needs method: random", f"list the grid's values, e.g. {key}: [value1, value2], "
                   "or set method: random and trials: N")
    dist = value.get("distribution")
    example = (f"{key}: {{distribution: int_uniform, min: 16, max: 128}}" if dist == "int_uniform"
               else f"{key}: {{distribution: log_uniform, min: 0.001, max: 0.1}}")
    unknown = sorted(set(value) - {"distribution", "min", "max"})
    if unknown:
        raise _err(f"{where}.{unknown[0]}", "unknown key", f"a distribution has distribution, min and max, e.g. {example}")
    for k in ("distribution", "min", "max"):
        if k not in value:
            raise _err(f"{where}.{k}", "is required", f"e.g. {example}")
    lo, hi = value["min"], value["max"]
    if dist not in DISTRIBUTIONS:
        raise _err(f"{where}.distribution", f"must be one of {', '.join(DISTRIBUTIONS)}, got {dist!r}", f"e.g. {example}")
    for k, v in (("min", lo), ("max", hi)):
        if not is_number(v) or (dist == "int_uniform" and not isinstance(v, int)):
            kind = "a whole number" if dist == "int_uniform" else "a number"
            raise _err(f"{where}.{k}", f"must be {kind}, got {v!r}", f"e.g. {example}")
    if lo >= hi:
        raise _err(where, f"min ({lo}) must be below max ({hi})", f"e.g. {example}")
    if dist == "log_uniform" and lo <= 0:
        raise _err(f"{where}.min", f"log_uniform needs min > 0, got {lo}", f"e.g. {example}")


def _check_args(spec: SweepSpec) -> None:
    """The spec's fixed trainer arguments: key=value strings, none set per trial, swept, or of an earlier version."""
    for arg in spec.args:
        if not isinstance(arg, str):
            raise _err("args", f"items must be key=value strings, got {arg!r}", "e.g. args: [train.epochs=2, optim.lr=0.1]")
        key = arg.split("=", 1)[0]
        if key in LEGACY:
            raise _err("args", f"{key} is no longer a key ({LEGACY[key][1]})", f"remove {arg!r} from args")
        if key in PER_TRIAL:
            raise _err("args", f"{key} is set per trial by the sweep", f"remove {arg!r} from args")
        if key in spec.parameters:
            raise _err("args", f"{key} is also a swept parameter", f"remove {arg!r} from args (the swept values would win)")


def validate(spec: SweepSpec) -> None:
    """Reject a spec no sweep can run (the trainer checks each trial's values later, in :func:`check_trials`)."""
    if not re.fullmatch(r"[A-Za-z0-9._-]+", spec.name):
        raise _err("name", f"{spec.name!r} has characters Slurm and shells treat specially",
                   "use letters, digits, '.', '_' and '-', e.g. name: lr-batch")
    if spec.method not in ("grid", "random"):
        raise _err("method", f"must be grid or random, got {spec.method!r}", "method: grid (every combination) or random")
    if spec.mode not in ("max", "min"):
        raise _err("mode", f"must be max or min, got {spec.mode!r}", "mode: max for accuracy, min for a loss")
    if spec.metric not in METRICS and not (spec.metric.startswith("test_") and len(spec.metric) > 5):
        raise _err("metric", f"{spec.metric!r} is not a metric of result.json",
                   f"use one of: {', '.join(METRICS)}, or test_<name> for any metric your task's eval_step returns")
    if spec.max_parallel < 1:
        raise _err("max_parallel", f"must be >= 1, got {spec.max_parallel}", "e.g. max_parallel: 4")
    if spec.method == "grid" and spec.trials is not None:
        raise _err("trials", "is for method: random only (a grid runs every combination)",
                   "remove trials:, or set method: random")
    if spec.method == "random":
        if spec.trials is None or spec.trials < 1:
            got = "none given" if spec.trials is None else f"got {spec.trials}"
            raise _err("trials", f"method: random needs trials >= 1 ({got})", "e.g. trials: 16")
        if spec.trials > MAX_TRIALS:
            raise _err("trials", f"{spec.trials} trials do not fit in one Slurm array (at most {MAX_TRIALS})",
                       f"Slurm's default MaxArraySize is 1001: use trials: {MAX_TRIALS} or fewer, or split the sweep")
    if not spec.parameters:
        raise _err("parameters", "is empty: nothing to sweep", "e.g. parameters: {optim.lr: [0.01, 0.1]}")
    if spec.command is not None:
        _check_command(spec)
    for key, value in spec.parameters.items():
        if key in LEGACY and spec.command is None:
            raise _err(f"parameters.{key}", f"is no longer a key ({LEGACY[key][1]})", "remove it from parameters")
        if key in PER_TRIAL and spec.command is None:
            raise _err(f"parameters.{key}", "is set per trial by the sweep", "remove it from parameters")
        _check_parameter(spec, key, value)
    _check_args(spec)
    space = _space(spec) if spec.method == "random" else math.inf
    if spec.trials and spec.trials > space:
        raise _err("trials", f"{spec.trials} distinct trials cannot be drawn: the parameters allow only {space}",
                   f"use trials: {space} or fewer, widen the ranges, or use method: grid")
    if spec.method == "grid":
        count = math.prod(len(v) for v in spec.parameters.values())
        if count > MAX_TRIALS:
            raise _err("parameters", f"the grid has {count} trials; one Slurm array holds at most {MAX_TRIALS}",
                       "Slurm's default MaxArraySize is 1001: list fewer values, split the sweep, "
                       f"or use method: random with trials: {MAX_TRIALS} or fewer")


def _check_command(spec: SweepSpec) -> None:
    """A command sweep: words that split, no trainer args, parameter names that make --name flags, known placeholders."""
    try:
        words = shlex.split(spec.command or "")
    except ValueError as exc:
        raise _err("command", f"cannot split {spec.command!r} into words ({exc})", "close every quote") from None
    if not words:
        raise _err("command", "is empty", 'e.g. command: "python train.py --epochs 2"')
    if spec.args:
        raise _err("args", "are trainer overrides; this sweep runs a command", "put fixed arguments in command:")
    for key in spec.parameters:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", key):
            raise _err(f"parameters.{key}", "is not a plain name (it becomes --name or fills {name})", "e.g. lr, batch-size")
    for name in re.findall(r"\{([^{}]*)\}", spec.command or ""):
        if name not in spec.parameters:
            raise _err("command", f"{{{name}}} names no parameter", f"parameters are: {', '.join(spec.parameters)}")


def _space(spec: SweepSpec) -> float:
    """How many distinct trials a random spec can draw (lists and int ranges are finite; real ranges are not)."""
    sizes = [len(v) if isinstance(v, list) else v["max"] - v["min"] + 1 if v["distribution"] == "int_uniform"
             else math.inf for v in spec.parameters.values()]
    return math.prod(sizes)


def _sample(rng: random.Random, value: Any) -> Any:
    if isinstance(value, list):
        return rng.choice(value)
    lo, hi = value["min"], value["max"]
    if value["distribution"] == "int_uniform":
        return rng.randint(lo, hi)  # both ends included
    x = math.exp(rng.uniform(math.log(lo), math.log(hi))) if value["distribution"] == "log_uniform" else rng.uniform(lo, hi)
    # 4 significant digits: what the table shows is exactly what ran; the clamp keeps rounding inside the bounds.
    return min(max(float(f"{x:.4g}"), lo), hi)


def plan(spec: SweepSpec) -> list[Trial]:
    """The trials of a validated spec: grid = every combination, the last parameter varying fastest, in the
    spec's order; random = ``trials`` samples from ``random.Random(seed)``, so the same seed gives the same trials."""
    keys = list(spec.parameters)
    if spec.method == "grid":
        combos = [dict(zip(keys, values, strict=True)) for values in itertools.product(*spec.parameters.values())]
    else:
        # Drawn in sequence, a repeat drawn again: more trials extend the list, and no trial runs twice.
        rng, combos, seen = random.Random(spec.seed), [], set()
        for _ in range(1000 * (spec.trials or 0)):
            c = {k: _sample(rng, spec.parameters[k]) for k in keys}
            if (text := json.dumps(c)) not in seen:
                seen.add(text)
                combos.append(c)
            if len(combos) == spec.trials:
                break
        else:  # validate() checked the space is large enough; only bad luck in a nearly full one ends here
            raise _err("trials", f"drew only {len(combos)} distinct trials of {spec.trials}",
                       "use fewer trials, or widen the ranges")
    if spec.command is not None:
        return [Trial(i, c, command_argv(spec.command, c), command=True) for i, c in enumerate(combos)]
    return [Trial(i, c, [*spec.args, *(_arg(k, v) for k, v in c.items())]) for i, c in enumerate(combos)]


def command_argv(command: str, values: dict[str, Any]) -> list[str]:
    """The command's words with ``{name}`` placeholders filled; values without a placeholder follow as --name value."""
    words, unused = shlex.split(command), dict(values)
    for key, value in values.items():
        if any(f"{{{key}}}" in w for w in words):
            words = [w.replace(f"{{{key}}}", fmt(value)) for w in words]
            del unused[key]
    return [*words, *(a for k, v in unused.items() for a in (f"--{k}", fmt(v)))]
