"""The verdict on one attempt of a job, in the batch shell after srun returns: how it ended, and what happens next.

``python -m cluster.job.verdict --phase train --rc $rc …`` reads the ranks' exit records (trainer/core/exits.py), srun's
own ``srun: error: n2: task 1: Killed`` lines in the job's log, and the requeue marker; it classifies the attempt
(finished, preempted, user_error, resource, infrastructure) by its first cause, not its echoes; appends one
``attempt_end`` line to events.jsonl; and then requeues (a preemption save, or an infrastructure failure within
``max_failures``, excluding the blamed nodes) or ends the job, writing the reason to result.json. It exits with the
job's exit code. Stdlib only: it runs with the host's python3, outside any container.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.job import nodes, placement, suspects
from trainer.core import exits
from trainer.core.errors import EXIT_REQUEUE
from trainer.core.events import EVENTS, read

SRUN_TASK = re.compile(r"srun: error: (\S+): tasks? ([\d,\-]+): (.+)$")
"""srun's line for a task that ended badly: node, task ids, how (Killed, Exited with exit code N, Out Of Memory)."""

SRUN_LAUNCH = re.compile(r"srun: error: Task launch for \S+ failed on node (\S+): (.+)$")
"""srun's line for a node it could not start tasks on."""

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
    return found


def judge(records: list[dict[str, Any]], srun: list[tuple[str, str, str]], rc: int, marker: bool) -> Verdict:
    """The first cause among the records and srun's lines (see the module docstring)."""
    steps = [r["step"] for r in records if isinstance(r.get("step"), int)]
    step = max(steps) if steps else None
    ended = [r for r in records if r.get("code") is not None]
    causes = [r for r in ended if exits.is_cause(r)]
    others = [r for r in records if r not in causes]
    if causes and all(c.get("aborted") for c in causes) and others and all(r.get("code") == 0 for r in others):
        ranks = ", ".join(str(c["rank"]) for c in causes)
        return Verdict(exits.FINISHED, f"every rank finished its work; rank {ranks} then aborted in teardown (a script "
                       "that destroys its process group without a barrier first)", step=step)
    if causes:
        return _first_cause(causes, step)
    if rc == 0:  # srun saw every task exit 0
        return Verdict(exits.FINISHED, "every rank finished", step=step)
    if marker or (rc == EXIT_REQUEUE and all(r.get("code") == EXIT_REQUEUE for r in ended)):
        return Verdict(exits.PREEMPTED, "saved after the warning signal", step=step)
    return _without_cause(records, srun, rc, step)


def _first_cause(causes: list[dict[str, Any]], step: int | None) -> Verdict:
    """The earliest recorded cause; an infrastructure cause blames what its records name (else the node it ran on)."""
    first = min(causes, key=lambda r: r["t"])
    infra = [c for c in causes if c.get("class") == exits.INFRASTRUCTURE]
    blame = sorted({n for c in infra for n in c.get("blame") or []})
    if first.get("class") == exits.INFRASTRUCTURE and "blame" not in first:
        blame = blame or [first["node"]]
    return Verdict(first.get("class", exits.USER_ERROR), exits.describe(first), first.get("where"), blame, step,
                   hard=any(c.get("hard") for c in infra))


