"""Suspect nodes: the nodes jobs blamed for an infrastructure failure, kept for a while so new jobs avoid them.

One JSON file (``runs/suspects.json`` in the submit folder, or ``$TRAINER_SUSPECTS``): node → until (epoch s), job,
cause. The verdict adds to it; ``make submit`` and sweeps pass the unexpired ones to Slurm as ``--exclude``;
``python -m cluster suspects [--clear NODE|all]`` lists and clears them. Stdlib only.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DEFAULT = "runs/suspects.json"


def default_path() -> str:
    """``$TRAINER_SUSPECTS``, else runs/suspects.json (relative to the submit folder, where jobs start)."""
    return os.environ.get("TRAINER_SUSPECTS") or DEFAULT


def load(path: Path) -> dict[str, dict[str, Any]]:
    """Every entry, expired ones included (an unreadable file is an empty list: it must never stop a job)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): v for k, v in data.items() if isinstance(v, dict)} if isinstance(data, dict) else {}


def _save(path: Path, entries: dict[str, dict[str, Any]]) -> None:
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}")
    tmp.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One writer at a time (jobs' verdicts may blame nodes at once): an flock on ``<path>.lock``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def add(path: Path, nodes: list[str], hours: float, job: str, cause: str) -> None:
    """Suspect ``nodes`` for ``hours`` from now (a later blame extends it)."""
    until = time.time() + hours * 3600
    try:
        with _locked(path):
            entries = load(path)
            for node in nodes:
                entries[node] = {"until": round(until), "job": job, "cause": cause[:200], "since": round(time.time())}
            _save(path, entries)
    except OSError as exc:  # stderr: a batch shell reads the verdict's stdout
        print(f"suspects: cannot write {path} ({exc.strerror})", file=sys.stderr)


def active(path: Path, now: float | None = None) -> list[str]:
    """The nodes still suspected (sorted)."""
    now = time.time() if now is None else now
    return sorted(n for n, e in load(path).items() if float(e.get("until", 0)) > now)


def clear(path: Path, node: str) -> list[str]:
    """Forget ``node`` (``all``: every node); returns the nodes removed."""
    with _locked(path):
        entries = load(path)
        gone = sorted(entries) if node == "all" else [node] if node in entries else []
        for n in gone:
            del entries[n]
        if gone:
            _save(path, entries)
    return gone


def show(path: Path, clear_node: str | None) -> int:
    """``python -m cluster suspects``: list (or clear) the suspects; exit 0."""
    if clear_node:
        gone = clear(path, clear_node)
        print(f"cleared: {', '.join(gone)}" if gone else f"{clear_node} is not in {path}")
        return 0
    now = time.time()
    entries = load(path)
    if not entries:
        print(f"no suspect nodes ({path})")
    for node, e in sorted(entries.items()):
        left = float(e.get("until", 0)) - now
        state = f"excluded for {left / 3600:.1f} h more" if left > 0 else "expired"
        print(f"{node}: {state}; job {e.get('job')}: {e.get('cause')}")
    return 0
