"""``python -m cluster runs``: every run in the ledger with its state, attempts, nodes, progress and last metric.

Slurm is asked once per call (one ``squeue``, one ``sacct``), not once per row; without accounting (or without
Slurm) the states come from the run folders: ``result.json``, the verdicts' ``attempt_end`` events, ``job_start``s.
"""

from __future__ import annotations

import fnmatch
import json
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cluster.job import ledger
from cluster.job.ledger import Record
from cluster.job.nodes import ask
from trainer.core.errors import UserError
from trainer.core.events import read as read_events

LIVE = {"PENDING": "pending", "CONFIGURING": "running", "RUNNING": "running", "COMPLETING": "running",
        "SUSPENDED": "suspended", "REQUEUED": "requeued", "REQUEUE_HOLD": "requeued", "REQUEUE_FED": "requeued",
        "RESIZING": "running", "SIGNALING": "running", "STAGE_OUT": "running"}
"""squeue's states as ours."""

ENDED = {"COMPLETED": "finished", "CANCELLED": "cancelled", "FAILED": "failed", "TIMEOUT": "failed: timeout",
         "OUT_OF_MEMORY": "failed: resource", "NODE_FAIL": "failed: infrastructure", "BOOT_FAIL": "failed: infrastructure",
         "DEADLINE": "failed: timeout", "PREEMPTED": "preempted", "REQUEUED": "ended"}
"""sacct's final states as ours, where the run folder has no verdict. (A job cancelled while its requeue completes
stays REQUEUED in accounting for good, though the controller says CANCELLED: squeue no longer lists it, so it ended.)"""


@dataclass
class Slurm:
    """What Slurm said in this call: live jobs (squeue) and accounting rows (sacct); None where it could not answer."""

    queue: dict[str, tuple[str, str]] | None = None  # job id (array task 12_3) → (state, nodes)
    accounting: dict[str, list[tuple[str, str]]] | None = None  # job id → [(state, nodes)] per attempt, oldest first


def ask_slurm(job_ids: list[str]) -> Slurm:
    """One squeue for every live job of this user (ids of ended jobs would make ``squeue -j`` fail) and one
    ``sacct --duplicates`` for ``job_ids``."""
    out = Slurm()
    proc = ask(["squeue", "-h", "-r", "-u", ledger.current_user(), "-o", "%i|%T|%N"])
    if proc is not None and proc.returncode == 0:
        out.queue = {}
        for line in filter(None, proc.stdout.splitlines()):
            job, state, nodes = (line.split("|") + ["", ""])[:3]
            out.queue[job.strip()] = (state, nodes)
    if job_ids:
        proc = ask(["sacct", "-X", "-D", "-n", "-P", "-j", ",".join(job_ids), "-o", "JobID,State,NodeList"])
        if proc is not None and proc.returncode == 0:
            out.accounting = {}
            for line in filter(None, proc.stdout.splitlines()):
                job, state, nodes = (line.split("|") + ["", ""])[:3]
                out.accounting.setdefault(job.strip(), []).append((state.split()[0] if state else "", nodes))
    return out


def owner_of(job: str) -> str | None:
    """The user a live job belongs to (None: Slurm does not list it, or does not answer)."""
    proc = ask(["squeue", "-h", "-j", job, "-o", "%u"])
    return proc.stdout.split()[0] if proc is not None and proc.returncode == 0 and proc.stdout.split() else None


@dataclass
class Row:
    """One line of the table (``--json`` prints these)."""

    name: str
    job: str
    kind: str
    state: str
    attempts: int
    nodes: str
    progress: str
    metric: str
    age_s: float
    run_dir: str


def progress_of(events: list[dict[str, Any]]) -> tuple[str, str]:
    """The last step (of how many) and the last logged metric, from the event log."""
    step = next((e.get("step") for e in reversed(events) if e.get("event") in ("progress", "metrics", "checkpoint",
                                                                                "first_step", "exit")), None)
    stop = next((e.get("stop") for e in reversed(events) if e.get("event") == "first_step" and "stop" in e), None)
    values = next((e.get("values") for e in reversed(events) if e.get("event") == "metrics"), None)
    values = values if isinstance(values, dict) else {}
    key = "loss" if "loss" in values else next(iter(values), None)
    metric = f"{key}={values[key]:.4g}" if key is not None and isinstance(values[key], (int, float)) else ""
    return ("" if step is None else f"{step}/{stop}" if stop else str(step)), metric


