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
import signal
import sys
import time
from pathlib import Path

from cluster.job import nodes, placement, suspects
from cluster.job.judge import Verdict, judge, srun_failures
from cluster.job.rules import Limits, RequeueRule, decide, history, repeated, restarts_counted
from trainer.core import exits
from trainer.core.errors import EXIT_REQUEUE
from trainer.core.events import EVENTS, read
from trainer.core.records import AttemptEnd, ExitRecord, RequeueMarker, exit_records


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
        marker = RequeueMarker.read(Path(ns.run_dir))
        restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        if RequeueRule(ns.max_requeues).requeues(ns.rc == EXIT_REQUEUE or marker is not None,
                                                 bool(marker and marker.deadline), restarts):
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
    events = list(read(run_dir))
    action, why = decide(v, before, limits, exits.regroups(events, job))
    # The safety cap behind the budgets; a sweep's trial (TRAINER_TRIAL, from the worker) counts its own requeues.
    requeued = restarts_counted(events, job, int(env.get("SLURM_RESTART_COUNT") or 0), bool(env.get("TRAINER_TRIAL")))
    counted = requeued - sum(e.deadline for e in before)  # saves for the time limit are no loop
    if action == "requeue" and not v.deadline and counted >= ns.max_requeues + ns.max_failures:
        action, why = "fail", f"{why}, but the job was requeued {requeued} times already"
    if v.blame and ((action == "requeue" and v.kind == exits.INFRASTRUCTURE) or v.kind == exits.FINISHED):
        suspects.add(limits.suspects, v.blame, limits.suspect_hours, job, v.cause, v.hard)  # finished: lost in place
    allocation = nodes.allocation(info, env)
    shape = placement.Shape(ns.least or ns.need, ns.most or ns.need, ns.in_place or ns.need > 0)
    if action == "requeue":
        # Nodes to avoid, most important first (ExcNodeList last: room permitting, the job keeps avoiding it).
        order = placement.blame_order(v.blame, [e.blamed for e in before],
                                      suspects.active(limits.suspects, limits.suspect_after), nodes.excluded(info))
        inside = placement.here(allocation, order, shape, v.blame) if v.kind == exits.INFRASTRUCTURE else None
        if inside is not None:  # the next attempt starts here, at once: the last lines tell the batch shell's loop
            why = f"{why} {inside.describe('the allocation')}{_give_back(job, allocation, inside.release)}"
            _record(run_dir, ns.phase, restart, job, v, "restart_here", why)
            # The nodes srun is asked for next, as decided here; the last line is the one batch scripts rendered
            # before step-nodes existed read (they avoid its nodes themselves).
            # here: the next attempt's number inside the allocation, past this attempt's recoveries in place.
            here = exits.next_attempt(events, job, restart).partition(".")[2]
            print(f"step-nodes: {','.join(inside.step)}\nhere: {here}\nrestart-here: {','.join(inside.avoid)}",
                  flush=True)
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
            before: list[AttemptEnd], seen: dict[str, str] | None) -> Verdict:
    """This attempt's verdict from its records and srun's lines, with what else is known: a doctor failing on every
    node (the setup's), the same step failing before on other nodes (the code's), a save for the time limit, hard
    evidence against the blamed node, and whether the attempt got past its starting step."""
    records: list[ExitRecord] = [r for r in exit_records(run_dir / "exits" / exits.attempt_folder())
                                 if r.phase == ns.phase]
    v = judge(records, srun_failures(nodes.job_log(info), restart, job), ns.rc, RequeueMarker.read(run_dir))
    nodes_seen = {r.node for r in records}
    if ns.phase == "doctor" and v.kind == exits.INFRASTRUCTURE and len(nodes_seen) > 1 and nodes_seen <= set(v.blame):
        v = Verdict(exits.USER_ERROR, f"{v.cause}; it fails on every node: the setup's, not a node's", step=v.step)
    earlier = repeated(v, before)
    if earlier is not None:
        v = Verdict(exits.USER_ERROR, f"{v.cause}; the same step {v.step} failed before on "
                    f"{', '.join(earlier.blamed or ['another node'])}: the code's fault, not a node's",
                    v.where, [], v.step)
    down = [n for n in v.blame if seen and n in seen and not nodes.is_usable(seen[n])]
    start, last = progress(run_dir, job, restart)
    reached = max([s for s in (last, v.step) if s is not None], default=None)
    ended = [r.t for r in records if r.ended and r.t]
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
    event = AttemptEnd(job, restart, phase, v.kind, v.cause, v.where, v.blame, v.hard, v.step, v.start_step,
                       v.progressed, v.first_end_t, v.deadline, action, why, round(time.time(), 3))
    try:
        with open(run_dir / EVENTS, "a") as f:
            f.write(json.dumps(event.to_json()) + "\n")
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

