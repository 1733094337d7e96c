"""Hyper-parameter sweeps: one YAML spec → many trials → one Slurm job array, submitted through submitit.

Each trial is an ordinary training run (:class:`cluster.task.TrainTask`) with its own run folder
``<sweep>/trials/<i>``, so it checkpoints and requeues on its own; W&B groups the trials under the
sweep id. ``<sweep>/sweep.json`` records what was submitted; :func:`status` reads it back together
with each trial's ``result.json`` and Slurm's view of the array.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from submitit.core.utils import FailedJobError, FailedSubmissionError

from cluster.profile import Profile, load_profile
from cluster.submit import check_slurm, executor, renderable
from cluster.task import TrainTask
from trainer.build import load_checked as load_train_config
from trainer.errors import UserError
from trainer.files import load_yaml, write_json

METRICS = ("test_accuracy", "test_loss", "train_samples_per_s", "train_time_s", "global_step")
"""Numeric keys of a run's result.json that a sweep can rank trials by."""

DISTRIBUTIONS = ("uniform", "log_uniform", "int_uniform")
"""Distributions a random sweep samples a parameter from (besides a list of choices)."""

MAX_TRIALS = 1000
"""Slurm's default MaxArraySize is 1001 (indexes 0-1000): larger arrays are refused at submission."""

PER_TRIAL = ("run.dir", "run.name", "tracking.group", "checkpoint.signal")
"""Trainer keys the sweep sets for every trial itself (submitit warns with USR2: the trainer must save on it)."""

FINISHED = ("completed", "failed", "cancelled", "timeout", "out_of_memory", "node_fail", "boot_fail", "deadline",
            "preempted")
"""Slurm states (lower case) after which a trial runs no more; a requeued task shows pending/requeued instead."""


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
    """Trainer arguments: the spec's fixed args, then the overrides as key=value."""

    def task_args(self, sweep_dir: Path) -> list[str]:
        """The trial's full trainer arguments, as TrainTask gets them: the warning signal submitit sends (first,
        as `python -m cluster submit` does), ``args``, then its own run folder, W&B group and run name."""
        return ["checkpoint.signal=SIGUSR2", *self.args, f"run.dir={sweep_dir / 'trials' / str(self.index)}",
                f"tracking.group={sweep_dir.name}", f"run.name={sweep_dir.name}-{self.index}"]


@dataclass
class Row:
    """One trial as :func:`status` sees it."""

    index: int
    """Trial index."""
    overrides: dict[str, Any]
    """The trial's swept values."""
    state: str
    """done (result.json), requeued (requeue.json), else Slurm's state in lower case, or unknown."""
    slurm: str
    """Slurm's own state in lower case, or unknown when neither sacct nor squeue knows the task."""
    value: float | None
    """The metric from result.json; None until the trial is done."""
    run_dir: Path
    """The trial's run folder."""


def _err(key: str, message: str, hint: str) -> UserError:
    return UserError(f"sweep.{key}" if key else "sweep", message, hint)


