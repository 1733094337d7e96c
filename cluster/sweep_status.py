"""A sweep's progress: each trial's state (its run folder, and Slurm's view of the array) and metric, as a table.

What `make sweep-status` and `make sweep WAIT=1` print; :mod:`cluster.sweep` plans and submits.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from cluster import sweep_report
from cluster.trials import Row, columns, fmt, is_number
from trainer.core.errors import UserError

FINISHED = ("completed", "failed", "cancelled", "timeout", "out_of_memory", "node_fail", "boot_fail", "deadline",
            "preempted")
"""Slurm states (lower case) after which a trial runs no more; a requeued task shows pending/requeued instead."""


def finish(sweep_dir: Path, poll_s: float = 5.0) -> int:
    """``--wait``: wait for every trial, print the table and where each failed trial's log is; 1 if any failed."""
    try:
        rows = wait_for(sweep_dir, poll_s)
    except KeyboardInterrupt:  # stops the waiting, not the sweep
        print(f"\nstopped waiting; the sweep runs on: python -m cluster sweep-status {shlex.quote(str(sweep_dir))}",
              file=sys.stderr)
        return 130
    print(format_status(sweep_dir, rows))
    page(sweep_dir, rows)
    data = _read_sweep(sweep_dir)
    failed = [r for r in rows if r.state != "done"]
    for r in sorted(failed, key=lambda r: r.index):
        # submitit's log layout (rank 0); a one-trial sweep is a plain job, not an array
        job = data["array_job_id"] if len(rows) == 1 else f"{data['array_job_id']}_{r.index}"
        print(f"trial {r.index} ended {r.state} without a result; log: {sweep_dir / 'logs' / job / f'{job}_0_log.err'}",
              file=sys.stderr)
    return 1 if failed else 0


def _job_indexes(job: str, array_id: str, n: int) -> list[int]:
    """Array indexes named by a sacct/squeue JobID: ``123_4``, a pending range ``123_[0-3,7%2]``, or ``123``."""
    head, _, tail = job.partition("_")
    if head != array_id:
        return []
    if not tail:
        return [0] if n == 1 else []  # submitit submits a one-trial sweep as a plain job
    if tail.isdigit():
        return [int(tail)]
    out: list[int] = []
    for part in tail.strip("[]").split("%")[0].split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and (hi.isdigit() or not hi):
            out += range(int(lo), int(hi or lo) + 1)
    return out


def _ask(cmd: list[str]) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):  # no Slurm here, or it hangs
        return ""
    return proc.stdout if proc.returncode == 0 else ""


def slurm_states(array_id: str, n: int) -> dict[int, str]:
    """Slurm's state (lower case) of each array task: sacct first, squeue for tasks sacct does not know (yet)."""
    states: dict[int, str] = {}
    for cmd in (["sacct", "-j", array_id, "-n", "-P", "-X", "--format=JobID,State"],
                ["squeue", "-h", "-r", "-j", array_id, "-o", "%i|%T"]):
        for line in _ask(cmd).splitlines():
            job, _, state = line.strip().partition("|")
            for i in _job_indexes(job, array_id, n):
                if state.split():
                    states.setdefault(i, state.split()[0].lower())  # "CANCELLED by 0" → cancelled
        if len(states) >= n:
            break
    return states


