"""Snapshot folders that outlive their job: a job killed, cancelled or lost with its node never reaches the end that
removes its snapshots, and on a node without a per-job ``/dev/shm`` they would hold RAM until a reboot.

Every process that uses a node's snapshot folder holds a shared ``flock`` on the folder's lease file for as long as it
lives, and renews the file's time every ``RENEW_S``. The kernel drops the lock when its holder dies, however it dies
(SIGKILL, the OOM killer), and in any container that shares the file (``--ipc=host``). A folder whose lease nobody
holds and nobody has renewed for ``GRACE_S`` belongs to a dead job: the next run on the node that takes snapshots
removes it (``sweep``). The grace spares an attempt's folder between its ranks' death and the next attempt's start in
the same allocation. Nothing here asks Slurm, so it works the same inside a container and without Slurm.

The root that holds every job's folders (``/dev/shm/trainer-snapshots-<uid>``) sits in a folder anyone may write: another
user can make that name first, as a symlink to this user's home or as a folder of theirs. So the root is made with mode
0o700 and used only while it is a real folder of this user that no one else may write (``safe_root``); the sweep
refuses any other root, and never follows a symlink below it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import threading
import time
from pathlib import Path

LEASE = ".lease"
RENEW_S = 60.0
"""How often a holder renews its leases' time."""
GRACE_S = 600.0
"""How long a folder nobody holds is kept after its last renewal (an attempt's restart in the allocation)."""
SWEPT = ".swept-"
"""A folder being removed is first renamed to this prefix (atomic), so a sweep killed half-way leaves no half folder
that looks whole."""

_HINT = "remove it, or set TRAINER_MEMORY_DIR to a folder of your own"

_held: dict[Path, int] = {}
_lock = threading.Lock()
_renewer: threading.Thread | None = None


class UnsafeRoot(PermissionError):
    """A snapshot root that is not this user's alone: nothing is written, read or removed under it."""


def safe_root(root: Path) -> None:
    """Make ``root`` (mode 0o700) if missing, then check it is a real folder of this user that no one else may write;
    else raise UnsafeRoot naming it (an OSError: a caller that cannot snapshot goes on without snapshots). A root an
    earlier release made that others could only read (umask 022) is narrowed to 0o700; one its group could write
    (umask 002) is refused like any other: what it holds may not be this user's."""
    root.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(root, 0o700)
    _check(root)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)  # swapped since the check: ELOOP
    try:
        st = os.fstat(fd)
        _refuse(root, st)
        if st.st_mode & 0o077:
            os.fchmod(fd, 0o700)  # snapshots hold the model and optimizer state: no one else reads them
    finally:
        os.close(fd)


def _check(root: Path) -> bool:
    """Whether ``root`` exists; raise UnsafeRoot when it is a symlink, not a folder, another user's, or writable by
    others."""
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        return False
    _refuse(root, st)
    return True


def _refuse(root: Path, st: os.stat_result) -> None:
    uid = os.getuid()
    if stat.S_ISLNK(st.st_mode):
        why = "is a symlink, not a folder"
    elif not stat.S_ISDIR(st.st_mode):
        why = "is not a folder"
    elif st.st_uid != uid:
        why = f"belongs to uid {st.st_uid}, not to uid {uid}"
    elif st.st_mode & 0o022:
        why = f"may be written by others (mode {stat.S_IMODE(st.st_mode):o})"
    else:
        return
    # Short: the session's warning keeps 200 characters of it.
    raise UnsafeRoot(f"snapshot root {root} {why}: not used. HINT: {_HINT}")


def hold(folder: Path) -> None:
    """Hold ``folder``'s lease for the rest of this process (made if missing; once per folder and process)."""
    folder = folder.absolute()
    with _lock:
        if folder in _held:
            return
        for _ in range(10):  # a sweep may remove the folder between our open and our lock: then make it again
            try:
                folder.mkdir(parents=True, exist_ok=True)
                fd = os.open(folder / LEASE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)  # waits while a sweep holds it to remove the folder
                if _current(folder, fd):
                    os.utime(fd)
                    _held[folder] = fd
                    _start_renewing()
                    return
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        raise OSError(f"could not hold a lease on {folder}: it was removed each time")


