"""Hyper-parameter sweeps: one YAML spec → an Optuna study → ``max_parallel`` workers as one Slurm job array.

Each worker (cluster/sweeps/worker.py, in the script of cluster/sweeps/script.py) asks the study for a trial, runs it as
an ordinary run of the built-in trainer or of the spec's ``command``, in its own run folder ``<sweep>/trials/<n>``
(so it checkpoints, requeues and resumes on its own), tells the study how it ended, and asks again until the study
has ``trials``. Random and grid trials are planned here, once, and enqueued. ``<sweep>/sweep.json`` records what was
submitted; ``RESUME=<sweep>`` adds trials to the same study with a new array of workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import shutil
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from cluster.job import ledger
from cluster.launch.command import Command, Trainer
from cluster.launch.launchers import sbatch
from cluster.launch.submission import python_for
from cluster.launch.submit import check_slurm, decide, load_train_config, suspect_nodes
from cluster.profile import Profile, load_profile
from cluster.sweeps import storage_url
from cluster.sweeps import study as studies
from cluster.sweeps.folder import SweepFile
from cluster.sweeps.script import worker_script
from cluster.sweeps.spec import SweepSpec, bad, load_spec, overrides_text, parameter, trial_args
from cluster.sweeps.status import finish, read_sweep
from cluster.sweeps.trials import columns, show
from trainer.core.errors import UserError
from trainer.data.batches import check_worlds


def candidates(spec: SweepSpec) -> list[dict[str, Any]]:
    """Values that stand for the whole space when checking arguments: each parameter at each of its ends (or
    choices), the others at their first value."""
    ends = {}
    for key, value in spec.parameters.items():
        p = parameter(spec, key, value)
        ends[key] = p["choices"] if p["type"] == "categorical" else [p["low"], p["high"]]
    base = {k: v[0] for k, v in ends.items()}
    return [{**base, key: v} for key, values in ends.items() for v in values]


def check_trials(spec: SweepSpec, trials: list[dict[str, Any]], sweep_dir: Path, worlds: list[int] | None = None) -> None:
    """Validate trials' full argument lists with the trainer's own loader before anything is submitted.

    An error is renamed after what the user wrote: ``sweep.args`` for the fixed args, ``sweep.parameters.<key>``
    for a swept key; the trainer's hint is kept.
    """
    if spec.command is not None:  # a command checks its own arguments when it starts
        return
    try:
        load_train_config(spec.args)
    except UserError as err:
        raise bad("args", f"{err.field}: {err.message}", err.hint) from None
    seen: set[tuple[str, ...]] = set()
    for i, values in enumerate(trials):
        args = tuple(trial_args(spec, values, sweep_dir.name, 0))
        if args in seen:
            continue
        seen.add(args)
        try:
            cfg = load_train_config(list(args))
            if cfg.data.global_batch_size and worlds:  # each trial's global batch on the profile's processes
                check_worlds(cfg.data.global_batch_size, worlds, cfg.data.batch_size)
        except UserError as err:
            if err.field in spec.parameters:
                raise bad(f"parameters.{err.field}", f"{err.message} (with {overrides_text(values)})", err.hint) from None
            raise bad(f"trials.{i}", f"{err.field}: {err.message} (with {overrides_text(values)})", err.hint) from None
        if spec.pruner != "none" and not cfg.train.eval_every and cfg.train.epochs < 2 and not cfg.train.max_steps:
            raise bad("pruner", "has no intermediate values to judge: the trainer evaluates once, at the end "
                       "(train.epochs=1, train.eval_every=0)", "set train.eval_every=N in args, or pruner: none")


def _flat(prefix: str, value: Any) -> dict[str, Any]:
    """Nested profile overrides ({container: {runtime: docker}}) as the dotted keys load_profile takes."""
    if not isinstance(value, dict):
        return {prefix: value}
    return {k: v for key, sub in value.items() for k, v in _flat(f"{prefix}.{key}" if prefix else str(key), sub).items()}


def sweep_profile(spec: SweepSpec, sets: dict[str, object], sweep_dir: Path) -> Profile:
    """The profile every worker runs with: the spec's cluster, its profile overrides, then ``--set`` ones.

    The Slurm job name defaults to the sweep name; the workers' logs go to ``<sweep>/logs``.
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
    if p.spare_nodes or p.min_nodes:
        raise UserError("sweep.profile.spare_nodes" if p.spare_nodes else "sweep.profile.min_nodes",
                        "a sweep's trials run on a fixed number of nodes", "spare_nodes: 0 and no node range for sweeps")
    return p


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


