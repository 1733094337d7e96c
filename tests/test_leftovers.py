"""A hung test is stopped by the timeout, named in the last lines, and leaves no process behind (tests/leftovers.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.procfs import alive

from .conftest import ROOT
from .test_slurm import slurm_env

__all__ = ["slurm_env"]  # the fixture, for the cluster test below

HUNG = '''
import os
import subprocess
import sys
import time


def test_hangs_with_ranks_and_an_orphan(tmp_path):
    pids = os.environ["PIDS"]
    # A rank leading its own process group (as spawn_ranks starts them), and a child it forks.
    subprocess.Popen(["bash", "-c", f"sleep 600 & echo $! >> {pids}; echo $$ >> {pids}; wait"], start_new_session=True)
    # An orphan: its parent exits at once, so it is reparented (to pytest, the subreaper).
    subprocess.run(["bash", "-c", f"setsid sleep 600 & echo $! >> {pids}"])
    time.sleep(600)


def test_after_it_runs():
    assert True
'''


def run_inner(tmp_path: Path, text: str, env: dict[str, str], timeout: int = 6) -> subprocess.CompletedProcess[str]:
    """pytest on one file with this suite's leftovers plugin and a ``timeout`` (seconds: the hung test's processes
    have started long before it, on a machine four times as slow too)."""
    (tmp_path / "test_inner.py").write_text(text)
    (tmp_path / "pytest.ini").write_text(f"[pytest]\ntimeout = {timeout}\naddopts = -ra -p tests.leftovers\n")
    return subprocess.run([sys.executable, "-m", "pytest", "-c", str(tmp_path / "pytest.ini"), "-p", "no:cacheprovider",
                           str(tmp_path / "test_inner.py")], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def test_a_hung_test_is_named_in_the_last_lines_and_its_processes_are_killed(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    proc = run_inner(tmp_path, HUNG, {"PIDS": str(pids)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-3:]
    assert any(line.startswith("FAILED") and "test_hangs_with_ranks_and_an_orphan" in line and "Timeout" in line
               for line in last), proc.stdout
    assert "1 failed, 1 passed" in last[-1]
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 3
    deadline = time.monotonic() + 30
    while any(alive(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in started if alive(p)]


HUNG_JOB = '''
import os
import subprocess
import time

import pytest


@pytest.fixture(scope="module")
def slurm_env():
    return dict(os.environ)  # the outer test's: its dev cluster's environment (no slow set-up inside the timeout)


def test_hangs_with_a_queued_job(slurm_env):
    out = subprocess.run(["sbatch", "--parsable", "-o", "/dev/null", "--wrap", "sleep 600"], env=slurm_env,
                         capture_output=True, text=True, check=True).stdout
    open(os.environ["JOB"], "w").write(out.split(";")[0].strip())
    time.sleep(600)
'''


def test_a_hung_cluster_test_cancels_the_jobs_it_submitted(slurm_env: dict[str, str], tmp_path: Path) -> None:
    job_file = tmp_path / "job"
    # 40 s: squeue, which the plugin asks before the test, may be slow on a busy machine.
    proc = run_inner(tmp_path, HUNG_JOB, {**slurm_env, "JOB": str(job_file)}, timeout=40)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert any(line.startswith("FAILED") and "test_hangs_with_a_queued_job" in line and "Timeout" in line
               for line in proc.stdout.strip().splitlines()[-2:]), proc.stdout
    job = job_file.read_text()
    deadline, state = time.monotonic() + 120, ""
    while not state.startswith("CANCELLED") and time.monotonic() < deadline:
        time.sleep(0.5)
        state = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job, "--format=State"], env=slurm_env,
                               capture_output=True, text=True).stdout
    assert state.startswith("CANCELLED"), state
