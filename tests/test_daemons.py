"""The dev daemons' supervisor (slurm/daemons.py), which slurm/dev-cluster.sh and containers/engine.sh use: a pid
file is trusted only for the process we started, a daemon that ignores TERM is killed, leftovers are found."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .conftest import ROOT

SUPERVISOR = [sys.executable, str(ROOT / "slurm" / "daemons.py")]


def supervise(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SUPERVISOR, *args], capture_output=True, text=True, timeout=60)


def test_a_pid_file_names_a_daemon_only_while_it_runs_what_we_started(tmp_path: Path) -> None:
    daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", str(tmp_path)],
                              start_new_session=True)
    comm = Path(f"/proc/{daemon.pid}/comm").read_text().strip()
    try:
        (tmp_path / "d.pid").write_text(f"{daemon.pid}\n")
        assert supervise("pid", str(tmp_path / "d.pid"), "--comm", comm).stdout.strip() == str(daemon.pid)
        assert supervise("pid", str(tmp_path / "d.pid"), "--cmdline-has", str(tmp_path)).returncode == 0
        assert supervise("pid", str(tmp_path / "d.pid"), "--comm", "slurmctld").returncode == 1  # a stranger's now
        assert supervise("alive", str(daemon.pid)).returncode == 0
        assert supervise("left", f"--cmdline-has={tmp_path}").stdout.split() == [str(daemon.pid)]
    finally:
        daemon.kill()
        daemon.wait()
    assert supervise("pid", str(tmp_path / "d.pid"), "--comm", comm).returncode == 1  # stale
    assert supervise("alive", str(daemon.pid)).returncode == 1
    assert supervise("pid", str(tmp_path / "none.pid")).returncode == 1


def test_a_daemon_that_ignores_term_is_killed_after_the_grace(tmp_path: Path) -> None:
    stubborn = subprocess.Popen(["bash", "-c", "trap '' TERM; while :; do sleep 0.1; done"], start_new_session=True)
    polite = subprocess.Popen(["sleep", "300"], start_new_session=True)
    done = supervise("stop", "--grace", "1", "--name", "test", str(stubborn.pid), str(polite.pid))
    assert done.returncode == 0, done.stderr
    assert f"test: still running after 1 s, killing: {stubborn.pid}" in done.stderr
    assert stubborn.wait(timeout=10) == -9 and polite.wait(timeout=10) == -15
