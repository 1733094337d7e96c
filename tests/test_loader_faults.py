"""A loader worker that dies under a rank: killed from outside (SIGKILL) the attempt is retried and no node blamed,
unless Slurm says its memory limit killed it (then the job's resource); out of shared memory, the job's resource; its
own crash (another signal), the code's. The real case: a worker SIGKILLed from outside while its rank trains."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.procfs import children
from cluster.job.judge import judge
from trainer.core import exits
from trainer.core.records import ExitRecord, exit_records

from .conftest import SMALL, faults, go, held, spawn_ranks

KILLED = "DataLoader worker (pid 306) is killed by signal: Killed. "
BUS = ("DataLoader worker (pid 306) is killed by signal: Bus error. It is possible that dataloader's workers are out of "
       "shared memory. Please try to raise your shared memory limit.")


@pytest.mark.parametrize(("message", "kind", "words"), [
    (KILLED, "infrastructure", "killed from outside the code"),
    (BUS, "resource", "out of shared memory (/dev/shm)"),
    ("DataLoader worker (pid 306) is killed by signal: Segmentation fault. ", "user_error", "Segmentation fault"),
    # the same kill, when the loader finds the dead worker before its SIGCHLD handler does
    ("DataLoader worker (pid(s) 306) exited unexpectedly", "infrastructure", "exited unexpectedly"),
])
def test_a_loader_workers_end_is_classed_by_its_signal(message: str, kind: str, words: str) -> None:
    info = exits.classify(RuntimeError(message))
    assert (info["class"], info["echo"]) == (kind, False) and words in info["cause"], info
    assert info.get("blame", []) == []  # never a node's fault on this evidence alone


def record(rank: int, node: str, kind: str, cause: str, **more: object) -> ExitRecord:
    return ExitRecord.from_json({"rank": rank, "node": node, "code": 1, "class": kind, "cause": cause, "t": rank, **more})


@pytest.mark.parametrize(("srun", "kind", "words"), [
    ([("n2", "1", "Exited with exit code 1")], "infrastructure", "loader worker was killed"),
    ([("n2", "1", "Out Of Memory")], "resource", "the job's memory limit"),  # Slurm's cgroup killed it
])
def test_the_verdict_on_a_killed_worker_is_the_memory_limits_when_srun_says_so(
        srun: list[tuple[str, str, str]], kind: str, words: str) -> None:
    killed = exits.classify(RuntimeError(KILLED))
    records = [record(0, "n1", "infrastructure", "lost a peer mid-collective", echo=True),
               record(1, "n2", killed["class"], killed["cause"], blame=killed["blame"])]
    v = judge(records, srun, 1, None)
    assert (v.kind, v.blame) == (kind, []) and words in v.cause, v


def test_a_worker_killed_from_outside_is_retried_with_nobody_blamed(tmp_path: Path) -> None:
    """Two ranks held at step 7 with loader workers; rank 1's get SIGKILL from outside (as the OOM
    killer sends it). Rank 1 records the kill, rank 0 the lost peer; the verdict retries and blames nobody."""
    run = tmp_path / "run"
    ranks = spawn_ranks([*SMALL, f"run.dir={run}", "data.num_workers=1", "dist.timeout_s=60"], tmp_path,
                        env={**faults(wait_at_step=7), "RUN_DIR": str(run), "SLURMD_NODENAME": "n1"})
    held(run, ranks)
    workers = children(ranks[1].pid)
    assert workers, "rank 1 has no loader worker"
    for worker in workers:  # its train and test loaders' (as the OOM killer might pick either)
        os.kill(worker, signal.SIGKILL)
    go(run)
    outs = [p.communicate(timeout=120)[0] for p in ranks]
    assert all(p.returncode for p in ranks), outs
    (folder,) = (run / "exits").iterdir()
    records = {r.rank: r for r in exit_records(folder)}
    assert records[1].kind == "infrastructure" and records[1].blame == [], (records, outs[1][-3000:])
    assert any(f"DataLoader worker (pid {w}) is killed by signal: Killed" in records[1].cause or  # any word torch
               f"DataLoader worker (pid(s) {w}) exited unexpectedly" in records[1].cause for w in workers) or \
        "died while handing over a batch" in records[1].cause, records  # a batch read ahead, fetched from the dead
    v = judge(list(records.values()), [], 1, None)
    assert (v.kind, v.blame) == ("infrastructure", []) and "rank 1" in v.cause and "loader worker" in v.cause, v


def hand_over(queue: Any, ready: Any) -> None:
    """A loader worker's part: a batch into the queue (its storage shared by file descriptor), then wait to be killed."""
    queue.put(torch.ones(64))
    queue.close()
    queue.join_thread()  # the batch's bytes are in the pipe; its storage is handed over when the reader asks
    ready.set()
    time.sleep(600)


