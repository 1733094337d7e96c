"""The event log and the run report: attempts, lost work and goodput after a preemption and a SIGKILL; real plots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest

from trainer.core.events import read
from trainer.runtime.records.attempts import PHASES, attempts, describe_recovery, figures, startup_lines

from .conftest import SMALL, clean_env, faults, ok, result_of, run_trainer
from .test_tracking import run_files
from .wandb_records import summary

ARGS = [*SMALL, "train.epochs=2", "checkpoint.poll_steps=1", "checkpoint.every_steps=5", "train.log_every=4"]


@pytest.fixture(scope="module")
def three_attempts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Preempted by a signal at step 6; resumed there and SIGKILLed at the end of step 14, before its poll: the last
    step it recorded is 13, 3 after its last checkpoint (10); then run to the end."""
    tmp = tmp_path_factory.mktemp("report")
    run = tmp / "run"
    args = [*ARGS, f"run.dir={run}"]
    first = run_trainer(args, tmp, env=faults(preempt_at_step=5))
    assert first.returncode == 75, first.stdout + first.stderr
    assert run_trainer(args, tmp, env=faults(kill_at_step=7, kill_rank=0)).returncode == -9
    ok(run_trainer(args, tmp))
    return run


def test_the_report_lists_the_attempts_lost_work_and_goodput(three_attempts: Path) -> None:
    runs = attempts(three_attempts)
    assert len(runs) == 3
    f = figures(runs)
    rows = f["attempts"]
    assert [r["exit"] for r in rows] == [75, "killed", 0]
    assert [r["resumed_step"] for r in rows][:2] == [0, 6]
    # Lost work: the steps the killed attempt made after its last checkpoint, which the third one made again.
    killed = runs[1]
    last_saved = max(e["step"] for e in killed.times("checkpoint"))
    assert rows[2]["resumed_step"] == last_saved
    assert last_saved == 10 and rows[1]["lost_steps"] == killed.last_step - last_saved == 3
    assert rows[0]["lost_steps"] == 0  # the signal's save kept every step
    # Goodput, recomputed from the raw events: (training − stalls − lost) / lifetime, summed over attempts.
    alloc = sum(a.end - a.start for a in runs)
    useful = 0.0
    for i, a in enumerate(runs):
        training = a.end - (a.first_step_t or a.end)
        done = a.last_step - int(a.info["resumed_step"])
        lost = rows[i]["lost_steps"] * (training / done if done else 0)
        useful += training - sum(e["stall_s"] for e in a.times("checkpoint")) - lost
    assert f["goodput"] == pytest.approx(useful / alloc) and 0 < f["goodput"] < 1
    assert result_of(three_attempts)["global_step"] == 64


def test_a_recovery_is_broken_down_by_phase(three_attempts: Path) -> None:
    """The SIGKILL's recovery (no verdict outside Slurm): its phases add up to the time from the killed attempt's
    last step to the next attempt's first, and name what the restore read and what was recomputed."""
    runs = attempts(three_attempts)
    (r,) = figures(runs)["recoveries"]  # the preemption is no failure: only the kill's
    assert r["after_attempt"] == 2 and r["restored_from"] == "disk"
    assert r["recomputed_steps"] == figures(runs)["attempts"][1]["lost_steps"] == 3
    assert sum(r[k] for k in PHASES) == pytest.approx(r["total_s"], abs=1e-6), json.dumps(r)
    assert r["startup"] > 0 and r["first_step"] > 0
    line = describe_recovery(r)
    assert line.startswith("recovery after attempt 2") and "restore" in line and "from disk" in line
    assert line in subprocess.run([sys.executable, "-m", "trainer.report", str(three_attempts)], capture_output=True,
                                  text=True, env=clean_env()).stdout


def test_each_start_up_is_broken_down_by_phase(three_attempts: Path) -> None:
    """Every attempt event splits its start so far into phases that add up to it (the process's start is known to
    the second), and the summary gives the first attempt's with its first step."""
    runs = attempts(three_attempts)
    for a in runs:
        phases = a.info["startup"]
        assert set(phases) == {"imports_s", "group_s", "model_s", "restore_s"} and min(phases.values()) >= 0, phases
        assert sum(phases.values()) == pytest.approx(a.info["t"] - a.info["started"], abs=1.0)
    (line,) = startup_lines(runs)[:1]
    assert line.startswith("start-up of attempt 1: ") and "imports" in line and "first step" in line
    assert line in figures(runs)["startup"]