def _fmt(value: Any) -> str:
    """A value as the table shows it (YAML's spelling of scalars)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)


def _arg(key: str, value: Any) -> str:
    """``key=value`` that the trainer's parser (YAML, via OmegaConf's dotlist) reads back as exactly ``value``.

    A string YAML would read as something else ("yes" → true, "0x10" → 16, "a #b" → "a") goes double-quoted.
    """
    plain = f"{key}={_fmt(value)}"
    if not isinstance(value, str):
        return plain
    try:
        back = OmegaConf.select(OmegaConf.from_dotlist([plain]), key)
    except OmegaConfBaseException:
        back = None
    return plain if isinstance(back, str) and back == value else f"{key}={json.dumps(value)}"


def _kv(overrides: dict[str, Any]) -> str:
    return " ".join(f"{k}={_fmt(v)}" for k, v in overrides.items())


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


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_parameter(spec: SweepSpec, key: str, value: Any) -> None:
    where = f"parameters.{key}"
    if isinstance(value, list):
        if not value:
            raise _err(where, "has no values", f"list one or more: {key}: [value1, value2]")
        for v in value:
            if isinstance(v, list | dict):
                raise _err(where, f"values must be single values, got {v!r}", f"list them flat: {key}: [value1, value2]")
        if len({json.dumps(float(v) if _number(v) else v) for v in value}) != len(value):  # 1 and 1.0 are one value
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
        if not _number(v) or (dist == "int_uniform" and not isinstance(v, int)):
            kind = "a whole number" if dist == "int_uniform" else "a number"
            raise _err(f"{where}.{k}", f"must be {kind}, got {v!r}", f"e.g. {example}")
    if lo >= hi:
        raise _err(where, f"min ({lo}) must be below max ({hi})", f"e.g. {example}")
    if dist == "log_uniform" and lo <= 0:
        raise _err(f"{where}.min", f"log_uniform needs min > 0, got {lo}", f"e.g. {example}")


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
    for key, value in spec.parameters.items():
        if key in PER_TRIAL:
            raise _err(f"parameters.{key}", "is set per trial by the sweep", "remove it from parameters")
        _check_parameter(spec, key, value)
    for arg in spec.args:
        if not isinstance(arg, str):
            raise _err("args", f"items must be key=value strings, got {arg!r}", "e.g. args: [train.epochs=2, optim.lr=0.1]")
        key = arg.split("=", 1)[0]
        if key in PER_TRIAL:
            raise _err("args", f"{key} is set per trial by the sweep", f"remove {arg!r} from args")
        if key in spec.parameters:
            raise _err("args", f"{key} is also a swept parameter", f"remove {arg!r} from args (the swept values would win)")
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
    return [Trial(i, c, [*spec.args, *(_arg(k, v) for k, v in c.items())]) for i, c in enumerate(combos)]


def check_trials(spec: SweepSpec, trials: list[Trial], sweep_dir: Path) -> None:
    """Validate every trial's full argument list with the trainer's own loader before anything is submitted.

    An error is renamed after what the user wrote: ``sweep.args`` for the fixed args, ``sweep.parameters.<key>``
    for a swept key; the trainer's hint is kept.
    """
    try:
        load_train_config(spec.args)
    except UserError as err:
        raise _err("args", f"{err.field}: {err.message}", err.hint) from None
    seen: set[tuple[str, ...]] = set()
    for t in trials:
        if tuple(t.args) in seen:  # random sweeps can draw the same values twice: one check is enough
            continue
        seen.add(tuple(t.args))
        try:
            load_train_config(t.task_args(sweep_dir))
        except UserError as err:
            if err.field in spec.parameters:
                raise _err(f"parameters.{err.field}", f"{err.message} (trial {t.index}: {_kv(t.overrides)})", err.hint) from None
            raise _err(f"trials.{t.index}", f"{err.field}: {err.message} (with {_kv(t.overrides)})", err.hint) from None


def _flat(prefix: str, value: Any) -> dict[str, Any]:
    """Nested profile overrides ({container: {runtime: docker}}) as the dotted keys load_profile takes."""
    if not isinstance(value, dict):
        return {prefix: value}
    return {k: v for key, sub in value.items() for k, v in _flat(f"{prefix}.{key}" if prefix else str(key), sub).items()}


def sweep_profile(spec: SweepSpec, sets: dict[str, object], sweep_dir: Path) -> Profile:
    """The profile every trial runs with: the spec's cluster, its profile overrides, then ``--set`` ones.

    The Slurm job name defaults to the sweep name; submitit's logs always go to ``<sweep>/logs``.
    """
    overrides: dict[str, object] = {"job_name": spec.name, **_flat("", spec.profile), **sets,
                                    "log_dir": str(sweep_dir / "logs")}
    try:
        p = load_profile(spec.cluster, overrides)
    except UserError as err:
        if err.field == "CLUSTER":
            raise UserError("sweep.cluster", err.message, err.hint) from None
        # A bad profile key may come from the spec's profile: or --set as well as from the profile file.
        raise UserError(f"sweep.{err.field}", err.message, f"{err.hint}; or the sweep's profile: and --set") from None
    if p.signal != "USR2" or p.launch != "srun":  # the same rule as `python -m cluster submit` with submitit
        raise UserError("sweep.profile.signal" if p.signal != "USR2" else "sweep.profile.launch",
                        "submitit always warns with USR2 and starts one task per process",
                        "use signal: USR2 and launch: srun for sweeps")
    if p.container.runtime != "none":
        # The batch shell's requeue rule watches $RUN_DIR for requeue.json: point it at this array task's trial.
        trials = shlex.quote(str(sweep_dir / "trials"))
        p = dataclasses.replace(p, setup=[*p.setup, f'export RUN_DIR={trials}/"${{SLURM_ARRAY_TASK_ID:-0}}"'])
    return p


def sweep_executor(p: Profile, spec: SweepSpec, sweep_dir: Path) -> Any:
    """The profile's submitit executor with the array throttle (``#SBATCH --array=0-N%max_parallel``); an optional
    preflight doctor checks the trials' folder and the spec's fixed args."""
    ex = executor(p, None, [*spec.args, f"run.dir={sweep_dir / 'trials'}"])
    ex.update_parameters(slurm_array_parallelism=spec.max_parallel)
    return ex


def array_script(p: Profile, spec: SweepSpec, sweep_dir: Path, n: int) -> str:
    """The exact batch script submitit submits for an array of ``n`` trials.

    submitit sets ``map_count`` on a copy of the executor when it submits a batch of two or more
    (``SlurmExecutor._internal_process_submissions``); the same is done here on a throwaway executor.
    A single trial is submitted as a plain job, without ``--array``.
    """
    with renderable():
        inner = sweep_executor(p, spec, sweep_dir)._executor
    if n > 1:
        inner.parameters["map_count"] = n
    return str(inner._make_submission_file_text(inner._submitit_command_str, "<uid>"))


def _columns(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows])


def trial_table(trials: list[Trial], parameters: list[str]) -> str:
    """The planned trials, one line each: index and swept values."""
    return _columns(["trial", *parameters], [[str(t.index), *(_fmt(t.overrides[k]) for k in parameters)] for t in trials])


def _new_sweep_dir(root: Path, name: str, create: bool) -> Path:
    """``root/sweeps/<name>-<time>``; with create, made here: mkdir is atomic, so two sweeps of one name started
    in the same second get different folders."""
    base = root / "sweeps" / f"{name}-{datetime.now():%Y%m%d-%H%M%S}"
    if create:
        base.parent.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        path = base if n == 1 else base.with_name(f"{base.name}-{n}")
        if create:
            with contextlib.suppress(FileExistsError):
                path.mkdir()  # atomic: of two sweeps started together, the second gets -2
                return path
        elif not path.exists():
            return path
        n += 1


def _unwritable(verb: str, sweep_dir: Path, exc: OSError) -> UserError:
    return UserError("SWEEP_DIR", f"cannot {verb} {str(sweep_dir)!r} ({exc.strerror or exc})",
                     "run the sweep from a folder this user can write, on storage every node shares")


def run(spec_path: str, sets: dict[str, object], dry_run: bool, wait: bool, poll_s: float = 5.0) -> int:
    """``python -m cluster sweep``: validate, then print (dry run) or submit the array; with wait, report the results."""
    spec = load_spec(spec_path)
    trials = plan(spec)
    sweep_dir = _new_sweep_dir(Path.cwd(), spec.name, create=False)
    if not re.fullmatch(r"[A-Za-z0-9._/+-]+", str(sweep_dir)):
        # submitit writes the log paths into the batch script (#SBATCH --output, srun --output) without quotes.
        raise UserError("SWEEP_DIR", f"{str(sweep_dir)!r} has characters submitit's batch script would not quote",
                        "run the sweep from a folder whose path has only letters, digits, '.', '_', '+', '-' and '/'")
    p = sweep_profile(spec, sets, sweep_dir)
    check_trials(spec, trials, sweep_dir)
    keys = list(spec.parameters)
    if dry_run:
        print(f"# sweep {spec.name}: {len(trials)} trials ({spec.method}), at most {spec.max_parallel} at a time, "
              f"profile {p.name}\n{trial_table(trials, keys)}\n")
        for t in trials:  # the tasks travel as pickles, not in the script
            print(f"# trial {t.index} runs: python -m trainer {shlex.join(t.task_args(sweep_dir))}")
        print()
        print(array_script(p, spec, sweep_dir, len(trials)), end="")
        return 0
    check_slurm()
    try:
        renamed = _new_sweep_dir(Path.cwd(), spec.name, create=True)
    except OSError as exc:
        raise _unwritable("create", sweep_dir, exc) from None
    if renamed != sweep_dir:  # another sweep took the name this second: the trials' folders follow the new one
        sweep_dir, p = renamed, sweep_profile(spec, sets, renamed)
    ex = sweep_executor(p, spec, sweep_dir)
    record = {
        "sweep_id": sweep_dir.name,
        "spec_file": str(Path(spec_path).resolve()),
        "spec": dataclasses.asdict(spec),
        "profile": p.name,
        "array_job_id": None,
        "submitted_at": None,
        "trials": [{"index": t.index, "overrides": t.overrides, "run_dir": str(sweep_dir / "trials" / str(t.index)),
                    "args": t.task_args(sweep_dir)} for t in trials],
    }
    try:  # written before submitting: a folder that cannot hold the record stops the sweep before anything runs
        (sweep_dir / "trials").mkdir()
        write_json(sweep_dir / "sweep.json", record)
        with ex.batch():  # one sbatch call: a job array
            jobs = [ex.submit(TrainTask(t.task_args(sweep_dir), p.max_requeues)) for t in trials]
    except OSError as exc:
        shutil.rmtree(sweep_dir, ignore_errors=True)
        raise _unwritable("write", sweep_dir, exc) from None
    except (FailedJobError, FailedSubmissionError):  # sbatch refused (partition, limits): no half-made sweep is left
        shutil.rmtree(sweep_dir, ignore_errors=True)
        print("sbatch refused the sweep's array; its message is above", file=sys.stderr)
        return 1
    array_id = str(jobs[0].job_id).split("_")[0]
    record.update(array_job_id=array_id, submitted_at=datetime.now().astimezone().isoformat(timespec="seconds"))
    write_json(sweep_dir / "sweep.json", record)
    shown = os.path.relpath(sweep_dir)  # as `make sweep-status` takes it, from the folder make runs in
    print(f"submitted sweep {sweep_dir.name}: {len(trials)} trials as Slurm array {array_id} "
          f"(at most {spec.max_parallel} at a time, profile {p.name})")
    print(f"folder: {shown}\nlogs:   {shown}/logs\nstatus: make sweep-status {shlex.quote('SWEEP_DIR=' + shown)}"
          f"    squeue -r -j {array_id}")
    return finish(sweep_dir, poll_s) if wait else 0


def finish(sweep_dir: Path, poll_s: float = 5.0) -> int:
    """``--wait``: wait for every trial, print the table and where each failed trial's log is; 1 if any failed."""
    try:
        rows = wait_for(sweep_dir, poll_s)
    except KeyboardInterrupt:  # stops the waiting, not the sweep
        print(f"\nstopped waiting; the sweep runs on: python -m cluster sweep-status {shlex.quote(str(sweep_dir))}",
              file=sys.stderr)
        return 130
    print(format_status(sweep_dir, rows))
    data = _read_sweep(sweep_dir)
    failed = [r for r in rows if r.state != "done"]
    for r in sorted(failed, key=lambda r: r.index):
        # submitit's log layout (rank 0); a one-trial sweep is a plain job, not an array
        job = data["array_job_id"] if len(rows) == 1 else f"{data['array_job_id']}_{r.index}"
        print(f"trial {r.index} ended {r.state} without a result; log: {sweep_dir / 'logs' / job / f'{job}_0_log.err'}",
              file=sys.stderr)
    return 1 if failed else 0


