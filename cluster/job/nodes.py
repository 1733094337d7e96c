"""What the verdict (and the run and sweep tools) ask Slurm about a job and its nodes: its log, whether enough nodes
remain, requeue and exclude.

Slurm takes ``ExcNodeList`` only on a pending job, so :func:`requeue` requeues first and updates after, while the
batch shell is still inside KillWait. Stdlib only (the verdict runs with the host's python3).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

UNUSABLE = ("down", "drain", "drng", "fail", "maint", "inval", "unk", "futr", "boot", "powered", "pow_dn", "npc")
"""Node states (sinfo's short forms, their prefixes) a requeued job cannot start on."""


def ask(cmd: list[str]) -> subprocess.CompletedProcess[str] | None:
    """Run a Slurm command; None when it cannot be run or hangs (then nothing may be concluded from it)."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None


def job_state_now(job: str) -> str | None:
    """One job's squeue state ("" once squeue no longer lists it); None when squeue does not answer."""
    proc = ask(["squeue", "-h", "-j", job, "-o", "%T"])
    if proc is None or (proc.returncode and "Invalid job id" not in proc.stderr):
        return None
    return proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else ""


def _run(*cmd: str) -> tuple[int, str]:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return 1, str(exc)
    return out.returncode, (out.stdout if out.returncode == 0 else out.stderr or out.stdout).strip()


def job_fields(job: str) -> dict[str, str]:
    """``scontrol show job -o JOB`` as a dict (values up to the next `` Key=``: paths may hold spaces), from the
    line of ``job`` itself (see :func:`job_line`)."""
    rc, out = _run("scontrol", "show", "job", "-o", job)
    return {} if rc else job_line(out, job)


def parse_fields(line: str) -> dict[str, str]:
    """``Key=value Key2=value with spaces`` as a dict (a value runs up to the next `` Key=``)."""
    return {m.group(1): m.group(2) for m in re.finditer(r"([\w:/]+)=(.*?)(?= [\w:/]+=|$)", line)}


def job_line(out: str, job: str) -> dict[str, str]:
    """The fields of ``job`` in ``scontrol show job -o`` output, which prints a line per job it matches: an array's
    id (which one of its tasks keeps as its own JobId) lists every task, a heterogeneous job's id each component. A
    lone line is the job's; of several, the one that names ``job``, else none (another task's nodes and log are not
    this one's)."""
    lines = [parse_fields(line) for line in out.splitlines() if line.strip()]
    if len(lines) == 1:
        return lines[0]
    return next((fields for fields in lines if _names(fields, job)), {})


def _names(fields: dict[str, str], job: str) -> bool:
    """Whether a job's fields are ``job``'s: its JobId; an array task ``12_3`` by ArrayJobId and ArrayTaskId (a task
    still pending shares its range's line: ``2-5%2``); a heterogeneous job's component ``12+1`` by HetJobId and
    HetJobOffset."""
    array, _, task = job.partition("_")
    het, _, offset = job.partition("+")
    if task:
        try:
            tasks = {int(n) for n in _numbers(fields.get("ArrayTaskId", "").split("%")[0])}
        except ValueError:  # N/A, or a form not read here: no proof that it is this task
            return False
        return fields.get("ArrayJobId") == array and task.isdigit() and int(task) in tasks
    if offset:
        return fields.get("HetJobId") == het and fields.get("HetJobOffset") == offset
    return fields.get("JobId") == job


def job_log(info: dict[str, str]) -> Path | None:
    """The batch script's stderr file (where srun's own lines go), from the job's fields (:func:`job_fields`).
    Slurm 26.05 leaves StdErr empty when it is StdOut's file (22.05 and 24.11 repeat the path)."""
    path = info.get("StdErr") or info.get("StdOut")
    return Path(path) if path else None


def hostnames(nodelist: str) -> list[str]:
    """A Slurm node list (``n[1-3]``) as node names: Slurm's own expansion, else :func:`expand` (scontrol failing or
    missing where this runs); a list neither can read, split at its commas."""
    rc, out = _run("scontrol", "show", "hostnames", nodelist)
    if rc == 0:
        return out.split()
    try:
        return expand(nodelist)
    except ValueError:
        return [name for name in nodelist.split(",") if name]


_PART = re.compile(r"(?:[^,\[\]]|\[[^\[\]]*\])+")
"""A node list's part between top-level commas: names with bracketed ranges (``n[1-3,7]``)."""
_SEGMENT = re.compile(r"([^\[]*)(?:\[([^\]]*)\])?")
"""A part's text up to and including its next bracket."""


def expand(nodelist: str) -> list[str]:
    """A Slurm node list as names, each once, by the rules ``scontrol show hostnames`` and python-hostlist (the
    trainer's, trainer/core/env.py) follow: ``n[01-03,7]`` is n01 n02 n03 n7 (a range keeps its first number's width),
    and each bracket multiplies (``r[1-2]n[1-2]``). Here because this module is stdlib only: the verdict runs with
    the host's python3, which may lack that package. ValueError for a list it cannot read."""
    parts = _PART.findall(nodelist)
    if ",".join(parts) != nodelist:
        raise ValueError(f"not a Slurm node list: {nodelist!r}")
    names: list[str] = []
    for part in parts:
        expanded = [""]
        for segment in _SEGMENT.finditer(part):
            prefix, ranges = segment.group(1), segment.group(2)  # ranges: None without a bracket, "" for "[]"
            here = [prefix + n for n in _numbers(ranges)] if ranges is not None else [prefix]
            expanded = [head + tail for head in expanded for tail in here]
        names += expanded
    return list(dict.fromkeys(names))


def _numbers(ranges: str) -> list[str]:
    """``01-03,7`` as 01 02 03 7: each range at its first number's width. ValueError for anything else."""
    out: list[str] = []
    for item in ranges.split(","):
        low, dash, high = item.partition("-")
        if not low.isdigit() or (dash and not (high.isdigit() and int(high) >= int(low))):
            raise ValueError(f"not a range of numbers: {item!r}")
        out += [f"{i:0{len(low)}d}" for i in range(int(low), int(high) + 1)] if dash else [low]
    return out


def allocation(info: dict[str, str], env: Mapping[str, str]) -> list[str]:
    """The nodes the job holds now, from Slurm's record of it (``info``: :func:`job_fields`): after a shrink it no
    longer holds the nodes it gave back, while ``SLURM_JOB_NODELIST`` still names them (the fallback when scontrol
    cannot say)."""
    held = info.get("NodeList", "")
    return hostnames(held if held and held != "(null)" else env.get("SLURM_JOB_NODELIST", ""))


def excluded(info: dict[str, str]) -> list[str]:
    """The job's ExcNodeList, as node names (Slurm's ``(null)`` when empty)."""
    value = info.get("ExcNodeList", "(null)")
    return [] if value in ("(null)", "") else hostnames(value)


def states(partition: str | None) -> dict[str, str] | None:
    """Each node of ``partition`` (None: every partition) with sinfo's short state; None when sinfo cannot say."""
    rc, out = _run("sinfo", "-h", "-N", *(["-p", partition] if partition else []), "-o", "%N %t")
    if rc:
        return None
    return {w[0]: w[1] for w in (line.split() for line in out.splitlines()) if len(w) >= 2}


def offers_expedited_requeue() -> bool:
    """Whether jobs here may ask for an expedited requeue: sbatch takes --requeue=expedite (Slurm 25.11 and later)
    and the cluster enables it (SlurmctldParameters=enable_expedited_requeue). Asked of Slurm itself."""
    rc, usage = _run("sbatch", "--help")
    if rc or "--requeue[=expedite]" not in usage:
        return False
    rc, config = _run("scontrol", "show", "config")
    return rc == 0 and "enable_expedited_requeue" in config


def memory_mb(partition: str | None) -> int | None:
    """The memory of the smallest node of ``partition`` in MB (sinfo's %m); None when sinfo cannot say."""
    rc, out = _run("sinfo", "-h", "-N", *(["-p", partition] if partition else []), "-o", "%m")
    sizes = [int(w) for w in out.split() if w.isdigit()] if rc == 0 else []
    return min(sizes) if sizes else None


def is_usable(state: str) -> bool:
    """Whether a node in this sinfo state can run a job (not down, drained, failing, unreachable: ``*``)."""
    return not state.rstrip("*~#!%$@^-").startswith(UNUSABLE) and not state.endswith("*")


def usable(partition: str | None) -> set[str] | None:
    """The nodes of ``partition`` a job can start on now; None when sinfo cannot say (then Slurm decides)."""
    seen = states(partition)
    return None if seen is None else {n for n, state in seen.items() if is_usable(state)}


def shortfall(usable_nodes: set[str] | None, need: int, partition: str) -> str | None:
    """Why a job of ``need`` nodes could never start in ``partition`` now, even avoiding nothing; None when it can
    (or sinfo cannot say: then Slurm decides)."""
    if usable_nodes is None or len(usable_nodes) >= need:
        return None
    return (f"partition {partition} has {len(usable_nodes)} usable node(s) for a job of {need}: failing instead of "
            "waiting forever (resubmit once nodes are back)")


def release(job: str, keep: list[str]) -> str | None:
    """Shrink the running job's allocation to ``keep`` (Slurm's own resize: the other nodes go back to the site);
    None when done, else why not. Slurm writes its resize scripts into the working folder: a scratch one here."""
    scratch = tempfile.mkdtemp(prefix="resize-")
    try:
        out = subprocess.run(["scontrol", "update", f"JobId={job}", f"NodeList={','.join(keep)}"], cwd=scratch,
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return None if out.returncode == 0 else (out.stderr or out.stdout).strip()


def requeue(job: str, exclude: list[str] | None) -> str | None:
    """Requeue the job, then set its ExcNodeList to ``exclude`` (None: leave it; empty: clear it, so that nodes
    excluded before may be used again) for its next start; None when it is requeued (a failed exclusion is only
    warned about), else why not. Slurm takes ExcNodeList only on a pending job: after the requeue every moment
    counts (KillWait)."""
    rc, out = _run("scontrol", "requeue", job)
    if rc:
        return f"scontrol requeue {job} failed: {out}"
    if exclude is not None:
        rc, out = _run("scontrol", "update", f"JobId={job}", f"ExcNodeList={','.join(sorted(exclude))}")
        if rc:
            print(f"warning: requeued, but setting ExcNodeList={','.join(exclude)} failed: {out}", file=sys.stderr)
    return None


def clean_memory(job: str, hosts: list[str]) -> None:
    """Remove the job's memory snapshots (trainer/checkpoint/memory.py) on ``hosts``, one task per node, each its own
    node's folder only (nodes that share a /dev/shm, as the dev cluster's do, keep each other's); best effort (a node
    that is gone has lost them anyway): snapshots never outlive the allocation."""
    if not hosts:
        return
    root = os.environ.get("TRAINER_MEMORY_DIR") or "/dev/shm"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(["srun", "--overlap", f"--nodes={len(hosts)}", f"--nodelist={','.join(hosts)}",
                        "--ntasks-per-node=1", "--kill-on-bad-exit=0", "bash", "-c",
                        # Only a root that is this user's own folder: one planted as a symlink leads elsewhere.
                        'r="$1/trainer-snapshots-$2"; [ -d "$r" ] && [ ! -L "$r" ] && [ -O "$r" ] && '
                        'rm -rf "$r/$3"-*/"$SLURMD_NODENAME"', "clean", root, str(os.getuid()),
                        job],
                       capture_output=True, timeout=20)
