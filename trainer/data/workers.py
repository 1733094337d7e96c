"""A loader's worker processes: started checked, they ignore preemption signals, and stop through their queue.

Workers are forked from a rank whose other threads run (gloo's, the hang watchdog). CPython before 3.11.10 (and
3.12.0) can leave such a child hung inside ``fork`` itself, before its first line of Python: a thread that was creating
a thread state at that instant (gloo's, releasing a tensor that Python let go of) held a lock the child then waits on
forever (CPython gh-112275). Each worker of our loaders therefore reports once it runs Python; one that has not within
``START_S`` is killed and the loader's workers are forked again.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import multiprocessing
import os
import select
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

START_S = 10.0
"""Seconds a forked worker may take to run its first line of Python (it takes milliseconds; a hung fork never does)."""
TRIES = 3
"""Forks of a loader's workers before giving up with the cause named."""


class Started:
    """A pipe each forked worker writes a byte to once it runs Python (non-blocking: nobody may be reading)."""

    def __init__(self) -> None:
        self.read, self.write = os.pipe()
        for fd in (self.read, self.write):
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
            os.set_inheritable(fd, False)  # forked workers keep it; a started program does not

    def __getstate__(self) -> dict[str, int]:
        return {"read": -1, "write": -1}  # a spawned worker's copy: these numbers mean nothing there

    def note(self) -> None:
        if self.write >= 0:
            with contextlib.suppress(OSError):  # full: nobody is counting (a loader that is not checked)
                os.write(self.write, b".")

    def drain(self) -> None:
        with contextlib.suppress(OSError):
            while os.read(self.read, 4096):
                pass

    def wait(self, count: int, timeout: float, clock: Any = time.monotonic) -> int:
        """How many of ``count`` workers reported within ``timeout`` seconds."""
        seen, deadline = 0, clock() + timeout
        while seen < count and clock() < deadline:
            if select.select([self.read], [], [], max(0.0, deadline - clock()))[0]:
                with contextlib.suppress(BlockingIOError):
                    seen += len(os.read(self.read, count - seen))
        return seen


def _worker_init(signals: tuple[int, ...], user_init: Any, started: Started | None, worker_id: int) -> None:
    # Slurm signals every process of a step: workers must survive until the trainer has saved.
    for sig in signals:
        signal.signal(sig, signal.SIG_IGN)
    if started is not None:
        started.note()
    if user_init is not None:
        user_init(worker_id)


def worker_init(signals: tuple[int, ...], user_init: Any) -> Any:
    """The ``worker_init_fn`` of our loaders: preemption signals ignored, the start reported, then the user's."""
    return functools.partial(_worker_init, signals, user_init, Started())


def checked_iter(loader: DataLoader[Any]) -> Iterator[Any]:
    """``iter(loader)``; where that forks workers, each must report that it runs Python, or all are forked again."""
    started = _started(loader)
    fresh = loader.num_workers > 0 and (not loader.persistent_workers or getattr(loader, "_iterator", None) is None)
    context = loader.multiprocessing_context or multiprocessing.get_context()
    if started is None or not fresh or context.get_start_method() != "fork":  # spawned workers start no fork hang
        return iter(loader)
    for attempt in range(1, TRIES + 1):
        started.drain()
        iterator = iter(loader)
        if started.wait(loader.num_workers, START_S) == loader.num_workers:
            return iterator
        _kill(iterator, loader)
        print(f"warning: a loader worker did not start within {START_S:.0f} s (try {attempt} of {TRIES}): killed, "
              f"its loader's workers forked again{python_note()}", file=sys.stderr, flush=True)
    raise RuntimeError(f"loader workers did not start in {TRIES} tries{python_note()}: use data.num_workers=0")


def start_workers(*loaders: Any) -> None:
    """Fork each persistent DataLoader's workers now (checked), not at its first pass; the batches it reads ahead are
    dropped when that pass starts (as between epochs). Anything else is left alone."""
    for loader in loaders:
        if isinstance(loader, DataLoader) and loader.persistent_workers and getattr(loader, "_iterator", None) is None:
            checked_iter(loader)


def shutdown_workers(loader: DataLoader[Any]) -> None:
    """Stop a loader's persistent workers now, through their queue: they ignore the preemption signals (SIGTERM
    included), so the interpreter's exit, which terminates children by signal and then joins them, would wait forever."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    loader._iterator = None


def hangs_in_fork(version: tuple[int, ...] = tuple(sys.version_info[:3])) -> bool:
    """Whether this interpreter can hang a child forked beside threads (CPython gh-112275)."""
    return version < (3, 11, 10) or (3, 12, 0) <= version < (3, 12, 1)


def python_note(version: tuple[int, ...] = tuple(sys.version_info[:3])) -> str:
    """Where this interpreter has the fork bug, which versions do not."""
    if hangs_in_fork(version):
        return (f" (Python {'.'.join(map(str, version))} can hang a process forked beside threads, CPython gh-112275: "
                "fixed in 3.11.10 and 3.12.1)")
    return ""


def _started(loader: DataLoader[Any]) -> Started | None:
    init = loader.worker_init_fn
    if isinstance(init, functools.partial) and init.func is _worker_init:
        return init.args[2]
    return None


def _kill(iterator: Any, loader: DataLoader[Any]) -> None:
    """End every worker of a failed start: the iterator's own shutdown first (it stops watching its workers, whose
    death would otherwise raise in this process), then SIGKILL (a hung one ignores the rest), then reap."""
    workers = list(getattr(iterator, "_workers", []))
    with contextlib.suppress(Exception):
        iterator._shutdown_workers()
    for worker in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker.pid, signal.SIGKILL)
        worker.join(5)
    loader._iterator = None
