"""What the verdict (and the run and sweep tools) ask Slurm about a job and its nodes: its log, whether enough nodes
remain, requeue and exclude.

Slurm takes ``ExcNodeList`` only on a pending job, so :func:`requeue` requeues first and updates after, while the
batch shell is still inside KillWait. Stdlib only (the verdict runs with the host's python3).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

UNUSABLE = ("down", "drain", "drng", "fail", "maint", "inval", "unk", "futr", "boot", "powered", "pow_dn", "npc")
"""Node states (sinfo's short forms, their prefixes) a requeued job cannot start on."""


def ask(cmd: list[str]) -> subprocess.CompletedProcess[str] | None:
    """Run a Slurm command; None when it cannot be run or hangs (then nothing may be concluded from it)."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None


def _run(*cmd: str) -> tuple[int, str]:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return 1, str(exc)
    return out.returncode, (out.stdout if out.returncode == 0 else out.stderr or out.stdout).strip()


def job_fields(job: str) -> dict[str, str]:
    """``scontrol show job -o JOB`` as a dict (values up to the next `` Key=``: paths may hold spaces)."""
    rc, out = _run("scontrol", "show", "job", "-o", job)
    return {} if rc else parse_fields(out)


def parse_fields(line: str) -> dict[str, str]:
    """``Key=value Key2=value with spaces`` as a dict (a value runs up to the next `` Key=``)."""
    return {m.group(1): m.group(2) for m in re.finditer(r"([\w:/]+)=(.*?)(?= [\w:/]+=|$)", line)}


def job_log(info: dict[str, str]) -> Path | None:
    """The batch script's stderr file (where srun's own lines go), from the job's fields (:func:`job_fields`)."""
    path = info.get("StdErr")
    return Path(path) if path else None


def hostnames(nodelist: str) -> list[str]:
    """A Slurm node list (``n[1-3]``) as node names."""
    rc, out = _run("scontrol", "show", "hostnames", nodelist)
    return out.split() if rc == 0 else nodelist.split(",")


def excluded(info: dict[str, str]) -> list[str]:
    """The job's ExcNodeList, as node names (Slurm's ``(null)`` when empty)."""
    value = info.get("ExcNodeList", "(null)")
    return [] if value in ("(null)", "") else hostnames(value)


def shortfall(info: dict[str, str], avoid: list[str], least: int = 0) -> str | None:
    """Why a requeue without ``avoid`` (blamed, and excluded already) could never start, or None when it can;
    ``least``: the fewest nodes of a node range (a running job's NumNodes is what it got)."""
    need, partition = least or int(info.get("NumNodes", "1").split("-")[0] or 1), info.get("Partition", "")
    rc, out = _run("sinfo", "-h", "-N", "-p", partition, "-o", "%N %t")
    if rc:
        return None  # no view of the partition: let Slurm decide
    gone = set(avoid)
    usable = {n for n, state in (line.split()[:2] for line in out.splitlines() if len(line.split()) >= 2)
              if n not in gone and not state.rstrip("*~#!%$@^-").startswith(UNUSABLE) and not state.endswith("*")}
    if len(usable) >= need:
        return None
    return (f"requeueing without {', '.join(sorted(gone))} leaves {len(usable)} usable node(s) in partition "
            f"{partition} for a job of {need}: failing instead of waiting forever (clear a node with "
            "`python -m cluster suspects --clear NODE` once it is fixed, and resubmit)")


def requeue(job: str, blamed: list[str], before: list[str]) -> str | None:
    """Requeue the job, then exclude ``blamed`` with ``before`` (what it excluded already, read beforehand: after the
    requeue every moment counts, KillWait) from its next start; None when it is requeued (a failed exclusion is only
    warned about), else why not."""
    rc, out = _run("scontrol", "requeue", job)
    if rc:
        return f"scontrol requeue {job} failed: {out}"
    if blamed:
        nodes = sorted(set(before) | set(blamed))
        rc, out = _run("scontrol", "update", f"JobId={job}", f"ExcNodeList={','.join(nodes)}")
        if rc:
            print(f"warning: requeued, but excluding {','.join(blamed)} failed: {out}", file=sys.stderr)
    return None
