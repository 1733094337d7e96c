"""The verdict on one attempt of a job, in the batch shell after srun returns: how it ended, and what happens next.

``python -m cluster.verdict --phase train --rc $rc …`` reads the ranks' exit records (trainer/core/exits.py), srun's
own ``srun: error: n2: task 1: Killed`` lines in the job's log, and the requeue marker; it classifies the attempt
(finished, preempted, user_error, resource, infrastructure) by its first cause, not its echoes; appends one
``attempt_end`` line to events.jsonl; and then requeues (a preemption save, or an infrastructure failure within
``max_failures``, excluding the blamed nodes) or ends the job, writing the reason to result.json. It exits with the
job's exit code. Stdlib only: it runs with the host's python3, outside any container.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster import nodes, suspects
from trainer.core import exits
from trainer.core.errors import EXIT_REQUEUE
from trainer.core.events import EVENTS, read

SRUN_TASK = re.compile(r"^srun: error: (\S+): tasks? ([\d,\-]+): (.+)$")
"""srun's line for a task that ended badly: node, task ids, how (Killed, Exited with exit code N, Terminated)."""

SRUN_LAUNCH = re.compile(r"^srun: error: Task launch for \S+ failed on node (\S+): (.+)$")
"""srun's line for a node it could not start tasks on."""

START_MARK = "attempt {restart} of job {job} starts"
"""The line the batch shell prints to stderr as an attempt starts: srun's lines after the last one are this attempt's."""


@dataclass
class Verdict:
    """How an attempt ended: its class, first cause, where (a user error's file:line), the nodes it blames."""

    kind: str
    cause: str
    where: str | None = None
    blame: list[str] = field(default_factory=list)
    step: int | None = None


def srun_failures(log: Path | None, restart: str, job: str) -> list[tuple[str, str, str]]:
    """(node, tasks, how) for each task srun reported in this attempt's part of the job log, in srun's order."""
    try:
        text = log.read_text(errors="replace") if log else ""
    except OSError:
        return []
    mark = START_MARK.format(restart=restart, job=job)
    lines = (text[text.rfind(mark):] if mark in text else text).splitlines()
    # After "Terminating StepId" srun reports the tasks it ended itself (--kill-on-bad-exit): echoes, not causes.
    cut = next((i for i, line in enumerate(lines) if "Terminating StepId" in line), len(lines))
    found: list[tuple[str, str, str]] = []
    for line in lines[:cut]:
        if m := SRUN_TASK.match(line):
            found.append((m[1], m[2], m[3]))
        elif m := SRUN_LAUNCH.match(line):
            found.append((m[1], "launch", f"srun could not start tasks there: {m[2]}"))
    return found


