"""Checkpoint cadence that sets itself (Young/Daly from measured stalls and interruptions), the deadline save before
the time limit, and saving on request; real processes where the runtime acts, tables for the arithmetic."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cluster.job.judge import DEADLINE, judge
from cluster.job.rules import Limits, decide
from trainer.core.records import AttemptEnd, ExitRecord, RequeueMarker
from trainer.runtime.saving.cadence import MAX_INTERVAL_S, MIN_INTERVAL_S, Cadence, history, interval_s

from . import warm
from .conftest import ROOT, SMALL, clean_env, faults, go, held, ok, outputs, result_of, run_trainer, spawn_ranks


@pytest.mark.parametrize(("stall", "mtbf", "expected"), [
    (2.0, 4 * 3600, math.sqrt(2 * 2 * 4 * 3600)),   # 240 s: the formula, inside the bounds
    (8.0, 4 * 3600, math.sqrt(2 * 8 * 4 * 3600)),   # 4 × the stall: 2 × the interval
    (0.01, 3600, MIN_INTERVAL_S),                    # a cheap save still waits the floor
    (30.0, 3600, 30.0 / 0.05),                       # an expensive one: at most 5 % of the time saving
    (60.0, 10 * 365 * 86400, MAX_INTERVAL_S),        # a cluster that never fails still saves every 4 h
])
def test_the_interval_follows_young_daly_within_its_bounds(stall: float, mtbf: float, expected: float) -> None:
    assert interval_s(stall, mtbf) == pytest.approx(expected)


def _events(run: Path, lines: list[dict[str, object]]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))


@pytest.mark.parametrize("batch", [False, True])
def test_interruptions_and_stalls_come_from_the_run_history(tmp_path: Path, batch: bool) -> None:
    """Two attempts killed without a word (no exit event), one preempted with a save: two interruptions count. Under
    a batch script each start's ``job_start`` comes first, the one now starting's too: not an interruption."""
    def start(t: float) -> list[dict[str, object]]:
        return [{"t": t, "event": "job_start", "job_id": "7"}] if batch else []

    _events(tmp_path, [
        *start(0.0), {"t": 0.0, "event": "attempt", "started": 0.0}, {"t": 100.0, "event": "checkpoint", "stall_s": 3.0},
        *start(200.0), {"t": 200.0, "event": "attempt", "started": 200.0},
        {"t": 300.0, "event": "checkpoint", "stall_s": 5.0},
        *start(400.0), {"t": 400.0, "event": "attempt", "started": 400.0}, {"t": 500.0, "event": "exit", "code": 75},
        *start(600.0),
    ])  # the attempt now starting has written nothing yet (but its batch script's start)
    ran, lost, stalls = history(tmp_path)
    assert (ran, lost, stalls) == (300.0, 2, [3.0, 5.0])
    c = Cadence(tmp_path, nodes=4, prior_hours=8)
    assert c.stall_s == 5.0 and c.mtbf_s == pytest.approx((300 + 2 * 3600) / 3, rel=1e-3)
    first = c.news()
    assert first and first.startswith("checkpoint cadence: saving every") and "2 seen, prior 2 h" in first
    before = c.interval()
    c.saved(45.0)  # storage got slower: the interval grows, and it says so
    assert c.stall_s == 25.0 and c.interval() > before and (c.news() or "").count("a save stalls 25 s") == 1
    assert c.news() is None  # nothing new


def test_a_fresh_run_assumes_a_second_per_save_until_it_measures_one(tmp_path: Path) -> None:
    c = Cadence(tmp_path, nodes=1, prior_hours=24)
    assert c.stall_s == 1.0 and c.interval() == pytest.approx(math.sqrt(2 * 86400), rel=1e-3)
    c.saved(4.0)
    assert c.stall_s == 4.0  # the guess is replaced, not averaged


DEADLINE_ARGS = [*SMALL, "train.epochs=3", "checkpoint.poll_steps=1"]


def test_the_time_limit_is_met_by_a_save_before_it_and_the_resumed_run_ends_as_an_uninterrupted_one(
        tmp_path: Path) -> None:
    """The job ends 30 s after the session starts; a save keeps about 22 s (two saves of a second, a step, 20 s for
    the exit and the requeue): the ranks save once the time left is below that, at some step, exit 75 and resume.
    When exactly is the margin's arithmetic, tested with a clock below; here, that the save came before the end."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    ok(run_trainer([*DEADLINE_ARGS, f"run.dir={ref}"], tmp_path, nproc=2))
    ranks = spawn_ranks([*DEADLINE_ARGS, f"run.dir={run}"], tmp_path, env=faults(end_in_s=30, step_delay_s=0.5))
    outs = outputs(ranks, timeout=240)
    assert [p.returncode for p in ranks] == [75, 75], outs[0]
    assert "the time limit is near: saved" in outs[0]
    marker = json.loads((run / "requeue.json").read_text())
    assert marker["signal"] == "deadline"
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    near = next(e for e in events if e["event"] == "deadline")
    saved = [e for e in events if e["event"] == "checkpoint"][-1]
    # Both are rounded to 0.1 s in the event: equal there when the time left was a hair below the margin.
    assert near["left_s"] <= near["margin_s"] and saved["step"] == marker["step"]
    assert saved["t"] < near["t"] + near["left_s"], (saved, near)  # the save ended before the limit, not after it
    ok(run_trainer([*DEADLINE_ARGS, f"run.dir={run}"], tmp_path, nproc=2))
    assert result_of(run)["param_checksums"] == result_of(ref)["param_checksums"]


