"""Hyper-parameter sweeps: one YAML spec → many trials → one Slurm job array, submitted through submitit.

Each trial is an ordinary training run (:class:`cluster.task.TrainTask`), or the spec's ``command`` with the trial's
values (:class:`cluster.task.CommandTask`), with its own run folder
``<sweep>/trials/<i>``, so it checkpoints and requeues on its own; W&B groups the trials under the
sweep id. ``<sweep>/sweep.json`` records what was submitted; :func:`status` reads it back together
with each trial's ``result.json`` and Slurm's view of the array.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import shutil
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from submitit.core.utils import FailedJobError, FailedSubmissionError

from cluster.command import Command, requeue_after
from cluster.profile import Profile, load_profile
from cluster.submit import check_slurm, executor, load_train_config, renderable, suspect_nodes
from cluster.sweep_spec import SweepSpec, Trial, _err, _kv, load_spec, plan
from cluster.sweep_status import finish
from cluster.task import CommandTask, TrainTask
from cluster.trials import columns, fmt
from trainer.core.errors import UserError
from trainer.core.files import write_json
from trainer.runtime.batches import check_worlds


def check_trials(spec: SweepSpec, trials: list[Trial], sweep_dir: Path, worlds: list[int] | None = None) -> None:
    """Validate every trial's full argument list with the trainer's own loader before anything is submitted.

    An error is renamed after what the user wrote: ``sweep.args`` for the fixed args, ``sweep.parameters.<key>``
    for a swept key; the trainer's hint is kept.
    """
    if spec.command is not None:  # a command checks its own arguments when it starts
        return
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
            cfg = load_train_config(t.task_args(sweep_dir))
            if cfg.data.global_batch_size and worlds:  # each trial's global batch on the profile's processes
                check_worlds(cfg.data.global_batch_size, worlds, cfg.data.batch_size)
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
    # The batch shell's requeue rule watches $RUN_DIR for requeue.json (and a command writes there): this array
    # task's trial.
    trials = shlex.quote(str(sweep_dir / "trials"))
    return dataclasses.replace(p, setup=[*p.setup, f'export RUN_DIR={trials}/"${{SLURM_ARRAY_TASK_ID:-0}}"'])


def sweep_executor(p: Profile, spec: SweepSpec, sweep_dir: Path) -> Any:
    """The profile's submitit executor with the array throttle (``#SBATCH --array=0-N%max_parallel``); an optional
    preflight doctor checks the trials' folder and the spec's fixed args."""
    ex = executor(p, None, [] if spec.command is not None else spec.args, command=spec.command is not None)
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


def trial_table(trials: list[Trial], parameters: list[str]) -> str:
    """The planned trials, one line each: index and swept values."""
    return columns(["trial", *parameters], [[str(t.index), *(fmt(t.overrides[k]) for k in parameters)] for t in trials])


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


def _task(p: Profile, t: Trial, sweep_dir: Path) -> TrainTask | CommandTask:
    if t.command:
        return CommandTask(t.task_args(sweep_dir), p.signal, requeue_after(p) if p.requeue_on_signal else None)
    return TrainTask(t.task_args(sweep_dir))


def _show(p: Profile, spec: SweepSpec, trials: list[Trial], sweep_dir: Path) -> None:
    """A dry run: the trials, the command each runs, and the array's batch script."""
    print(f"# sweep {spec.name}: {len(trials)} trials ({spec.method}), at most {spec.max_parallel} at a time, "
          f"profile {p.name}\n{trial_table(trials, list(spec.parameters))}\n")
    for t in trials:  # the tasks travel as pickles, not in the script
        program = f"trainer.launch {shlex.join(Command(()).launch_args(p))}" if t.command else "trainer"
        print(f"# trial {t.index} runs: python -m {program} {shlex.join(t.task_args(sweep_dir))}")
    print()
    print(array_script(p, spec, sweep_dir, len(trials)), end="")


def _record(spec_path: str, spec: SweepSpec, p: Profile, trials: list[Trial], sweep_dir: Path) -> dict[str, Any]:
    """sweep.json before submission: the spec, the profile and every trial's values, folder and arguments."""
    return {
        "sweep_id": sweep_dir.name,
        "spec_file": str(Path(spec_path).resolve()),
        "spec": dataclasses.asdict(spec),
        "profile": p.name,
        "array_job_id": None,
        "submitted_at": None,
        "trials": [{"index": t.index, "overrides": t.overrides, "run_dir": str(sweep_dir / "trials" / str(t.index)),
                    "args": t.task_args(sweep_dir)} for t in trials],
    }


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
    check_trials(spec, trials, sweep_dir, p.world_sizes())
    if dry_run:
        _show(p, spec, trials, sweep_dir)
        return 0
    check_slurm()
    try:
        renamed = _new_sweep_dir(Path.cwd(), spec.name, create=True)
    except OSError as exc:
        raise _unwritable("create", sweep_dir, exc) from None
    if renamed != sweep_dir:  # another sweep took the name this second: the trials' folders follow the new one
        sweep_dir, p = renamed, sweep_profile(spec, sets, renamed)
    ex = sweep_executor(p, spec, sweep_dir)
    avoid = suspect_nodes()
    if avoid:
        ex.update_parameters(slurm_exclude=",".join(avoid))
    record = _record(spec_path, spec, p, trials, sweep_dir)
    try:  # written before submitting: a folder that cannot hold the record stops the sweep before anything runs
        (sweep_dir / "trials").mkdir()
        write_json(sweep_dir / "sweep.json", record)
        with ex.batch():  # one sbatch call: a job array
            jobs = [ex.submit(_task(p, t, sweep_dir)) for t in trials]
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

