"""Shared helpers: launch the real trainer in real processes (torchrun, gloo) with a clean environment."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.procfs import GROUP, STATE, pids, stat
from tests import warm
from trainer.core.env import without_placement

ROOT = Path(__file__).resolve().parent.parent
AUDIT = Path(__file__).resolve().parent / "audit"

pytest_plugins = ["tests.leftovers", "tests.xdist_groups"]
if os.environ.get("TRAINER_TEST_CPU") == "1":  # each test's CPU seconds, the costliest listed at the end
    pytest_plugins.append("tests.cputime")

# The tests' submissions go to a ledger of their own, not the checkout's runs/ledger (a user's list of runs); the
# jobs they submit inherit it.
if "TRAINER_LEDGER" not in os.environ:
    os.environ["TRAINER_LEDGER"] = tempfile.mkdtemp(prefix="test-ledger-")
    atexit.register(shutil.rmtree, os.environ["TRAINER_LEDGER"], True)

# Small enough for seconds per run on 2 cores, big enough to learn.
SMALL = [
    "data.synthetic_train_size=1024",
    "data.synthetic_test_size=256",
    "data.num_workers=0",
    "train.epochs=1",
    "optim.warmup_steps=2",
    "train.log_every=8",
    "tracking.mode=disabled",
    "run.report=false",  # a second process per run, a quarter of the suite's CPU: tests/test_report.py makes pages
]


def faults(at: dict[str, dict[str, object]] | None = None, **values: object) -> dict[str, str]:
    """The environment that injects test faults (trainer/testing/faults.py), e.g. ``faults(preempt_at_step=3)``;
    ``at={"0": {"kill_at_step": 4}, "1": {...}}`` gives attempts of a Slurm job faults of their own."""
    words = [f"{k}={v}" for k, v in values.items()]
    words += [f"{attempt}:{k}={v}" for attempt, more in (at or {}).items() for k, v in more.items()]
    return {"TRAINER_FAULTS": " ".join(words)}


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The parent's environment minus anything that would tell the trainer where it runs."""
    env = without_placement(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a rank that outlives a test's timeout shows its stacks (ranks_timed_out)
    env["TRAINER_CHECKSUM"] = "1"  # every rank's parameter hash in result.json (off by default: a full model copy)
    env.update(extra or {})
    return env


def run_trainer(args: list[str], cwd: Path, nproc: int = 1, env: dict[str, str] | None = None,
                timeout: float = 480, script: Path | None = None,
                torchrun: bool = False) -> subprocess.CompletedProcess[str]:
    """``python -m trainer args`` (or SCRIPT) in ``nproc`` processes started the way srun starts them (warm: see
    tests/warm/); ``torchrun=True``: under ``torchrun --standalone`` and its agent instead, in new interpreters."""
    target = [str(script)] if script else ["-m", "trainer"]
    if torchrun:
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc-per-node={nproc}", *target, *args], cwd=cwd, env=clean_env(env),
                              capture_output=True, text=True, timeout=timeout)
    if nproc == 1:
        return warm.run([sys.executable, *target, *args], cwd=cwd, env=clean_env(env), capture_output=True,
                        text=True, timeout=timeout)
    ranks = spawn_ranks(args, cwd, nproc, env, script=script, split=True)
    return wait_ranks(ranks, [sys.executable, *target, *args], timeout)


def wait_ranks(ranks: list[Any], args: list[str], timeout: float,
               grace: float = 5.0) -> subprocess.CompletedProcess[str]:
    """Wait for every rank, reading their streams as they go. Once one fails, the others get ``grace`` seconds to
    end on their own, then SIGTERM (as torchrun's agent stops a failed group). Returns the ranks' streams in rank
    order and the exit code of the rank that failed first (0 when none failed); on a timeout kills them all and
    raises TimeoutExpired."""
    outs: list[tuple[str, str]] = [("", "")] * len(ranks)
    errors: list[BaseException] = []

    def read(i: int) -> None:
        try:
            outs[i] = ranks[i].communicate()
        except BaseException as exc:  # noqa: BLE001 - raised again in the test's thread
            errors.append(exc)

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(ranks))]
    for t in readers:
        t.start()
    deadline, stop_at, first = time.monotonic() + timeout, None, None
    while any(t.is_alive() for t in readers):
        now = time.monotonic()
        if first is None:
            first = next((i for i, t in enumerate(readers) if not t.is_alive() and ranks[i].returncode), None)
            stop_at = None if first is None else now + grace
        if now > deadline or (stop_at is not None and now > stop_at):
            if now > deadline:
                raise ranks_timed_out(ranks, readers, outs, args, timeout)
            for i, t in enumerate(readers):
                if t.is_alive():
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(ranks[i].pid, signal.SIGTERM)
            stop_at = deadline
        time.sleep(0.05)
    if errors:
        raise errors[0]
    codes = [p.returncode for p in ranks]
    assert None not in codes, codes
    if first is None:
        first = next((i for i, c in enumerate(codes) if c), None)
    code = 0 if first is None else codes[first]
    return subprocess.CompletedProcess(args, code, "".join(o for o, _ in outs), "".join(e or "" for _, e in outs))