@pytest.mark.parametrize(("imports", "hint"), [(8.0, True), (4.0, False), (5.5, False)])
def test_slow_imports_point_at_the_doctor(tmp_path: Path, imports: float, hint: bool) -> None:
    """Imports of 5 s and more that are most of a start-up get the pointer (the H200 machine's: 10 s of 11)."""
    phases = {"imports_s": imports, "group_s": 0.5, "model_s": 4.0, "restore_s": 0.5}
    events = [{"t": 20.0, "event": "attempt", "started": 9.0, "nodes": 1, "resumed_step": 0, "startup": phases},
              {"t": 21.0, "event": "first_step", "step": 1}, {"t": 30.0, "event": "exit", "code": 0, "step": 9}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (line,) = startup_lines(attempts(tmp_path))
    total = imports + 5.0 + 1.0
    assert line.startswith(f"start-up of attempt 1: {total:.1f} s to the first step (imports {imports:.1f}, "
                           "process group 0.5, model and data 4.0, restore 0.5, first step 1.0)")
    assert ("trainer.doctor" in line) == hint


def test_a_sigkilled_attempt_leaves_only_whole_lines(three_attempts: Path) -> None:
    lines = (three_attempts / "events.jsonl").read_text().splitlines()
    assert all(isinstance(json.loads(line), dict) for line in lines)
    assert sum(json.loads(line)["event"] == "attempt" for line in lines) == 3


def test_the_report_is_one_offline_page_with_real_plots(three_attempts: Path, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "trainer.report", str(three_attempts)], capture_output=True,
                          text=True, env=clean_env())
    assert proc.returncode == 0, proc.stderr
    assert "goodput" in proc.stdout and proc.stdout.count("\n") >= 5  # header, 3 attempts, totals
    page = (three_attempts / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 3
    assert "http://" not in page and "https://" not in page and "<script" not in page and "<link" not in page
    for name in ("loss", "throughput", "timeline"):
        png = three_attempts / f"report-{name}.png"
        assert png.stat().st_size > 5000
        pixels = matplotlib.image.imread(png)
        assert pixels.shape[0] > 150 and pixels.shape[1] > 300 and pixels.std() > 0.01  # decodes, not blank
    bad = subprocess.run([sys.executable, "-m", "trainer.report", str(tmp_path)], capture_output=True, text=True,
                         env=clean_env())
    assert bad.returncode == 2 and "error: RUN_DIR" in bad.stderr and "HINT:" in bad.stderr


@pytest.mark.parametrize("page", [True, False])
def test_every_finished_run_writes_its_report_and_gives_wandb_its_goodput(tmp_path: Path, page: bool) -> None:
    """``run.report=false`` skips the page (and its process), not the goodput W&B gets."""
    run = tmp_path / "run"
    args = [a for a in SMALL if not a.startswith(("tracking.", "run.report"))] + ["tracking.mode=offline"]
    proc = ok(run_trainer([*args, f"run.dir={run}", f"run.report={page}"], tmp_path))
    assert (f"report: {run / 'report.html'}" in proc.stdout and "goodput" in proc.stdout) == page, proc.stdout
    assert (run / "report.html").exists() == page
    events = list(read(run))
    kinds = [e["event"] for e in events]
    assert kinds[0] == "attempt" and kinds[-1] == "exit" and "first_step" in kinds
    (saved,) = [e for e in events if e["event"] == "checkpoint"]
    assert saved["bytes"] == Path(saved["path"]).stat().st_size and saved["stall_s"] > 0
    (wandb_file,) = run_files(run)
    final = summary(wandb_file)["summary"]
    assert final["goodput"] == pytest.approx(figures(attempts(run))["goodput"], rel=0.05) and 0 < final["goodput"] < 1


def test_without_matplotlib_the_report_is_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer import report

    events = [{"t": 10.0, "event": "attempt", "started": 9.0, "nodes": 1, "resumed_step": 0},
              {"t": 12.0, "event": "first_step", "step": 1}, {"t": 20.0, "event": "exit", "code": 0, "step": 9}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))

    def no_plots(*args: object) -> None:
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(report, "plots", no_plots)
    path, table = report.render(tmp_path)
    assert "goodput 72.7 %" in table  # (20 - 12) training of (20 - 9) allocated seconds
    assert "<table>" in path.read_text() and "data:image" not in path.read_text()


