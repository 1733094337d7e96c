"""Jobs that live through several faults in one run on the real dev cluster (3 nodes): kills, a stop, preemptions, a
node range that shrinks in place, a time limit without a warning signal, a spare node taking over from memory. Each ends
with the uninterrupted run's parameters. (A file of its own so that CI's dev clusters share the healing tests out.)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from .conftest import ROOT, SMALL, faults, go, held, ok, run_trainer
from .test_healing import SLOW, events, excluded, finished, job_fields, kill_rank, submit
from .test_slurm import DEV_THREADS, cluster_cmd, idle, job_id_of, job_runs, job_state, reference, sh, slurm_env, wait_for

__all__ = ["reference", "slurm_env"]  # the fixtures, shared with test_slurm


def test_a_job_meeting_three_faults_keeps_going_and_ends_as_if_uninterrupted(
        slurm_env: dict[str, str], tmp_path: Path, reference: str) -> None:
    """2 nodes of 3, max_failures=10: a rank killed, a preemption, a rank killed on another node. Each requeue avoids
    the newest blame; the older one is used again rather than failing the job with its budget unspent."""
    run = tmp_path / "run"
    plan = {"0": {"kill_at_step": 4, "kill_rank": 1}, "1": {"wait_at_step": 2},
            "2": {"kill_at_step": 2, "kill_rank": 1}}  # the second kill: on a node the first one's requeue kept
    env = {**slurm_env, **faults(at=plan), "TRAINER_SUSPECTS": str(tmp_path / "suspects.json")}
    job = submit(env, "sbatch", [*SLOW, f"run.dir={run}"], ["max_failures=10"])
    held(run, ranks=2, attempt="1")
    assert sh(["scancel", "--signal=USR2", job], env).returncode == 0
    result = finished(run, job, env)
    first, second = (e["blamed"][0] for e in events(run, "attempt_end") if e["class"] == "infrastructure")
    assert result["outcome"] == "finished" and result["param_checksums"] == [reference, reference], result
    ends = events(run, "attempt_end")
    assert [(e["class"], e["decision"]) for e in ends] == [
        ("infrastructure", "requeue"), ("preempted", "requeue"), ("infrastructure", "requeue"), ("finished", "done")]
    assert ends[0]["blamed"] == [first] and ends[2]["blamed"] == [second] and first != second
    assert f"{first} used again although blamed" in ends[2]["why"], ends[2]
    assert second in excluded(job, env) and first not in excluded(job, env)


def snapshotted(run: Path, attempt: int) -> int | None:
    """The step of a memory snapshot of attempt number ``attempt`` newer than every durable checkpoint, if any."""
    starts = events(run, "attempt")
    if len(starts) <= attempt:
        return None
    begun = starts[attempt]
    saved = max([int(begun["resumed_step"]), *(e["step"] for e in events(run, "checkpoint") if e["t"] > begun["t"])])
    snaps = [e["step"] for e in events(run, "snapshot") if e["t"] > begun["t"] and e["step"] > saved]
    return max(snaps) if snaps else None


# Durable saves every 10 steps, memory snapshots every 2: a kill lands after a snapshot newer than the last save.
MEMORY = [*SMALL, "train.epochs=2", "checkpoint.every_steps=10", "checkpoint.memory_every_steps=2"]


def test_a_spare_node_takes_over_inside_the_allocation_from_node_memory(slurm_env: dict[str, str], tmp_path: Path,
                                                                        reference: str) -> None:
    """Rank 1 killed from outside after step 5 (a snapshot of step 4 in memory, no durable save yet): the next
    attempt starts at once on the spare node, restores from the memory of the nodes it runs on (the spare receives
    the state from the node that kept it), and ends as if uninterrupted; no requeue."""
    run = tmp_path / "run"
    env = {**slurm_env, **faults(at={"0": {"wait_at_step": 4}}), "TRAINER_SUSPECTS": str(tmp_path / "suspects.json")}
    job = submit(env, "sbatch", [*MEMORY, f"run.dir={run}"], ["spare_nodes=1"])
    held(run, ranks=2)
    node, killed_at = kill_rank(job, 1, 0), time.time()
    go(run)
    result = finished(run, job, env)
    assert result["outcome"] == "finished" and result["param_checksums"] == [reference, reference], result
    ends = events(run, "attempt_end")
    assert [(e["attempt"], e["decision"]) for e in ends] == [("0", "restart_here"), ("0.1", "done")], ends
    assert ends[0]["blamed"] == [node]
    runs = job_runs(job, env)
    assert runs == ["COMPLETED"], runs  # one run of the job: no requeue
    assert excluded(job, env) == "(null)"
    second = events(run, "attempt")[1]
    assert (second["restored_from"], second["resumed_step"]) == ("memory", 4), second
    first_step = next(e["t"] for e in events(run, "first_step") if e["t"] > second["t"])
    print(f"kill → first recovered step: {first_step - killed_at:.1f} s (spare node, from memory)")
    report = sh([sys.executable, "-m", "trainer.report", str(run)], env).stdout
    assert "recovery after attempt 1 (restart_here)" in report and "from memory" in report, report
    left = list(Path("/dev/shm").glob(f"trainer-snapshots-{os.getuid()}/{job}-*/*/step_*"))
    assert not left, left  # the job's end cleared every node's snapshots


def test_a_command_whose_process_is_killed_is_retried_without_its_node(slurm_env: dict[str, str],
                                                                       tmp_path: Path) -> None:
    """CMD=: the command (a session script, examples/char_lm) dies of SIGKILL; its wrapper records the kill."""
    run = tmp_path / "run"
    script = str(ROOT / "examples" / "char_lm" / "train.py")
    args = ["--max-steps", "40", "--max-bytes", "40000", "--batch-size", "8", "--sample", "0", "--eval-every", "1000",
            "tracking.mode=disabled", "checkpoint.every_steps=5"]
    env = {**slurm_env, **faults(at={"0": {"wait_at_step": 6}}), "RUN_DIR": str(run),
           "TRAINER_SUSPECTS": str(tmp_path / "s.json")}
    job = submit(env, "sbatch", ["python", script, *args])
    held(run, ranks=2)
    node = kill_rank(job, 1, 0, script)
    go(run)
    wait_for(lambda: job_state(job, env) == "COMPLETED" and len(events(run, "attempt_end")) == 2, timeout=300,
             what="the retried job to complete")
    first, last = events(run, "attempt_end")
    assert (first["class"], first["blamed"]) == ("infrastructure", [node]), first
    assert "killed by SIGKILL" in first["cause"] and last["class"] == "finished", (first, last)
    assert node in excluded(job, env)


@pytest.mark.slurm_compat
def test_a_node_range_job_shrinks_in_place_then_requeues_and_trains_the_same_run(slurm_env: dict[str, str],
                                                                                tmp_path: Path) -> None:
    """NODES=2-3, no global batch set: a rank killed, the job goes on at once on the 2 nodes left inside its
    allocation (no requeue) and gives the lost node back; a second rank killed leaves too few, so it is requeued
    (never asking for the node it gave back); a preemption then requeues it again. It keeps the first attempt's
    global batch throughout and ends with the parameters of the uninterrupted 3-node run (to float tolerance: another
    reduction order)."""
    import torch

    ref, run = tmp_path / "ref", tmp_path / "run"
    env = {**slurm_env, "TRAINER_SUSPECTS": str(tmp_path / "suspects.json")}
    # The uninterrupted run, as the job starts: 3 processes whose batch script says they may change size (its global
    # batch the first attempt's, kept).
    ok(run_trainer([*SLOW, f"run.dir={ref}"], tmp_path, nproc=3, env={**DEV_THREADS, "TRAINER_NODES": "2-3"}))
    idle(env, 3)  # a node range starts on as many as are free: all three
    # wait_at_step counts the steps of its own process: held at steps 5, 4 + 3 = 7 and (from the save at 6) 9.
    hold = {"0": {"wait_at_step": 4}, "0.1": {"wait_at_step": 2}, "1": {"wait_at_step": 2}}
    proc = cluster_cmd(["--launcher", "sbatch", "--nodes", "2-3", "--", *SLOW, f"run.dir={run}",
                        "checkpoint.every_steps=6", "checkpoint.memory_every_steps=2"], {**env, **faults(at=hold)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = job_id_of(proc.stdout)
    held(run, ranks=3)
    first, killed_at = kill_rank(job, 1, 0), time.time()
    go(run)
    held(run, ranks=2, attempt="0.1")
    second = kill_rank(job, 1, 0)
    go(run, "0.1")
    wait_for(lambda: len(list((run / "faults").glob("waiting.1.*"))) >= 2, timeout=240, what="attempt 1 to hold")
    assert sh(["scancel", "--signal=USR2", job], env).returncode == 0
    go(run, "1")
    wait_for(lambda: (run / "result.json").exists(), timeout=300, what="the job to end")
    # scontrol, not sacct: 22.05's accounting keeps a PENDING record of a resized job's requeue that never ends.
    wait_for(lambda: "JobState=COMPLETED" in sh(["scontrol", "show", "job", job], env).stdout, 60, "COMPLETED")
    result = json.loads((run / "result.json").read_text())
    assert result["outcome"] == "finished" and result["resumed_from"], result
    assert result["global_step"] == json.loads((ref / "result.json").read_text())["global_step"]  # the same batches
    ends = events(run, "attempt_end")
    assert [(e["attempt"], e["decision"]) for e in ends] == [
        ("0", "restart_here"), ("0.1", "requeue"), ("1", "requeue"), ("2", "done")], ends
    assert ends[0]["blamed"] == [first] and f"{first} given back to Slurm" in ends[0]["why"], ends[0]
    assert ends[1]["blamed"] == [second] and ends[1]["class"] != "user_error", ends[1]
    starts = {e["attempt"]: e["step_nodes"].split(",") for e in events(run, "job_start") if "step_nodes" in e}
    assert len(starts["0"]) == 3 and first not in starts["0.1"] and len(starts["0.1"]) == 2, starts
    steps = [(a["processes"], a["resumed_step"], a.get("restored_from")) for a in events(run, "attempt")]
    assert steps[:2] == [(3, 0, None), (2, 4, "memory")] and steps[2][1] == 6, steps
    print(f"kill → first recovered step: {first_step_after(run, killed_at) - killed_at:.1f} s (3 → 2 nodes, memory)")
    a, b = (torch.load(json.loads((r / "result.json").read_text())["checkpoint"], weights_only=True)["model"]
            for r in (ref, run))
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)
    report = sh([sys.executable, "-m", "trainer.report", str(run)], env).stdout
    assert "processes per attempt: 3 → 2" in report, report


def end_time(job: str, env: dict[str, str]) -> float:
    """The running job's end time (its time limit), as Slurm has it."""
    return datetime.strptime(job_fields(job, env)["EndTime"], "%Y-%m-%dT%H:%M:%S").timestamp()


