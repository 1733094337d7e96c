"""``python -m cluster cancel RUN`` and ``resubmit RUN [key=value …] [--set KEY=VALUE]``."""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

from cluster.job import ledger
from cluster.runs.status import resolve
from cluster.runs.table import ask_slurm
from trainer.core.errors import UserError


def _live_ids(record: dict[str, Any]) -> list[str]:
    """The job ids (array tasks too) of ``record`` that Slurm lists as pending or running."""
    if record.get("kind") == "trial":
        raise UserError("RUN", f"{record.get('name')} is a sweep's trial: its worker runs the next one after it",
                        f"cancel the sweep: python -m cluster cancel {str(record.get('sweep_dir', '')).rstrip('/')}")
    slurm = ask_slurm([])
    if slurm.queue is None:
        raise UserError("squeue", "Slurm did not answer", "try again on a login node (eval \"$(slurm/dev-cluster.sh env)\" "
                        "for the dev cluster)")
    ids = [str(a) for a in record.get("arrays") or [record["job_id"]]]
    return [j for j in slurm.queue if j in ids or j.partition("_")[0] in ids]


def cancel(ref: str) -> int:
    """Cancel a run's job (a sweep: all its workers) and mark it cancelled by the user in the ledger."""
    record = resolve(ref)
    live = _live_ids(record)
    if not live:
        print(f"{record.get('name')} (job {record['job_id']}) is not pending or running: nothing to cancel")
        return 1
    ids = sorted({j.partition("_")[0] for j in live})
    proc = subprocess.run(["scancel", *ids], capture_output=True, text=True)
    if proc.returncode:
        raise UserError("scancel", proc.stderr.strip() or f"exit {proc.returncode}",
                        "is it your job? python -m cluster runs lists yours")
    ledger.write({**record, "cancelled_at": round(time.time(), 3)})
    print(f"cancelled {record.get('name')} (job {', '.join(ids)}); its folder stays: {record.get('run_dir')}")
    return 0


UNSAFE = ("model.", "data.global_batch_size", "run.dir")
"""Overrides a resumed run must not change (its checkpoints would not fit, or it would not be the same run)."""


def resubmit(ref: str, overrides: list[str], sets: list[str]) -> int:
    """Submit a run again with its command, profile and run folder: it resumes from its last checkpoint and
    continues its W&B run; ``overrides`` (the built-in trainer's key=value) and ``sets`` (profile keys) where safe."""
    from cluster.profile import load_profile, node_range
    from cluster.launch.submit import submit

    record = resolve(ref)
    if record.get("by_hand"):
        raise UserError("RUN", f"job {record['job_id']} was submitted by hand: its batch script is not known here",
                        f"submit it again as before, in the same folder: RUN_DIR={record.get('run_dir')} sbatch <script> …")
    if record.get("kind") != "job":
        raise UserError("RUN", f"{record.get('name')} is a {record.get('kind')}, not a job",
                        "a sweep goes on with: make sweep SWEEP=<its spec> RESUME=<its folder>")
    if _live_ids(record):
        raise UserError("RUN", f"job {record['job_id']} is still pending or running",
                        f"wait for it, or python -m cluster cancel {ref} first")
    if record.get("command") and overrides:
        raise UserError("key=value", "overrides are for the built-in trainer; this run is a command",
                        "change the command's arguments by submitting anew (make submit CMD=…)")
    bad = [o for o in overrides if "=" not in o or o.startswith(UNSAFE)]
    if bad:
        raise UserError(bad[0].partition("=")[0], "cannot change when a run resumes from its checkpoint",
                        "submit a new run instead (make submit ARGS=…)")
    kv = [s for s in sets if "=" not in s]
    if kv:
        raise UserError("--set", f"{kv[0]!r} is not KEY=VALUE", "e.g. --set time_min=60")
    if record.get("cwd") and os.path.isdir(str(record["cwd"])):
        os.chdir(str(record["cwd"]))  # relative paths (a script, a profile, the log folder) mean what they meant
    profile_sets: dict[str, object] = node_range(str(record["nodes_arg"])) if record.get("nodes_arg") else {}
    profile_sets.update(s.split("=", 1) for s in [*record.get("set", []), *sets])  # the new --set wins
    p = load_profile(str(record.get("cluster") or record.get("profile") or "dev"), profile_sets)
    args = list(record.get("args") or [])  # the trainer's overrides, or the command's words (a module's arguments)
    origin = {"cluster": record.get("cluster"), "set": [*record.get("set", []), *sets],
              "nodes_arg": record.get("nodes_arg"), "resubmit_of": str(record["job_id"])}
    os.environ["RUN_DIR"] = str(record["run_dir"])  # the batch script takes it: the same folder, its checkpoints
    print(f"resubmitting {record.get('name')} (job {record['job_id']}) in {record['run_dir']}")
    return submit(p, [*args, *overrides], str(record.get("launcher") or "sbatch"), False, False,
                  record.get("module"), origin)