def result_of(run_dir: Path) -> dict[str, Any]:
    """A run folder's result.json ({} when it has none yet)."""
    return read_dict(run_dir / "result.json")


def read_dict(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; {} when it is missing, torn or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def job_state(record: Record, slurm: Slurm, events: list[dict[str, Any]],
              superseded: bool = False) -> tuple[str, int, str]:
    """(state, attempts, nodes) of one job: Slurm's word while it lives, else the run folder's verdict
    (``superseded``: the job was resubmitted, so the folder's result.json is its successor's)."""
    job = record.job_id
    starts = [e for e in events if e.get("event") == "job_start" and str(e.get("job_id")) == job]
    acct = (slurm.accounting or {}).get(job, [])
    # sacct lists a pending job too, and a job that gave nodes back (RESIZING); restarts inside the allocation are
    # attempts that only the batch script's job_start events show.
    attempts = max(sum(state not in ("PENDING", "RESIZING") for state, _ in acct), len(starts))
    live = (slurm.queue or {}).get(job)
    nodes = (live[1] if live and live[1] and not live[1].startswith("(") else "") or (acct[-1][1] if acct else "")
    nodes = "" if nodes in ("None assigned", "(null)") else nodes
    if live:
        state = LIVE.get(live[0], live[0].lower())
        return ("requeued" if state == "pending" and attempts > 0 else state), attempts, nodes
    # A resubmitted job's folder holds its successor's result: only the job's own verdicts speak for it then.
    result = {} if superseded else result_of(Path(record.run_dir))
    ends = [e for e in events if e.get("event") == "attempt_end" and str(e.get("job_id")) == job]
    if record.cancelled_at or (acct and acct[-1][0] == "CANCELLED" and not result):
        return "cancelled", attempts, nodes
    if result.get("outcome") in ("finished", "pruned"):
        return str(result["outcome"]), attempts, nodes
    if result.get("outcome") == "failed":
        return (f"failed: {result['class']}" if result.get("class") else "failed"), attempts, nodes
    if ends and ends[-1].get("decision") in ("done", "fail"):  # the verdict ended the job
        cls = ends[-1].get("class")
        return ("finished" if ends[-1]["decision"] == "done" else f"failed: {cls}"), attempts, nodes
    if acct:
        return ENDED.get(acct[-1][0], acct[-1][0].lower() or "unknown"), attempts, nodes
    if slurm.queue is None:
        return "unknown (no squeue)", attempts, nodes
    return ("ended" if starts else "never started"), attempts, nodes


def trial_state(record: Record, slurm: Slurm, events: list[dict[str, Any]]) -> tuple[str, int, str]:
    """A sweep's trial: its result, else running while its worker (an array task, which runs one trial after
    another) lives and still holds it."""
    attempts = sum(e.get("event") == "job_start" for e in events)
    outcome = result_of(Path(record.run_dir)).get("outcome")
    if outcome:
        return str(outcome), attempts, ""
    live = (slurm.queue or {}).get(record.job_id)
    holds = read_dict(Path(record.sweep_dir) / "workers" / f"{record.job_id}.json")  # <array>_<w>: its worker's file
    if live and holds.get("trial") == record.trial:
        return LIVE.get(live[0], live[0].lower()), attempts, live[1]
    return "ended", attempts, ""


def sweep_row(record: Record, slurm: Slurm) -> tuple[str, int, str]:
    """(state, workers that started, progress) of a sweep, from its workers' files and Slurm; no study is opened."""
    folder = Path(record.run_dir)
    arrays = record.ids()
    live = [s for j, (s, _) in (slurm.queue or {}).items() if j.partition("_")[0] in arrays]
    done = total = 0
    for path in folder.glob("workers/*.json"):
        history = [h for h in read_dict(path).get("history") or [] if isinstance(h, dict)]
        done += sum(h.get("state") in ("COMPLETE", "PRUNED") for h in history)
        total += len(history)
    target = read_dict(folder / "sweep.json").get("target")
    if live:
        state = "running" if any(LIVE.get(s) == "running" for s in live) else "pending"
    elif record.cancelled_at:
        state = "cancelled"
    else:
        state = "finished" if target and done >= target else "ended" if total else "unknown"
    return state, total, f"{done}/{target or '?'} trials"


def rows(slurm: Slurm | None = None, trials: bool = False) -> list[Row]:
    """A row per recorded run, newest first (trials only with ``trials``)."""
    every = ledger.records()
    recs = [r for r in every if trials or r.kind != "trial"]
    slurm = slurm or ask_slurm(sorted({str(j) for r in recs for j in r.ids()}))
    superseded = {r.resubmit_of for r in every if r.resubmit_of}
    now, out = time.time(), []
    for r in recs:
        run_dir = Path(r.run_dir)
        age = now - (r.submitted_at or now)
        if r.kind == "sweep":
            state, attempts, progress = sweep_row(r, slurm)
            out.append(Row(r.name, r.job_id, "sweep", state, attempts, "", progress, "", age,
                           str(run_dir)))
            continue
        events = list(read_events(run_dir))
        state, attempts, nodes = (trial_state(r, slurm, events) if r.kind == "trial"
                                  else job_state(r, slurm, events, r.job_id in superseded))
        progress, metric = progress_of(events)
        out.append(Row(r.name, r.job_id, r.kind, state, attempts, nodes,
                       progress, metric, age, str(run_dir)))
    return out


def since_seconds(text: str) -> float:
    """``--since``: 30m, 6h, 2d, or a date (2026-11-25, 2026-11-25T14:00), as an age in seconds."""
    found = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text)
    if found:
        return float(found.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[found.group(2)]
    try:
        from datetime import datetime

        return time.time() - datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise UserError("--since", f"{text!r} is neither an age nor a date", "e.g. --since 6h, --since 2d, "
                        "--since 2026-11-25") from None


def select(table: list[Row], state: str | None, since: str | None, pattern: str | None) -> list[Row]:
    """The rows a user asked for: a state (its first word: ``failed`` matches every failure), an age, a name or job
    id pattern (shell-style: ``char-*``)."""
    if state:
        table = [r for r in table if r.state.split(":")[0].strip() == state or r.state.split(" ")[0] == state]
    if since:
        limit = since_seconds(since)
        table = [r for r in table if r.age_s <= limit]
    if pattern:
        table = [r for r in table if fnmatch.fnmatch(r.name, pattern) or fnmatch.fnmatch(r.job, pattern)]
    return table


def age(seconds: float) -> str:
    """A short age: 45s, 12m, 3h, 2d."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(max(seconds, 0))}s"


COLUMNS = ("name", "job", "state", "attempts", "nodes", "progress", "metric", "age")


def table(found: list[Row], width: int = 120) -> str:
    """The rows as a table no wider than ``width``: the name and nodes columns give way first."""
    cells = [[r.name, r.job, r.state, str(r.attempts), r.nodes or "-", r.progress or "-", r.metric or "-", age(r.age_s)]
             for r in found]
    widths = [max([len(c[i]) for c in cells] + [len(COLUMNS[i])]) for i in range(len(COLUMNS))]
    for i in (0, 4, 6):  # too wide: shorten name, nodes, metric (never below their heading)
        over = sum(widths) + 2 * (len(widths) - 1) - width
        if over > 0:
            widths[i] = max(len(COLUMNS[i]), widths[i] - over)

    def fit(text: str, w: int) -> str:
        return text if len(text) <= w else text[:max(w - 1, 0)] + "…"

    lines = ["  ".join(h.upper().ljust(w) for h, w in zip(COLUMNS, widths, strict=True)).rstrip()]
    lines += ["  ".join(fit(c, w).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return "\n".join(lines)


def show(state: str | None, since: str | None, pattern: str | None, as_json: bool, trials: bool, width: int,
         limit: int | None = None) -> int:
    """Print the runs table (or JSON), the newest ``limit`` rows (None: all) and how many older ones there are; a
    message, not an empty table, when nothing is recorded or matches."""
    found = select(rows(trials=trials), state, since, pattern)
    shown = found if limit is None else found[:limit]
    if as_json:
        print(json.dumps([asdict(r) for r in shown], indent=1))
        return 0
    if not found:
        print(f"no runs recorded in {ledger.folder()}" if not ledger.records() else "no run matches")
        return 0
    print(table(shown, width))
    if len(found) > len(shown):
        more = len(found) - len(shown)
        print(f"… and {more:,} older run{'s' if more > 1 else ''} (--all shows every one, -n N the newest N)")
    return 0
