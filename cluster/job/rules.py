"""What happens after an attempt ends: the job's budgets (max_requeues, max_failures, a storm of attempts that make
no progress), counted from the verdicts on its earlier attempts (typed ``AttemptEnd`` records); and the requeue rule
for a saved run, one copy (``RequeueRule``): the verdict decides with it, and the batch shell's fallback, for when
no verdict can run, is rendered from it. Stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.job.judge import DEADLINE, Verdict
from trainer.core import exits
from trainer.core.errors import EXIT_REQUEUE
from trainer.core.events import read
from trainer.core.records import REQUEUE_MARKER, AttemptEnd, attempt_ends


@dataclass(frozen=True)
class RequeueRule:
    """A run that saved for a requeue (exit 75, or its marker) is requeued while requeues are left; a save before the
    job's time limit does not count against ``max_requeues`` (a 7-day run on 24-hour limits needs 7)."""

    max_requeues: int

    def requeues(self, saved: bool, deadline: bool, done: int) -> bool:
        """Whether a run that ``saved`` (for the time limit: ``deadline``) is requeued after ``done`` requeues."""
        return saved and (deadline or done < self.max_requeues)

    def shell(self) -> str:
        """The same rule as a shell condition over ``$rc``, the marker and Slurm's restart count: what the batch shell
        applies when no verdict can run (beside a container, a host without python3)."""
        marker = f'"$RUN_DIR/{REQUEUE_MARKER}"'
        return (f"[[ $rc -eq {EXIT_REQUEUE} || -f {marker} ]] && {{ grep -qs '\"signal\": \"deadline\"' {marker} "
                f"|| (( ${{SLURM_RESTART_COUNT:-0}} < {self.max_requeues} )); }}")


def history(run_dir: Path, job: str) -> list[AttemptEnd]:
    """The earlier verdicts of this job (a reused run folder holds other jobs' too)."""
    return attempt_ends(list(read(run_dir)), job)


def restarts_counted(events: list[dict[str, Any]], job: str, restarts: int, trial: bool) -> int:
    """The requeues of ``job`` its safety cap counts (``restarts``: Slurm's count). A job's: Slurm's, whatever its run
    folder holds (the cap stops a requeue loop that the budgets' records miss, in a folder that forgot them too). A
    sweep's trial's (``trial``): those since the trial's first attempt in this job, for a worker is one job that runs
    trial after trial, each with budgets of its own, and Slurm's count grows across them. That first attempt is the
    batch shell's first ``job_start`` in the trial's folder (on the sweep's shared disk); none there: Slurm's count."""
    starts = [e["restart"] for e in events if e.get("event") == "job_start" and str(e.get("job_id")) == job
              and isinstance(e.get("restart"), int)]
    return restarts - min(starts) if trial and starts else restarts


def repeated(v: Verdict, before: list[AttemptEnd]) -> AttemptEnd | None:
    """An earlier infrastructure failure at the same step on other nodes: then it is the code's, not a node's."""
    if v.kind != exits.INFRASTRUCTURE or v.step is None:
        return None
    return next((e for e in before if e.kind == exits.INFRASTRUCTURE and e.step == v.step
                 and set(e.blamed) != set(v.blame)), None)


@dataclass
class Limits:
    max_requeues: int
    max_failures: int
    suspects: Path
    suspect_hours: float
    suspect_after: int = 2
    storm_after: int = 3
    """Attempts in a row that end before passing their starting step: then the job stops (0: never)."""


def decide(v: Verdict, before: list[AttemptEnd], limits: Limits, regrouped: int = 0) -> tuple[str, str]:
    """("requeue" | "fail" | "done", why); ``regrouped``: the job's recoveries in place so far, each an
    infrastructure failure that ``max_failures`` counts."""
    if v.kind == exits.FINISHED:
        return "done", "finished"
    rule = RequeueRule(limits.max_requeues)
    if v.deadline:
        last = [e for e in before if e.deadline]
        if last and v.step is not None and last[-1].step == v.step:
            return "fail", f"{DEADLINE}, but no step was trained since the last time (step {v.step}): the time " \
                           "limit leaves no room for training and a save"
        return "requeue", f"{DEADLINE}: requeue {len(last) + 1} (not counted against max_requeues)"
    if v.kind == exits.PREEMPTED:
        done = sum(e.kind == exits.PREEMPTED and not e.deadline for e in before)
        if rule.requeues(True, False, done):
            return "requeue", f"preempted: requeue {done + 1} of max_requeues={limits.max_requeues}"
        return "fail", f"preempted, but {done} requeues done (max_requeues={limits.max_requeues})"
    if v.kind != exits.INFRASTRUCTURE:
        return "fail", f"{v.kind.replace('_', ' ')}: not retried"
    stuck = storm(v, before, limits.storm_after)
    if stuck:
        return "fail", stuck
    failures = sum(e.kind == exits.INFRASTRUCTURE for e in before) + regrouped
    of = f" ({regrouped} recovered in place)" if regrouped else ""
    if failures >= limits.max_failures:
        return "fail", f"infrastructure failure {failures + 1}{of}, max_failures={limits.max_failures}: not retried"
    return "requeue", f"infrastructure failure {failures + 1}{of} of max_failures={limits.max_failures}: retried"


def storm(v: Verdict, before: list[AttemptEnd], after: int) -> str | None:
    """Why the job stops restarting: ``after`` attempts in a row, this one included, ended before passing the step
    they started from (a fault that comes back at once: restarting only burns the allocation); else None."""
    if not after or v.progressed is not False:
        return None
    trail = [e.progressed for e in before[-(after - 1):]] if after > 1 else []
    if len(trail) < after - 1 or any(p is not False for p in trail):
        return None
    return (f"{after} attempts in a row ended before passing their starting step (step {v.start_step}): a failure "
            "that comes back at once; stopping instead of restarting again (profile storm_after)")