def first_step_after(run: Path, t: float) -> float:
    return float(next(e["t"] for e in events(run, "first_step") if e["t"] > t))


@pytest.mark.slurm_compat
def test_a_job_without_a_warning_signal_saves_before_its_time_limit_and_requeues_apart_from_preemptions(
        slurm_env: dict[str, str], tmp_path: Path, reference: str) -> None:
    """--time=2 and no --signal: the runtime reads the job's end time, saves before it, exits 75; the verdict
    requeues it although max_requeues=0 (time limits are not preemptions), and the run ends as if uninterrupted. The
    ranks hold after step 2 until the end is closer than any margin (SLACK_S), however long they took to start."""
    from trainer.runtime.saving.cadence import SLACK_S

    run = tmp_path / "run"
    env = {**slurm_env, **faults(at={"0": {"wait_at_step": 1}})}
    job = submit(env, "sbatch", [*SLOW, f"run.dir={run}"], ["time_min=2", "signal_grace_s=0", "max_requeues=0"])
    held(run, ranks=2)
    ends_at = end_time(job, env)
    wait_for(lambda: time.time() > ends_at - SLACK_S + 1, 150, "the time limit to be near")
    go(run)
    result = finished(run, job, env)
    assert result["outcome"] == "finished" and result["param_checksums"] == [reference, reference], result
    ends = events(run, "attempt_end")
    assert ends[0]["cause"].startswith("deadline") and ends[0]["decision"] == "requeue", ends
    assert "not counted against max_requeues" in ends[0]["why"] and ends[-1]["class"] == "finished"
    near = events(run, "deadline")[0]
    saved = next(e for e in events(run, "checkpoint") if e["t"] > near["t"])
    end = near["t"] + near["left_s"]  # the job's end time as Slurm gave it
    assert near["left_s"] <= near["margin_s"] and saved["t"] < end, (near, saved)  # how much room: tests/test_cadence.py


