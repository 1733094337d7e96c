#!/usr/bin/env python3
"""The dev daemons' supervisor: which of our daemons run, stopping them, and what they left behind. Used by
slurm/dev-cluster.sh (Slurm, munge, MariaDB) and containers/engine.sh (dockerd, containerd) and apptainer.sh, which
keep apt, ``unshare`` and their config files; standard library only (it runs before any venv exists).

    daemons.py pid FILE [--comm NAME] [--cmdline-has TEXT]   the pid in FILE, if that process is alive and ours
    daemons.py alive PID                                    0 if PID runs (a zombie does not)
    daemons.py stop [--grace S] [--name WHAT] PID...        TERM, up to S seconds, then KILL
    daemons.py left [--mntns INODE] [--cgroup ID...] [--cmdline-has TEXT]   pids that match (our leftovers)

A pid file is trusted only when its process still runs the command we started (``--comm``, or a word of its
command line): a stale file must never make us signal a stranger.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path


def state(pid: int) -> str | None:
    """The process's state letter (None: gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Running, and not a zombie (our daemons' parent may be a PID 1 that reaps late: kill -0 succeeds on those)."""
    return state(pid) not in (None, "Z", "X")


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def pid_of(file: Path, comm: str | None = None, has: str | None = None) -> int | None:
    """The pid recorded in ``file`` when that process is alive and is the one we started."""
    try:
        text = "".join(c for c in file.read_text() if c.isdigit())
    except OSError:
        return None
    if not text or not alive(int(text)):
        return None
    pid = int(text)
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    if (comm is not None and name != comm) or (has is not None and has not in cmdline(pid)):
        return None
    return pid


def stop(pids: list[int], grace_s: float, what: str, say: bool = True) -> list[int]:
    """TERM every pid, wait up to ``grace_s`` for them to end, then KILL what is left; the pids still there after."""
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        if say:
            print(f"{what}: still running after {grace_s:g} s, killing: {' '.join(map(str, left))}", file=sys.stderr)
        for pid in left:
            _signal(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while (left := [p for p in left if alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.1)
    return left


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _pids() -> Iterator[int]:
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            yield int(entry)


def leftovers(mntns: str | None = None, cgroups: list[str] | None = None, has: str | None = None) -> list[int]:
    """Live processes in mount namespace ``mntns`` (its inode), in a cgroup naming one of ``cgroups``, or whose
    command line holds ``has``: what a daemon that died without cleaning up left running."""
    found = []
    for pid in _pids():
        try:
            if mntns and str(os.stat(f"/proc/{pid}/ns/mnt").st_ino) == mntns and alive(pid):
                found.append(pid)
                continue
            if cgroups and any(c in Path(f"/proc/{pid}/cgroup").read_text() for c in cgroups) and alive(pid):
                found.append(pid)
                continue
        except OSError:
            continue
        if has and has in cmdline(pid) and alive(pid):
            found.append(pid)
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="slurm/daemons.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="verb", required=True)
    q = sub.add_parser("pid")
    q.add_argument("file", type=Path)
    q.add_argument("--comm")
    q.add_argument("--cmdline-has")
    a = sub.add_parser("alive")
    a.add_argument("pid", type=int)
    s = sub.add_parser("stop")
    s.add_argument("pids", type=int, nargs="*")
    s.add_argument("--grace", type=float, default=8.0)
    s.add_argument("--name", default="stop")
    left = sub.add_parser("left")
    left.add_argument("--mntns")
    left.add_argument("--cgroup", nargs="*", default=[])
    left.add_argument("--cmdline-has")
    ns = p.parse_args(argv)
    if ns.verb == "pid":
        pid = pid_of(ns.file, ns.comm, ns.cmdline_has)
        if pid is None:
            return 1
        print(pid)
        return 0
    if ns.verb == "alive":
        return 0 if alive(ns.pid) else 1
    if ns.verb == "stop":
        return 1 if stop(ns.pids, ns.grace, ns.name) else 0
    for pid in leftovers(ns.mntns, ns.cgroup, ns.cmdline_has):
        print(pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
