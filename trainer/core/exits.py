"""Each rank's exit record: how this process ended, for the batch shell's verdict on the attempt (cluster/job/verdict.py).

``$RUN_DIR/exits/<job>.<attempt>/<phase>-<rank>.json``, written when the process starts (no ``code`` yet) and again as it
ends: Slurm's node name, rank, exit code, class, one-line cause, where (file:line of a user error), step, and the
nodes it blames (a hang report names the stuck rank's). A rank killed by a signal keeps only its start record: that,
with srun's own ``task N: Killed`` line, names it. Stdlib only and torch-free: the verdict runs with the host's python.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from trainer.core.records import ExitRecord, exit_records

FINISHED, PREEMPTED, USER_ERROR, RESOURCE, INFRASTRUCTURE = (
    "finished", "preempted", "user_error", "resource", "infrastructure")
CLASSES = (FINISHED, PREEMPTED, USER_ERROR, RESOURCE, INFRASTRUCTURE)
"""How an attempt (or one rank of it) ended; only ``infrastructure`` is retried."""

PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "socket timeout",
             "connection refused", "communicator was aborted", "timed out", "timeout", "recvbytes", "sendbytes",
             "ncclremoteerror")
"""Message fragments of a collective whose peer went away or never answered: an echo of another rank's end, never a
first cause, when the error comes from torch.distributed (see :data:`DISTRIBUTED`)."""

DISTRIBUTED = ("gloo", "processgroup", "c10d", "nccl", "torch.distributed", "collective")
"""Markers of an error raised by torch.distributed (a user's own BrokenPipeError or timeout is the user's)."""

DEVICE = re.compile(r"nccl error|uncorrectable ecc|\bxid\b|cudaerrorlaunchfailure|nvlink|cuda error: (an illegal "
                    r"instruction|unspecified launch failure|uncorrectable|ecc|misaligned)", re.I)
"""Message fragments of a failing GPU or interconnect: the node's fault (a device-side assert is the code's)."""

LOADER_KILLED = re.compile(r"dataloader worker \(pid(?:\(s\))? [\d, ]+\) "
                           r"(?:is killed by signal: (\w[\w ]*)|exited unexpectedly)", re.I)
"""torch's word for a loader worker ended by a signal: ``Killed`` (SIGKILL from outside the code: the OOM killer, a
person, a daemon) or ``Bus error`` (shared memory, /dev/shm, exhausted); another signal (a segfault) is the code's.
"exited unexpectedly" is the same SIGKILL when the loader notices the dead worker before its SIGCHLD handler does."""

FULL = (errno.ENOSPC, errno.EDQUOT)
"""A write that found no room (a disk or quota, /dev/shm): the job's resource, not its code; a retry finds it full."""

STORAGE_FAILED = (errno.EIO, errno.EROFS, errno.ESTALE)
"""A file system that failed under the job (I/O error, remounted read-only, a stale handle): retried."""

EXIT_VARIABLES = ("SLURMD_NODENAME", "TRAINER_ATTEMPT", "SLURM_RESTART_COUNT", "SLURM_JOB_ID", "RANK", "SLURM_PROCID",
                  "RUN_DIR")
"""What this module reads: container launchers pass them in (the container's own host name is no node's name)."""

_written: dict[str, bool] = {}
_without: set[int] = set()
_started: dict[str, int] = {}
"""The rank each phase's start record was written under, where it was given (the end record goes beside it)."""


SPARE_BASE = 1_000_000
"""Warm spares go by ``SPARE_BASE + their number`` (records, regroups): no rank of a job has such a number."""


def names(processes: Iterable[int]) -> str:
    """Processes as records and regroups number them, for people: ``rank 2``, ``ranks 0, 2``, ``rank 1 and spare
    1001`` (a warm spare, which may have joined and trained, goes by its own number)."""
    ranks = sorted(p for p in processes if p < SPARE_BASE)
    spares = sorted(p - SPARE_BASE for p in processes if p >= SPARE_BASE)
    said = [f"{what}{'s' if len(nums) > 1 else ''} {', '.join(map(str, nums))}"
            for what, nums in (("rank", ranks), ("spare", spares)) if nums]
    return " and ".join(said) or "no process"


def node_name(environ: Mapping[str, str] | None = None) -> str:
    """Slurm's name for this node (SLURMD_NODENAME), else the host name."""
    return (os.environ if environ is None else environ).get("SLURMD_NODENAME") or socket.gethostname()