def test_the_verdict_counts_time_limit_requeues_apart_and_stops_a_run_that_cannot_progress(tmp_path: Path) -> None:
    RequeueMarker("deadline", 7).write(tmp_path)
    saved = [ExitRecord(rank=0, node="n1", code=75, kind="preempted", step=7)]
    v = judge(saved, [], 75, RequeueMarker.read(tmp_path))
    assert v.deadline and v.cause == DEADLINE and v.kind == "preempted"
    limits = Limits(max_requeues=1, max_failures=1, suspects=tmp_path / "s.json", suspect_hours=1)
    before = [AttemptEnd.from_json(e) for e in ({"class": "preempted", "cause": "saved after the warning signal"},
                                                {"class": "preempted", "cause": DEADLINE, "step": 3})]
    assert before[1].deadline  # an earlier layout: the flag from its cause
    action, why = decide(v, before, limits)  # max_requeues=1 is spent on the preemption, not on time limits
    assert action == "requeue" and "requeue 2 (not counted against max_requeues)" in why
    action, why = decide(v, [*before, AttemptEnd(kind="preempted", cause=DEADLINE, step=7, deadline=True)], limits)
    assert action == "fail" and "no step was trained since the last time (step 7)" in why
    RequeueMarker("SIGUSR2", 7).write(tmp_path)
    assert not judge(saved, [], 75, RequeueMarker.read(tmp_path)).deadline


