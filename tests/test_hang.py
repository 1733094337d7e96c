"""Hang diagnostics with real processes: a deliberately stuck rank is named, with its stacks, and every rank exits."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer.core.env import DistEnv
from trainer.runtime.health import heartbeat
from trainer.runtime.health.heartbeat import EXIT_HANG, Heartbeat, build_report, set_aside

from .conftest import SMALL, faults, ok, outputs, run_trainer, spawn_ranks

OLD_REPORT_TIME = datetime(2024, 1, 2, 3, 4, 5).timestamp()


def _previous_attempt(hang: Path) -> None:
    """What a requeued job finds: an earlier attempt's files and report, naming rank 0 stuck at step 99."""
    hang.mkdir(parents=True)
    for rank, seq in ((0, 500), (1, 900)):
        _beat(hang, rank, seq, "old phase", step=99)
    (hang / "report.txt").write_text("HANG: old report\nstuck rank(s): 0 — old\n")
    os.utime(hang / "report.txt", (OLD_REPORT_TIME, OLD_REPORT_TIME))


@pytest.mark.parametrize("requeued", [False, True])
def test_stuck_rank_is_named_with_its_stack_and_every_rank_exits(tmp_path: Path, requeued: bool) -> None:
    run = tmp_path / "run"
    if requeued:
        _previous_attempt(run / "hang")
    # Exit 3 on both ranks is the watchdog's report, not gloo's timeout (600 s; the outputs' 240 s come first).
    args = [*SMALL, f"run.dir={run}", "dist.timeout_s=600", "dist.heartbeat_timeout_s=6"]
    procs = spawn_ranks(args, tmp_path, env=faults(hang_at_step=6))
    outs = outputs(procs, timeout=240)
    assert [p.returncode for p in procs] == [EXIT_HANG, EXIT_HANG], outs
    report = (run / "hang" / "report.txt").read_text()
    assert "stuck rank(s): 1 " in report, report
    assert "rank   1 STUCK" in report and "rank   0 waits" in report
    assert "_stuck_for_test" in report  # rank 1's own Python stack, from faulthandler
    assert "backward (gradient all-reduce)" in report  # where rank 0 waits for it
    # Printed once, by rank 0; rank 1 only leaves its files.
    assert outs[0].count("HANG: no progress") == 1 and "HANG" not in outs[1]
    assert {p.name for p in (run / "hang").iterdir()} >= {"rank_0.txt", "rank_1.txt", "rank_0.json", "rank_1.json"}
    assert "NCCL trace" not in report and not list((run / "hang").glob("nccl_trace_*"))  # gloo: no flight recorder
    # The earlier attempt's diagnostics are kept beside it, named by its report's time, untouched.
    kept = run / f"hang-{datetime.fromtimestamp(OLD_REPORT_TIME):%Y%m%d-%H%M%S}"
    if requeued:
        assert (kept / "report.txt").read_text().startswith("HANG: old report"), sorted(run.iterdir())
        assert json.loads((kept / "rank_1.json").read_text())["seq"] == 900
        assert f"moved to {kept}" in outs[0]
        assert "old" not in report and "step 99" not in report
    else:
        assert not kept.exists() and "moved to" not in outs[0]


def test_a_save_longer_than_the_timeout_is_no_hang(tmp_path: Path) -> None:
    """Rank 0 writes the checkpoint of the last step (16) for 8 s, steadily, while rank 1 waits for it, under a 5 s
    heartbeat timeout: a save does not count as a hang (a write that stops for longer would)."""
    run = tmp_path / "run"
    ok(run_trainer([*SMALL, f"run.dir={run}", "dist.heartbeat_timeout_s=5", "checkpoint.every_steps=16",
                    "checkpoint.async_save=false"], tmp_path, nproc=2, env=faults(save_delay_s=8)))
    assert [e["step"] for e in map(json.loads, (run / "events.jsonl").read_text().splitlines())
            if e["event"] == "checkpoint"] == [16]
    assert not (run / "hang").exists()


ONE = DistEnv(0, 0, 1, 1, 0, 1, "127.0.0.1", 29500, None, "single")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# (what happens, seconds later each time, the heartbeat's answer after it: None, or the silent seconds reported)
WATCH = [
    ([("beat", 5), ("beat", 5), ("beat", 5)], [None, None, None]),  # steady progress under a 10 s timeout
    ([("beat", 5), ("none", 11)], [None, 11.0]),  # silent past the timeout
    ([("beat", 5), ("alive", 8), ("none", 8)], [None, None, None]),  # a long phase that says it is alive
    ([("pause", 1), ("none", 30), ("resume", 0), ("none", 9), ("none", 2)], [None, None, None, None, 11.0]),
    ([("none", 10)], [None]),  # exactly the timeout: not yet
]