class RanksTimedOut(subprocess.TimeoutExpired):
    """A timeout that shows where each rank was: the tail of its output, its Python stacks among it."""

    def __str__(self) -> str:
        return f"{super().__str__()}\n{self.output}"


def ranks_timed_out(ranks: list[Any], readers: list[threading.Thread], outs: list[tuple[str, str]], args: list[str],
                    timeout: float) -> RanksTimedOut:
    """Every rank still running dumps its stacks, and so do its loader workers, then is killed."""
    alive = [i for i, t in enumerate(readers) if t.is_alive()]
    waits = _dump_stacks(ranks, alive)
    for i in alive:
        readers[i].join(5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(ranks[i].pid, signal.SIGKILL)
        readers[i].join(30)
    return RanksTimedOut(args, timeout, waits + _tails([o + (e or "") for o, e in outs], alive))


def outputs(procs: list[Any], timeout: float) -> list[str]:
    """Each process's output once all have exited. Past ``timeout`` (for all together), the ones still running show
    where they wait, in the kernel and in Python (SIGABRT to each one's process group: its loader workers too), are
    killed, and the test fails with every tail: a hang names its place instead of only its timeout."""
    deadline, outs = time.monotonic() + timeout, []
    for i, p in enumerate(procs):
        try:
            outs.append(p.communicate(timeout=max(0.1, deadline - time.monotonic()))[0] or "")
        except subprocess.TimeoutExpired:
            raise _outlived(procs, outs, i, timeout) from None
    return outs


def _outlived(procs: list[Any], outs: list[str], first: int, timeout: float) -> RanksTimedOut:
    alive = [i for i in range(first, len(procs)) if procs[i].poll() is None]
    waits = _dump_stacks(procs, alive)
    for p in procs[first:]:
        try:
            out = p.communicate(timeout=10)[0]
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.kill()
            out = p.communicate(timeout=30)[0]
        outs.append(out or "")
    return RanksTimedOut(procs[first].args, timeout, waits + _tails(outs, alive))


def _dump_stacks(procs: list[Any], alive: list[int]) -> str:
    """Where each still-running process (``alive``: indices) and its group wait in the kernel; then SIGABRT to each
    group, so that every process of it dumps its Python stacks into its output (PYTHONFAULTHANDLER=1, clean_env)."""
    waits = "".join(f"--- rank {i}: where the kernel holds its processes\n{kernel_waits(procs[i].pid)}" for i in alive)
    for i in alive:
        try:
            os.killpg(procs[i].pid, signal.SIGABRT)  # a leader of its own group (spawn_ranks)
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(ProcessLookupError):
                procs[i].send_signal(signal.SIGABRT)
    return waits


def _tails(texts: list[str], alive: list[int]) -> str:
    """The end of each process's output, the ones that outlived the timeout marked."""
    return "".join(f"--- rank {i}{' (still running at the timeout)' if i in alive else ''}\n{t[-12000:]}\n"
                   for i, t in enumerate(texts))


def kernel_waits(group: int) -> str:
    """Each process of a process group (a rank and its loader workers) with its state (T: stopped) and, per thread,
    the kernel function it sleeps in: where a hang waits, even for a process whose Python stacks cannot be dumped."""
    lines = []
    for pid in pids():
        fields = stat(pid)
        if fields is None or int(fields[GROUP]) != group:
            continue
        with contextlib.suppress(OSError):
            proc = Path(f"/proc/{pid}")
            cmd = proc.joinpath("cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
            waits = sorted(t.joinpath("wchan").read_text() or "running" for t in proc.glob("task/[0-9]*"))
            lines.append(f"pid {pid} state {fields[STATE]} {cmd}\n  threads in: {', '.join(waits)}\n")
    return "".join(lines) or "(none left)\n"


def held(run: Path, procs: list[Any] | None = None, ranks: int | None = None, attempt: str = "0",
         timeout: float = 240) -> None:
    """Wait until ``ranks`` ranks (default: one per process of ``procs``) of ``attempt`` of the run wait at the
    ``wait_at_step`` test fault (``procs``, if given, must all still run). A rank then goes on when a signal reaches
    it, or every rank when ``go`` says so."""
    deadline = time.monotonic() + timeout
    while len(list((run / "faults").glob(f"waiting.{attempt}.*"))) < (ranks or len(procs or [])):
        alive = all(p.poll() is None for p in procs or [])
        assert alive and time.monotonic() < deadline, "".join(p.communicate()[0] or "" for p in procs or []) or \
            f"timed out waiting for {ranks} rank(s) of attempt {attempt} to hold"
        time.sleep(0.1)


def go(run: Path, attempt: str = "0") -> None:
    """Let every rank of ``attempt`` held at ``wait_at_step`` go on."""
    (run / "faults" / f"go.{attempt}").touch()


def result_of(run_dir: Path) -> dict[str, Any]:
    """The summary rank 0 wrote at the end of a run."""
    return json.loads((run_dir / "result.json").read_text())


def ok(proc: subprocess.CompletedProcess[str], code: int = 0) -> subprocess.CompletedProcess[str]:
    """Assert the exit code, showing the output when it differs."""
    assert proc.returncode == code, f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc


@contextlib.contextmanager
def small_tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """``folder`` (made) on a tmpfs of ``size`` (``64k``) while the block runs: a disk that fills from outside the code
    under test. Skips the test where no tmpfs can be mounted (not root)."""
    folder.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)])


