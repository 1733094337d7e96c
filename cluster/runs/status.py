"""``python -m cluster status RUN``: one run on one screen, and how any tool here finds a run from what a user types.

A run is named by its folder, its job id (an array task: ``12_3``) or its name (the newest run of that name).
"""

from __future__ import annotations

import re
import shlex
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from cluster.job import ledger
from cluster.job.ledger import Record
from cluster.runs import logs as run_logs
from cluster.runs.table import (
    age,
    ask_slurm,
    job_state,
    owner_of,
    progress_of,
    read_dict,
    result_of,
    sweep_row,
    trial_state,
)
from trainer.core.errors import UserError
from trainer.core.events import read as read_events
from trainer.runtime.records.attempts import attempts as attempts_of
from trainer.runtime.records.attempts import audit_lines, describe_recovery, recoveries


def resolve(ref: str) -> Record:
    """The ledger's record of ``ref``; a clear error for an unknown run or someone else's job."""
    if not ref.strip():  # `make status` without RUN= passes '': as a path, the folder it runs in
        raise UserError("RUN", "no run given", "RUN=<folder, job id or name>, e.g. RUN=runs/1234 (python -m cluster "
                        "runs lists the recorded runs)")
    records = ledger.records()
    path = Path(ref).expanduser()
    if path.exists():
        here = str(path.resolve())
        found = [r for r in records if r.run_dir == here]
        if found:
            return found[0]
        raise UserError("RUN", f"{ref} is a folder, but no recorded run lives there",
                        "python -m cluster runs lists the recorded runs (jobs submitted before the ledger are not in it)")
    found = ([r for r in records if r.job_id == ref or ref in [str(a) for a in r.arrays]]
             if re.fullmatch(r"\d+(_\d+)?", ref) else [r for r in records if r.name == ref])
    if found:
        return found[0]
    if re.fullmatch(r"\d+(_\d+)?", ref):
        owner = owner_of(ref)
        me = ledger.current_user()
        if owner and owner != me:
            raise UserError("RUN", f"job {ref} belongs to {owner}, not to you ({me})",
                            "name one of your runs: python -m cluster runs")
        raise UserError("RUN", f"job {ref} is not in the ledger ({ledger.folder()})",
                        "python -m cluster runs lists the recorded runs; run this from the project it was submitted from")
    raise UserError("RUN", f"no run named {ref!r} in the ledger ({ledger.folder()})",
                    "give a run folder, a job id or a name from: python -m cluster runs")


def _when(t: Any) -> str:
    return datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S") if isinstance(t, (int, float)) and t else "?"


def attempt_lines(record: Record, events: list[dict[str, Any]]) -> list[str]:
    """One line per attempt: when it started, on how many nodes, how it ended (the verdict's class and cause). An
    attempt is a ``job_start`` and the verdict after it (a restart on spare nodes, ``0.1``, starts again in place), or
    a recovery in place inside one (an ``attempt`` event with ``regroup``: no process started)."""
    job = record.job_id
    inside = ("regroup", "grew")
    mine = [e for e in events if str(e.get("job_id")) == job and (e.get("event") in ("job_start", "attempt_end")
                                                                  or e.get("event") == "attempt"
                                                                  and any(e.get(k) for k in inside))]
    out = []
    for i, e in enumerate(mine):
        if e.get("event") == "attempt":
            how = "recovered in place" if e.get("regroup") else "grew back"
            out.append(f"  {e.get('attempt')}  {_when(e.get('t'))}  {e.get('nodes')} node(s)  {how}: "
                       f"{e.get('processes')} processes from step {e.get('resumed_step')}")
        if e.get("event") != "job_start":
            continue
        later = next((j for j in range(i + 1, len(mine)) if mine[j].get("event") == "job_start"), len(mine))
        end = next((x for x in mine[i + 1:later] if x.get("event") == "attempt_end"), None)
        how = (f"{end.get('class')}: {end.get('cause')} → {end.get('decision')}" if end
               else "running, or ended without a verdict")
        out.append(f"  {end.get('attempt') if end else e.get('attempt', e.get('restart'))}  {_when(e.get('t'))}  "
                   f"{e.get('nodes')} node(s)  {how}")
    return out