def _script(p: Profile, spec: SweepSpec, sweep_dir: Path) -> str:
    origin = f"sweep {spec.name}: {spec.max_parallel} worker(s), rendered by `python -m cluster sweep`"
    work = Command(()) if spec.command is not None else Trainer(())  # each trial's words come as "$@"
    return worker_script(p, python_for(p), sweep_dir, spec.max_parallel, work, origin)


def _show(p: Profile, spec: SweepSpec, planned: list[dict[str, Any]] | None, sweep_dir: Path) -> None:
    """A dry run: the planned trials (random, grid) or the search space (adaptive), and the workers' batch script."""
    keys = list(spec.parameters)
    print(f"# sweep {spec.name}: {spec.method} sampler, pruner {spec.pruner}, {spec.max_parallel} worker(s) as one "
          f"array, study in {storage_url.hidden(spec.storage)}, profile {p.name}")
    if planned is not None:
        print(columns(["trial", *keys], [[str(i), *(show(t[k]) for k in keys)] for i, t in enumerate(planned)]))
    else:
        print(f"# {spec.trials} trials, sampled as results come in from:")
        for key, value in spec.parameters.items():
            print(f"#   {key}: {parameter(spec, key, value)}")
    example = planned[0] if planned else candidates(spec)[0]
    program = "trainer.launch ... --" if spec.command else "trainer"
    print(f"# a trial runs: python -m {program} {shlex.join(trial_args(spec, example, sweep_dir.name, 0))}\n")
    print(_script(p, spec, sweep_dir), end="")


def _taken(study: Any) -> list[dict[str, Any]]:
    return [t.params or t.system_attrs.get("fixed_params", {}) for t in study.get_trials(deepcopy=False)
            if "lost" not in t.user_attrs]


def run(spec_path: str, sets: dict[str, object], dry_run: bool, wait: bool, resume: str | None = None,
        poll_s: float = 5.0) -> int:
    """``python -m cluster sweep``: validate, then print (dry run) or submit the workers; with wait, report the results."""
    spec = load_spec(spec_path)
    storage_url.warn_if_exposed(Path(spec_path), spec.storage)
    record = read_sweep(Path(resume)) if resume else None
    if record is not None:
        _check_resume(spec, record, resume or "")
    sweep_dir = Path(resume).resolve() if resume else _new_sweep_dir(Path.cwd(), spec.name, create=False)
    p = sweep_profile(spec, sets, sweep_dir)
    studies.check(spec, sweep_dir)
    planned = (studies.plan(spec, [], spec.trials) if spec.method in ("grid", "random") and record is None else None)
    check_trials(spec, planned if planned is not None else candidates(spec), sweep_dir, p.world_sizes())
    decide(p)  # as a job's: the partition holds the workers, the expedited requeue (what the dry run shows too)
    if dry_run:
        _show(p, spec, planned, sweep_dir)
        return 0
    check_slurm()
    if record is None:
        try:
            sweep_dir = _new_sweep_dir(Path.cwd(), spec.name, create=True)
        except OSError as exc:
            raise _unwritable("create", sweep_dir, exc) from None
        p = sweep_profile(spec, sets, sweep_dir)
        decide(p)
        record = SweepFile(sweep_id=sweep_dir.name, study=sweep_dir.name)
    return _submit(spec_path, spec, p, sweep_dir, record, wait, poll_s)


