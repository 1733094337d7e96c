"""``python -m cluster logs RUN [--rank N] [--attempt K] [-f]``: one attempt's, one rank's output.

Both launchers keep every attempt in one file per job (sbatch: the batch log, each task's line tagged ``N: `` by
``srun --label``; submitit: one file per task). Each attempt starts with the batch shell's (or the task's) line
``attempt K of job J starts``, which splits them; the rank is the Slurm task (with ``launch: torchrun``, the node).
"""

from __future__ import annotations

import codecs
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from cluster.job.ledger import Record
from trainer.core.errors import UserError
from trainer.core.exits import EXIT_INTERRUPTED

MARK = re.compile(r"(?:^|\s)attempt ([\d.]+) of job (\d+) starts")
"""An attempt's first line; its id is Slurm's restart count, with ``.N`` for a restart inside the allocation."""
LABEL = re.compile(r"^\s*(\d+): ")


def files(record: Record, rank: int | None) -> list[Path]:
    """The job's log files: the batch log (sbatch), or its tasks' files (submitit: ``<job>_<task>_log.out/err``)."""
    if not record.log:
        return []
    log = Path(record.log)
    if not record.task_logs:
        return [log]
    job = record.job_id
    task = "*" if rank is None else str(rank)
    return sorted(log.glob(f"{job}_{task}_log.out")) + sorted(log.glob(f"{job}_{task}_log.err"))


def attempts(lines: list[str], job: str) -> list[tuple[str, list[str]]]:
    """The lines of each attempt of ``job`` (before the first mark: attempt 0's). A mark repeated for the same
    attempt (the batch shell's and a submitit task's) does not split it."""
    out: list[tuple[str, list[str]]] = [("0", [])]
    marked = False
    for line in lines:
        found = MARK.search(line)
        if found and found.group(2) == job and not (marked and out[-1][0] == found.group(1)):
            out.append((found.group(1), []))
            marked = True
        out[-1][1].append(line)
    return [(k, part) for k, part in out if part]


def select(lines: list[str], job: str, rank: int | None, attempt: str | None, labelled: bool) -> list[str]:
    """The lines of one attempt (all of them: None) of one rank (every rank: None); labels are taken off."""
    parts = attempts(lines, job)
    if attempt is not None:
        parts = [p for p in parts if p[0] == attempt]
    chosen = [line for _, part in parts for line in part]
    if rank is None or not labelled:
        return chosen
    out = []
    for line in chosen:
        found = LABEL.match(line)
        if found and int(found.group(1)) == rank:
            out.append(line[found.end():])
    return out


def read_lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def _whole_lines(path: Path) -> tuple[list[str], int]:
    """The complete lines of ``path`` and the bytes they take: a line still being written is left to ``_follow``."""
    try:
        data = path.read_bytes()
    except OSError:
        return [], 0
    whole = data[: data.rfind(b"\n") + 1]
    return whole.decode(errors="replace").splitlines(), len(whole)


def show(record: Record, rank: int | None, attempt: str | None, follow: bool,
         alive: Callable[[], bool], poll_s: float = 2.0) -> int:
    """Print the chosen lines; with ``follow``, go on printing new ones while ``alive()`` says the job may still
    write (pending, running, requeued, suspended, or Slurm did not answer)."""
    if record.kind == "sweep":
        raise UserError("RUN", f"{record.name} is a sweep: its workers' logs are in {record.log}",
                        "python -m cluster logs <sweep>-<n> for one trial (its worker's log), or runs --trials")
    if record.kind == "trial":  # its worker's log, from the trial's start to the next trial's
        lines = trial_lines(read_lines(Path(record.log)), record.worker or 0, record.trial or 0)
        if rank is not None:
            lines = [line[m.end():] for line in lines if (m := LABEL.match(line)) and int(m.group(1)) == rank]
        print("\n".join(lines))
        return 0
    try:
        return _show_job(record, rank, attempt, follow, alive, poll_s)
    except KeyboardInterrupt:
        if not follow:
            raise
        # Ctrl-C ends the following, not the job: one line instead of a traceback, and the shell's 130.
        print(f"\nstopped following; job {record.job_id} runs on", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


def _show_job(record: Record, rank: int | None, attempt: str | None, follow: bool, alive: Callable[[], bool],
              poll_s: float) -> int:
    """A job's chosen lines (its log files, see :func:`files`), then with ``follow`` its new ones (:func:`show`)."""
    job = record.job_id
    paths = files(record, rank)
    while follow and not any(p.exists() for p in paths) and alive():  # pending: no log yet
        time.sleep(poll_s)
        paths = files(record, rank)
    if not any(p.exists() for p in paths):
        raise UserError("RUN", f"no log of job {job} at {record.log or '(not recorded)'}",
                        "a pending job has none yet (-f waits for it); a removed log cannot be shown")
    labelled, offset = not record.task_logs, 0
    for i, path in enumerate(paths):
        if len(paths) > 1:
            print(f"==> {path} <==")
        # The followed file is read once: its new lines start where these end (none dropped, none split in two).
        lines, read = _whole_lines(path) if follow and i == 0 else (read_lines(path), 0)
        offset = read if i == 0 else offset
        for line in select(lines, job, rank, attempt, labelled):
            print(line)
    if follow:  # the attempt being written (submitit: the first of the chosen task files)
        for line in _follow(paths[0], job, rank, labelled, alive, poll_s, offset):
            print(line, flush=True)
    return 0


def _follow(path: Path, job: str, rank: int | None, labelled: bool, alive: Callable[[], bool],
            poll_s: float, offset: int) -> Iterator[str]:
    """New lines of ``path`` (of ``rank``) after byte ``offset`` until the job ends; a new attempt's first line is shown
    too."""
    decode = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may straddle two reads
    partial = ""
    while True:
        running = alive()
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
        except OSError:
            chunk = b""
        offset += len(chunk)
        *complete, partial = (partial + decode.decode(chunk)).split("\n")
        if not running and partial:  # the job ended: its last line will not get a newline
            complete, partial = [*complete, partial], ""
        for line in complete:
            yield from ([line] if MARK.search(line) else select([line], job, rank, None, labelled))
        if not running:
            return
        time.sleep(poll_s)


def last_lines(record: Record, rank: int | None, attempt: str, count: int = 10) -> list[str]:
    """The last lines of one attempt of one rank (for ``status`` on a failed attempt)."""
    job = record.job_id
    out: list[str] = []
    for path in files(record, rank):
        out += select(read_lines(path), job, rank, attempt, not record.task_logs)
    return out[-count:]


def trial_lines(lines: list[str], worker: int, trial: int) -> list[str]:
    """A sweep worker's log cut to one trial: from the worker's line that takes (or re-attaches to) it to the line
    that takes the next one."""
    take = re.compile(rf"worker {worker}: (?:trial|re-attached to trial) (\d+)\b")
    out, inside = [], False
    for line in lines:
        found = take.search(line)
        if found:
            inside = int(found.group(1)) == trial
        if inside:
            out.append(line)
    return out
