"""Snapshot folders of dead jobs are cleared from node memory (trainer/checkpoint/lease.py): leases held by real
processes, holders killed with SIGKILL from outside, the clock of the sweep injected."""

from __future__ import annotations

import fcntl
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainer.checkpoint import lease

from .conftest import ROOT, SMALL, ok, run_trainer

HOLDER = ("import sys, time; from pathlib import Path; from trainer.checkpoint import lease; "
          "lease.RENEW_S = float(sys.argv[2]); lease.hold(Path(sys.argv[1])); print('held', flush=True); "
          "time.sleep(600)")


@pytest.fixture
def holders() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


def hold(procs: list[subprocess.Popen[str]], folder: Path, renew_s: float = 3600.0,
         wait: bool = True) -> subprocess.Popen[str]:
    """A process that holds ``folder``'s lease until it is killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder), str(renew_s)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE)
    procs.append(proc)
    if wait:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def aged(folder: Path, when: float) -> Path:
    """Set the time of ``folder`` and everything in it to ``when``."""
    for path in [*folder.rglob("*"), folder]:
        os.utime(path, (when, when))
    return folder


def waiting_for_a_lock(pid: int) -> bool:
    """Whether ``pid`` is blocked on a file lock (the kernel lists waiters with "->" in /proc/locks)."""
    return any("->" in line and line.split()[5] == str(pid) for line in Path("/proc/locks").read_text().splitlines())


def snapshot(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "step_00000003.pt").write_bytes(b"x" * 1000)
    return folder


def test_only_folders_nobody_holds_or_renewed_within_the_grace_are_removed(
        tmp_path: Path, holders: list[subprocess.Popen[str]]) -> None:
    root, t0 = tmp_path / "trainer-snapshots-0", 1_000_000.0
    live, killed, mine = root / "1-a.0" / "n1", root / "2-b.0" / "n1", root / "4-d.0" / "n1"
    hold(holders, snapshot(live))
    victim = hold(holders, snapshot(killed))
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    old, young = snapshot(root / "3-c.0" / "n1"), snapshot(root / "3-c.0" / "n2")  # made before leases: no lease
    snapshot(mine)
    (root / ".swept-9-9").mkdir()  # a sweep killed half-way
    (root / "5-e.1").mkdir()  # an attempt's folder with no node in it
    for folder in (live, killed, old, mine, root / "5-e.1"):
        aged(folder, t0)
    aged(young, t0 + lease.GRACE_S)

    assert lease.sweep(root, mine, now=t0 + lease.GRACE_S - 1) == (0, 0)
    assert sorted(p.name for p in root.iterdir()) == ["1-a.0", "2-b.0", "3-c.0", "4-d.0", "5-e.1"]
    removed, freed = lease.sweep(root, mine, now=t0 + lease.GRACE_S + 1)
    assert (removed, freed) == (2, 2000), "the killed holder's folder and the old one without a lease"
    assert not killed.exists() and not old.exists() and not (root / "2-b.0").exists()
    assert live.is_dir() and young.is_dir() and mine.is_dir(), "a live holder's, a recent and our own folder stay"
    assert sorted(p.name for p in root.iterdir()) == ["1-a.0", "3-c.0", "4-d.0"]
    assert lease.sweep(root, mine, now=t0 + 10 * lease.GRACE_S) == (1, 1000)  # young's turn; live still stays
    assert live.is_dir() and (live / "step_00000003.pt").is_file()


def test_a_holder_renews_its_lease_while_it_lives(tmp_path: Path, holders: list[subprocess.Popen[str]]) -> None:
    folder = tmp_path / "1-a.0" / "n1"
    hold(holders, folder, renew_s=0.05)
    aged(folder, 1000.0)
    deadline = time.monotonic() + 60
    while (folder / lease.LEASE).stat().st_mtime == 1000.0:
        assert time.monotonic() < deadline, "the lease was not renewed"
        time.sleep(0.05)


def test_a_process_that_starts_while_its_folder_is_swept_makes_it_again_and_holds_it(
        tmp_path: Path, holders: list[subprocess.Popen[str]]) -> None:
    """The sweep keeps the lease locked until the folder is renamed away: the starting process waits for the lock,
    then sees its lease is no longer at its path and makes a new one."""
    root = tmp_path / "trainer-snapshots-0"
    folder = snapshot(root / "1-a.0" / "n1")
    (folder / lease.LEASE).touch()
    sweeping = os.open(folder / lease.LEASE, os.O_RDONLY)
    fcntl.flock(sweeping, fcntl.LOCK_EX)
    proc = hold(holders, folder, wait=False)
    deadline = time.monotonic() + 60
    while not waiting_for_a_lock(proc.pid):
        assert time.monotonic() < deadline and proc.poll() is None, "the holder never waited for the lock"
        time.sleep(0.02)
    os.rename(folder, root / ".swept-1-1")
    os.close(sweeping)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    check = os.open(folder / lease.LEASE, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(check, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(check)
    assert lease.sweep(root, root / "x" / "y", now=time.time() + 10 * lease.GRACE_S) == (0, 1000)
    assert folder.is_dir() and not (root / ".swept-1-1").exists()


def test_a_run_that_takes_snapshots_clears_a_dead_jobs_folder(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    dead = snapshot(shm / f"trainer-snapshots-{os.getuid()}" / "123-deadbeef.0" / "n9")
    (dead / lease.LEASE).touch()
    aged(dead, time.time() - 2 * lease.GRACE_S)
    args = [*SMALL, "train.epochs=1", "checkpoint.memory=on", "checkpoint.memory_every_steps=3",
            f"run.dir={tmp_path / 'run'}"]
    ok(run_trainer(args, tmp_path, env={"TRAINER_MEMORY_DIR": str(shm)}))
    assert not dead.parent.exists()
    assert list((shm / f"trainer-snapshots-{os.getuid()}").iterdir()) == [], "the finished run cleared its own"


def test_a_sweep_that_lost_a_race_to_another_leaves_the_folder_made_again_alone(
        tmp_path: Path, holders: list[subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sweeps of one node's root: B opens a dead folder's lease; before B locks it, A removes the folder and the
    job's next attempt makes it again, with a lease of its own. B then locks the old lease file, which nobody holds:
    it must see that the file is no longer the folder's, and leave the live folder alone."""
    root, t0 = tmp_path / "trainer-snapshots-0", 1_000_000.0
    folder = snapshot(root / "1-a.0" / "n1")
    (folder / lease.LEASE).touch()
    aged(folder, t0)
    later, nobody = t0 + 2 * lease.GRACE_S, root / "x" / "y"
    real_flock, raced = fcntl.flock, []

    def flock(fd: int, op: int) -> None:
        if op == fcntl.LOCK_EX | fcntl.LOCK_NB and not raced:  # B, between its open and its lock
            raced.append(True)
            assert lease.sweep(root, nobody, now=later) == (1, 1000)  # A
            hold(holders, folder)  # the next attempt
        real_flock(fd, op)

    monkeypatch.setattr(lease.fcntl, "flock", flock)
    assert lease.sweep(root, nobody, now=later) == (0, 0)  # B
    assert raced and folder.is_dir() and (folder / lease.LEASE).is_file()


