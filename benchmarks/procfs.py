"""This machine's processes as /proc shows them: to find a rank, its family or its CPU time from outside it.

No torch here: the tests' process plugin (tests/leftovers.py) imports it in every pytest process.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

STATE, PARENT, GROUP, UTIME, STIME, CUTIME, CSTIME = 0, 1, 2, 11, 12, 13, 14
"""Indexes into :func:`stat`'s fields (proc(5)'s fields 3, 4, 5, 14-17: it counts from the pid, 1)."""


def processes() -> Iterator[tuple[int, dict[str, str], list[str]]]:
    """Every process this user may read: (pid, its environment, its argv), to fault one from outside."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():  # /proc/sys, /proc/self …: not processes to read
            continue
        try:
            env = dict(v.split("=", 1) for v in (proc / "environ").read_text().split("\0") if "=" in v)
            argv = (proc / "cmdline").read_text().split("\0")
        except (OSError, ValueError):
            continue
        yield int(proc.name), env, argv


def pids() -> list[int]:
    """Every process's pid, in order."""
    return sorted(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit())


def stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command's name (which may hold spaces and parentheses), or None for a
    process gone or unreadable. Index them with :data:`STATE`, :data:`PARENT`, …"""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (a rank's loader workers), live or not yet reaped."""
    return [p for p in pids() if (fields := stat(p)) is not None and int(fields[PARENT]) == pid]


def alive(pid: int | str) -> bool:
    """Whether ``pid`` runs or is stopped: a zombie (ended, not yet reaped) does not."""
    fields = stat(pid)
    return fields is not None and fields[STATE] != "Z"
