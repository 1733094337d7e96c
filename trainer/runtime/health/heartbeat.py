"""Hang diagnostics: per-rank heartbeats and one report naming the stuck rank(s), with every rank's stacks.

Every rank beats at the same points of each step (data → forward → backward → optimizer → flag all-reduce),
so ``seq``, the count of those beats, is comparable across ranks. When a rank goes silent past the timeout,
its watchdog thread writes ``<run>/hang/rank_<r>.txt`` (its Python stacks, by faulthandler) and
``rank_<r>.json`` (its last beat). Ranks that wait in a collective for a stuck peer go silent too, but they
got further: the stuck ranks are the ones with the lowest ``seq``. Rank 0 collects the files, writes
``report.txt``, prints it once, and every rank exits with :data:`EXIT_HANG`. On NCCL each rank also dumps the
flight recorder (its recent collectives) to ``nccl_trace_rank_<r>.pkl``: torch dumps it only on a collective
timeout, which this exit comes before. A new attempt in the same run folder first moves an old ``hang/`` aside.

Where the job's store runs apart (``store``: the survivors can regroup), the ranks that wait do not exit: they have the
stuck ranks killed (the store does it, on their nodes) and go on once their collective fails, as after any lost rank;
the stuck ranks exit as before. A rank whose watchdog cannot run (stopped, or holding the GIL) is killed all the same.
There each rank also counts in the store while it runs (``pulse``, a thread of its own): a stopped rank's count stands
still, so the others need not wait out a grace for files it will never write.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from trainer.core import exits
from trainer.core.env import DistEnv
from trainer.core.files import move_aside, write_atomic, write_json
from trainer.core.records import exit_records

EXIT_HANG = 3
"""Exit code after a hang report (no step finished for ``dist.heartbeat_timeout_s`` on some rank)."""

HANG_FOLDER = "hang"
"""The run folder's subfolder for the hang report and every rank's files (``hang-<k>`` after the k-th regroup)."""


def hang_folder(run_dir: Path, generation: int = 0) -> Path:
    """Where a hang report of the group's ``generation`` goes: ``hang/``, after the k-th regroup ``hang-k/`` (a hang
    the group went on from keeps its report, and the next one's files are its own)."""
    return run_dir / (f"{HANG_FOLDER}-{generation}" if generation else HANG_FOLDER)


def hang_folders(run_dir: Path) -> list[Path]:
    """Every generation's hang folder in ``run_dir`` (not those set aside, whose names carry a time)."""
    return [f for f in run_dir.glob(f"{HANG_FOLDER}*")
            if f.name == HANG_FOLDER or f.name.removeprefix(f"{HANG_FOLDER}-").isdigit()]

NCCL_DUMP_TIMEOUT_S = 5.0
"""How long a rank waits for NCCL's flight recorder dump before it reports without it."""


class JobStore(Protocol):
    """The job's store as the watchdog uses it (``trainer.core.regroup.Membership``). Ranks go by their number as
    started (``members``): a regroup may renumber the group while a report runs."""

    def members(self) -> tuple[int, ...]:
        """The current group's ranks, as started, in rank order."""

    def pulse(self) -> None:
        """Count once more for this process (from the pulse thread)."""

    def still(self, ranks: tuple[int, ...], wait_s: float) -> list[int]:
        """Those of ``ranks`` whose counts stood still for ``wait_s`` seconds: not running."""

    def have_killed(self, ranks: list[int]) -> None:
        """Ask the store process to kill these ranks, stuck."""