def planted(tmp_path: Path) -> tuple[Path, Path]:
    """A user's own folders (``home``: what a job's snapshot folders look like, old, without a lease), and the node's
    snapshot root that another user made first in the shared /dev/shm: a symlink to that home."""
    home = tmp_path / "home"
    aged(snapshot(home / "1-a.0" / "n1"), 1_000_000.0)
    root = tmp_path / "shm" / f"trainer-snapshots-{os.getuid()}"
    root.parent.mkdir()
    root.symlink_to(home)
    return root, home


def test_a_root_planted_as_a_symlink_is_refused_and_what_it_points_to_left_alone(tmp_path: Path) -> None:
    root, home = planted(tmp_path)
    with pytest.raises(PermissionError, match=r"is a symlink, not a folder: not used\. HINT: remove it"):
        lease.sweep(root, root / "2-b.0" / "n1", now=time.time() + 10 * lease.GRACE_S)
    with pytest.raises(lease.UnsafeRoot, match="is a symlink"):
        lease.safe_root(root)
    assert (home / "1-a.0" / "n1" / "step_00000003.pt").is_file() and os.listdir(home) == ["1-a.0"]


@pytest.mark.parametrize("how", ["writable by others", "another user's"])
def test_a_root_another_user_could_have_filled_is_refused(tmp_path: Path, how: str) -> None:
    root = tmp_path / f"trainer-snapshots-{os.getuid()}"
    old = aged(snapshot(root / "1-a.0" / "n1"), 1_000_000.0)
    if how == "writable by others":
        root.chmod(0o1777)
    elif os.getuid() != 0:
        pytest.skip("only root can give a folder to another user")
    else:
        os.chown(root, 4242, 4242)
    said = "may be written by others" if how == "writable by others" else "belongs to uid 4242"
    with pytest.raises(PermissionError, match=said):
        lease.sweep(root, root / "2-b.0" / "n1", now=time.time() + 10 * lease.GRACE_S)
    with pytest.raises(lease.UnsafeRoot, match=said):
        lease.safe_root(root)
    assert old.is_dir()