@pytest.fixture
def hostile_dir(tmp_path: Path) -> Path:
    """A folder whose name would break naive shell quoting."""
    path = tmp_path / "a'; echo x $(touch pwned) b"
    path.mkdir()
    return path


def exported(script: Path, base: dict[str, str]) -> dict[str, str]:
    """``base`` plus the variables that ``bash SCRIPT env`` prints as ``export NAME=VALUE`` lines (shell-unquoted,
    ``$NAME`` taken from ``base``: ``PATH=/x/bin:"$PATH"`` puts /x/bin first)."""
    import re
    import shlex
    import string

    env = dict(base)
    out = subprocess.run(["bash", str(script), "env"], capture_output=True, text=True, env=base).stdout
    for line in out.splitlines():
        m = re.fullmatch(r"export (\w+)=(.*)", line.strip())
        if m:
            env[m.group(1)] = string.Template(" ".join(shlex.split(m.group(2)))).safe_substitute(env)
    return env


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_ranks(args: list[str], cwd: Path, world: int = 2, env: dict[str, str] | None = None,
                module: str = "trainer", script: Path | None = None, split: bool = False,
                nodes: list[str] | None = None) -> list[Any]:
    """Start ``world`` trainer processes the way srun does: one process per rank, no agent in between (warm: see
    tests/warm/). Each rank's stderr goes to its stdout unless ``split``. ``nodes``: rank r runs as the only
    process of Slurm node ``nodes[r]`` (SLURMD_NODENAME), as if the ranks ran on that many machines.

    Each rank leads its own process group, so a test can signal a rank together with its
    DataLoader workers, as Slurm signals every process of a step.
    """
    port = str(free_port())
    procs = []
    for rank in range(world):
        rank_env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                    "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, **(env or {})}
        if nodes:
            rank_env.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank), SLURMD_NODENAME=nodes[rank])
        target = [str(script)] if script else ["-m", module]
        procs.append(warm.Popen([sys.executable, *target, *args], cwd=cwd, env=clean_env(rank_env),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE if split else subprocess.STDOUT,
                                text=True, start_new_session=True))
    return procs


# Module fixtures that cost next to nothing to make once per worker (the others run training or build an image).
CHEAP_FIXTURES = {"slurm_env", "pkg"}


def _module_fixtures(item: pytest.Function) -> set[str]:
    """The costly module-scoped fixtures a test uses that its own file defines (made once per worker running it)."""
    path = item.nodeid.split("::")[0]
    return {name for name, defs in item._fixtureinfo.name2fixturedefs.items()
            for d in defs if d.scope == "module" and d.baseid == path and name not in CHEAP_FIXTURES}


