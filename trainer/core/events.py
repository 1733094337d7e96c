"""The run's event log: ``<run>/events.jsonl``, append-only JSON lines written by rank 0 across every attempt.

Each event is one ``write`` of one complete line to a file opened with O_APPEND, so a crash or a SIGKILL leaves
whole lines only (a torn last line, possible on power loss, is skipped by readers). Events: ``attempt`` (job,
restart count, nodes, processes, versions, git commit), ``first_step``, ``progress`` (the step reached, at every
signal poll), ``metrics``, ``checkpoint`` (step, seconds training waited, bytes), ``signal``, ``exit`` (code); the batch
shell adds ``job_start``/``job_end`` and the verdict on each attempt, ``attempt_end`` (class, cause, blamed nodes,
decision: cluster/job/verdict.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

EVENTS = "events.jsonl"


def process_start() -> float:
    """When this process started (wall clock), from /proc: the attempt's start-up includes imports."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def git_commit(folder: Path) -> str | None:
    """The commit of the code in ``folder`` (the job's working folder), when it is a git checkout."""
    try:
        out = subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


class EventLog:
    """Rank 0's appender (other ranks get one that writes nothing). The file is opened at the first event, so a run
    refused before it starts writes none."""

    def __init__(self, run_dir: Path | None) -> None:
        self.path = run_dir / EVENTS if run_dir else None
        self.fd: int | None = None

    def emit(self, event: str, durable: bool = False, **fields: Any) -> None:
        """Append one event; ``durable``: fsync it (attempt boundaries, checkpoints), else leave it to the page cache."""
        if self.path is None:
            return
        line = json.dumps({"t": round(time.time(), 3), "event": event, **fields}, default=str) + "\n"
        try:
            if self.fd is None:
                self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.write(self.fd, line.encode())
            if durable:
                os.fsync(self.fd)
        except OSError:
            pass  # the log serves the report; a full disk must not stop training here (saves will say so)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def read(run_dir: Path) -> Iterator[dict[str, Any]]:
    """Every complete event of a run, in order (a line that does not parse, a torn last one, is skipped)."""
    try:
        lines = (run_dir / EVENTS).read_text(errors="replace").splitlines()
    except OSError:
        return
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "event" in event and "t" in event:
            yield event