def attempt_id() -> str:
    """This attempt of the job: Slurm's restart count, with ``.k`` for the k-th restart inside one allocation
    (TRAINER_ATTEMPT, set by a batch script with spare nodes)."""
    return os.environ.get("TRAINER_ATTEMPT") or os.environ.get("SLURM_RESTART_COUNT") or "0"


def later_attempt(attempt: str, n: int) -> str:
    """The ``n``-th attempt after ``attempt`` inside one allocation: ``0`` → ``0.n``, ``0.2`` → ``0.(2+n)`` (restarts
    in place and recoveries in place share the count)."""
    restart, _, here = attempt.partition(".")
    return f"{restart}.{int(here or 0) + n}"


def next_attempt(events: list[dict[str, Any]], job: str, attempt: str) -> str:
    """The attempt after ``attempt`` inside its allocation, past every recovery in place the event log holds for it."""
    restart = attempt.partition(".")[0]
    taken = [str(e.get("attempt")) for e in events if e.get("event") == "attempt" and str(e.get("job_id")) == job]
    here = [int(a.partition(".")[2] or 0) for a in [attempt, *taken]
            if a.partition(".")[0] == restart and (a.partition(".")[2] or "0").isdigit()]
    return later_attempt(restart, max(here, default=0) + 1)


def regroups(events: list[dict[str, Any]], job: str, besides: str | None = None) -> int:
    """Job ``job``'s recoveries in place (``attempt`` events with ``regroup``), those within attempt ``besides`` left
    out (the session counts its own)."""
    return sum(e.get("event") == "attempt" and bool(e.get("regroup")) and str(e.get("job_id")) == job
               and e.get("within") != besides for e in events)


def failures(events: list[dict[str, Any]], job: str, besides: str | None = None) -> int:
    """The infrastructure failures job ``job`` has had, the number ``max_failures`` limits: the verdicts that found
    one (``attempt_end``) and the recoveries in place (see :func:`regroups`)."""
    return regroups(events, job, besides) + sum(e.get("event") == "attempt_end" and str(e.get("job_id")) == job
                                                and e.get("class") == INFRASTRUCTURE for e in events)


def attempt_folder() -> str:
    """The folder of this attempt's records: job id and attempt (a reused run folder keeps other jobs' apart)."""
    return f"{os.environ.get('SLURM_JOB_ID') or 'local'}.{attempt_id()}"


def record_path(phase: str = "train", rank: int | None = None) -> Path | None:
    """Where this process's record goes (None outside a batch job: no RUN_DIR); ``rank`` None: the rank its start
    record was written under (a warm spare's own number), else the environment's."""
    run_dir = os.environ.get("RUN_DIR")
    if not run_dir:
        return None
    rank = _started.get(phase) if rank is None else rank
    rank = int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0) if rank is None else rank
    return Path(run_dir) / "exits" / attempt_folder() / f"{phase}-{rank}.json"


def write(path: Path | None, **fields: Any) -> None:
    """Write (replace) one record atomically; a failure to write never hides how the process ended."""
    if path is None:
        return
    record = ExitRecord.from_json({"node": node_name(), "pid": os.getpid(), "t": round(time.time(), 3), **fields})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(record.to_json(), default=str) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        print(f"exit record {path}: {exc.strerror}", file=sys.stderr)


def started(rank: int | None, phase: str = "train") -> None:
    """The start record (``rank`` None: from the environment): a process that never writes its end was killed."""
    path = record_path(phase, rank)
    if path is None:
        return
    write(path, rank=int(path.stem.rsplit("-", 1)[1]), phase=phase, code=None)
    _written[str(path)] = False
    if rank is not None:
        _started[phase] = rank


def ended(code: int, info: dict[str, Any], phase: str = "train", rank: int | None = None, **more: Any) -> None:
    """The end record, ``info`` holding ``class`` and ``cause`` (see :func:`outcome`); the first one wins: a process
    classifies its own end once, where it knows most."""
    path = record_path(phase, rank)
    if path is None or _written.get(str(path)):
        return
    _written[str(path)] = True
    if _without:
        more["went_on_without"] = sorted(_without)
    done = False
    try:
        with signals_deferred():
            write(path, rank=int(path.stem.rsplit("-", 1)[1]), phase=phase, code=code, **info, **more)
            done = True
    finally:  # a write cut short (an error, a handler run before the hold): whoever catches it records the end
        _written[str(path)] = done


ASYNC_SIGNALS = (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2,
                 signal.SIGALRM)