CLUSTERS = os.environ.get("DEV_CLUSTERS", "").split()
"""Dev clusters of this machine's Slurm to spread the cluster tests over (their DEV_CLUSTER_DIRs; .ci/run starts three);
unset: the one dev cluster (slurm/dev-cluster.sh's default folder, or DEV_CLUSTER_DIR)."""
IMAGE_TIMEOUT = 2400
"""Seconds for a test that uses the built container image, its build included. On 2026-11-30 a VM at about half its
usual speed (`import torch` 4-5 CPU-s against 2.3) took more than 1200 s to build the image and the SIF and run the
reference job beside the rest of CI, in both compatibility sets."""
JOB_TIMEOUT = 1200
"""Seconds for a test that runs jobs on a dev cluster. Such a job lives through attempts each started by Slurm: 1 to 4
minutes alone, up to 8.3 beside the rest of CI on that half-speed VM (the sweep in MariaDB, 495 s). It catches a hang,
never a slow machine."""
CLUSTER_OF: dict[str, int] = {}
"""Test file → the index in CLUSTERS of the dev cluster its tests use (filled at collection)."""
CLUSTER_SECONDS = {
    "tests/test_healing_life.py": 714, "tests/test_healing.py": 632, "tests/test_slurm_commands.py": 502,
    "tests/test_slurm.py": 485, "tests/test_regroup_cluster.py": 258, "tests/test_sweep_cluster.py": 163,
    "tests/test_apptainer.py": 161, "tests/test_audit_cluster.py": 96, "tests/test_docker.py": 81,
    "tests/test_runs_cluster.py": 66, "tests/test_shards_cluster.py": 61, "tests/test_leftovers.py": 48,
    "tests/test_cpu_binding.py": 39, "tests/test_gpu_layouts.py": 34, "tests/test_doctor.py": 24,
    "tests/test_pyxis.py": 1,  # skipped: no pyxis in CI
}
"""Seconds each file's cluster tests took in CI (.ci/run, 2 cores, 2026-11-29 on a20710a: the line CI prints after the
xdist workers' line; test_healing.py's tests then, split since as their durations were), to share the files out so the
clusters finish together; a file not listed counts 40 s a test.
Only the balance depends on them."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Groups for pytest-xdist (tests/xdist_groups.py). Every test of a dev cluster runs on one worker, in file order:
    the cluster's nodes fit one job at a time, and the healing tests drain and blame nodes the others would use (with
    them, a file's tests that share a module fixture, such as the built image). With several clusters (DEV_CLUSTERS),
    whole files go to the cluster with the fewest seconds of tests so far (CLUSTER_SECONDS), one group and one worker
    each. Other tests sharing a module fixture (a reference run) run on one worker, so it is made once. The rest
    spread over the workers.
    """
    from .xdist_groups import publish  # here: imported before pytest registers it, it would miss assert rewriting

    tests = [(t, t.nodeid.split("::")[0], _module_fixtures(t)) for t in items if isinstance(t, pytest.Function)]
    cluster_files = {path for t, path, shared in tests if "slurm_env" in t.fixturenames and shared}
    on_cluster = [(t, path) for t, path, shared in tests
                  if "slurm_env" in t.fixturenames or (path in cluster_files and shared)]
    cost: dict[str, float] = {}
    for _, path in on_cluster:
        cost[path] = cost.get(path, 0) + 40
    cost = {path: CLUSTER_SECONDS.get(path, c) for path, c in cost.items()}
    load = [0.0] * max(1, len(CLUSTERS))
    for path in sorted(cost, key=lambda f: (-cost[f], f)):  # the costliest first, each to the least loaded cluster
        CLUSTER_OF[path] = load.index(min(load))
        load[CLUSTER_OF[path]] += cost[path]
    groups = {t.nodeid: f"dev-cluster-{CLUSTER_OF[path]}" for t, path in on_cluster}
    for t, path, shared in tests:
        if shared and t.nodeid not in groups:
            groups[t.nodeid] = path
    publish(groups)
    for t, _, _ in tests:
        if "image" in t.fixturenames and not t.get_closest_marker("timeout"):
            # Its first test builds the image (or waits for the other worker's build): minutes on a busy machine.
            t.add_marker(pytest.mark.timeout(IMAGE_TIMEOUT))
        elif "slurm_env" in t.fixturenames and not t.get_closest_marker("timeout"):
            t.add_marker(pytest.mark.timeout(JOB_TIMEOUT))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Under xdist the tests that need the built image run last on their worker, which meanwhile runs its other
        # cluster tests; under CI the compatibility sets (one process, collection order) start by building it.
        items.sort(key=lambda t: "image" in getattr(t, "fixturenames", ()))