def test_auto_cadence_measures_the_injected_save_cost_and_says_its_interval(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = ok(run_trainer([*SMALL, "checkpoint.cadence=auto", "checkpoint.every_steps=16", "checkpoint.mtbf_hours=2",
                           f"run.dir={run}"], tmp_path, env=faults(save_delay_s=2)))
    lines = [x for x in proc.stdout.splitlines() if x.startswith("checkpoint cadence:")]
    assert "a save stalls 1 s, interruptions every 2 h (0 seen, prior 2 h)" in lines[0], lines
    stalls = [json.loads(x)["stall_s"] for x in (run / "events.jsonl").read_text().splitlines()
              if json.loads(x)["event"] == "checkpoint"]
    assert min(stalls) >= 2
    m = re.search(r"saving every ([\d.]+) (s|min): a save stalls ([\d.]+) s", lines[-1])
    assert m and float(m[3]) >= 2, lines  # the measured cost replaced the first guess
    expected = interval_s(float(m[3]), 2 * 3600)
    assert float(m[1]) * (60 if m[2] == "min" else 1) == pytest.approx(expected, rel=0.05), lines


def test_save_now_saves_at_the_next_poll_and_training_goes_on(tmp_path: Path) -> None:
    """The run waits after step 5 (a test fault) while `cluster save-now` asks; it saves at that poll and goes on."""
    run = tmp_path / "run"
    proc = warm.Popen([sys.executable, "-m", "trainer", *SMALL, "checkpoint.poll_steps=1", f"run.dir={run}"],
                      cwd=tmp_path, env=clean_env(faults(wait_at_step=4)), stdout=subprocess.PIPE,
                      stderr=subprocess.STDOUT, text=True)
    held(run, [proc])
    asked = subprocess.run([sys.executable, "-m", "cluster", "save-now", str(run)], capture_output=True, text=True,
                           cwd=ROOT)
    assert asked.returncode == 0 and "asked" in asked.stdout
    go(run)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    saves = [json.loads(x)["step"] for x in (run / "events.jsonl").read_text().splitlines()
             if json.loads(x)["event"] == "checkpoint"]
    assert saves == [5, 32] and not (run / "save-now").exists(), saves
    bad = subprocess.run([sys.executable, "-m", "cluster", "save-now", str(tmp_path)], capture_output=True, text=True,
                         cwd=ROOT)
    assert bad.returncode == 2 and "is not a run folder" in bad.stderr


def test_fixed_cadence_keeps_its_saves(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ok(run_trainer([*SMALL, "checkpoint.every_steps=5", f"run.dir={run}"], tmp_path))
    steps = [json.loads(x)["step"] for x in (run / "events.jsonl").read_text().splitlines()
             if json.loads(x)["event"] == "checkpoint"]
    assert steps == [5, 10, 15, 20, 25, 30, 32]
    assert torch.load(result_of(run)["checkpoint"], weights_only=True)["step"] == 32


def test_the_report_sets_the_loss_the_cadence_expected_against_the_loss_seen(tmp_path: Path) -> None:
    from trainer.report import table
    from trainer.runtime.records.attempts import attempts, figures

    _events(tmp_path, [
        {"t": 0.0, "event": "attempt", "started": 0.0, "resumed_step": 0, "processes": 1},
        {"t": 1.0, "event": "cadence", "interval_s": 120.0, "stall_s": 0.5, "mtbf_s": 14400},
        {"t": 10.0, "event": "first_step", "step": 1}, {"t": 15.0, "event": "checkpoint", "step": 5, "stall_s": 0.5},
        {"t": 20.0, "event": "progress", "step": 10},  # then killed: no exit event
        {"t": 30.0, "event": "attempt", "started": 30.0, "resumed_step": 5, "processes": 1},
        {"t": 40.0, "event": "exit", "code": 0, "step": 12},
    ])
    f = figures(attempts(tmp_path))
    assert f["cadence"] == {"interval_s": 120.0, "expected_lost_s": 60.0, "measured_lost_s": 5.0, "interruptions": 1}
    assert ("auto cadence: saving every 120 s; work lost per unannounced interruption: 60.0 s expected, 5.0 s "
            "measured over 1; 0.50 s spent saving") in table(f)


def test_attempts_killed_without_a_save_shorten_the_interval_of_the_next(tmp_path: Path) -> None:
    """Two attempts SIGKILLed after 5 steps (unannounced), one preempted with a save (announced): the next attempt
    counts 2 interruptions and derives its interval from them, the measured stall and the prior."""
    run = tmp_path / "run"
    args = [*SMALL, "checkpoint.cadence=auto", "checkpoint.mtbf_hours=1", "checkpoint.every_steps=2",
            "checkpoint.poll_steps=1", f"run.dir={run}"]
    for _ in range(2):
        assert run_trainer(args, tmp_path, env=faults(kill_at_step=4, kill_rank=0)).returncode == -9
    assert run_trainer(args, tmp_path, env=faults(preempt_at_step=3)).returncode == 75
    last = ok(run_trainer(args, tmp_path))
    line = next(x for x in last.stdout.splitlines() if x.startswith("checkpoint cadence:"))
    assert "(2 seen, prior 60 min)" in line, line
    ran, lost, stalls = history(run)
    assert lost == 2 and ran > 0 and stalls
    from trainer.runtime.records.attempts import attempts, figures

    # Each attempt's first cadence line is filed under it, not under the attempt before: it counts the interruptions
    # before it (0, 1, 2, 2) in its time between them, (prior 3600 s + the seconds run) / (interruptions + 1).
    runs = attempts(run)
    first = [a.times("cadence")[0]["mtbf_s"] for a in runs]
    assert len(runs) == 4 and [round(m / 600) for m in first] == [6, 3, 2, 2], first
    f = figures(runs)
    assert f["cadence"] and f["cadence"]["interruptions"] == 2


class _Limit:
    """A Deadline whose time left is set by the test."""

    def __init__(self, left: float | None) -> None:
        self.left = left

    def left_s(self) -> float | None:
        return self.left


class Clock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


def _policy(left: float | None, async_save: bool = False, save_s: float = 1.0, clock: Clock | None = None,
            **cfg: object):  # type: ignore[no-untyped-def]
    from trainer.core.env import DistEnv
    from trainer.core.schema import CheckpointConfig
    from trainer.runtime.saving.policy import SavePolicy
    from trainer.runtime.saving.signals import Preemption

    env = DistEnv(0, 0, 1, 1, 0, 1, "127.0.0.1", 29500, None, "single")
    config = CheckpointConfig(async_save=async_save, **{"poll_steps": 1, **cfg})  # type: ignore[arg-type]
    return SavePolicy(config, env, Preemption(()), deadline=_Limit(left), save_s=save_s,  # type: ignore[arg-type]
                      clock=clock or Clock())


def test_the_deadline_margin_covers_the_longest_blocking_save_and_the_steps_to_the_next_poll() -> None:
    from trainer.runtime.saving.cadence import SLACK_S

    clock = Clock()
    p = _policy(left=1000.0, clock=clock)
    assert p.margin_s() == pytest.approx(2 * 1.0 + SLACK_S)
    p.saved(6.0, blocking=False)  # an async save's copy: not what a last, blocking save takes
    p.saved(4.0, blocking=True)
    assert p.save_s == 4.0 and p.margin_s() == pytest.approx(2 * 4.0 + SLACK_S)
    assert _policy(1000.0, async_save=True, save_s=4.0).margin_s() == pytest.approx(2 * 8.0 + SLACK_S)  # one in flight
    clock.now += 300  # the first span (start-up, compiling, a first evaluation) does not count; later ones do
    p.poll(1)
    assert p.poll_span_s == 0.0
    for span in (2.5, 7.0, 3.0):
        clock.now += span
        p.poll(2)
    assert p.poll_span_s == 7.0 and p.margin_s() == pytest.approx(2 * (4.0 + 7.0) + SLACK_S)
    assert not p.poll(4).deadline
    p.deadline.left = p.margin_s() - 1  # type: ignore[union-attr]
    assert p.poll(5).deadline
    assert _policy(None).poll(1) == _policy(None).poll(1)  # no time limit: never a deadline


@pytest.mark.parametrize(("every_minutes", "polls", "due"), [
    (1.0, [(30, False), (29, False), (2, True), (30, False), (31, True)], None),  # the interval restarts at a save
    (0.0, [(3600, False)], None),  # no timed saves
])
def test_timed_saves_fall_due_by_the_clock_at_the_polls(every_minutes: float, polls: list[tuple[float, bool]],
                                                        due: None) -> None:
    clock = Clock()
    p = _policy(None, clock=clock, every_minutes=every_minutes)
    for later, expected in polls:
        clock.now += later
        got = p.poll(1).due
        assert got is expected, (later, clock.now)
        if got:
            p.saved(0.1)


def test_the_auto_cadence_counts_the_time_this_attempt_has_run(tmp_path: Path) -> None:
    clock = Clock()
    c = Cadence(tmp_path, nodes=2, prior_hours=2, clock=clock)
    assert c.mtbf_s == pytest.approx(3600)
    clock.now += 1800
    assert c.mtbf_s == pytest.approx(5400)  # (observed 1800 s + prior 3600 s) / (0 interruptions + 1)


def test_the_deadline_counts_down_on_the_wall_clock() -> None:
    from trainer.runtime.saving.cadence import Deadline

    wall = Clock()
    d = Deadline("42", end_in_s=90, wall=wall)
    assert d.left_s() == 90
    wall.now += 100
    assert d.left_s() == -10
    assert Deadline(None, wall=wall).left_s() is None


@pytest.mark.parametrize(("left", "grace", "at_limit"), [
    (100.0, 120.0, True),     # the profile's warning, on time
    (170.0, 120.0, True),     # Slurm may send it up to a minute early
    (400.0, 120.0, False),    # a preemption (scancel --signal, a higher-priority job) earlier on
    (50.0, 0.0, True),        # no warning asked for: only a signal inside the margin and that minute
    (None, 120.0, False),     # no time limit known
])
def test_a_warning_signal_near_the_limit_is_the_limits(left: float | None, grace: float, at_limit: bool) -> None:
    assert _policy(left).signal_at_limit(grace) is at_limit


def test_the_end_time_comes_from_squeue_and_a_missing_one_is_none(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer.runtime.saving.cadence import _end_time

    fake = tmp_path / "squeue"
    fake.write_text('#!/bin/sh\n[ "$SLURM_TIME_FORMAT" = %s ] && [ "$3" = 42 ] && echo 1795600000 || echo Unknown\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    assert _end_time("42") == 1795600000.0 and _end_time("43") is None
    monkeypatch.setenv("PATH", "/nonexistent")
    assert _end_time("42") is None


def test_profiles_pass_the_grace_and_the_prior_and_may_drop_the_signal(capsys: pytest.CaptureFixture[str]) -> None:
    from cluster.__main__ import main as cluster_main

    assert cluster_main(["submit", "--launcher", "sbatch", "--dry-run", "--set", "signal_grace_s=0",
                         "--set", "mtbf_hours=6"]) == 0
    out = capsys.readouterr().out
    assert "--signal" not in out and "TRAINER_SIGNAL_GRACE_S=0" in out and "export TRAINER_MTBF_HOURS=6" in out
    assert cluster_main(["submit", "--dry-run", "--set", "signal_grace_s=0"]) == 2  # submitit always warns
    assert "error: profile.signal_grace_s: 0 (no warning signal) needs the sbatch launcher" in capsys.readouterr().err
