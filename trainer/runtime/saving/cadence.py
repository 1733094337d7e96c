"""When to save on its own (``checkpoint.cadence=auto``), and the job's deadline (its Slurm end time).

Young (1974) and Daly (2006): with saves that stall training C seconds and interruptions every M seconds on average,
saving every τ ≈ √(2·C·M) loses the least (C/τ spent saving, τ/2 recomputed per interruption). C is measured: each
save's stall on rank 0 (an async save's copy only), and before this run saved, the stalls in its event log. M counts
only interruptions nobody announced (an attempt killed without an exit, or one the verdict classed as infrastructure),
since a preemption with a warning signal loses almost nothing: M = (node-free time observed + M₀) / (interruptions + 1), where
M₀ = ``mtbf_hours`` (per node) / nodes is the prior. The answer is clamped so that saving never takes more than 5 %
of the time, and a run saves at least every ``MAX_INTERVAL_S``.

Rank 0 reads the end time with ``squeue`` (Slurm 22.05 has no variable for it; a time limit can change while the job
runs) in a thread every ``READ_EVERY_S``, and asks for a last save when the time left is below twice (the longest
blocking save + the steps until the ranks next agree) plus ``SLACK_S`` (see ``SavePolicy.margin_s``).
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from trainer.runtime.records.attempts import attempts

MIN_INTERVAL_S = 30.0
MAX_INTERVAL_S = 4 * 3600.0
MAX_OVERHEAD = 0.05
"""The interval is at least stall / MAX_OVERHEAD: saving never takes more than 5 % of the time."""
FIRST_STALL_S = 1.0
"""The stall assumed before any save of the run was measured."""
READ_EVERY_S = 300.0
SLACK_S = 20.0
"""Seconds the deadline keeps for the end of the attempt: closing W&B, the processes' exit, the verdict, the requeue."""
SIGNAL_EARLY_S = 60.0
"""Slurm may send the --signal warning up to a minute before the time it was asked for (sbatch's manual)."""


def interval_s(stall_s: float, mtbf_s: float) -> float:
    """Young/Daly's √(2·C·M), within [max(MIN_INTERVAL_S, C / MAX_OVERHEAD), MAX_INTERVAL_S]."""
    low = max(MIN_INTERVAL_S, stall_s / MAX_OVERHEAD)
    return min(MAX_INTERVAL_S, max(low, math.sqrt(2 * stall_s * mtbf_s)))


def history(run_dir: Path) -> tuple[float, int, list[float]]:
    """From a run's event log, before this attempt writes to it: (seconds its earlier attempts ran, how many ended
    unannounced, their save stalls)."""
    runs = attempts(run_dir)
    if runs and runs[-1].info.get("event") == "job_start" and not runs[-1].events:
        runs.pop()  # this attempt's own batch start: it has not ended, let alone unannounced
    ran = sum(a.end - a.start for a in runs)
    lost = sum(1 for a in runs if a.exit_code == "killed" or a.verdict.get("class") == "infrastructure")
    stalls = [float(e["stall_s"]) for a in runs for e in a.times("checkpoint") if "stall_s" in e]
    return ran, lost, stalls


def longest_save_s(run_dir: Path) -> float:
    """The longest blocking save in a run's event log (a last save before the time limit blocks), at least
    FIRST_STALL_S."""
    return max([FIRST_STALL_S, *(float(e["stall_s"]) for a in attempts(run_dir) for e in a.times("checkpoint")
                                 if e.get("blocking") and "stall_s" in e)])


def _words(seconds: float) -> str:
    return f"{seconds / 3600:.3g} h" if seconds >= 5400 else f"{seconds / 60:.3g} min" if seconds >= 90 else \
        f"{seconds:.3g} s"


class Cadence:
    """Rank 0's answer to "how long between saves", re-derived as stalls are measured."""

    def __init__(self, run_dir: Path, nodes: int, prior_hours: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        ran, self.lost, stalls = history(run_dir)
        self.prior_s = prior_hours * 3600 / max(1, nodes)
        self.ran_s, self.clock, self.started = ran, clock, clock()
        self.stall_s = max(stalls[-3:]) if stalls else FIRST_STALL_S
        self.measured = bool(stalls)
        self.said = 0.0

    @property
    def mtbf_s(self) -> float:
        observed = self.ran_s + self.clock() - self.started
        return (observed + self.prior_s) / (self.lost + 1)

    def interval(self) -> float:
        return interval_s(self.stall_s, self.mtbf_s)

    def saved(self, stall_s: float) -> None:
        """A save stalled training this long: the newest measurement weighs most (storage changes speed)."""
        self.stall_s = 0.5 * (self.stall_s + stall_s) if self.measured else stall_s
        self.measured = True

    def news(self) -> str | None:
        """One line when the interval is first derived or moved by a quarter since it was last said."""
        now = self.interval()
        if self.said and abs(now - self.said) < 0.25 * self.said:
            return None
        self.said = now
        return (f"checkpoint cadence: saving every {_words(now)}: a save stalls {self.stall_s:.2g} s, interruptions "
                f"every {_words(self.mtbf_s)} ({self.lost} seen, prior {_words(self.prior_s)})")


class Deadline:
    """The job's end time: Slurm's SLURM_JOB_END_TIME from the start (23.02 and later), and rank 0 reads it again
    with squeue in a thread, since a time limit may change while the job runs (``end_in_s``: a test's fixed end,
    seconds from now)."""

    def __init__(self, job_id: str | None, end_in_s: float = 0.0, known_end: float | None = None,
                 wall: Callable[[], float] = time.time) -> None:
        self.wall = wall
        self.end: float | None = wall() + end_in_s if end_in_s > 0 else known_end
        self.job_id = job_id
        if job_id and not end_in_s and shutil.which("squeue"):
            threading.Thread(target=self._watch, name="trainer-deadline", daemon=True).start()
        elif job_id and not end_in_s and known_end is None:
            print("note: squeue is not reachable here (a container without Slurm's tools?) and Slurm gives no "
                  "SLURM_JOB_END_TIME (before 23.02): no save before the time limit unless the warning signal comes "
                  "(profile signal_grace_s)", flush=True)

    def _watch(self) -> None:
        while True:
            self.end = _end_time(self.job_id or "") or self.end
            time.sleep(READ_EVERY_S)

    def left_s(self) -> float | None:
        """Seconds to the time limit, or None without one."""
        return None if self.end is None else self.end - self.wall()


def _end_time(job_id: str) -> float | None:
    """The job's end time from squeue (None: unknown, unlimited, or squeue unreachable)."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%e"], capture_output=True, text=True, timeout=30,
                             env={**os.environ, "SLURM_TIME_FORMAT": "%s"}).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return float(out) if out.isdigit() else None
