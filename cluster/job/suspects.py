"""Suspect nodes: the evidence jobs left against nodes, and which nodes new jobs avoid because of it.

One JSON file (``runs/suspects.json`` in the submit folder, or ``$TRAINER_SUSPECTS``): node → its evidence, one entry
per blame (job, cause, when, until when it counts, hard or not). One blame is weak evidence: a SIGKILL may be the
OOM-killer acting on the job's own memory, a user's ``kill``, a transient fault. A node is avoided only after
``suspect_after`` blames from different jobs within their time (``suspect_hours``), or at once for hard evidence:
a doctor node check failed, a device or interconnect error, srun could not start tasks there, Slurm set it DOWN or
DRAIN. The verdict adds evidence; ``make submit`` and sweeps pass the avoided nodes to Slurm as ``--exclude`` unless
that would leave too few nodes (then the least suspect are used again: fail open, see :func:`fail_open`);
``python -m cluster suspects [--clear NODE|all]`` shows and clears the evidence. Stdlib only.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT = "runs/suspects.json"
AFTER = 2
"""Default ``suspect_after``: blames from this many different jobs make a node avoided."""


def default_path() -> str:
    """``$TRAINER_SUSPECTS``, else runs/suspects.json (relative to the submit folder, where jobs start)."""
    return os.environ.get("TRAINER_SUSPECTS") or DEFAULT


def load(path: Path) -> dict[str, list[dict[str, Any]]]:
    """Every node's evidence, expired entries included; an unreadable file is no evidence (it must never stop a job).
    A list written before evidence was weighed (node → one entry) reads as one soft blame per node."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    out: dict[str, list[dict[str, Any]]] = {}
    for node, value in data.items():
        entries = value if isinstance(value, list) else [value] if isinstance(value, dict) else []
        kept = [_entry(e) for e in entries if isinstance(e, dict)]
        if kept:
            out[str(node)] = kept
    return out


def _entry(e: dict[str, Any]) -> dict[str, Any]:
    """One blame in today's shape (an old entry's ``since`` is its time; it was never hard)."""
    t = float(e.get("t", e.get("since", 0)) or 0)
    return {"t": t, "until": float(e.get("until", 0) or 0), "job": str(e.get("job")), "cause": str(e.get("cause")),
            "hard": bool(e.get("hard", False))}


def _save(path: Path, entries: dict[str, list[dict[str, Any]]]) -> None:
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


def add(path: Path, nodes: Iterable[str], hours: float, job: str, cause: str, hard: bool = False) -> None:
    """Record one blame of each of ``nodes`` by ``job``, counting for ``hours`` from now; expired entries go."""
    now = time.time()
    try:
        with _locked(path):
            entries = load(path)
            for node in nodes:
                kept = [e for e in entries.get(node, []) if e["until"] > now]
                kept.append({"t": round(now, 1), "until": round(now + hours * 3600), "job": job, "cause": cause[:200],
                             "hard": hard})
                entries[node] = kept
            _save(path, entries)
    except OSError as exc:  # stderr: a batch shell reads the verdict's stdout
        print(f"suspects: cannot write {path} ({exc.strerror})", file=sys.stderr)


@dataclass(frozen=True)
class Standing:
    """What the evidence says of one node now."""

    node: str
    evidence: list[dict[str, Any]]
    """Its blames that still count, oldest first."""
    avoided: bool
    why: str
    """One line: the evidence that avoids it, or what is missing."""

    @property
    def weight(self) -> tuple[int, int, float]:
        """How suspect it is (hard evidence first, then blames from more jobs, then the newest): for ordering."""
        jobs = {e["job"] for e in self.evidence}
        return (any(e["hard"] for e in self.evidence), len(jobs), max((e["t"] for e in self.evidence), default=0.0))


def standing(path: Path, after: int = AFTER, now: float | None = None) -> list[Standing]:
    """Every node with evidence that still counts, the most suspect first."""
    now = time.time() if now is None else now
    out = []
    for node, entries in load(path).items():
        live = sorted((e for e in entries if e["until"] > now), key=lambda e: e["t"])
        if not live:
            continue
        hard = [e for e in live if e["hard"]]
        jobs = sorted({e["job"] for e in live})
        if hard:
            why = f"hard evidence from job {hard[-1]['job']}: {hard[-1]['cause']}"
        elif len(jobs) >= after:
            why = f"blamed by {len(jobs)} jobs ({', '.join(jobs)}), avoided from {after}"
        else:
            why = f"blamed by {len(jobs)} job(s) ({', '.join(jobs)}): avoided from {after} different jobs"
        out.append(Standing(node, live, bool(hard) or len(jobs) >= after, why))
    return sorted(out, key=lambda s: s.weight, reverse=True)


def active(path: Path, after: int = AFTER, now: float | None = None) -> list[str]:
    """The nodes the evidence avoids now, the most suspect first."""
    return [s.node for s in standing(path, after, now) if s.avoided]


def fail_open(ordered: list[str], usable: set[str], need: int) -> tuple[list[str], list[str]]:
    """(avoided, used again): avoid the nodes of ``ordered`` (the first matters most) as long as at least ``need``
    of ``usable`` stay; a node that would take the count below ``need`` is used again instead. Nodes not in
    ``usable`` (down, drained, outside the partition) cost nothing to avoid."""
    avoided: list[str] = []
    again: list[str] = []
    for node in dict.fromkeys(ordered):
        if node in usable and len(usable - set(avoided) - {node}) < need:
            again.append(node)
        else:
            avoided.append(node)
    return avoided, again


def clear(path: Path, node: str) -> list[str]:
    """Forget ``node``'s evidence (``all``: every node's); returns the nodes removed."""
    with _locked(path):
        entries = load(path)
        gone = sorted(entries) if node == "all" else [node] if node in entries else []
        for n in gone:
            del entries[n]
        if gone:
            _save(path, entries)
    return gone


def show(path: Path, clear_node: str | None, after: int = AFTER) -> int:
    """``python -m cluster suspects``: each node's evidence and whether new jobs avoid it (or clear one); exit 0."""
    if clear_node:
        gone = clear(path, clear_node)
        print(f"cleared: {', '.join(gone)}" if gone else f"{clear_node} is not in {path}")
        return 0
    now = time.time()
    nodes = standing(path, after, now)
    expired = sorted(set(load(path)) - {s.node for s in nodes})
    if not nodes and not expired:
        print(f"no evidence against any node ({path})")
    for s in nodes:
        left = max(e["until"] for e in s.evidence) - now
        print(f"{s.node}: {'AVOIDED' if s.avoided else 'watched'} ({s.why}); evidence counts {left / 3600:.1f} h more")
        for e in s.evidence:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(e["t"]))
            print(f"  {when}  job {e['job']}{'  [hard]' if e['hard'] else ''}: {e['cause']}")
    for node in expired:
        print(f"{node}: expired (no evidence counts any more)")
    return 0