"""Signals that arrive from outside at any moment; their Python handlers may raise. torch's loader SIGCHLD handler
raises while a dead worker is registered, at every child's exit: two killed workers used to cut an end record short."""


@contextmanager
def signals_deferred(signums: Iterable[int] = ASYNC_SIGNALS) -> Iterator[None]:
    """Run the Python handlers of ``signums`` that arrive meanwhile after the block, once each. Python runs them in
    the main thread only (between any two bytecodes, whichever thread the signal reached), so elsewhere this is a
    no-op. A handler replaced inside the block (a session restoring the default) stays, and gets them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []

    def note(signum: int, frame: object) -> None:
        came.append(signum)

    saved = {s: h for s in signums if callable(h := signal.getsignal(s))}
    for signum in saved:
        signal.signal(signum, note)
    try:
        yield
    finally:
        for signum, handler in saved.items():
            if signal.getsignal(signum) is note:
                signal.signal(signum, handler)
        for signum in dict.fromkeys(came):  # to the handler set now (SIG_DFL's action for a restored default)
            now = signal.getsignal(signum)
            now(signum, None) if callable(now) else signal.raise_signal(signum)


def went_on_without(ranks: list[int]) -> None:
    """This process's group went on without ``ranks`` (as started): its end record says so (the verdict then does
    not count their ends as the attempt's)."""
    _without.update(ranks)


def outcome(kind: str, cause: str, **more: Any) -> dict[str, Any]:
    """A class and a one-line cause (plus ``where``, ``blame``, ``echo`` …), as records hold them."""
    return {"class": kind, "cause": cause, **more}


EXIT_INTERRUPTED = 130
"""A process stopped by SIGINT (128 + 2, as a shell reports it)."""


def interrupted() -> dict[str, Any]:
    """The end of a process SIGINT stopped (Ctrl-C; srun or scancel passing it on): an echo of a stop from outside,
    as ``trainer.launch`` classes a command SIGINT killed; never the user's error."""
    return outcome(INFRASTRUCTURE, "interrupted by SIGINT", echo=True)


def classify(exc: BaseException) -> dict[str, Any]:
    """An exception's class, one-line cause, and where (the innermost frame outside torch) for a user error.
    ``echo``: a collective lost its peer (this rank stopped because another ended first)."""
    text = f"{type(exc).__name__}: {exc}".strip()
    first = _first_sentence(text)
    low = text.lower()
    if (worker := LOADER_KILLED.search(text)) and (killed := _loader_killed(worker[1] or "killed", first)):
        return killed
    if _handover_lost(exc):
        return {"class": INFRASTRUCTURE, "cause": "a loader worker died while handing over a batch (its process is "
                f"gone: killed from outside the code, e.g. by the OOM killer): {first}", "echo": False, "blame": []}
    if type(exc).__name__ == "OutOfMemoryError" or "out of memory" in low:
        return {"class": RESOURCE, "cause": f"out of memory: {first}", "echo": False}
    if isinstance(exc, MemoryError) or getattr(exc, "errno", None) == errno.ENOMEM:  # the host's (a fork too)
        return {"class": RESOURCE, "cause": f"out of host memory: {first.rstrip(':')}", "echo": False}
    if (disk := storage_error(exc)) is not None:  # torch.save hides the OSError behind an empty RuntimeError
        cause = _first_sentence(f"{disk.strerror or disk}{f': {disk.filename}' if disk.filename else ''}")
        if disk.errno in FULL:
            return {"class": RESOURCE, "cause": f"no room to write: {cause}", "echo": False}
        return {"class": INFRASTRUCTURE, "cause": f"storage failed: {cause}", "echo": False,
                "blame": []}  # retried, but no node blamed: the file system may be shared
    distributed = type(exc).__module__.startswith("torch.distributed") or type(exc).__name__.startswith("Dist") \
        or any(m in low for m in DISTRIBUTED)
    if type(exc).__name__ in ("RegroupFailed", "RendezvousTimeout"):  # the lost or missing rank is the cause
        return {"class": INFRASTRUCTURE, "cause": first, "echo": True}
    if type(exc).__name__ == "MainFailed":  # rank 0's failure (a full disk), seen from another rank: rank 0 has it
        return {"class": getattr(exc, "kind", USER_ERROR), "cause": first, "echo": True}
    if distributed and any(p in low for p in PEER_LOST):
        return {"class": INFRASTRUCTURE, "cause": f"lost a peer mid-collective ({first})", "echo": True}
    if DEVICE.search(text) or type(exc).__name__ == "DistBackendError":  # hard evidence against the node
        return {"class": INFRASTRUCTURE, "cause": f"device or interconnect error: {first}", "echo": False, "hard": True}
    return {"class": USER_ERROR, "cause": first, "echo": False, "where": where(exc)}


