"""Hang diagnostics with real processes: a deliberately stuck rank is named, with its stacks, and every rank exits."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from trainer.heartbeat import EXIT_HANG, build_report

from .conftest import SMALL, ok, run_trainer, spawn_ranks


def test_stuck_rank_is_named_with_its_stack_and_every_rank_exits(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = [*SMALL, f"run.dir={run}", "dist.timeout_s=120", "dist.heartbeat_timeout_s=3", "debug.hang_at_step=6"]
    t0 = time.monotonic()
    procs = spawn_ranks(args, tmp_path)
    outs = [p.communicate(timeout=90)[0] for p in procs]
    elapsed = time.monotonic() - t0
    assert [p.returncode for p in procs] == [EXIT_HANG, EXIT_HANG], outs
    assert elapsed < 60, f"took {elapsed:.0f} s: the report must come long before dist.timeout_s=120"
    report = (run / "hang" / "report.txt").read_text()
    assert "stuck rank(s): 1 " in report, report
    assert "rank   1 STUCK" in report and "rank   0 waits" in report
    assert "_stuck_for_test" in report  # rank 1's own Python stack, from faulthandler
    assert "backward (gradient all-reduce)" in report  # where rank 0 waits for it
    # Printed once, by rank 0; rank 1 only leaves its files.
    assert outs[0].count("HANG: no progress") == 1 and "HANG" not in outs[1]
    assert {p.name for p in (run / "hang").iterdir()} >= {"rank_0.txt", "rank_1.txt", "rank_0.json", "rank_1.json"}


def test_no_false_alarm_with_a_short_timeout(tmp_path: Path) -> None:
    """Saves (rank 1 waits while rank 0 writes) and evaluation do not count as hangs."""
    run = tmp_path / "run"
    ok(run_trainer([*SMALL, f"run.dir={run}", "dist.heartbeat_timeout_s=3", "checkpoint.every_steps=4",
                    "debug.save_delay_s=0.5", "train.epochs=2"], tmp_path, nproc=2))
    assert not (run / "hang").exists()


def _beat(folder: Path, rank: int, seq: int, phase: str) -> None:
    (folder / f"rank_{rank}.json").write_text(json.dumps(
        {"rank": rank, "host": "n1", "pid": 100 + rank, "seq": seq, "step": 7, "phase": phase, "silent_s": 5}))
    (folder / f"rank_{rank}.txt").write_text(f"stacks of rank {rank}\n")


@pytest.mark.parametrize(("beats", "world", "expect"), [
    ({0: 40, 1: 38, 2: 40, 3: 38}, 4, "stuck rank(s): 1, 3 "),
    ({0: 40, 1: 40}, 2, "all 2 ranks stopped at the same point"),
    ({0: 40}, 2, "rank   1 ?      wrote nothing"),
])
def test_report_names_the_ranks_furthest_behind(tmp_path: Path, beats: dict[int, int], world: int, expect: str) -> None:
    for rank, seq in beats.items():
        _beat(tmp_path, rank, seq, "forward" if seq == min(beats.values()) else "backward")
    report = build_report(tmp_path, world, 60)
    assert expect in report, report
    if "stuck rank(s): 1, 3" in expect:
        assert "stacks of rank 1" in report and "stacks of rank 3" in report and "stacks of rank 0" not in report