def _without_cause(records: list[dict[str, Any]], srun: list[tuple[str, str, str]], rc: int,
                   step: int | None) -> Verdict:
    """No rank recorded why: srun's own lines decide (only a kill or a failed launch is evidence against a node)."""
    silent = [r for r in records if r.get("code") is None]
    oom = [s for s in srun if "out of memory" in s[2].lower()]
    if oom:
        return Verdict(exits.RESOURCE, f"task {oom[0][1]} on {oom[0][0]}: {oom[0][2]} (the job's memory limit: ask "
                       "for more memory per task, or use less)", step=step)
    killed = [s for s in srun if s[1] == "launch" or any(k in s[2] for k in KILLED)]
    if killed:
        node, tasks, how = killed[0]
        ranks = ", ".join(str(r["rank"]) for r in silent if r.get("node") == node)
        who = f"rank {ranks}" if ranks else f"task {tasks}"
        cause = f"{node}: {how}" if tasks == "launch" else f"{who} on {node} was killed (srun: task {tasks}: {how})"
        return Verdict(exits.INFRASTRUCTURE, cause, blame=[node], step=step, hard=tasks == "launch")
    if silent:  # no kill in srun's lines (torchrun's agent reports one as exit 1): blame only a single node
        where = sorted({str(r.get("node")) for r in silent})
        return Verdict(exits.INFRASTRUCTURE, f"rank {silent[0]['rank']} on {silent[0].get('node')} ended without a "
                       "record (killed by a signal)", blame=where if len(where) == 1 else [], step=step)
    if any(r.get("echo") for r in records):
        return Verdict(exits.INFRASTRUCTURE, "a peer was lost mid-collective (no rank recorded why)", step=step)
    if srun:
        return Verdict(exits.USER_ERROR, f"task {srun[0][1]} on {srun[0][0]}: {srun[0][2]}, without a record of why "
                       "(its output is above)", step=step)
    return Verdict(exits.USER_ERROR, f"the tasks exited {rc} without a record (their output is above)", step=step)


def history(run_dir: Path, job: str) -> list[dict[str, Any]]:
    """The earlier verdicts of this job (``attempt_end`` events; a reused run folder holds other jobs' too)."""
    return [e for e in read(run_dir) if e.get("event") == "attempt_end" and e.get("job_id") == job]


def repeated(v: Verdict, before: list[dict[str, Any]]) -> dict[str, Any] | None:
    """An earlier infrastructure failure at the same step on other nodes: then it is the code's, not a node's."""
    if v.kind != exits.INFRASTRUCTURE or v.step is None:
        return None
    return next((e for e in before if e.get("class") == exits.INFRASTRUCTURE and e.get("step") == v.step
                 and set(e.get("blamed") or []) != set(v.blame)), None)


@dataclass
class Limits:
    max_requeues: int
    max_failures: int
    suspects: Path
    suspect_hours: float
    suspect_after: int = 2
    storm_after: int = 3
    """Attempts in a row that end before passing their starting step: then the job stops (0: never)."""


DEADLINE = "deadline: saved before the time limit"
"""The cause of an attempt the runtime saved and ended because the job's time limit was near (no signal needed)."""


def with_deadline(v: Verdict, run_dir: Path) -> Verdict:
    """A preemption whose requeue marker says the runtime saved for the time limit: a cause of its own."""
    try:
        marker = json.loads((run_dir / "requeue.json").read_text()) if v.kind == exits.PREEMPTED else {}
    except (OSError, ValueError):
        marker = {}
    return Verdict(exits.PREEMPTED, DEADLINE, step=v.step) if marker.get("signal") == "deadline" else v


def decide(v: Verdict, before: list[dict[str, Any]], limits: Limits) -> tuple[str, str]:
    """("requeue" | "fail" | "done", why). Time-limit requeues are not counted against max_requeues (a 7-day run on
    24-hour limits needs 7), but one that made no step since the last is the end."""
    if v.kind == exits.FINISHED:
        return "done", "finished"
    if v.cause == DEADLINE:
        last = [e for e in before if e.get("cause") == DEADLINE]
        if last and v.step is not None and last[-1].get("step") == v.step:
            return "fail", f"{DEADLINE}, but no step was trained since the last time (step {v.step}): the time " \
                           "limit leaves no room for training and a save"
        return "requeue", f"{DEADLINE}: requeue {len(last) + 1} (not counted against max_requeues)"
    if v.kind == exits.PREEMPTED:
        done = sum(e.get("class") == exits.PREEMPTED and e.get("cause") != DEADLINE for e in before)
        if done < limits.max_requeues:
            return "requeue", f"preempted: requeue {done + 1} of max_requeues={limits.max_requeues}"
        return "fail", f"preempted, but {done} requeues done (max_requeues={limits.max_requeues})"
    if v.kind != exits.INFRASTRUCTURE:
        return "fail", f"{v.kind.replace('_', ' ')}: not retried"
    stuck = storm(v, before, limits.storm_after)
    if stuck:
        return "fail", stuck
    failures = sum(e.get("class") == exits.INFRASTRUCTURE for e in before)
    if failures >= limits.max_failures:
        return "fail", f"infrastructure failure {failures + 1}, max_failures={limits.max_failures}: not retried"
    return "requeue", f"infrastructure failure {failures + 1} of max_failures={limits.max_failures}: retried"