def _check_resume(spec: SweepSpec, record: SweepFile, resume: str) -> None:
    old = record.spec
    new = {**dataclasses.asdict(spec), "storage": storage_url.hidden(spec.storage)}
    for key in ("parameters", "metric", "mode", "command", "args", "storage"):
        if old[key] != new[key]:
            raise bad(key, f"differs from the study's in {resume} ({old[key]!r}): its trials would not compare",
                       "resume with the spec the sweep was made from, changing trials, method, pruner or max_parallel")


def prepare(spec_path: str, spec: SweepSpec, profile: str, sweep_dir: Path, record: SweepFile) -> SweepFile:
    """The sweep's folders, sweep.json and study: planned trials (random, grid) enqueued, the target raised by
    ``trials`` (a grid: by the combinations left). Returns the record as written."""
    for sub in ("trials", "workers", "logs"):
        (sweep_dir / sub).mkdir(exist_ok=True)
    # Recorded with the database password hidden; the workers read the whole URL from a file only this user reads.
    storage_url.keep(spec.storage, sweep_dir)
    record = record.but(spec_file=str(Path(spec_path).resolve()), profile=profile,
                        spec={**dataclasses.asdict(spec), "storage": storage_url.hidden(spec.storage)})
    record.write(sweep_dir)
    study = studies.open_study(record, sweep_dir, spec.seed)
    taken = _taken(study)
    new = studies.plan(spec, taken, spec.trials) if spec.method in ("grid", "random") else None
    for values in new or []:
        study.enqueue_trial(values, skip_if_exists=False)
    record = record.but(target=len(taken) + (len(new) if new is not None else spec.trials or 0))
    record.write(sweep_dir)
    return record


def _submit(spec_path: str, spec: SweepSpec, p: Profile, sweep_dir: Path, record: SweepFile, wait: bool,
            poll_s: float) -> int:
    """Write sweep.json, create the study (enqueue planned trials) and submit one array of workers (through the
    same sbatch call as a job)."""
    fresh = not record.arrays
    try:
        record = prepare(spec_path, spec, p.name, sweep_dir, record)
    except OSError as exc:
        if fresh:
            shutil.rmtree(sweep_dir, ignore_errors=True)
        raise _unwritable("write", sweep_dir, exc) from None
    array, proc = sbatch(_script(p, spec, sweep_dir), suspect_nodes(p))
    if proc.wait() or not array:
        print("sbatch refused the sweep's workers; its message is above", file=sys.stderr)
        if fresh:
            shutil.rmtree(sweep_dir, ignore_errors=True)
        return proc.returncode or 1
    record = record.but(arrays=(*record.arrays, array),
                        submitted_at=datetime.now().astimezone().isoformat(timespec="seconds"))
    record.write(sweep_dir)
    try:  # one record per sweep (RESUME adds its array to it)
        ledger.write(ledger.Record(kind="sweep", key=record.sweep_id, name=record.sweep_id,
                                   job_id=record.arrays[0], arrays=record.arrays,
                                   run_dir=str(sweep_dir), profile=p.name, launcher="sweep",
                                   spec_file=record.spec_file, log=str(sweep_dir / "logs")))
    except OSError as err:
        print(f"warning: could not record sweep {sweep_dir.name} in {ledger.folder()}: {err}", file=sys.stderr)
    shown = os.path.relpath(sweep_dir)  # as `make sweep-status` takes it, from the folder make runs in
    print(f"submitted sweep {sweep_dir.name}: {record.target} trials ({spec.method}, pruner {spec.pruner}) run by "
          f"{spec.max_parallel} worker(s) as Slurm array {array} (profile {p.name})")
    print(f"folder: {shown}\nlogs:   {shown}/logs/worker-{array}_<w>.out\n"
          f"status: make sweep-status {shlex.quote('SWEEP_DIR=' + shown)}    squeue -r -j {array}")
    return finish(sweep_dir, poll_s) if wait else 0