def throughput(events: list[dict[str, Any]]) -> float | None:
    """Steps per second over the last attempt's metrics and progress events."""
    last = max((i for i, e in enumerate(events) if e.get("event") == "attempt"), default=0)
    points = [(e["t"], e["step"]) for e in events[last:] if e.get("event") in ("metrics", "progress", "first_step")
              and isinstance(e.get("step"), int)]
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return None
    return (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])


def progress_lines(events: list[dict[str, Any]], running: bool = True) -> list[str]:
    """Progress, and while the run is running its throughput and ETA; the last checkpoint."""
    step_text, metric = progress_of(events)
    out = []
    if step_text:
        rate = throughput(events) if running else None
        line = f"progress: step {step_text}" + (f", {metric}" if metric else "")
        if rate:
            line += f", {rate:.3g} steps/s"
            if "/" in step_text:
                done, stop = (int(x) for x in step_text.split("/"))
                line += f", ETA {age((stop - done) / rate)}" if stop > done else ""
        out.append(line)
    ckpt = next((e for e in reversed(events) if e.get("event") == "checkpoint"), None)
    if ckpt:
        out.append(f"last checkpoint: step {ckpt.get('step')}, {age(time.time() - float(ckpt['t']))} ago")
    return out


def _wandb(run_dir: Path) -> str | None:
    data = read_dict(run_dir / "tracking.json")
    if not data:
        return None
    found = sorted(run_dir.glob("wandb/*run-*"))
    return f"{data.get('run_id')}" + (f" ({found[-1]})" if found else "")


def show(ref: str) -> int:
    """Print one run's screen: what it runs, its state, attempts, progress, checkpoint, W&B run, logs; for a
    failed attempt, the last lines of the rank that caused it."""
    record = resolve(ref)
    slurm = ask_slurm(record.ids())
    run_dir = Path(record.run_dir)
    events = list(read_events(run_dir))
    kind = record.kind
    if kind == "sweep":
        state, workers, trials = sweep_row(record, slurm)
        print(f"sweep {record.name}  arrays {', '.join(map(str, record.arrays))}  {state}, {trials}")
        print(f"folder: {run_dir}\nlogs:   {record.log}\nmore:   make sweep-status SWEEP_DIR={shlex.quote(str(run_dir))}")
        return 0
    state, attempts, nodes = (trial_state if kind == "trial" else job_state)(record, slurm, events)
    what = record.command or record.args
    print(f"{kind} {record.name}  job {record.job_id}  {state}" + (f"  on {nodes}" if nodes else ""))
    print(f"submitted {_when(record.submitted_at)} ({record.launcher}, profile {record.profile or '?'}"
          f", git {(record.git or '?')[:10]}){' by hand' if record.by_hand else ''}")
    print(f"runs:   {' '.join(map(str, what)) or '(the built-in trainer, defaults)'}")
    print(f"folder: {run_dir}")
    for line in progress_lines(events, running=state == "running"):
        print(line)
    wandb = _wandb(run_dir)
    if wandb:
        print(f"W&B run: {wandb}")
    lines = attempt_lines(record, events)
    print(f"attempts ({attempts}):" + ("" if lines else " none started yet"))
    for line in lines:
        print(line)
    runs = attempts_of(run_dir)
    for line in [*map(describe_recovery, recoveries(runs)), *audit_lines(runs)]:
        print(line)
    print(f"logs:   {record.log}   (python -m cluster logs {shlex.quote(ref)} [--rank N] [--attempt K] [-f])")
    _why(record, events, run_dir)
    return 0


def _why(record: Record, events: list[dict[str, Any]], run_dir: Path) -> None:
    """A failed run: its first cause and the last lines of the rank it names."""
    result = result_of(run_dir)
    end = next((e for e in reversed(events) if e.get("event") == "attempt_end"
                and str(e.get("job_id")) == record.job_id), None)
    if result.get("outcome") != "failed" or end is None:
        return
    cause = str(result.get("cause") or end.get("cause"))
    found = re.search(r"\brank (\d+)", cause)
    rank = int(found.group(1)) if found else None
    print(f"failed: {cause}" + (f" ({result.get('where')})" if result.get("where") else ""))
    attempt = str(end.get("attempt") or 0)
    tail = run_logs.last_lines(record, rank, attempt)
    if tail:
        print(f"--- last lines of {'rank ' + str(rank) if rank is not None else 'the job'}, attempt {attempt}:")
        print("\n".join(tail))