@pytest.mark.parametrize(("steps", "answers"), WATCH)
def test_the_watchdog_fires_only_after_the_timeout_of_silence_outside_a_pause(
        tmp_path: Path, steps: list[tuple[str, float]], answers: list[float | None]) -> None:
    clock = Clock()
    hb = Heartbeat(ONE, tmp_path, 10.0, clock=clock)
    paused = contextlib.ExitStack()
    got = []
    for what, later in steps:
        clock.now += later
        if what == "beat":
            hb.beat("forward", 1)
        elif what == "alive":
            hb.alive()
        elif what == "pause":
            paused.enter_context(hb.waiting())
        elif what == "resume":
            paused.close()
        got.append(hb.silent_for())
    assert got == answers


def test_a_timeout_of_zero_never_fires(tmp_path: Path) -> None:
    clock = Clock()
    hb = Heartbeat(ONE, tmp_path, 0.0, clock=clock)
    clock.now += 1e6
    assert hb.silent_for() is None


def _beat(folder: Path, rank: int, seq: int, phase: str, step: int = 7) -> None:
    (folder / f"rank_{rank}.json").write_text(json.dumps(
        {"rank": rank, "host": "n1", "pid": 100 + rank, "seq": seq, "step": step, "phase": phase, "silent_s": 5}))
    (folder / f"rank_{rank}.txt").write_text(f"stacks of rank {rank}\n")


class RegroupingStore:
    """The job's store as the watchdog sees it (heartbeat.JobStore), in memory: ranks as started are (0, spare
    1000000, 2); origin 2 is stopped, and the others regroup without it while the report runs."""

    def __init__(self, hb: list[Heartbeat]) -> None:
        self.now: tuple[int, ...] = (0, 1_000_000, 2)
        self.asked: list[list[int]] = []
        self.hb = hb

    def members(self) -> tuple[int, ...]:
        return self.now

    def pulse(self) -> None:
        pass

    def still(self, ranks: tuple[int, ...], wait_s: float) -> list[int]:
        self.now = (0, 1_000_000)  # a regroup renumbers the group meanwhile
        return [2]

    def have_killed(self, ranks: list[int]) -> None:
        self.asked.append(ranks)
        self.hb[0].beat("step", 8)  # killed: the collective fails, the group goes on


def test_a_stopped_rank_is_named_by_its_number_as_started_even_once_the_group_is_renumbered(tmp_path: Path) -> None:
    """Rank 0 of three fires; rank 1 (a spare that took rank 1's place) wrote its files, rank 2 wrote none and its
    pulse stood still: the report says it is not running, at once, and the kill names it by its number as started
    (2), not by its rank in the group after the regroup (where a third place no longer exists)."""
    clock, holder = Clock(), []
    store = RegroupingStore(holder)
    hb = Heartbeat(DistEnv(0, 0, 3, 1, 0, 3, "127.0.0.1", 29500, None, "slurm"), tmp_path, 6.0, clock=clock,
                   store=store)
    holder.append(hb)
    hb.beat("backward (gradient all-reduce)", 7)
    _beat(tmp_path, 1, hb.seq, "backward (gradient all-reduce)")
    clock.now += 7
    hb._report(7.0)  # returns: the group went on (no exit)
    assert store.asked == [[2]]
    assert "rank   2 STUCK  wrote nothing: not running (its pulse in the store stood still)" in \
        (tmp_path / "report.txt").read_text()