def test_the_root_is_made_for_its_user_alone_and_an_older_releases_root_narrowed(tmp_path: Path) -> None:
    root = tmp_path / "shm" / f"trainer-snapshots-{os.getuid()}"
    lease.safe_root(root)
    assert stat.S_IMODE(root.lstat().st_mode) == 0o700 and root.lstat().st_uid == os.getuid()
    root.chmod(0o755)  # as the umask made it before: readable by everyone, written by none
    lease.safe_root(root)
    assert stat.S_IMODE(root.lstat().st_mode) == 0o700


def test_the_sweep_follows_no_symlink_below_the_root(tmp_path: Path) -> None:
    _, home = planted(tmp_path)
    root = tmp_path / "own"
    root.mkdir(mode=0o700)
    (root / "3-c.0").mkdir()
    (root / "3-c.0" / "n1").symlink_to(home / "1-a.0" / "n1")
    (root / "1-a.0").symlink_to(home / "1-a.0")
    (root / f"{lease.SWEPT}1-1").symlink_to(home)  # as if a sweep had renamed it there
    assert lease.sweep(root, root / "x" / "y", now=time.time() + 10 * lease.GRACE_S) == (0, 0)
    assert (home / "1-a.0" / "n1" / "step_00000003.pt").is_file()


@pytest.mark.parametrize("how", ["a symlink", "another user's folder"])
def test_a_run_on_a_node_whose_root_another_user_made_trains_without_snapshots(tmp_path: Path, how: str) -> None:
    """Nothing is written, read or removed under a root that is not the user's alone: one warning, and training and
    durable checkpoints go on."""
    root, _ = planted(tmp_path)
    if how == "another user's folder":
        if os.getuid() != 0:
            pytest.skip("only root can give a folder to another user")
        root.unlink()
        root.mkdir()
        root.chmod(0o777)
        os.chown(root, 4242, 4242)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if "run" not in p.parts)
    args = [*SMALL, "train.epochs=1", "checkpoint.memory=on", "checkpoint.memory_every_steps=3",
            f"run.dir={tmp_path / 'run'}"]
    proc = ok(run_trainer(args, tmp_path, env={"TRAINER_MEMORY_DIR": str(root.parent)}))
    assert "warning: memory snapshots stop (UnsafeRoot: snapshot root" in proc.stdout, proc.stdout
    assert (tmp_path / "run" / "result.json").is_file()
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if "run" not in p.parts) == before