def _current(folder: Path, fd: int) -> bool:
    """Whether ``fd`` is still ``folder``'s lease file (a sweep may have renamed the folder away meanwhile)."""
    try:
        now, mine = os.stat(folder / LEASE), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)


def release(folder: Path) -> None:
    """Stop holding ``folder``'s lease (its snapshots were cleared)."""
    with _lock:
        fd = _held.pop(folder.absolute(), None)
    if fd is not None:
        os.close(fd)


def renew() -> None:
    """Set every held lease's time to now."""
    with _lock:
        for fd in _held.values():
            with contextlib.suppress(OSError):
                os.utime(fd)


def _start_renewing() -> None:
    global _renewer
    if _renewer is None or not _renewer.is_alive():
        _renewer = threading.Thread(target=_renew_forever, name="trainer-lease", daemon=True)
        _renewer.start()


def _renew_forever() -> None:
    while True:
        time.sleep(RENEW_S)
        renew()


def sweep(root: Path, keep: Path, now: float | None = None, grace_s: float = GRACE_S) -> tuple[int, int]:
    """Remove the folders ``root/<job>/<node>`` that no process holds and nobody has renewed for ``grace_s``
    (``keep`` and the folders of live processes are never touched); returns (folders removed, bytes freed). A root
    that is not this user's alone raises UnsafeRoot, and nothing below it is touched."""
    now = time.time() if now is None else now
    keep = keep.absolute()
    removed = freed = 0
    if not _check(root):
        return removed, freed
    with contextlib.suppress(OSError):
        for job in list(root.iterdir()):
            if job.is_symlink() or not job.is_dir():  # only our own folders: a symlink's target is someone's data
                continue
            if job.name.startswith(SWEPT):
                freed += _delete(job)
                continue
            emptied = False
            for node in list(job.iterdir()):
                if node.is_dir() and not node.is_symlink() and node.absolute() != keep:
                    gone = _remove_if_dead(node, root, now, grace_s)
                    if gone is not None:
                        removed, freed, emptied = removed + 1, freed + gone, True
            if job.absolute() not in keep.parents and (emptied or _idle(job, now, grace_s)):
                with contextlib.suppress(OSError):
                    job.rmdir()  # only when empty
    return removed, freed


def _remove_if_dead(folder: Path, root: Path, now: float, grace_s: float) -> int | None:
    """Remove ``folder`` if no process holds its lease and it was last renewed (or, without a lease, changed) over
    ``grace_s`` ago; the bytes freed, or None when it stays. The lease stays locked until the folder is renamed away,
    so a process that starts to use it meanwhile waits, then sees the folder gone and makes a new one."""
    try:
        fd = os.open(folder / LEASE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:  # made before leases, or whose maker has not opened its lease yet: its age decides
        moved = _move(folder, root) if _idle(folder, now, grace_s) else None
        return None if moved is None else _delete(moved)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # held: a live process uses it
        # Another sweep may have moved this folder away after our open, and a new holder made it again: the file
        # locked is then an old one, and the folder at this path is not what it tells about.
        if not _current(folder, fd) or now - os.fstat(fd).st_mtime <= grace_s:
            return None
        moved = _move(folder, root)
    finally:
        os.close(fd)  # before the delete: a holder waiting for the lock need not wait for it
    return None if moved is None else _delete(moved)


def _idle(folder: Path, now: float, grace_s: float) -> bool:
    """Whether ``folder`` and what it holds have not changed for ``grace_s``."""
    try:
        newest = max([folder.lstat().st_mtime, *(p.lstat().st_mtime for p in folder.iterdir())])
    except OSError:
        return False
    return now - newest > grace_s


def _move(folder: Path, root: Path) -> Path | None:
    """Rename ``folder`` away under ``root`` (atomic); where it went, or None when it could not move."""
    target = root / f"{SWEPT}{os.getpid()}-{time.monotonic_ns()}"
    try:
        os.rename(folder, target)
    except OSError:
        return None
    return target


def _delete(folder: Path) -> int:
    """Delete ``folder``; the bytes it held."""
    size = 0
    with contextlib.suppress(OSError):
        size = sum(p.lstat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
    shutil.rmtree(folder, ignore_errors=True)
    return size
