"""Slowness put on a process from outside it, as a noisy neighbour or a throttled host does: the time lost falls
wherever the process happens to be (loading data, in backward, in host work), not in a phase its code chose.

- ``Throttle``: SIGSTOP for ``stop_s``, SIGCONT for ``run_s``, again and again, on one process;
- ``CpuQuota``: a CPU quota (cgroup v2 ``cpu.max``, or v1 ``cpu.cfs_quota_us`` where the cpu controller is v1) on a
  set of processes and every child they start afterwards, as a container limit or a host's share does;
- ``pin``: the opposite, quiet: a process and its children on cores of their own, as ranks on separate GPUs or
  nodes have them (two ranks sharing two cores differ by up to 1.45× per step with nothing wrong).

Used by the tests (tests/test_audit.py, tests/test_audit_cluster.py) and the audit benchmark (benchmarks/audit.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import uuid
from collections.abc import Iterable
from pathlib import Path

from benchmarks.procfs import children

CGROUP = Path("/sys/fs/cgroup")


class Throttle:
    """SIGSTOP for ``stop_s``, SIGCONT for ``run_s``, until the ``with`` block ends: the process runs
    ``run_s / (stop_s + run_s)`` of the time, so it is ``(stop_s + run_s) / run_s`` times slower wherever it is."""

    def __init__(self, pid: int, stop_s: float = 0.02, run_s: float = 0.03) -> None:
        self.pid, self.stop_s, self.run_s, self.done = pid, stop_s, run_s, threading.Event()
        self.thread = threading.Thread(target=self._cycle, daemon=True)

    def _cycle(self) -> None:
        try:
            while not self.done.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                self.done.wait(self.stop_s)
                os.kill(self.pid, signal.SIGCONT)
                self.done.wait(self.run_s)
        except ProcessLookupError:
            return

    def __enter__(self) -> Throttle:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)


def pin(pid: int, cores: set[int]) -> int:
    """Every thread of ``pid`` and of its child processes (loader workers) on ``cores``; threads and children started
    later inherit it. Returns how many threads were pinned."""
    family, pinned = {pid, *children(pid)}, 0
    for member in family:
        for task in Path(f"/proc/{member}/task").glob("[0-9]*"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(task.name), cores)
                pinned += 1
    return pinned


def cpu_controller() -> tuple[Path, str] | None:
    """Where this machine's CPU controller lives and its version ("v2" or "v1"), or None (no cgroup to write)."""
    v2 = CGROUP / "cgroup.controllers"
    if v2.exists() and "cpu" in v2.read_text().split():
        return CGROUP, "v2"
    for v1 in (CGROUP / "cpu", CGROUP / "cpu,cpuacct"):
        if (v1 / "cpu.cfs_quota_us").exists():
            return v1, "v1"
    return None


class CpuQuota:
    """``cpus`` CPUs' worth of time (0.1: 10 ms of every 100 ms) for ``pids`` and their later children, until the
    ``with`` block ends (or ``lift()``): a new cgroup under the machine's CPU controller, removed afterwards, its
    processes moved back to the root group. Needs root; ``CpuQuota.possible()`` says whether it can work here."""

    PERIOD_US = 100_000

    def __init__(self, pids: Iterable[int], cpus: float) -> None:
        found = cpu_controller()
        if found is None:
            raise RuntimeError("no writable CPU cgroup controller on this machine")
        self.root, self.version = found
        self.pids, self.cpus = list(pids), cpus
        self.group = self.root / f"outside-quota-{uuid.uuid4().hex[:8]}"
        self.origin: dict[Path, list[int]] = {}

    @staticmethod
    def possible() -> bool:
        found = cpu_controller()
        return found is not None and os.access(found[0], os.W_OK)

    def __enter__(self) -> CpuQuota:
        self.group.mkdir()
        quota = max(1000, int(self.cpus * self.PERIOD_US))
        if self.version == "v2":
            (self.group / "cpu.max").write_text(f"{quota} {self.PERIOD_US}")
        else:
            (self.group / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
            (self.group / "cpu.cfs_quota_us").write_text(str(quota))
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError, OSError):  # it may have ended meanwhile
                self.origin.setdefault(self._group_of(pid), []).append(pid)
                (self.group / "cgroup.procs").write_text(str(pid))
        return self

    def _group_of(self, pid: int) -> Path:
        """The group of the CPU controller ``pid`` is in now, to go back to."""
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if (self.version == "v2" and controllers == "") or "cpu" in controllers.split(","):
                return self.root / path.lstrip("/")
        return self.root

    def lift(self) -> None:
        if not self.group.exists():
            return
        back = {pid: group for group, pids in self.origin.items() for pid in pids}
        for pid in (self.group / "cgroup.procs").read_text().split():  # children started meanwhile: the root group
            with contextlib.suppress(ProcessLookupError, OSError):
                (back.get(int(pid), self.root) / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            self.group.rmdir()

    def __exit__(self, *exc: object) -> None:
        self.lift()