def judge(records: list[dict[str, Any]], srun: list[tuple[str, str, str]], rc: int, marker: bool) -> Verdict:
    """The first cause among the records and srun's lines (see the module docstring)."""
    steps = [r["step"] for r in records if isinstance(r.get("step"), int)]
    step = max(steps) if steps else None
    ended = [r for r in records if r.get("code") is not None]
    causes = [r for r in ended if r["code"] not in (0, EXIT_REQUEUE) and not r.get("echo")]
    silent = [r for r in records if r.get("code") is None]
    if causes and all(c.get("aborted") for c in causes) and all(r.get("code") == 0 for r in records if r not in causes):
        ranks = ", ".join(str(c["rank"]) for c in causes)
        return Verdict(exits.FINISHED, f"every rank finished its work; rank {ranks} then aborted in teardown (a script "
                       "that destroys its process group without a barrier first)", step=step)
    if causes:
        first = min(causes, key=lambda r: r["t"])
        blame = sorted({n for c in causes if c.get("class") == exits.INFRASTRUCTURE for n in c.get("blame") or []})
        if first.get("class") == exits.INFRASTRUCTURE and not blame:
            blame = [first["node"]]
        return Verdict(first.get("class", exits.USER_ERROR), exits.describe(first), first.get("where"), blame, step)
    if rc == 0:  # srun saw every task exit 0
        return Verdict(exits.FINISHED, "every rank finished", step=step)
    if marker or (rc == EXIT_REQUEUE and all(r.get("code") == EXIT_REQUEUE for r in ended)):
        return Verdict(exits.PREEMPTED, "saved after the warning signal", step=step)
    killed = [s for s in srun if "exit code" not in s[2]]
    if killed:
        node, tasks, how = killed[0]
        ranks = ", ".join(str(r["rank"]) for r in silent if r.get("node") == node) or "?"
        cause = f"{node}: {how}" if tasks == "launch" else f"rank {ranks} on {node} was killed (srun: task {tasks}: {how})"
        return Verdict(exits.INFRASTRUCTURE, cause, blame=[node], step=step)
    if silent:
        first = silent[0]
        return Verdict(exits.INFRASTRUCTURE, f"rank {first['rank']} on {first['node']} ended without a record "
                       "(killed by a signal)", blame=sorted({r["node"] for r in silent}), step=step)
    if any(r.get("echo") for r in ended):
        return Verdict(exits.INFRASTRUCTURE, "a peer was lost mid-collective (no rank recorded why)", step=step)
    if srun:
        return Verdict(exits.INFRASTRUCTURE, f"srun: task {srun[0][1]} on {srun[0][0]}: {srun[0][2]}",
                       blame=[srun[0][0]], step=step)
    return Verdict(exits.USER_ERROR, f"the tasks exited {rc} without a record (their output is above)", step=step)


def history(run_dir: Path) -> list[dict[str, Any]]:
    """The earlier verdicts of this job (``attempt_end`` events)."""
    return [e for e in read(run_dir) if e.get("event") == "attempt_end"]


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


def decide(v: Verdict, before: list[dict[str, Any]], limits: Limits) -> tuple[str, str]:
    """("requeue" | "fail" | "done", why)."""
    if v.kind == exits.FINISHED:
        return "done", "finished"
    if v.kind == exits.PREEMPTED:
        done = sum(e.get("class") == exits.PREEMPTED for e in before)
        if done < limits.max_requeues:
            return "requeue", f"preempted: requeue {done + 1} of max_requeues={limits.max_requeues}"
        return "fail", f"preempted, but {done} requeues done (max_requeues={limits.max_requeues})"
    if v.kind != exits.INFRASTRUCTURE:
        return "fail", f"{v.kind.replace('_', ' ')}: not retried"
    failures = sum(e.get("class") == exits.INFRASTRUCTURE for e in before)
    if failures >= limits.max_failures:
        return "fail", f"infrastructure failure {failures + 1}, max_failures={limits.max_failures}: not retried"
    return "requeue", f"infrastructure failure {failures + 1} of max_failures={limits.max_failures}: retried"