def test_a_batch_whose_worker_was_killed_before_handing_it_over_is_the_kill() -> None:
    """A batch read ahead by a worker that is SIGKILLed before the rank takes it: the rank cannot fetch its shared
    memory from the dead worker (a connection error deep in multiprocessing). That is the kill, not the code's error."""
    context = torch.multiprocessing.get_context("fork")
    queue, ready = context.Queue(), context.Event()
    worker = context.Process(target=hand_over, args=(queue, ready), daemon=True)
    worker.start()
    try:
        assert ready.wait(60), "the worker never handed its batch over"
        os.kill(worker.pid or 0, signal.SIGKILL)
        worker.join(30)
        with pytest.raises((ConnectionError, FileNotFoundError, EOFError)) as raised:
            queue.get(timeout=30)
    finally:
        worker.kill()
    info = exits.classify(raised.value)
    assert (info["class"], info["echo"], info["blame"]) == ("infrastructure", False, []), info
    assert "died while handing over a batch" in info["cause"], info
    assert exits.classify(ConnectionResetError(104, "Connection reset by peer"))["class"] == "user_error"  # the code's


class Kick:
    """A record field whose rendering sends this process ``signum``: a signal that arrives mid-write."""

    def __init__(self, signum: int | None = None) -> None:
        self.signum = signum

    def __str__(self) -> str:
        if self.signum is None:
            raise RuntimeError("the write failed")
        os.kill(os.getpid(), self.signum)
        return "kicked"


def second_worker(signum: int, frame: object) -> None:
    raise RuntimeError("DataLoader worker (pid 307) is killed by signal: Killed. ")  # as torch's SIGCHLD handler


def test_a_second_killed_worker_never_cuts_the_first_ones_end_record_short(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's SIGCHLD handler raises once per dead worker: the second raise came while rank 1 wrote the first's end
    record, which then had none (1 run in 10 of the test above). The handler now runs once the record is written."""
    monkeypatch.setenv("RUN_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    previous = signal.signal(signal.SIGCHLD, second_worker)
    try:
        with pytest.raises(RuntimeError, match="pid 307"):
            exits.ended(1, exits.classify(RuntimeError(KILLED)), note=Kick(signal.SIGCHLD))
    finally:
        signal.signal(signal.SIGCHLD, previous)
    (folder,) = (tmp_path / "exits").iterdir()
    (end,) = exit_records(folder)
    assert (end.rank, end.code, end.kind, end.extra.get("note")) == (1, 1, "infrastructure", "kicked"), end


def test_an_end_record_cut_short_leaves_the_end_to_whoever_catches_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUN_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    exits.started(None)
    with pytest.raises(RuntimeError, match="the write failed"):
        exits.ended(1, exits.classify(RuntimeError(KILLED)), note=Kick())
    (folder,) = (tmp_path / "exits").iterdir()
    assert [r.code for r in exit_records(folder)] == [None]  # the start record only
    exits.ended(1, exits.classify(RuntimeError("the write failed")))
    assert [(r.code, r.kind) for r in exit_records(folder)] == [(1, "user_error")]


def test_deferred_signals_reach_the_handler_set_when_the_block_ends() -> None:
    """Each signal that came inside the block runs once after it, in the handler then set: the saved one, or the one
    code inside set (a session restoring SIG_IGN or its own), never the saved one over it."""
    seen: list[str] = []
    usr1 = signal.signal(signal.SIGUSR1, lambda n, f: seen.append("before"))
    usr2 = signal.signal(signal.SIGUSR2, lambda n, f: seen.append("usr2"))
    try:
        with exits.signals_deferred([signal.SIGUSR1, signal.SIGUSR2]):
            for _ in range(3):
                os.kill(os.getpid(), signal.SIGUSR1)
            signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # set inside: it stays, and gets what came
            os.kill(os.getpid(), signal.SIGUSR2)
            assert seen == []
        assert seen == ["before"] and signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR1, usr1)
        signal.signal(signal.SIGUSR2, usr2)