def test_a_regrouped_rank_records_its_hang_under_its_rank_as_started(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """After a regroup the group is origins (2, 5): this process (started as 5) is rank 1 now. Its hang record goes to
    train-5.json, not to train-1.json (the lost rank 1's own record); the stuck rank 0, which wrote no beat, is found
    on its node by its start record as 2, not by rank 0's."""
    from trainer.core import exits
    monkeypatch.setenv("RUN_DIR", str(tmp_path))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setattr(exits, "_started", {})
    monkeypatch.setattr(exits, "_written", {})
    folder = exits.record_path(rank=0)
    assert folder is not None
    for origin in (0, 1, 2):
        exits.write(folder.with_name(f"train-{origin}.json"), rank=origin, phase="train", code=None, node=f"n{origin}")
    exits.started(5)
    hb = Heartbeat(DistEnv(1, 1, 2, 1, 0, 2, "127.0.0.1", 29500, None, "slurm"), tmp_path / "hang-1", 6.0)
    hb.folder.mkdir()
    _beat(hb.folder, 1, 40, "backward")
    hb._record_hang(hb.folder, 2, 7.0, (2, 5))
    lost = json.loads(folder.with_name("train-1.json").read_text())
    mine = json.loads(folder.with_name("train-5.json").read_text())
    assert lost["code"] is None  # untouched
    assert mine["code"] == EXIT_HANG and mine["blame"] == ["n2"], mine


@pytest.mark.parametrize(("beats", "world", "expect"), [
    ({0: 40, 1: 38, 2: 40, 3: 38}, 4, "stuck rank(s): 1, 3 "),
    ({0: 40, 1: 40}, 2, "all 2 ranks stopped at the same point"),
    ({0: 40}, 2, "stuck rank(s): 1 — the others got further and wait for them"),  # stopped before it wrote
])
def test_report_names_the_ranks_furthest_behind(tmp_path: Path, beats: dict[int, int], world: int, expect: str) -> None:
    for rank, seq in beats.items():
        _beat(tmp_path, rank, seq, "forward" if seq == min(beats.values()) else "backward")
    report = build_report(tmp_path, world, 60)
    assert expect in report, report
    if "stuck rank(s): 1, 3" in expect:
        assert "stacks of rank 1" in report and "stacks of rank 3" in report and "stacks of rank 0" not in report
    if world == 2 and len(beats) == 1:  # the rank that wrote is the one waiting (it was named stuck, its stacks shown)
        assert "rank   0 waits" in report and "rank   1 STUCK  wrote nothing" in report and "stacks of rank 0" not in \
            report, report


def test_set_aside_keeps_every_earlier_attempt(tmp_path: Path) -> None:
    hang = tmp_path / "hang"
    assert set_aside(hang) is None  # a first attempt: nothing to move
    for attempt in ("first", "second"):  # both reports written in the same second
        hang.mkdir()
        (hang / "report.txt").write_text(attempt)
        os.utime(hang / "report.txt", (OLD_REPORT_TIME, OLD_REPORT_TIME))
        set_aside(hang)
    stamp = f"{datetime.fromtimestamp(OLD_REPORT_TIME):%Y%m%d-%H%M%S}"
    assert not hang.exists()
    assert (tmp_path / f"hang-{stamp}" / "report.txt").read_text() == "first"
    assert (tmp_path / f"hang-{stamp}-2" / "report.txt").read_text() == "second"


def test_a_new_attempt_sets_aside_every_regroup_generation_of_the_last_one(tmp_path: Path) -> None:
    """The next attempt's regroups count from 1 again: an earlier attempt's hang-1/ and hang-2/ (stale beats and
    reports that would satisfy rank 0's wait at once) go aside with hang/, as hang/ always did; set-aside ones stay."""
    from trainer.runtime.records.rundir import RunDir
    kept = tmp_path / "hang-20240102-030405"
    for name in ("hang", "hang-1", "hang-2", kept.name):
        _previous_attempt(tmp_path / name)
    torch.distributed.init_process_group("gloo", store=torch.distributed.FileStore(str(tmp_path / "store"), 1),
                                         rank=0, world_size=1)
    try:
        RunDir(tmp_path, ONE).create("seed: 1\n")
    finally:
        torch.distributed.destroy_process_group()
    left = sorted(p.name for p in tmp_path.glob("hang*"))
    stamp = f"{datetime.fromtimestamp(OLD_REPORT_TIME):%Y%m%d-%H%M%S}"
    assert left == sorted([kept.name, f"hang-{stamp}-2", f"hang-1-{stamp}", f"hang-2-{stamp}"]), left


class _Exited(Exception):
    pass


@pytest.mark.parametrize("dump", ["writes", "raises", "blocks", "missing"])
def test_nccl_flight_recorder_is_dumped_and_never_blocks_the_report(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], dump: str) -> None:
    """Our wiring only (no GPU here): on an NCCL group the report asks torch for the trace, and survives its failure."""
    release = threading.Event()

    def fake_dump(*args: Any, **kwargs: Any) -> bytes:
        if dump == "raises":
            raise RuntimeError("flight recorder disabled\nmore")
        if dump == "blocks":
            release.wait()
        return b"pickled trace"

    def fake_exit(code: int) -> None:
        raise _Exited(code)

    c10d = torch._C._distributed_c10d
    if dump == "missing":
        monkeypatch.delattr(c10d, "_dump_nccl_trace", raising=False)
    else:
        monkeypatch.setattr(c10d, "_dump_nccl_trace", fake_dump, raising=False)
    monkeypatch.setattr(heartbeat, "_nccl_backend", lambda: True)
    monkeypatch.setattr(heartbeat, "NCCL_DUMP_TIMEOUT_S", 0.5)
    monkeypatch.setattr(os, "_exit", fake_exit)
    hb = Heartbeat(DistEnv(0, 0, 1, 1, 0, 1, "127.0.0.1", 29500, None, "single"), tmp_path / "hang", 3)
    hb.beat("backward (gradient all-reduce)", 7)
    t0 = time.monotonic()
    try:
        with pytest.raises(_Exited, match=str(EXIT_HANG)):
            hb._report(4.0)
    finally:
        release.set()
    assert time.monotonic() - t0 < 3
    report = (tmp_path / "hang" / "report.txt").read_text()
    assert "rank   0 STUCK" in report and report in capsys.readouterr().err
    trace = tmp_path / "hang" / "nccl_trace_rank_0.pkl"
    expect = {"writes": "; NCCL trace nccl_trace_rank_0.pkl",
              "raises": "; NCCL trace not written (RuntimeError: flight recorder disabled)",
              "blocks": "; NCCL trace not written (no answer in 0.5 s)",
              "missing": "; NCCL trace not written (this torch has no _dump_nccl_trace)"}[dump]
    assert expect in report, report
    if dump == "writes":
        assert trace.read_bytes() == b"pickled trace"
    elif dump != "blocks":
        assert not trace.exists()
