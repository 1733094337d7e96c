"""Nothing outlives its test: processes a test started, and Slurm jobs a cluster test submitted, end with it.

A test that hangs is stopped by pytest-timeout (pyproject: ``timeout``; the signal method raises in the test, so
teardown still runs), which names it in the failure and the short summary. Teardown then SIGKILLs the process group of
every process the test left behind (ranks lead their own groups, as under srun) and ``scancel``s the jobs it queued.
The pytest process is made a child subreaper, so a rank whose launcher died is reparented here and still found.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest

from benchmarks.procfs import PARENT, STATE, alive, pids, processes, stat

PR_SET_CHILD_SUBREAPER = 36
KEPT: set[int] = set()  # long-lived helpers of the whole session (the warm server, tests/warm/), not a test's leftovers


def keep(pid: int) -> None:
    """Never kill ``pid`` as a leftover (its children still are)."""
    KEPT.add(pid)


def pytest_configure(config: pytest.Config) -> None:
    # Not on Linux: orphans go to init and only the direct tree is found.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def descendants(root: int) -> set[int]:
    """Every live (not zombie) process below ``root``, from /proc."""
    children: dict[int, list[int]] = {}
    for pid in pids():
        fields = stat(pid)
        if fields is not None and fields[STATE] != "Z":
            children.setdefault(int(fields[PARENT]), []).append(pid)
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def kill_trees(pids: set[int]) -> None:
    """SIGKILL each process and the process group it leads or belongs to (never our own group)."""
    ours = os.getpgrp()
    for pid in pids:
        try:
            group = os.getpgid(pid)
            if group != ours:
                os.killpg(group, signal.SIGKILL)
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def queued_jobs(env: dict[str, str]) -> set[str]:
    """This user's job ids in squeue (empty when squeue does not answer)."""
    try:
        out = subprocess.run(["squeue", "--me", "-h", "-o", "%A"], env=env, capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return set(out.split())


def outliving(slurm: dict[str, str], wait_s: float = 60) -> dict[int, str]:
    """Processes of this dev cluster's jobs (their SLURM_CONF is its own) whose job Slurm no longer lists: what a
    job left running after its end (Slurm's proctrack/linuxproc lets a daemonised child outlive its job). A job that
    has just ended gets ``wait_s`` for its processes to exit. pid → what it runs."""
    deadline = time.monotonic() + wait_s
    while True:
        queued = queued_jobs(slurm)
        found = {pid: f"{' '.join(argv)[:160]} (job {env['SLURM_JOB_ID']})" for pid, env, argv in processes()
                 if env.get("SLURM_JOB_ID") and env.get("SLURM_CONF") == slurm.get("SLURM_CONF")
                 and env["SLURM_JOB_ID"] not in queued and alive(pid)}
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(1)


@pytest.fixture(autouse=True)
def _leaves_nothing_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    before = descendants(os.getpid())
    slurm = request.getfixturevalue("slurm_env") if "slurm_env" in request.fixturenames else None
    jobs = queued_jobs(slurm) if slurm is not None else set()
    yield
    kill_trees(descendants(os.getpid()) - before - KEPT)
    if slurm is None:
        return
    left = sorted(queued_jobs(slurm) - jobs)
    if left:
        subprocess.run(["scancel", *left], env=slurm, capture_output=True, timeout=30)
    stray = outliving(slurm)
    kill_trees(set(stray))
    if stray and not left:  # a hung test's jobs were cancelled just now; a finished job's processes must be gone
        pytest.fail("processes outlived their Slurm job: " + "; ".join(f"pid {p}: {what}" for p, what in stray.items()))
