"""A loader worker that dies under a rank: killed from outside (SIGKILL) the attempt is retried and no node blamed,
unless Slurm says its memory limit killed it (then the job's resource); out of shared memory, the job's resource; its
own crash (another signal), the code's. The real case: a worker SIGKILLed from outside while its rank trains."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

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
    assert any(f"DataLoader worker (pid {w}) is killed by signal: Killed" in records[1].cause or  # either word torch
               f"DataLoader worker (pid(s) {w}) exited unexpectedly" in records[1].cause for w in workers), records
    v = judge(list(records.values()), [], 1, None)
    assert (v.kind, v.blame) == ("infrastructure", []) and "rank 1" in v.cause and "loader worker" in v.cause, v