def _loader_killed(how: str, first: str) -> dict[str, Any] | None:
    """A loader worker killed by SIGKILL: retried and nobody blamed (the judge makes it the memory limit's when srun
    says so); out of shared memory: the job's resource. None for another signal (the code's own crash)."""
    if how.lower() == "killed":
        return {"class": INFRASTRUCTURE, "cause": "a loader worker was killed from outside the code (SIGKILL: the "
                f"OOM killer, a person or a daemon): {first}", "echo": False, "blame": []}
    if how.lower() == "bus error":
        return {"class": RESOURCE, "cause": "the loader workers ran out of shared memory (/dev/shm): give the "
                f"container more (--shm-size) or use fewer workers: {first}", "echo": False}
    return None


def _handover_lost(exc: BaseException) -> bool:
    """A batch in shared memory whose loader worker is gone: the fetch of its file descriptor from that worker
    (``rebuild_storage_fd``, through multiprocessing's resource sharer) failed to connect or was cut off."""
    return isinstance(exc, (ConnectionError, FileNotFoundError, EOFError)) and any(
        frame.f_code.co_name == "rebuild_storage_fd" for frame, _ in traceback.walk_tb(exc.__traceback__))


def storage_error(exc: BaseException) -> OSError | None:
    """The OSError of a full or failed file system behind ``exc`` (itself, its causes and contexts, and each rank's
    failure a ``torch.distributed.checkpoint`` CheckpointException holds), if any."""
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo:
        here = todo.pop()
        if not isinstance(here, BaseException) or id(here) in seen:
            continue
        seen.add(id(here))
        if isinstance(here, OSError) and here.errno in FULL + STORAGE_FAILED:
            return here
        ranks = getattr(here, "failures", None)  # DCP's: rank -> (exception, traceback)
        todo += [here.__cause__, here.__context__]
        todo += [f[0] if isinstance(f, tuple) else f for f in ranks.values()] if isinstance(ranks, dict) else []
    return None


def raised(exc: BaseException, rank: int, step: int, emit: Any) -> None:
    """A session's loop raised ``exc``: an ``exit`` event (``emit``: the event log's) and, for an error or a
    ``sys.exit(n)``, this rank's exit record now (closing W&B may outlast srun's grace before its SIGKILL)."""
    stopped = isinstance(exc, KeyboardInterrupt)
    code = exc.code if isinstance(exc, SystemExit) else EXIT_INTERRUPTED if stopped else 1
    info = interrupted() if stopped else {} if isinstance(exc, SystemExit) else classify(exc)  # DCP's: BaseExceptions
    emit("exit", durable=True, code=code, step=step, error=type(exc).__name__,
         **{k: v for k, v in info.items() if k in ("class", "cause", "where")})
    if info:
        ended(EXIT_INTERRUPTED if stopped else 1, info, rank=rank, step=step)
    elif isinstance(code, int) and code not in (0, 75):  # sys.exit(n) inside the session (75: a requeue)
        ended(code, outcome(USER_ERROR, f"sys.exit({code})"), rank=rank, step=step)


def _first_sentence(text: str) -> str:
    """An error's first line without the C++ source position torch puts first, cut after its first sentence."""
    line = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\] ", "", text.splitlines()[0] if text else "")
    return line.split(". ", 1)[0][:300]


def where(exc: BaseException) -> str | None:
    """``file:line`` of the innermost frame that is not torch's or the standard library's: the code that raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    skip = (os.sep + "torch" + os.sep, os.path.dirname(os.__file__) + os.sep)
    ours = [f for f in frames if not any(s in f.filename for s in skip)]
    chosen = ours or list(frames)
    return f"{chosen[-1].filename}:{chosen[-1].lineno}" if chosen else None


def first_failure() -> str | None:
    """For a rank that lost its peer: the failure another rank of this attempt recorded first, if any yet."""
    path = record_path()
    if path is None:
        return None
    failed = [r for r in exit_records(path.parent) if r.is_cause and r.pid != os.getpid()]
    return f"stopped because {min(failed, key=lambda r: r.t).describe()}" if failed else None