def storm(v: Verdict, before: list[dict[str, Any]], after: int) -> str | None:
    """Why the job stops restarting: ``after`` attempts in a row, this one included, ended before passing the step
    they started from (a fault that comes back at once: restarting only burns the allocation); else None."""
    if not after or v.progressed is not False:
        return None
    trail = [e.get("progressed") for e in before[-(after - 1):]] if after > 1 else []
    if len(trail) < after - 1 or any(p is not False for p in trail):
        return None
    return (f"{after} attempts in a row ended before passing their starting step (step {v.start_step}): a failure "
            "that comes back at once; stopping instead of restarting again (profile storm_after)")


def main(argv: list[str] | None = None) -> int:
    """Judge this attempt, act (requeue, restart here, or end), record it; exit with the job's code."""
    ns = _parser().parse_args(argv)
    # The requeue's SIGTERM reaches this whole job step: ignored here and (inherited) in scontrol, so that the
    # exclusion after the requeue still happens before KillWait's SIGKILL.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        return _verdict(ns)
    except Exception:  # noqa: BLE001 - a bug here must not lose a preemption save: the plain requeue rule instead
        import traceback

        traceback.print_exc()
        marker = (Path(ns.run_dir) / "requeue.json").exists()
        limit = with_deadline(Verdict(exits.PREEMPTED, ""), Path(ns.run_dir)).cause == DEADLINE  # not counted
        if (ns.rc == EXIT_REQUEUE or marker) and (limit or int(os.environ.get("SLURM_RESTART_COUNT") or 0) < ns.max_requeues):
            print("verdict failed (above): requeueing the saved run by the plain rule", file=sys.stderr)
            return 0 if nodes.requeue(os.environ.get("SLURM_JOB_ID", "0"), None) is None else ns.rc
        return ns.rc or 1


def _verdict(ns: argparse.Namespace) -> int:
    run_dir, env = Path(ns.run_dir), os.environ
    job, restart = env.get("SLURM_JOB_ID", "0"), exits.attempt_id()
    info = nodes.job_fields(job)  # read once: the log, the nodes it excludes already, its size and partition
    seen = nodes.states(info.get("Partition"))  # read once: hard evidence, and which nodes a requeue could use
    before = history(run_dir, job)
    v = _judged(ns, run_dir, job, restart, info, before, seen)
    limits = Limits(ns.max_requeues, ns.max_failures, Path(ns.suspects), ns.suspect_hours, ns.suspect_after,
                    ns.storm_after)
    action, why = decide(v, before, limits)
    restarts = int(env.get("SLURM_RESTART_COUNT") or 0) - sum(e.get("cause") == DEADLINE for e in before)
    if action == "requeue" and v.cause != DEADLINE and restarts >= ns.max_requeues + ns.max_failures:
        action, why = "fail", f"{why}, but the job was requeued {env.get('SLURM_RESTART_COUNT')} times already"
    if action == "requeue" and v.kind == exits.INFRASTRUCTURE and v.blame:
        suspects.add(limits.suspects, v.blame, limits.suspect_hours, job, v.cause, v.hard)
    allocation = nodes.hostnames(env.get("SLURM_JOB_NODELIST", ""))
    shape = placement.Shape(ns.least or ns.need, ns.most or ns.need, ns.in_place or ns.need > 0)
    if action == "requeue":
        # Nodes to avoid, most important first (ExcNodeList last: room permitting, the job keeps avoiding it).
        order = placement.blame_order(v.blame, [e.get("blamed") or [] for e in before],
                                      suspects.active(limits.suspects, limits.suspect_after), nodes.excluded(info))
        inside = placement.here(allocation, order, shape) if v.kind == exits.INFRASTRUCTURE else None
        if inside is not None:  # the next attempt starts here, at once: the last line tells the batch shell's loop
            why = f"{why} {inside.describe('the allocation')}{_give_back(job, allocation, inside.release)}"
            _record(run_dir, ns.phase, restart, job, v, "restart_here", why)
            print(f"restart-here: {','.join(inside.avoid)}", flush=True)
            return 0
        action, why = _requeue(job, info, seen, order, ns.min_nodes, why)
    if shape.in_place:  # the job ends or starts again elsewhere: no node keeps its snapshots
        nodes.clean_memory(job, allocation)
    _record(run_dir, ns.phase, restart, job, v, action, why)
    return 0 if action == "requeue" else _finish(run_dir, v, action, why, ns.rc)