class Heartbeat:
    """This rank's heartbeat and the watchdog thread that reports when it stops."""

    def __init__(self, env: DistEnv, folder: Path, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic, store: JobStore | None = None) -> None:
        """``store``: where the others can go on without stuck ranks, it has them killed; this process counts there
        while it runs, and it tells which ranks stopped counting."""
        self.env, self.folder, self.timeout_s, self.clock, self.store = env, folder, timeout_s, clock, store
        self.interval = min(1.0, timeout_s / 4)
        # A pulse per rank every 0.5-5 s: at 16,384 ranks and the default timeout, some 3,300 adds a second on the store.
        self.pulse_s = min(5.0, max(0.5, timeout_s / 12))
        self.seq, self.step, self.phase = 0, 0, "start"
        self.last = clock()
        self.paused = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def beat(self, phase: str, step: int | None = None) -> None:
        """Record progress at a point every rank passes in the same order (counted in ``seq``)."""
        self.seq += 1
        self.phase = phase
        if step is not None:
            self.step = step
        self.last = self.clock()

    def alive(self) -> None:
        """Progress inside a long phase (a checkpoint write, evaluation batches): refreshes the clock only."""
        self.last = self.clock()

    @contextlib.contextmanager
    def waiting(self, on: bool = True) -> Iterator[None]:
        """Suspend the timeout while this rank legitimately waits on another (rank 0's checkpoint write)."""
        self.paused += on
        try:
            yield
        finally:
            self.paused -= on
            self.last = self.clock()

    def start(self) -> None:
        """Arm the watchdog (after the first step: compiling and warm-up may take minutes)."""
        if self.timeout_s <= 0 or self._threads:
            return
        self.last = self.clock()
        self._threads = [threading.Thread(target=self._watch, name="heartbeat-watchdog", daemon=True)]
        if self.store is not None:
            self._threads.append(threading.Thread(target=self._pulse, name="heartbeat-pulse", daemon=True))
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Disarm the watchdog (the loop is over; the final save and tracking upload may take long). The pulse thread
        ends by itself (it may wait on a store that is gone)."""
        self._stop.set()
        for thread in self._threads[:1]:
            thread.join()
        self._threads = []

    def silent_for(self) -> float | None:
        """Seconds without progress, once past the timeout and not paused (None: all is well)."""
        silent = self.clock() - self.last
        return silent if not self.paused and self.timeout_s > 0 and silent > self.timeout_s else None

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            silent = self.silent_for()
            if silent is not None:
                self._report(silent)

    def _pulse(self) -> None:
        """Count in the store every ``pulse_s`` while this process runs (its own thread: the watchdog's may be busy
        reporting, and must still count)."""
        assert self.store is not None
        while not self._stop.wait(self.pulse_s):
            with contextlib.suppress(Exception):  # the store gone: the report still comes, after the grace
                self.store.pulse()

    def _still(self, members: tuple[int, ...]) -> list[int]:
        """The ranks (of the group of ``members``) whose pulse stood still: stopped, or holding the GIL; none without
        a store or ``members``, or when the store does not answer."""
        if self.store is None or not members:
            return []
        try:
            still = self.store.still(members, max(2.0, 2.5 * self.pulse_s))
        except Exception:  # noqa: BLE001 - no store to ask: the grace decides, as without one
            return []
        return [members.index(r) for r in still]

    def _report(self, silent: float) -> None:
        """Write this rank's stacks and last beat; rank 0 writes the report. Then leave: the job is stuck."""
        rank, world, folder = self.env.rank, self.env.world_size, self.folder  # as the hang began (a regroup moves them)
        members = self._members(world)
        grace = max(5.0, min(30.0, self.timeout_s))  # for the other ranks' files (their clocks run a bit apart)
        with contextlib.suppress(OSError):
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / f"rank_{rank}.txt", "w") as f:
                f.write(f"rank {rank} on {exits.node_name()} (pid {os.getpid()}): no progress for {silent:.0f} s; "
                        f"last beat: step {self.step}, {self.phase} (#{self.seq})\n")
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
            last = {"rank": rank, "host": exits.node_name(), "pid": os.getpid(), "seq": self.seq,
                    "step": self.step, "phase": self.phase, "silent_s": round(silent, 1),
                    "nccl_trace": dump_nccl_trace(folder / f"nccl_trace_rank_{rank}.pkl")}
            # The .json marks the .txt as complete. No fsync: a dead file system must not hold up the report.
            write_json(folder / f"rank_{rank}.json", last, durable=False)
        self._collect(folder, rank, world, grace, silent, members)
        if self._went_on(folder, rank, world, grace, members):
            return
        self._record_hang(folder, world, silent, members)
        os._exit(EXIT_HANG)  # the main thread is stuck: only a hard exit leaves

    def _members(self, world: int) -> tuple[int, ...]:
        """The group's ranks as started, as the hang began (none without a store, or once a regroup changed it)."""
        with contextlib.suppress(Exception):
            members = self.store.members() if self.store is not None else ()
            return members if len(members) == world else ()
        return ()

    def _collect(self, folder: Path, rank: int, world: int, grace: float, silent: float,
                 members: tuple[int, ...]) -> None:
        """Rank 0 waits up to ``grace`` for every running rank's files (not those whose pulse stood still: they
        will write none) and writes the report; the others wait for it, unless rank 0 is not running."""
        still = self._still(members)
        report = folder / "report.txt"
        deadline = time.monotonic() + grace
        if rank == 0:
            while len(list(folder.glob("rank_*.json"))) < world - len(still) and time.monotonic() < deadline:
                time.sleep(0.2)
            text = build_report(folder, world, self.timeout_s, still)
            with contextlib.suppress(OSError):
                write_atomic(report, text, durable=False)
            print(text, file=sys.stderr, flush=True)
            return
        while 0 not in still and not report.exists() and time.monotonic() < deadline + grace:
            time.sleep(0.2)
        if not report.exists():  # rank 0 could not report (dead, stopped, or stuck without releasing the GIL)
            print(f"rank {rank}: no progress for {silent:.0f} s and no report from rank 0; stacks in {folder}",
                  file=sys.stderr, flush=True)

    def _went_on(self, folder: Path, rank: int, world: int, grace: float, members: tuple[int, ...]) -> bool:
        """Where the others can go on without the stuck ranks (a store, and ``members``: the group as the hang
        began) and this rank (``rank`` of ``world`` then) is not one: have them killed, by their numbers as started,
        and True once this rank's loop beats again (its collective failed, it regrouped: its place and folder may
        have changed meanwhile). False: exit as before."""
        if self.store is not None and self.silent_for() is None:  # already going on: another rank had them killed
            return True
        stuck, whole = stuck_now(_beats(folder), world)
        if self.store is None or whole or not stuck or rank in stuck:
            return False
        if members:  # else a regroup renumbered the group as the hang began: it is going on already
            self.store.have_killed([members[r] for r in stuck])
        deadline = time.monotonic() + 2 * grace
        while time.monotonic() < deadline:
            if self.silent_for() is None:  # beating again: the group went on without them
                return True
            time.sleep(0.1)
        return False

    def _record_hang(self, folder: Path, world: int, silent: float, members: tuple[int, ...]) -> None:
        """This rank's exit record for the verdict: the stuck ranks' nodes are blamed (none when all wait alike).
        Records go by rank as started, beats by place in the group (``members`` maps one to the other)."""
        beats = _beats(folder)
        stuck, whole = stuck_now(beats, world)
        nodes = sorted({b.get("host", "?") for r, b in beats.items() if r in stuck}) if not whole else []
        if any(r not in beats for r in stuck):  # stuck holding the GIL (no beat written): their start records say where
            path = exits.record_path()
            where = {r.rank: r.node for r in exit_records(path.parent)} if path else {}
            nodes = sorted({str(where.get(members[r] if members else r, "?")) for r in stuck} - {"?"})
        cause = f"hang: no progress for {silent:.0f} s; " + (
            f"stuck rank(s) {', '.join(map(str, stuck))} on {', '.join(nodes)}" if nodes
            else "every rank waits in the same collective (network or NCCL)")
        exits.ended(EXIT_HANG, exits.outcome(exits.INFRASTRUCTURE, cause, blame=nodes), step=self.step)


