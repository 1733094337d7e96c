"""``python -m cluster cancel RUN`` and ``resubmit RUN [key=value …] [--set KEY=VALUE]``."""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from dataclasses import replace

from cluster.job import ledger
from cluster.job.ledger import Record
from cluster.runs.status import resolve
from cluster.runs.table import ask_slurm
from trainer.core.errors import UserError


def _live_ids(record: Record) -> list[str]:
    """The job ids (array tasks too) of ``record`` that Slurm lists as pending or running."""
    if record.kind == "trial":
        raise UserError("RUN", f"{record.name} is a sweep's trial: its worker runs the next one after it",
                        f"cancel the sweep: python -m cluster cancel {shlex.quote(record.sweep_dir.rstrip('/'))}")
    slurm = ask_slurm([])
    if slurm.queue is None:
        raise UserError("squeue", "Slurm did not answer", "try again on a login node (eval \"$(slurm/dev-cluster.sh env)\" "
                        "for the dev cluster)")
    ids = record.ids()
    return [j for j in slurm.queue if j in ids or j.partition("_")[0] in ids]


def cancel(ref: str) -> int:
    """Cancel a run's job (a sweep: all its workers) and mark it cancelled by the user in the ledger."""
    record = resolve(ref)
    live = _live_ids(record)
    if not live:
        print(f"{record.name} (job {record.job_id}) is not pending or running: nothing to cancel")
        return 1
    ids = sorted({j.partition("_")[0] for j in live})
    proc = subprocess.run(["scancel", *ids], capture_output=True, text=True)
    if proc.returncode:
        raise UserError("scancel", proc.stderr.strip() or f"exit {proc.returncode}",
                        "is it your job? python -m cluster runs lists yours")
    print(f"cancelled {record.name} (job {', '.join(ids)}); its folder stays: {record.run_dir}")
    try:  # Slurm has cancelled it: a ledger that cannot be written only loses the mark
        ledger.write(replace(record, cancelled_at=round(time.time(), 3)))
    except OSError as exc:
        print(f"warning: the ledger could not record the cancel ({exc}): `runs` may show it as failed")
    return 0


UNSAFE = ("model.", "data.global_batch_size", "run.dir")
"""Overrides a resumed run must not change (its checkpoints would not fit, or it would not be the same run)."""


def resubmit(ref: str, overrides: list[str], sets: list[str]) -> int:
    """Submit a run again with its command, profile and run folder: it resumes from its last checkpoint and
    continues its W&B run; ``overrides`` (the built-in trainer's key=value) and ``sets`` (profile keys) where safe."""
    from cluster.launch.launchers import pick
    from cluster.launch.submission import Origin, Submission
    from cluster.launch.submit import submit
    from cluster.profile import load_profile, node_range

    record = resolve(ref)
    if record.by_hand:
        raise UserError("RUN", f"job {record.job_id} was submitted by hand: its batch script is not known here",
                        "submit it again as before, in the same folder: "
                        f"RUN_DIR={shlex.quote(str(record.run_dir))} sbatch <script> …")
    if record.kind != "job":
        raise UserError("RUN", f"{record.name} is a {record.kind}, not a job",
                        "a sweep goes on with: make sweep SWEEP=<its spec> RESUME=<its folder>")
    if _live_ids(record):
        raise UserError("RUN", f"job {record.job_id} is still pending or running",
                        f"wait for it, or python -m cluster cancel {shlex.quote(ref)} first")
    if record.command and overrides:
        raise UserError("key=value", "overrides are for the built-in trainer; this run is a command",
                        "change the command's arguments by submitting anew (make submit CMD=…)")
    bad = [o for o in overrides if "=" not in o or o.startswith(UNSAFE)]
    if bad:
        raise UserError(bad[0].partition("=")[0], "cannot change when a run resumes from its checkpoint",
                        "submit a new run instead (make submit ARGS=…)")
    kv = [s for s in sets if "=" not in s]
    if kv:
        raise UserError("--set", f"{kv[0]!r} is not KEY=VALUE", "e.g. --set time_min=60")
    if record.cwd and os.path.isdir(record.cwd):
        os.chdir(record.cwd)  # relative paths (a script, a profile, the log folder) mean what they meant
    profile_sets: dict[str, object] = node_range(record.nodes_arg) if record.nodes_arg else {}
    for item in [*record.sets, *sets]:  # the new --set wins
        key, _, value = item.partition("=")
        profile_sets[key] = value
    p = load_profile(record.cluster or record.profile or "dev", profile_sets)
    args = list(record.args)  # the trainer's overrides, or the command's words (a module's arguments)
    if not record.command and "checkpoint.resume=never" in args:  # it was to start afresh once: now it continues
        args.append("checkpoint.resume=auto")
    origin = Origin(record.cluster, (*record.sets, *sets), record.nodes_arg, resubmit_of=record.job_id)
    launcher = pick(record.launcher)
    os.environ["RUN_DIR"] = record.run_dir  # the batch script takes it: the same folder, its checkpoints
    print(f"resubmitting {record.name} (job {record.job_id}) in {record.run_dir}")
    return submit(Submission.parse(p, [*args, *overrides], record.module, origin), launcher, False, False)
