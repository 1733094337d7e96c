"""Trials whose worker Slurm no longer lists: found through squeue, failed in the study and, while a worker lives
to run them, enqueued again. Run by the sweep workers inside their jobs and by `make sweep-status`."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from cluster.job.nodes import ask

if TYPE_CHECKING:
    from cluster.sweeps.study import Trials


def job_indexes(job: str, array_id: str) -> list[int]:
    """Array indexes named by a sacct/squeue JobID: ``123_4``, or a pending range ``123_[0-3,7%2]``."""
    head, _, tail = job.partition("_")
    if head != array_id or not tail:
        return []
    if tail.isdigit():
        return [int(tail)]
    out: list[int] = []
    for part in tail.strip("[]").split("%")[0].split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and (hi.isdigit() or not hi):
            out += range(int(lo), int(hi or lo) + 1)
    return out


def task_states(cmd: list[str], arrays: list[str]) -> dict[tuple[str, int], str] | None:
    """Each array task's state (lower case) in one Slurm command's ``JobID|State`` lines (squeue ``-o %i|%T``, sacct
    ``-P --format=JobID,State``); None when it cannot answer. squeue's "Invalid job id": every job gone from the
    controller, so none listed."""
    proc = ask(cmd)
    if proc is None or (proc.returncode and "Invalid job id" not in proc.stderr):
        return None
    states: dict[tuple[str, int], str] = {}
    for line in (proc.stdout if proc.returncode == 0 else "").splitlines():
        job, _, state = line.strip().partition("|")
        for a in arrays:
            for i in job_indexes(job, a):
                if state.split():
                    states.setdefault((a, i), state.split()[0].lower())  # "CANCELLED by 0" → cancelled
    return states


def squeue_states(arrays: list[str]) -> dict[tuple[str, int], str] | None:
    """The state of each (array, task) pair Slurm's controller still lists (pending, running, requeued...); None when
    squeue cannot answer (then nothing may be concluded)."""
    if not arrays:
        return {}
    return task_states(["squeue", "-h", "-r", "-j", ",".join(arrays), "-o", "%i|%T"], arrays)


def fail_lost(trials: Trials, retry: bool) -> None:
    """A RUNNING trial whose worker Slurm lists neither pending nor running is failed (never left RUNNING); with
    ``retry`` (a worker asking), or while another worker still lives to take it, its values are enqueued again and
    start over as a new trial. Nothing is concluded when squeue cannot answer; a worker never judges its own trial."""
    study = trials.study
    here = (os.environ.get("SLURM_ARRAY_JOB_ID", ""), int(os.environ.get("SLURM_ARRAY_TASK_ID", "-1")))
    running = [t for t in study.get_trials(deepcopy=False) if t.state.name == "RUNNING" and t.user_attrs.get("array")
               and (str(t.user_attrs["array"]), int(t.user_attrs.get("worker", -1))) != here]
    if not running:
        return
    alive = squeue_states(sorted({str(t.user_attrs["array"]) for t in running}))
    if alive is None:
        return
    for t in running:
        task = (str(t.user_attrs["array"]), int(t.user_attrs.get("worker", -1)))
        if task in alive:
            continue
        why = f"its worker (array task {task[0]}_{task[1]}) is no longer pending or running in Slurm"
        if not trials.fail(t.number, "lost", why):  # another process judged it first, and enqueued its retry
            continue
        if retry or alive:
            study.enqueue_trial(t.params, user_attrs={"retry_of": t.number}, skip_if_exists=False)
        print(f"trial {t.number} failed: {why}" + ("; its values run again as a new trial" if retry or alive else ""),
              file=sys.stderr)
