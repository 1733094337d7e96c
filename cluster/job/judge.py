"""How an attempt ended, judged from what its processes left: their exit records (trainer/core/records.py) and srun's
own lines in the job's log. The first cause wins, never its echoes (a peer that lost its collective). Stdlib only.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from trainer.core import exits
from trainer.core.errors import EXIT_REQUEUE
from trainer.core.records import ExitRecord, RequeueMarker

SRUN_TASK = re.compile(r"srun: error: (\S+): tasks? ([\d,\-]+): (.+)$")
"""srun's line for a task that ended badly: node, task ids, how (Killed, Exited with exit code N, Out Of Memory)."""

SRUN_LAUNCH = re.compile(r"srun: error: Task launch for \S+ failed on node (\S+): (.+)$")
"""srun's line for a node it could not start tasks on."""

SRUN_STEP = re.compile(r"srun: error: (Unable to create step for job \S+: .+|Unable to confirm allocation for job \S+: .+)$")
"""srun's line for a step Slurm refused before any task started (nodes the job does not hold, an allocation gone)."""

KILLED = ("Killed", "exit code 137")
"""How srun reports a task ended by SIGKILL (the OOM-killer, a dying node; a container reports it as 137)."""

START_MARK = "attempt {restart} of job {job} starts"
"""The line the batch shell prints to stderr as an attempt starts: srun's lines after the last one are this attempt's."""

LOG_TAIL = 4 << 20
"""Bytes of the job log read (it holds every attempt's output)."""


@dataclass
class Verdict:
    """How an attempt ended: its class, first cause, where (a user error's file:line), the nodes it blames."""

    kind: str
    cause: str
    where: str | None = None
    blame: list[str] = field(default_factory=list)
    step: int | None = None
    progressed: bool | None = None
    """Whether the attempt trained past the step it started from (None: unknown)."""
    start_step: int | None = None
    """The step the attempt started from (resumed at), when it got that far."""
    first_end_t: float | None = None
    """When the first rank recorded its end (the failure noticed), if one did."""
    hard: bool = False
    """The blame is hard evidence (a device error, a failed launch, the doctor, Slurm's own node state): other jobs
    avoid the node at once, not after blames from several jobs (cluster/job/suspects.py)."""
    deadline: bool = False
    """A save before the job's time limit (a requeue that max_requeues does not count)."""


DEADLINE = "deadline: saved before the time limit"
"""The cause of an attempt the runtime saved and ended because the job's time limit was near (no signal needed)."""