def _job_indexes(job: str, array_id: str, n: int) -> list[int]:
    """Array indexes named by a sacct/squeue JobID: ``123_4``, a pending range ``123_[0-3,7%2]``, or ``123``."""
    head, _, tail = job.partition("_")
    if head != array_id:
        return []
    if not tail:
        return [0] if n == 1 else []  # submitit submits a one-trial sweep as a plain job
    if tail.isdigit():
        return [int(tail)]
    out: list[int] = []
    for part in tail.strip("[]").split("%")[0].split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and (hi.isdigit() or not hi):
            out += range(int(lo), int(hi or lo) + 1)
    return out


def _ask(cmd: list[str]) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):  # no Slurm here, or it hangs
        return ""
    return proc.stdout if proc.returncode == 0 else ""


def slurm_states(array_id: str, n: int) -> dict[int, str]:
    """Slurm's state (lower case) of each array task: sacct first, squeue for tasks sacct does not know (yet)."""
    states: dict[int, str] = {}
    for cmd in (["sacct", "-j", array_id, "-n", "-P", "-X", "--format=JobID,State"],
                ["squeue", "-h", "-r", "-j", array_id, "-o", "%i|%T"]):
        for line in _ask(cmd).splitlines():
            job, _, state = line.strip().partition("|")
            for i in _job_indexes(job, array_id, n):
                if state.split():
                    states.setdefault(i, state.split()[0].lower())  # "CANCELLED by 0" → cancelled
        if len(states) >= n:
            break
    return states


