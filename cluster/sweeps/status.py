"""A sweep's progress: the study's trials (state, metric, steps reported) and Slurm's view of its workers, as a table.

What `make sweep-status` and `make sweep WAIT=1` print; :mod:`cluster.sweeps.submit` submits, :mod:`cluster.sweeps.worker` runs.
"""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path
from typing import Any

from cluster.sweeps import report as sweep_report
from cluster.sweeps.folder import SweepFile, log_path
from cluster.sweeps.lost import fail_lost, squeue_states, task_states
from cluster.sweeps.trials import Row, columns, show
from trainer.core.errors import UserError
from trainer.core.exits import EXIT_INTERRUPTED

FINISHED = ("completed", "failed", "cancelled", "timeout", "out_of_memory", "node_fail", "boot_fail", "deadline",
            "preempted", "ended")
"""Slurm states (lower case) after which a worker runs no more; a requeued one shows pending/requeued instead.
"ended" is ours: accounting's word for a task squeue no longer lists is not final (see :func:`slurm_states`)."""

STATES = {"COMPLETE": "complete", "PRUNED": "pruned", "FAIL": "failed", "RUNNING": "running", "WAITING": "waiting"}
"""Optuna's trial states as the table spells them."""


def slurm_states(arrays: list[str]) -> dict[tuple[str, int], str]:
    """Slurm's state (lower case) of each worker: squeue's while the controller lists it, else sacct's. A state of
    sacct's that is not final, for a task squeue no longer lists, says "ended": a job cancelled while its requeue
    completed stays REQUEUED in accounting for good. When squeue cannot answer, sacct's as it is."""
    if not arrays:
        return {}
    live = squeue_states(arrays)
    accounted = task_states(["sacct", "-j", ",".join(arrays), "-n", "-P", "-X", "--format=JobID,State"], arrays) or {}
    states = {task: state if live is None or state in FINISHED else "ended" for task, state in accounted.items()}
    return {**states, **(live or {})}


def read_sweep(sweep_dir: Path) -> SweepFile:
    """The sweep's record (sweep.json), or a clear error for a folder that is not a sweep."""
    try:
        data = SweepFile.read(sweep_dir)
    except (OSError, ValueError):
        raise UserError("SWEEP_DIR", f"{str(sweep_dir)!r} is not a sweep folder (no readable sweep.json)",
                        "pass a folder under sweeps/ made by `make sweep`, e.g. SWEEP_DIR=sweeps/example-20250101-120000"
                        ) from None
    if data.study is None:
        raise UserError("SWEEP_DIR", f"{sweep_dir} is a sweep of an earlier version (no study)",
                        "its trials' run folders and result.json are still there; submit a new sweep for the table")
    return data


def _sort_key(mode: str) -> Any:
    def key(r: Row) -> tuple[int, float, int]:
        if r.value is None or r.state != "complete":
            return (1, 0.0, r.index)
        return (0, -r.value if mode == "max" else r.value, r.index)
    return key


def status(sweep_dir: Path) -> tuple[list[Row], Any]:
    """Every trial with its state and metric, best first (per the spec's mode), and the study."""
    from cluster.sweeps.study import open_trials

    data = read_sweep(sweep_dir)
    trials = open_trials(data, sweep_dir)
    study = trials.study
    fail_lost(trials, retry=False)  # retried only while a worker lives to run it
    slurm = slurm_states(list(data.arrays))
    rows = []
    for t in study.get_trials(deepcopy=False):
        task = (str(t.user_attrs.get("array", "")), int(t.user_attrs.get("worker", -1)))
        raw = slurm.get(task, "unknown")
        state = STATES[t.state.name]
        if state == "running" and raw in ("pending", "requeued"):
            state = "requeued"
        steps = t.intermediate_values
        value = t.value if t.state.name == "COMPLETE" else steps[max(steps)] if steps and state == "pruned" else None
        run_dir = Path(t.user_attrs.get("run_dir") or sweep_dir / "trials" / str(t.number))
        rows.append(Row(t.number, dict(t.params), state, raw, value, run_dir, len(steps),
                        f"{task[0]}_{task[1]}" if task[0] else ""))
    return sorted(rows, key=_sort_key(data.settings.mode)), study