def srun_failures(log: Path | None, restart: str, job: str) -> list[tuple[str, str, str]]:
    """(node, tasks, how) for each task srun reported in this attempt's part of the job log, in srun's order."""
    try:
        with open(log or "", "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - LOG_TAIL))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    mark = START_MARK.format(restart=restart, job=job)
    lines = (text[text.rfind(mark):] if mark in text else text).splitlines()
    # After "Terminating StepId" srun reports the tasks it ended itself (--kill-on-bad-exit): echoes, not causes.
    cut = next((i for i, line in enumerate(lines) if "Terminating StepId" in line), len(lines))
    found: list[tuple[str, str, str]] = []
    for line in lines[:cut]:
        if m := SRUN_TASK.search(line):
            found.append((m[1], m[2], m[3]))
        elif m := SRUN_LAUNCH.search(line):
            found.append((m[1], "launch", f"srun could not start tasks there: {m[2]}"))
        elif m := SRUN_STEP.search(line):
            found.append(("", "step", m[1].rstrip(".")))
    return found


def judge(records: list[ExitRecord], srun: list[tuple[str, str, str]], rc: int,
          marker: RequeueMarker | None) -> Verdict:
    """The first cause among the records and srun's lines (see the module docstring); ``marker``: the requeue
    marker this attempt left, if any."""
    steps = [r.step for r in records if isinstance(r.step, int)]
    step = max(steps) if steps else None
    ended = [r for r in records if r.ended]
    causes = [r for r in ended if r.is_cause]
    others = [r for r in records if r not in causes]
    if causes and all(c.aborted for c in causes) and others and all(r.code == 0 for r in others):
        ranks = ", ".join(str(c.rank) for c in causes)
        return Verdict(exits.FINISHED, f"every rank finished its work; rank {ranks} then aborted in teardown (a script "
                       "that destroys its process group without a barrier first)", step=step)
    if went_on := _went_on(records):  # the lost ranks' nodes are blamed: evidence for suspects, no restart
        return Verdict(exits.FINISHED, went_on[0], blame=went_on[1], step=step)
    if causes:
        first = _first_cause(causes, step)
        if first.kind == exits.INFRASTRUCTURE and not first.hard and (oom := _memory_limit(srun, step)):
            return oom  # Slurm's memory limit explains a kill (a loader worker's, say) that a rank only saw
        return first
    if rc == 0:  # srun saw every task exit 0
        return Verdict(exits.FINISHED, "every rank finished", step=step)
    if marker and marker.deadline:
        return Verdict(exits.PREEMPTED, DEADLINE, step=step, deadline=True)
    if marker or (rc == EXIT_REQUEUE and all(r.code == EXIT_REQUEUE for r in ended)):
        return Verdict(exits.PREEMPTED, "saved after the warning signal", step=step)
    return _without_cause(records, srun, rc, step)


def _went_on(records: list[ExitRecord]) -> tuple[str, list[str]] | None:
    """The survivors of lost ranks went on in place and finished (``went_on_without``): every rank not lost finished
    (a lost rank's own record, a hang its watchdog reported before it was killed, is no cause of the attempt's end).
    (Its cause line, the lost ranks' nodes), else None."""
    lost = {r for rec in records for r in rec.went_on_without or []}
    gone = [r for r in records if r.rank in lost]
    stayed = [r for r in records if r.rank not in lost]
    if not gone or not stayed or any(not r.ended or r.code != 0 for r in stayed):
        return None
    where = ", ".join(f"{exits.names([r.rank])} on {r.node}" + (f" ({r.cause})" if r.ended and r.cause else "")
                      for r in sorted(gone, key=lambda r: r.rank))
    return f"every rank finished; {where} lost, and the others went on without a restart", sorted({r.node for r in gone})


def _first_cause(causes: list[ExitRecord], step: int | None) -> Verdict:
    """The earliest recorded cause; an infrastructure cause blames what its records name (else the node it ran on)."""
    first = min(causes, key=lambda r: r.t)
    infra = [c for c in causes if c.kind == exits.INFRASTRUCTURE]
    blame = sorted({n for c in infra for n in c.blame or []})
    if first.kind == exits.INFRASTRUCTURE and first.blame is None:
        blame = blame or [first.node]
    return Verdict(first.kind or exits.USER_ERROR, first.describe(), first.where, blame, step,
                   hard=any(c.hard for c in infra))


def _memory_limit(srun: list[tuple[str, str, str]], step: int | None) -> Verdict | None:
    """srun's word that the job's memory limit killed a task (Slurm's cgroup OOM killer), as the verdict, if it said so."""
    oom = [s for s in srun if "out of memory" in s[2].lower()]
    if not oom:
        return None
    return Verdict(exits.RESOURCE, f"task {oom[0][1]} on {oom[0][0]}: {oom[0][2]} (the job's memory limit: ask for "
                   "more memory per task, or use less)", step=step)


def _without_cause(records: list[ExitRecord], srun: list[tuple[str, str, str]], rc: int,
                   step: int | None) -> Verdict:
    """No rank recorded why: srun's own lines decide (only a kill or a failed launch is evidence against a node)."""
    silent = [r for r in records if not r.ended]
    refused = [s for s in srun if s[1] == "step"]
    if refused and not records:  # no task started: Slurm's placement failed, not the code (no node to blame)
        return Verdict(exits.INFRASTRUCTURE, f"srun could not create the job step: {refused[0][2]}", step=step)
    if oom := _memory_limit(srun, step):
        return oom
    killed = [s for s in srun if s[1] == "launch" or any(k in s[2] for k in KILLED)]
    if killed:
        node, tasks, how = killed[0]
        ranks = [r.rank for r in silent if r.node == node]
        who = exits.names(ranks) if ranks else f"task {tasks}"
        were = "were" if len(ranks) > 1 else "was"
        cause = f"{node}: {how}" if tasks == "launch" else f"{who} on {node} {were} killed (srun: task {tasks}: {how})"
        return Verdict(exits.INFRASTRUCTURE, cause, blame=[node], step=step, hard=tasks == "launch")
    if silent:  # no kill in srun's lines (torchrun's agent reports one as exit 1): blame only a single node
        where = sorted({r.node for r in silent})
        return Verdict(exits.INFRASTRUCTURE, f"{exits.names([silent[0].rank])} on {silent[0].node} ended without a "
                       "record (killed by a signal)", blame=where if len(where) == 1 else [], step=step)
    if any(r.echo for r in records):
        return Verdict(exits.INFRASTRUCTURE, "a peer was lost mid-collective (no rank recorded why)", step=step)
    if srun:
        return Verdict(exits.USER_ERROR, f"task {srun[0][1]} on {srun[0][0]}: {srun[0][2]}, without a record of why "
                       "(its output is above)", step=step)
    return Verdict(exits.USER_ERROR, f"the tasks exited {rc} without a record (their output is above)", step=step)