def test_a_jobs_life_of_kills_a_stop_and_a_preemption_ends_as_if_uninterrupted(
        slurm_env: dict[str, str], tmp_path: Path, reference: str) -> None:
    """spare_nodes=1, max_failures=10: a rank killed (the spare takes over, from memory), a rank stopped from outside
    (SIGSTOP: the hang watchdog names it), a preemption (requeued, from its save), a rank killed again; the job ends
    with the uninterrupted run's parameters."""
    run = tmp_path / "run"
    plan = {"0": {"kill_at_step": 4, "kill_rank": 1},  # after a snapshot of step 4
            "0.1": {"wait_at_step": 2},  # held: rank 0 is stopped from outside, and never answers again
            "0.2": {"wait_at_step": 2},  # held: Slurm's warning signal
            "1": {"kill_at_step": 4, "kill_rank": 1}}
    env = {**slurm_env, **faults(at=plan), "TRAINER_SUSPECTS": str(tmp_path / "suspects.json")}
    job = submit(env, "sbatch", [*MEMORY, f"run.dir={run}", "checkpoint.poll_steps=1", "dist.heartbeat_timeout_s=15"],
                 ["spare_nodes=1", "max_failures=10"])
    held(run, ranks=2, attempt="0.1")
    kill_rank(job, 0, 0, sig=signal.SIGSTOP)  # rank 0, on another node than the kill's
    go(run, "0.1")
    held(run, ranks=2, attempt="0.2")
    assert sh(["scancel", "--signal=USR2", job], env).returncode == 0
    result = finished(run, job, env)
    assert result["outcome"] == "finished" and result["param_checksums"] == [reference, reference], result
    ends = events(run, "attempt_end")
    assert [(e["class"], e["decision"]) for e in ends] == [
        ("infrastructure", "restart_here"), ("infrastructure", "restart_here"), ("preempted", "requeue"),
        ("infrastructure", "restart_here"), ("finished", "done")], ends
    assert "hang" in ends[1]["cause"], ends[1]
    assert [a["restored_from"] for a in events(run, "attempt")] == [None, "memory", "memory", "disk", "memory"]