DEAD_START_THEN_RESUMED_AT_50 = [
    {"t": 1000.0, "event": "job_start", "job_id": "7", "restart": 1, "nodes": 2},  # a bad node: dies before its session
    {"t": 1030.0, "event": "job_end", "job_id": "7", "code": 1},
    {"t": 1031.0, "event": "attempt_end", "job_id": "7", "attempt": "1", "class": "infrastructure",
     "cause": "node n3: CUDA error", "decision": "requeue"},
    {"t": 2000.0, "event": "job_start", "job_id": "7", "restart": 2, "nodes": 2},
    {"t": 2010.0, "event": "attempt", "started": 2005.0, "job_id": "7", "attempt": "2", "nodes": 2,
     "resumed_step": 50, "torch": "2.x"},
    {"t": 2020.0, "event": "first_step", "step": 51},
    {"t": 2100.0, "event": "exit", "code": 0, "step": 100}]
"""Job 7's second start, dead before its session opened, then its third, resumed at step 50 and finished at 100."""


def test_a_start_that_died_before_its_session_opened_is_an_attempt_of_its_own(tmp_path: Path) -> None:
    """Requeued onto a bad node, the second start died before the session opened (no ``attempt`` event): its batch
    events went to the first attempt, which then counted 911 s of training and the failure, and goodput read 96 %.
    And an attempt killed in its restore (nothing after its ``attempt`` event) lasts until that event at least."""
    events = [{"t": 100.0, "event": "job_start", "job_id": "7", "restart": 0, "nodes": 2},
              {"t": 110.0, "event": "attempt", "started": 105.0, "job_id": "7", "attempt": "0", "nodes": 2,
               "resumed_step": 0},
              {"t": 120.0, "event": "first_step", "step": 1},
              {"t": 200.0, "event": "checkpoint", "step": 50, "stall_s": 1.0},
              {"t": 201.0, "event": "exit", "code": 75, "step": 50},
              {"t": 203.0, "event": "attempt_end", "job_id": "7", "attempt": "0", "class": "preempted",
               "decision": "requeue"},
              *DEAD_START_THEN_RESUMED_AT_50,
              {"t": 3000.0, "event": "job_start", "job_id": "8", "restart": 0, "nodes": 1},  # killed in its restore
              {"t": 3300.0, "event": "attempt", "started": 3001.0, "job_id": "8", "attempt": "0", "nodes": 1,
               "resumed_step": 100}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    f = figures(attempts(tmp_path))
    assert [(r["exit"], r["ended"], r["allocated_s"], r["training_s"], r["lost_steps"]) for r in f["attempts"]] == [
        (75, "preempted", 103.0, 83.0, 0), (1, "infrastructure", 31.0, 0.0, 0), (0, None, 100.0, 80.0, 0),
        ("killed", None, 300.0, 0.0, 0)]
    assert f["goodput"] == pytest.approx((82.0 + 80.0) * 2 / ((103.0 + 31.0 + 100.0) * 2 + 300.0))


def test_a_recovery_spans_the_starts_that_died_before_the_next_session(tmp_path: Path) -> None:
    """A node died at step 80 (saved at 50); the requeue landed on a bad node and died before its session; the next
    start resumed at 50. One recovery, from attempt 1 to attempt 3, recomputing 30 steps (the dead start's pair was
    skipped and the recovery counted from it, with 0 steps recomputed)."""
    events = [{"t": 100.0, "event": "job_start", "job_id": "7", "restart": 0, "nodes": 2},
              {"t": 110.0, "event": "attempt", "started": 105.0, "job_id": "7", "attempt": "0", "nodes": 2,
               "resumed_step": 0, "torch": "2.x"},
              {"t": 120.0, "event": "first_step", "step": 1},
              {"t": 200.0, "event": "checkpoint", "step": 50, "stall_s": 1.0},
              {"t": 290.0, "event": "progress", "step": 80},
              {"t": 300.0, "event": "job_end", "job_id": "7", "code": 1},
              {"t": 301.0, "event": "attempt_end", "job_id": "7", "attempt": "0", "class": "infrastructure",
               "cause": "node n2 died", "decision": "requeue"},
              *DEAD_START_THEN_RESUMED_AT_50]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    f = figures(attempts(tmp_path))
    [r] = f["recoveries"]
    assert (r["after_attempt"], r["recomputed_steps"], r["total_s"]) == (1, 30, 1730.0)
    assert [(a["exit"], a["lost_steps"]) for a in f["attempts"]] == [(1, 30), (1, 0), (0, 0)]
    from trainer import report

    path, _ = report.render(tmp_path)
    assert "torch 2.x" in path.read_text()  # the software of the last session, not the dead start's None


def test_a_recovery_in_place_is_an_attempt_of_the_report_and_of_status(tmp_path: Path) -> None:
    """A regroup (Session.regroup) is the next attempt inside its allocation (``0`` → ``0.1``, no process started):
    the report gives it a row and a line broken down by phase, `cluster status` a line, and the attempt it ended
    counts as an infrastructure failure."""
    from cluster.job.ledger import Record
    from cluster.runs.status import attempt_lines
    from trainer import report

    events = [{"t": 9.0, "event": "job_start", "job_id": "5", "attempt": "0", "nodes": 3},
              {"t": 10.0, "event": "attempt", "started": 9.0, "job_id": "5", "attempt": "0", "nodes": 3,
               "processes": 3, "resumed_step": 0},
              {"t": 12.0, "event": "first_step", "step": 1},
              {"t": 14.9, "event": "progress", "step": 8},
              {"t": 15.2, "event": "attempt", "started": 15.0, "job_id": "5", "attempt": "0.1", "within": "0",
               "regroup": True, "nodes": 2, "processes": 2, "resumed_step": 7},
              {"t": 15.2, "event": "regroup", "step": 7, "lost": [2], "generation": 1, "members": [0, 1],
               "world_size": 2, "was": 3, "exact": True, "detection_s": 0.05, "abort_s": 0.01, "rendezvous_s": 0.004,
               "transfer_s": 0.011, "total_s": 0.025},
              {"t": 15.3, "event": "first_step", "step": 8},
              {"t": 17.0, "event": "attempt", "started": 17.0, "job_id": "5", "attempt": "0.2", "within": "0",
               "grew": True, "nodes": 3, "processes": 3, "resumed_step": 8},
              {"t": 17.0, "event": "regroup", "step": 8, "lost": [], "generation": 2, "members": [0, 1, 1000000],
               "world_size": 3, "was": 2, "exact": False, "abort_s": 0.01, "rendezvous_s": 0.004,
               "transfer_s": 0.011, "total_s": 0.031},
              {"t": 17.3, "event": "first_step", "step": 9},  # growing back is no recovery from a failure
              {"t": 20.0, "event": "exit", "code": 0, "step": 9}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    f = figures(attempts(tmp_path))
    assert [(r["id"], r["processes"], r["ended"]) for r in f["attempts"]] == \
           [("0", 3, "infrastructure"), ("0.1", 2, None), ("0.2", 3, None)]  # growing back: no failure
    [r] = f["recoveries"]
    assert (r["detection"], r["abort"], r["rendezvous"], r["transfer"]) == (0.05, 0.01, 0.004, 0.011)
    assert r["first_step"] == pytest.approx(0.1) and r["recomputed_steps"] == 1
    line = ("recovered in place after attempt 1 (rank 2 lost, 2 of 3 processes went on; no process started, no "
            "file read): 175 ms from the loss to the next first step (detection 50 ms, abort 10 ms, rendezvous 4 ms, "
            "transfer 11 ms, first step 100 ms); 1 step(s) recomputed")
    path, table = report.render(tmp_path)
    assert line in path.read_text() and line in table
    said = attempt_lines(Record("job", "5", "x"), events)
    assert said[1].startswith("  0.1  ") and said[1].endswith("2 node(s)  recovered in place: 2 processes from step 7")
    assert said[2].startswith("  0.2  ") and said[2].endswith("3 node(s)  grew back: 3 processes from step 8")
    assert ("grew back in attempt 3: warm spares joined, 2 → 3 processes from step 8 in 31 ms (no rank lost)"
            in table)