def _give_back(job: str, allocation: list[str], release: list[str]) -> str:
    """Shrinking: give ``release`` back to Slurm (their memory cleared first); what went wrong, for the log line."""
    if not release:
        return ""
    nodes.clean_memory(job, release)
    problem = nodes.release(job, [n for n in allocation if n not in release])
    return f"; {', '.join(release)} could not be given back ({problem})" if problem else ""


def _requeue(job: str, info: dict[str, str], seen: dict[str, str] | None, order: list[str], least: int,
             why: str) -> tuple[str, str]:
    """Requeue the job avoiding ``order`` as far as the partition allows (``least``: a node range's minimum, else
    the job's node count); ("requeue" | "fail", why)."""
    usable = None if seen is None else {n for n, state in seen.items() if nodes.is_usable(state)}
    need = least or int(info.get("NumNodes", "1").split("-")[0] or 1)
    partition = info.get("Partition", "?")
    short = nodes.shortfall(usable, need, partition)
    if short:
        return "fail", f"{why}, but {short}"
    queued = placement.queue(order, usable, need)
    already = nodes.excluded(info)
    problem = nodes.requeue(job, queued.avoid if set(queued.avoid) != set(already) else None)
    return ("fail", problem) if problem else ("requeue", f"{why}: {queued.describe(f'partition {partition}')}")


def _judged(ns: argparse.Namespace, run_dir: Path, job: str, restart: str, info: dict[str, str],
            before: list[dict[str, Any]], seen: dict[str, str] | None) -> Verdict:
    """This attempt's verdict from its records and srun's lines, with what else is known: a doctor failing on every
    node (the setup's), the same step failing before on other nodes (the code's), a save for the time limit, hard
    evidence against the blamed node, and whether the attempt got past its starting step."""
    records = [r for r in exits.records(run_dir / "exits" / exits.attempt_folder()) if r.get("phase") == ns.phase]
    v = judge(records, srun_failures(nodes.job_log(info), restart, job), ns.rc, (run_dir / "requeue.json").exists())
    nodes_seen = {r.get("node") for r in records}
    if ns.phase == "doctor" and v.kind == exits.INFRASTRUCTURE and len(nodes_seen) > 1 and nodes_seen <= set(v.blame):
        v = Verdict(exits.USER_ERROR, f"{v.cause}; it fails on every node: the setup's, not a node's", step=v.step)
    earlier = repeated(v, before)
    if earlier is not None:
        v = Verdict(exits.USER_ERROR, f"{v.cause}; the same step {v.step} failed before on "
                    f"{', '.join(earlier.get('blamed') or ['another node'])}: the code's fault, not a node's",
                    v.where, [], v.step)
    v = with_deadline(v, run_dir)
    down = [n for n in v.blame if seen and n in seen and not nodes.is_usable(seen[n])]
    start, last = progress(run_dir, job, restart)
    reached = max([s for s in (last, v.step) if s is not None], default=None)
    ended = [float(r["t"]) for r in records if r.get("code") is not None and "t" in r]
    return dataclasses.replace(v, hard=v.hard or bool(down) or (ns.phase == "doctor" and bool(v.blame)),
                               start_step=start, progressed=None if start is None else bool(reached and reached > start),
                               first_end_t=min(ended, default=None))