def _read_sweep(sweep_dir: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads((sweep_dir / "sweep.json").read_text())
    except (OSError, ValueError):
        raise UserError("SWEEP_DIR", f"{str(sweep_dir)!r} is not a sweep folder (no readable sweep.json)",
                        "pass a folder under sweeps/ made by `make sweep`, e.g. SWEEP_DIR=sweeps/example-20250101-120000"
                        ) from None
    return data


def _sort_key(mode: str) -> Any:
    def key(r: Row) -> tuple[int, float, int]:
        if r.value is None:
            return (1, 0.0, r.index)
        return (0, -r.value if mode == "max" else r.value, r.index)
    return key


def status(sweep_dir: Path) -> list[Row]:
    """Every trial with its state and metric, best first (per the spec's mode); trials without a metric last."""
    data = _read_sweep(sweep_dir)
    metric, mode, trials = data["spec"]["metric"], data["spec"]["mode"], data["trials"]
    slurm = slurm_states(str(data["array_job_id"]), len(trials)) if data["array_job_id"] else {}
    rows = []
    for t in trials:
        run_dir = Path(t["run_dir"])
        raw = slurm.get(t["index"], "unknown")
        value: float | None = None
        try:
            found = json.loads((run_dir / "result.json").read_text())[metric]
            value = found if is_number(found) else None
            state = "done"
        except (OSError, ValueError, KeyError):
            # A saved-for-requeue trial waits for its next start, unless Slurm has already ended it for good.
            state = "requeued" if (run_dir / "requeue.json").exists() and raw not in FINISHED else raw
        rows.append(Row(t["index"], t["overrides"], state, raw, value, run_dir))
    return sorted(rows, key=_sort_key(mode))


FORGOTTEN_S = 120.0
"""A trial Slurm never reported (no accounting, and squeue forgets ended jobs) counts as ended after this long."""


def wait_for(sweep_dir: Path, poll_s: float = 5.0) -> list[Row]:
    """Poll :func:`status` until Slurm has ended every trial (a requeued trial is waited for); print progress.

    Without accounting, a trial squeue once listed and no longer knows has ended (squeue forgets ended jobs);
    one never seen at all counts as ended after :data:`FORGOTTEN_S`, so waiting always ends.
    """
    last, seen, started = -1, set(), time.monotonic()
    while True:
        rows = status(sweep_dir)
        seen |= {r.index for r in rows if r.slurm != "unknown"}
        gone = time.monotonic() - started > FORGOTTEN_S
        ended = sum(r.slurm in FINISHED or (r.slurm == "unknown" and (r.state == "done" or r.index in seen or gone))
                    for r in rows)
        if ended != last:
            print(f"{ended}/{len(rows)} trials ended", flush=True)
            last = ended
        if ended == len(rows):
            return rows
        time.sleep(poll_s)


def format_status(sweep_dir: Path, rows: list[Row]) -> str:
    """The status table (trial, swept values, state, metric) and, last, the best trial's run folder."""
    data = _read_sweep(sweep_dir)
    metric, mode, keys = data["spec"]["metric"], data["spec"]["mode"], list(data["spec"]["parameters"])
    body = [[str(r.index), *(fmt(r.overrides.get(k)) for k in keys), r.state,
             "-" if r.value is None else f"{r.value:.4f}" if isinstance(r.value, float) else str(r.value)] for r in rows]
    scored = sorted((r for r in rows if r.value is not None), key=_sort_key(mode))
    best = (f"best: trial {scored[0].index} ({metric} {scored[0].value}, {mode}): {scored[0].run_dir}" if scored
            else f"best: none yet (no trial has {metric} in its result.json)")
    array = data["array_job_id"] or "(not submitted)"
    head = f"sweep {data['sweep_id']}: array {array}, {len(rows)} trials, ranked by {metric} ({mode})"
    return f"{head}\n{columns(['trial', *keys, 'state', metric], body)}\n{best}"


def newest_sweep(root: Path) -> Path:
    """The most recently submitted sweep folder under ``root/sweeps``."""
    found = sorted(root.glob("sweeps/*/sweep.json"), key=lambda f: f.stat().st_mtime)
    if not found:
        raise UserError("SWEEP_DIR", f"no sweep under {root / 'sweeps'}",
                        "submit one first (make sweep SWEEP=cluster/sweeps/example.yaml), or pass SWEEP_DIR=…")
    return found[-1].parent


def show_status(sweep_dir: str | None) -> int:
    """``python -m cluster sweep-status``: print the table of one sweep (default: the newest)."""
    folder = Path(sweep_dir) if sweep_dir else newest_sweep(Path.cwd())
    rows = status(folder)
    print(format_status(folder, rows))
    page(folder, rows)
    return 0


def page(sweep_dir: Path, rows: list[Row]) -> None:
    """sweep.html and sweep.png (cluster/sweep_report.py); a plotting problem costs a note, not the status."""
    try:
        print(f"report: {sweep_report.write(sweep_dir, _read_sweep(sweep_dir), rows)}")
    except Exception as exc:
        print(f"note: no sweep report ({type(exc).__name__}: {exc})", file=sys.stderr)