def _beats(folder: Path) -> dict[int, dict[str, Any]]:
    """Each rank's last beat, as it wrote it when the watchdog fired."""
    beats: dict[int, dict[str, Any]] = {}
    for path in folder.glob("rank_*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            info = json.loads(path.read_text())
            beats[int(info["rank"])] = info
    return beats


def stuck_now(beats: dict[int, dict[str, Any]], world: int) -> tuple[list[int], bool]:
    """The stuck ranks from the beats written so far: those that wrote none (stopped, or stuck holding the GIL),
    else the ones that got least far; and whether that is every rank."""
    missing = [r for r in range(world) if r not in beats]
    return (missing, False) if missing else stuck_ranks(beats, world)


def stuck_ranks(beats: dict[int, dict[str, Any]], world: int) -> tuple[list[int], bool]:
    """The ranks that got least far, and whether that is every rank (a collective that never completes)."""
    if not beats:
        return [], False
    low = min(b["seq"] for b in beats.values())
    stuck = sorted(r for r, b in beats.items() if b["seq"] == low)
    return stuck, len(stuck) == len(beats) == world


def build_report(folder: Path, world: int, timeout_s: float, still: list[int] | None = None) -> str:
    """The hang report from the ranks' files: who is stuck where (as the exit records judge: a rank that wrote nothing
    first, :func:`stuck_now`), then each stuck rank's stacks (``still``: the ranks whose pulse in the store stood
    still)."""
    beats = _beats(folder)
    missing = [r for r in range(world) if r not in beats]
    lines = [f"HANG: no progress for more than {timeout_s:.0f} s (dist.heartbeat_timeout_s); stacks in {folder}"]
    stuck, whole = stuck_now(beats, world)
    if beats:
        if whole:
            lines.append(f"all {world} ranks stopped at the same point (step {beats[0]['step']}, {beats[0]['phase']}): "
                         "a collective that never completes (network, NCCL) rather than one slow rank")
        else:
            lines.append(f"stuck rank(s): {', '.join(map(str, stuck))} — the others got further and wait for them")
        for r in sorted(beats):
            b = beats[r]
            mark = "STUCK" if r in stuck else "waits"
            trace = f"; NCCL trace {b['nccl_trace']}" if b.get("nccl_trace") else ""
            lines.append(f"  rank {r:>3} {mark}  {b['host']} pid {b['pid']}: step {b['step']}, {b['phase']} (#{b['seq']})"
                         f"{trace}")
    for r in missing:
        why = ("not running (its pulse in the store stood still): stopped, or stuck holding the GIL" if r in (still or [])
               else "dead, or stuck without releasing the GIL")
        lines.append(f"  rank {r:>3} STUCK  wrote nothing: {why}")
    for r in stuck[:4]:  # the stacks that matter; the others are in the folder
        with contextlib.suppress(OSError):
            lines += ["", f"--- rank {r} stacks ---", (folder / f"rank_{r}.txt").read_text().rstrip()]
    return "\n".join(lines)


def _nccl_backend() -> bool:
    """Whether the default process group runs NCCL (then its flight recorder holds this rank's collectives)."""
    try:
        return dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"
    except Exception:  # a group torn down meanwhile
        return False


def dump_nccl_trace(path: Path) -> str | None:
    """Write NCCL's flight recorder to ``path``; return what the report says about it (None: not on NCCL).

    The dump is private torch API and takes locks a stuck NCCL thread may hold: it runs in a daemon thread,
    waited for at most :data:`NCCL_DUMP_TIMEOUT_S`, and a failure is only noted, never raised.
    """
    if not _nccl_backend():
        return None
    dump = getattr(getattr(torch._C, "_distributed_c10d", None), "_dump_nccl_trace", None)
    if dump is None:
        return "not written (this torch has no _dump_nccl_trace)"
    outcome: list[str] = []

    def write() -> None:
        try:
            path.write_bytes(dump())
            outcome.append(path.name)
        except Exception as exc:
            outcome.append(f"not written ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0]})")

    try:
        thread = threading.Thread(target=write, name="nccl-trace-dump", daemon=True)
        thread.start()
        thread.join(NCCL_DUMP_TIMEOUT_S)
    except RuntimeError as exc:  # no thread to be had: the report (and the exit after it) must still happen
        return f"not written ({exc})"
    return outcome[0] if outcome else f"not written (no answer in {NCCL_DUMP_TIMEOUT_S:g} s)"


def set_aside(folder: Path) -> Path | None:
    """Move an earlier attempt's ``folder`` to ``<folder>-<time of its report>`` (kept, never overwritten)."""
    if not folder.exists():
        return None
    report = folder / "report.txt"
    stamp = datetime.fromtimestamp((report if report.exists() else folder).stat().st_mtime).strftime("%Y%m%d-%H%M%S")
    return move_aside(folder, f"{folder.name}-{stamp}")