def workers_ended(data: SweepFile, seen: set[tuple[str, int]], gone: bool) -> tuple[int, int]:
    """(workers ended, workers): by Slurm's states (:func:`slurm_states`); without accounting, a worker squeue listed
    once and no longer lists has ended (squeue forgets ended jobs), and one never seen counts as ended once ``gone``."""
    arrays = list(data.arrays)
    workers = [(a, i) for a in arrays for i in range(data.settings.max_parallel)]
    states = slurm_states(arrays)
    seen |= set(states)
    ended = sum(states.get(w, "unknown") in FINISHED or (w not in states and (w in seen or gone)) for w in workers)
    return ended, len(workers)


FORGOTTEN_S = 120.0
"""A worker Slurm never reported (no accounting, and squeue forgets ended jobs) counts as ended after this long."""


def wait_for(sweep_dir: Path, poll_s: float = 5.0) -> None:
    """Poll until Slurm has ended every worker (a requeued worker is waited for); print progress as trials end."""
    data, seen, started, last = read_sweep(sweep_dir), set[tuple[str, int]](), time.monotonic(), ""
    while True:
        ended, total = workers_ended(data, seen, time.monotonic() - started > FORGOTTEN_S)
        rows, _ = status(sweep_dir)
        done = sum(r.state in ("complete", "pruned", "failed") for r in rows)
        line = f"{done}/{data.target} trials ended ({sum(r.state == 'running' for r in rows)} running)"
        if line != last:
            print(line, flush=True)
            last = line
        if ended == total:
            return
        time.sleep(poll_s)


def finish(sweep_dir: Path, poll_s: float = 5.0) -> int:
    """``--wait``: wait for every worker, print the table and each failed trial's cause and log; 1 if one failed."""
    try:
        wait_for(sweep_dir, poll_s)
    except KeyboardInterrupt:  # stops the waiting, not the sweep
        print(f"\nstopped waiting; the sweep runs on: python -m cluster sweep-status {shlex.quote(str(sweep_dir))}",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    rows, study = status(sweep_dir)
    print(format_status(sweep_dir, rows))
    page(sweep_dir, rows, study)
    attrs = {t.number: t.user_attrs for t in study.get_trials(deepcopy=False)}
    retried = {a["retry_of"] for a in attrs.values() if "retry_of" in a}
    failed = [r for r in rows if r.state not in ("complete", "pruned") and r.index not in retried]
    for r in sorted(failed, key=lambda r: r.index):
        why = attrs[r.index].get("cause") or attrs[r.index].get("lost") or r.state
        print(f"trial {r.index} {r.state}: {why}; its folder: {r.run_dir}; its worker's log: "
              f"{log_path(sweep_dir, r.worker)}", file=sys.stderr)
    return 1 if failed else 0


def format_status(sweep_dir: Path, rows: list[Row]) -> str:
    """The status table (trial, swept values, state, steps, metric, worker) and, last, the best trial's run folder."""
    data = read_sweep(sweep_dir)
    spec = data.settings
    metric, mode, keys = spec.metric, spec.mode, list(spec.parameters)
    body = [[str(r.index), *(show(r.overrides.get(k)) for k in keys), r.state, str(r.steps),
             "-" if r.value is None else f"{r.value:.4f}", r.worker or "-"] for r in rows]
    scored = [r for r in rows if r.state == "complete" and r.value is not None]
    best = (f"best: trial {scored[0].index} ({metric} {scored[0].value}, {mode}): {scored[0].run_dir}" if scored
            else f"best: none yet (no trial has completed with {metric})")
    arrays = ", ".join(data.arrays) or "(not submitted)"
    head = (f"sweep {data.sweep_id}: {spec.method}, pruner {spec.pruner}, {len(rows)} of {data.target} "
            f"trials, workers: array {arrays}; ranked by {metric} ({mode})")
    return f"{head}\n{columns(['trial', *keys, 'state', 'steps', metric, 'worker'], body)}\n{best}"


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
    rows, study = status(folder)
    print(format_status(folder, rows))
    page(folder, rows, study)
    return 0


def page(sweep_dir: Path, rows: list[Row], study: Any) -> None:
    """sweep.html (cluster/sweeps/report.py); a plotting problem costs a note, not the status."""
    try:
        print(f"report: {sweep_report.write(sweep_dir, read_sweep(sweep_dir), rows, study)}")
    except Exception as exc:
        print(f"note: no sweep report ({type(exc).__name__}: {exc})", file=sys.stderr)