def _read_sweep(sweep_dir: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads((sweep_dir / "sweep.json").read_text())
    except (OSError, ValueError):
        raise UserError("SWEEP_DIR", f"{str(sweep_dir)!r} is not a sweep folder (no readable sweep.json)",
                        "pass a folder under sweeps/ made by `make sweep`, e.g. SWEEP_DIR=sweeps/example-20250101-120000"
                        ) from None
    return data


def _sort_key(mode: str) -> Any:
    def key(r: Row) -> tuple[int, float, int]:
        if r.value is None:
            return (1, 0.0, r.index)
        return (0, -r.value if mode == "max" else r.value, r.index)
    return key


def status(sweep_dir: Path) -> list[Row]:
    """Every trial with its state and metric, best first (per the spec's mode); trials without a metric last."""
    data = _read_sweep(sweep_dir)
    metric, mode, trials = data["spec"]["metric"], data["spec"]["mode"], data["trials"]
    slurm = slurm_states(str(data["array_job_id"]), len(trials)) if data["array_job_id"] else {}
    rows = []
    for t in trials:
        run_dir = Path(t["run_dir"])
        raw = slurm.get(t["index"], "unknown")
        value: float | None = None
        try:
            found = json.loads((run_dir / "result.json").read_text())[metric]
            value = found if _number(found) else None
            state = "done"
        except (OSError, ValueError, KeyError):
            # A saved-for-requeue trial waits for its next start, unless Slurm has already ended it for good.
            state = "requeued" if (run_dir / "requeue.json").exists() and raw not in FINISHED else raw
        rows.append(Row(t["index"], t["overrides"], state, raw, value, run_dir))
    return sorted(rows, key=_sort_key(mode))


FORGOTTEN_S = 120.0
"""A trial Slurm never reported (no accounting, and squeue forgets ended jobs) counts as ended after this long."""


def wait_for(sweep_dir: Path, poll_s: float = 5.0) -> list[Row]:
    """Poll :func:`status` until Slurm has ended every trial (a requeued trial is waited for); print progress.

    Without accounting, a trial squeue once listed and no longer knows has ended (squeue forgets ended jobs);
    one never seen at all counts as ended after :data:`FORGOTTEN_S`, so waiting always ends.
    """
    last, seen, started = -1, set(), time.monotonic()
    while True:
        rows = status(sweep_dir)
        seen |= {r.index for r in rows if r.slurm != "unknown"}
        gone = time.monotonic() - started > FORGOTTEN_S
        ended = sum(r.slurm in FINISHED or (r.slurm == "unknown" and (r.state == "done" or r.index in seen or gone))
                    for r in rows)
        if ended != last:
            print(f"{ended}/{len(rows)} trials ended", flush=True)
            last = ended
        if ended == len(rows):
            return rows
        time.sleep(poll_s)


def format_status(sweep_dir: Path, rows: list[Row]) -> str:
    """The status table (trial, swept values, state, metric) and, last, the best trial's run folder."""
    data = _read_sweep(sweep_dir)
    metric, mode, keys = data["spec"]["metric"], data["spec"]["mode"], list(data["spec"]["parameters"])
    body = [[str(r.index), *(_fmt(r.overrides.get(k)) for k in keys), r.state,
             "-" if r.value is None else f"{r.value:.4f}" if isinstance(r.value, float) else str(r.value)] for r in rows]
    scored = sorted((r for r in rows if r.value is not None), key=_sort_key(mode))
    best = (f"best: trial {scored[0].index} ({metric} {scored[0].value}, {mode}): {scored[0].run_dir}" if scored
            else f"best: none yet (no trial has {metric} in its result.json)")
    array = data["array_job_id"] or "(not submitted)"
    head = f"sweep {data['sweep_id']}: array {array}, {len(rows)} trials, ranked by {metric} ({mode})"
    return f"{head}\n{_columns(['trial', *keys, 'state', metric], body)}\n{best}"


def newest_sweep(root: Path) -> Path:
    """The most recently submitted sweep folder under ``root/sweeps``."""
    found = sorted(root.glob("sweeps/*/sweep.json"), key=lambda f: f.stat().st_mtime)
    if not found:
        raise UserError("SWEEP_DIR", f"no sweep under {root / 'sweeps'}",
                        "submit one first (make sweep SWEEP=cluster/sweeps/example.yaml), or pass SWEEP_DIR=…")
    return found[-1].parent


def show_status(sweep_dir: str | None) -> int:
    """``python -m cluster sweep-status``: print the table of one sweep (default: the newest)."""
    folder = Path(sweep_dir) if sweep_dir else newest_sweep(Path.cwd())
    print(format_status(folder, status(folder)))
    return 0