def progress(run_dir: Path, job: str, attempt: str) -> tuple[int | None, int | None]:
    """(the step this attempt started from, the last step its events name), from the event log; (None, None) when
    the attempt never got to its first step's bookkeeping (no ``attempt`` event)."""
    start: int | None = None
    last: int | None = None
    for e in read(run_dir):
        if e.get("event") == "attempt" and str(e.get("job_id")) == job and str(e.get("attempt")) == attempt:
            start, last = int(e.get("resumed_step") or 0), None
        elif start is not None and isinstance(e.get("step"), int) and e.get("event") != "attempt_end":
            last = max(last or 0, int(e["step"]))
    return start, last


def _record(run_dir: Path, phase: str, restart: str, job: str, v: Verdict, action: str, why: str) -> None:
    """The verdict in one line of the log and one ``attempt_end`` event (the budgets count these)."""
    blamed = f" [blamed: {', '.join(v.blame)}]" if v.blame else ""
    where = f" at {v.where}" if v.where else ""
    print(f"attempt ended: {v.kind}: {v.cause}{where}{blamed} -> {why}", file=sys.stderr, flush=True)
    event = {"t": round(time.time(), 3), "event": "attempt_end", "job_id": job, "attempt": restart, "phase": phase,
             "class": v.kind, "cause": v.cause, "where": v.where, "blamed": v.blame, "hard": v.hard, "step": v.step,
             "start_step": v.start_step, "progressed": v.progressed, "first_end_t": v.first_end_t, "decision": action,
             "why": why}
    try:
        with open(run_dir / EVENTS, "a") as f:
            f.write(json.dumps(event) + "\n")
    except OSError as exc:
        print(f"verdict: cannot append to {run_dir / EVENTS} ({exc.strerror})", file=sys.stderr)


def _finish(run_dir: Path, v: Verdict, action: str, why: str, rc: int) -> int:
    if action == "done":
        return 0
    result = {"outcome": "failed", "class": v.kind, "cause": v.cause, "where": v.where, "blamed": v.blame,
              "step": v.step, "reason": why, "exit_code": rc or 1}
    with contextlib.suppress(OSError):
        (run_dir / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    return rc or 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cluster.job.verdict", description=__doc__)
    p.add_argument("--run-dir", default=os.environ.get("RUN_DIR", "."), help="the run folder (default: $RUN_DIR)")
    p.add_argument("--phase", default="train", choices=("train", "doctor"), help="which step of the attempt ended")
    p.add_argument("--rc", type=int, required=True, help="srun's exit code")
    p.add_argument("--max-requeues", type=int, default=3)
    p.add_argument("--max-failures", type=int, default=3)
    p.add_argument("--suspects", default=suspects.default_path(), help="the suspects list to add blamed nodes to")
    p.add_argument("--suspect-hours", type=float, default=24.0)
    p.add_argument("--suspect-after", type=int, default=suspects.AFTER,
                   help="blames from this many different jobs make other jobs avoid a node (hard evidence: one)")
    p.add_argument("--storm-after", type=int, default=3,
                   help="stop after this many attempts in a row end before passing their starting step (0: never)")
    p.add_argument("--in-place", action="store_true",
                   help="the batch script restarts inside the allocation (spare nodes, a node range)")
    p.add_argument("--least", type=int, default=0, help="the fewest nodes an attempt may train on (in place)")
    p.add_argument("--most", type=int, default=0, help="the most nodes an attempt trains on (in place)")
    p.add_argument("--need", type=int, default=0, help="nodes per attempt of a job with spare nodes (in place)")
    p.add_argument("--min-nodes", type=int, default=0,
                   help="the fewest nodes a requeued job may start on, spares included (a node range; Slurm shows the "
                        "allocated count)")
    p.add_argument("--avoid", default="", help="(ignored: the event log holds the job's blames)")
    return p


if __name__ == "__main__":
    sys.exit(main())