def main(argv: list[str] | None = None) -> int:
    """Judge this attempt, record it, act (requeue or not); exit with the job's code."""
    ns = _parser().parse_args(argv)
    run_dir, env = Path(ns.run_dir), os.environ
    job, restart = env.get("SLURM_JOB_ID", "0"), exits.attempt_id()
    records = [r for r in exits.records(run_dir / "exits" / restart) if r.get("phase") == ns.phase]
    log = nodes.job_log(job)
    v = judge(records, srun_failures(log, restart, job), ns.rc, (run_dir / "requeue.json").exists())
    before = history(run_dir)
    earlier = repeated(v, before)
    if earlier is not None:
        v = Verdict(exits.USER_ERROR, f"{v.cause}; the same step {v.step} failed before on "
                    f"{', '.join(earlier.get('blamed') or ['another node'])}: the code's fault, not a node's",
                    v.where, [], v.step)
    limits = Limits(ns.max_requeues, ns.max_failures, Path(ns.suspects), ns.suspect_hours)
    # The requeue's SIGTERM reaches this whole job step: ignored here and (inherited) in scontrol, so that the
    # exclusion after the requeue still happens before KillWait's SIGKILL.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    action, why = decide(v, before, limits)
    if action == "requeue" and v.blame:
        suspects.add(limits.suspects, v.blame, limits.suspect_hours, job, v.cause)
        left = spare(env.get("SLURM_JOB_NODELIST", ""), ns.need, [*ns.avoid.split(","), *v.blame])
        if left is not None:  # the next attempt starts here, at once: printed for the batch shell's loop
            why += f" here, on the allocation's other nodes ({left})"
            _record(run_dir, ns.phase, restart, v, "restart_here", why)
            _say(v, why)
            print(f"restart-here: {','.join(sorted({n for n in [*ns.avoid.split(','), *v.blame] if n}))}", flush=True)
            return 0
        short = nodes.shortfall(job, v.blame)
        if short:
            action, why = "fail", f"{why}, but {short}"
    if action == "requeue":
        _record(run_dir, ns.phase, restart, v, action, why)
        _say(v, why)
        problem = nodes.requeue(job, v.blame)
        if problem is None:
            return 0
        action, why = "fail", problem
    _record(run_dir, ns.phase, restart, v, action, why)
    return _finish(run_dir, v, action, why, ns.rc)


def spare(nodelist: str, need: int, avoid: list[str]) -> str | None:
    """The nodes of this allocation the next attempt can run on without ``avoid`` (None: fewer than ``need``)."""
    if not need or not nodelist:
        return None
    left = [n for n in nodes.hostnames(nodelist) if n not in avoid]
    return ",".join(left[:need]) if len(left) >= need else None


def _record(run_dir: Path, phase: str, restart: str, v: Verdict, action: str, why: str) -> None:
    event = {"t": round(time.time(), 3), "event": "attempt_end", "attempt": restart, "phase": phase,
             "class": v.kind, "cause": v.cause, "where": v.where, "blamed": v.blame, "step": v.step,
             "decision": action, "why": why}
    try:
        with open(run_dir / EVENTS, "a") as f:
            f.write(json.dumps(event) + "\n")
    except OSError as exc:
        print(f"verdict: cannot append to {run_dir / EVENTS} ({exc.strerror})", file=sys.stderr)


def _say(v: Verdict, why: str) -> None:
    blamed = f" [blamed: {', '.join(v.blame)}]" if v.blame else ""
    where = f" at {v.where}" if v.where else ""
    print(f"attempt ended: {v.kind}: {v.cause}{where}{blamed} -> {why}", file=sys.stderr, flush=True)


def _finish(run_dir: Path, v: Verdict, action: str, why: str, rc: int) -> int:
    _say(v, why)
    if action == "done":
        return 0
    result = {"outcome": "failed", "class": v.kind, "cause": v.cause, "where": v.where, "blamed": v.blame,
              "step": v.step, "reason": why, "exit_code": rc or 1}
    with contextlib.suppress(OSError):
        (run_dir / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    return rc or 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cluster.verdict", description=__doc__)
    p.add_argument("--run-dir", default=os.environ.get("RUN_DIR", "."), help="the run folder (default: $RUN_DIR)")
    p.add_argument("--phase", default="train", choices=("train", "doctor"), help="which step of the attempt ended")
    p.add_argument("--rc", type=int, required=True, help="srun's exit code")
    p.add_argument("--max-requeues", type=int, default=3)
    p.add_argument("--max-failures", type=int, default=3)
    p.add_argument("--suspects", default=suspects.default_path(), help="the suspects list to add blamed nodes to")
    p.add_argument("--suspect-hours", type=float, default=24.0)
    p.add_argument("--need", type=int, default=0, help="nodes per attempt, when the job holds spare nodes")
    p.add_argument("--avoid", default="", help="nodes of this allocation earlier attempts were blamed on")
    return p


if __name__ == "__main__":
    sys.exit(main())

