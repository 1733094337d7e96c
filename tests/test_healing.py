"""Self-healing jobs on the real dev cluster (3 nodes): a killed rank, a hang and a node failing the doctor are the
cluster's (blamed, excluded, retried from the last checkpoint); a bug in user code is the user's (never retried).

Faults are real: a rank's process is SIGKILLed from outside, a rank stops forever, the doctor fails on one node.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from benchmarks.procfs import PARENT, processes, stat
from cluster.job.nodes import parse_fields

from .conftest import ROOT, SMALL, faults, go, held, ok, run_trainer
from .test_slurm import DEV_THREADS, cluster_cmd, idle, job_id_of, job_runs, job_state, reference, sh, slurm_env, wait_for

__all__ = ["reference", "slurm_env"]  # the fixtures, shared with test_slurm

SLOW = [*SMALL, "train.epochs=2", "checkpoint.every_steps=3"]


def submit(env: dict[str, str], launcher: str, args: list[str], sets: list[str] = ()) -> str:  # type: ignore[assignment]
    proc = cluster_cmd(["--launcher", launcher, *(a for s in sets for a in ("--set", s)), "--", *args], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return job_id_of(proc.stdout)


def events(run: Path, kind: str) -> list[dict[str, Any]]:
    try:
        lines = (run / "events.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def kill_rank(job: str, rank: int | None, restart: int, script: str | None = None, not_on: str = "",
              sig: signal.Signals = signal.SIGKILL) -> str:
    """SIGKILL (or ``sig``) the training process of ``rank`` (None: of any rank not on node ``not_on``) in attempt
    ``restart`` of ``job`` (``script``: the command's own process, under `python -m trainer.launch`); return its
    Slurm node name. A warm spare is never the one (its step numbers its tasks from 0 too), nor a loader worker (forked
    from the rank: the same environment and argv, its parent among the matches)."""
    found: dict[int, str] = {}
    for pid, env, argv in processes():
        ours = env.get("SLURM_JOB_ID") == job and int(env.get("SLURM_RESTART_COUNT") or 0) == restart and \
            "TRAINER_SPARE" not in env
        which = env.get("SLURM_PROCID") == str(rank) if rank is not None else (
            "SLURM_PROCID" in env and env.get("SLURMD_NODENAME") != not_on)
        trainer = "python" in Path(argv[0]).name and (
            argv[1:2] == [script] if script else "-m" in argv and not {"cluster.job.verdict", "trainer.store"} & set(argv))
        if ours and which and trainer:
            found[pid] = env["SLURMD_NODENAME"]
    for pid, node in found.items():
        fields = stat(pid)
        if fields is not None and int(fields[PARENT]) not in found:
            os.kill(pid, sig)
            return node
    raise AssertionError(f"no process of rank {rank} in attempt {restart} of job {job}")


def job_fields(job: str, env: dict[str, str]) -> dict[str, str]:
    """``scontrol show job -o JOB`` as a dict, read with the verdict's own parser (cluster.job.nodes)."""
    return parse_fields(sh(["scontrol", "show", "job", "-o", job], env).stdout)


def cancelled(job: str, env: dict[str, str]) -> None:
    """scancel, then wait until the job has let go of its nodes. The controller's word, not sacct's: a job cancelled
    while its requeue completes stays REQUEUED in accounting for good."""
    assert sh(["scancel", job], env).returncode == 0
    wait_for(lambda: job_fields(job, env).get("JobState") == "CANCELLED", 120, "the cancel")


def excluded(job: str, env: dict[str, str]) -> str:
    return job_fields(job, env).get("ExcNodeList", "")


def finished(run: Path, job: str, env: dict[str, str]) -> dict[str, Any]:
    wait_for(lambda: (run / "result.json").exists(), timeout=300, what="the job to end")
    wait_for(lambda: job_state(job, env) in ("COMPLETED", "FAILED"), timeout=60, what="the job's end in sacct")
    return dict(json.loads((run / "result.json").read_text()))


@pytest.mark.parametrize("launcher", ["sbatch", "submitit"])
def test_a_killed_rank_is_blamed_excluded_and_the_job_ends_as_if_uninterrupted(
        slurm_env: dict[str, str], tmp_path: Path, reference: str, launcher: str) -> None:
    """Rank 1 SIGKILLed from outside while the ranks are held after step 5 (step 3 saved): srun's words for it (which
    differ by Slurm version) are read, its node blamed and excluded, and the requeued job ends as if uninterrupted."""
    run, suspects = tmp_path / "run", tmp_path / "suspects.json"
    env = {**slurm_env, **faults(at={"0": {"wait_at_step": 4}}), "TRAINER_SUSPECTS": str(suspects)}
    job = submit(env, launcher, [*SLOW, f"run.dir={run}"])
    held(run, ranks=2)
    node = kill_rank(job, 1, 0)
    go(run)
    result = finished(run, job, env)
    assert result["outcome"] == "finished" and result["resumed_from"], result
    assert result["param_checksums"] == [reference, reference]
    first, last = events(run, "attempt_end")
    assert (first["class"], first["blamed"], first["decision"]) == ("infrastructure", [node], "requeue"), first
    assert "Killed" in first["cause"] and last["class"] == "finished"
    assert node in excluded(job, env) and node in json.loads(suspects.read_text())
    report = sh([sys.executable, "-m", "trainer.report", str(run)], env).stdout
    assert "infrastructure" in report and node in report, report


def test_a_bug_in_user_code_fails_once_naming_file_and_line(slurm_env: dict[str, str], tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = [*SMALL, f"run.dir={run}", "model.target=faulty_model:Faulty", "model.kwargs.fail_at=5",
            f"run.python_path=[{ROOT / 'tests' / 'scripts'}]"]
    proc = cluster_cmd(["--launcher", "sbatch", "--wait", "--", *args], slurm_env)
    assert proc.returncode != 0
    result = json.loads((run / "result.json").read_text())
    assert result["class"] == "user_error" and "ValueError: tensor shape mismatch" in result["cause"], result
    assert result["where"].startswith(str(ROOT / "tests" / "scripts" / "faulty_model.py:")), result
    assert "rank 1" in result["cause"] and "not retried" in result["reason"]
    job = job_id_of(proc.stdout)
    attempts = job_runs(job, slurm_env)
    assert attempts == ["FAILED"], attempts


def test_max_failures_ends_the_job_instead_of_retrying_forever(slurm_env: dict[str, str], tmp_path: Path) -> None:
    """Rank 1 killed after step 5 of the first attempt, rank 0 after step 4 of the second, at global step 7 (on
    another node: the first one's is excluded; at another step, or the verdict would call it the code's): with
    max_failures=1 the second failure ends the job."""
    run = tmp_path / "run"
    kills = {"0": {"kill_at_step": 4, "kill_rank": 1}, "1": {"kill_at_step": 3, "kill_rank": 0}}
    env = {**slurm_env, **faults(at=kills), "TRAINER_SUSPECTS": str(tmp_path / "suspects.json")}
    job = submit(env, "sbatch", [*SLOW, f"run.dir={run}"], ["max_failures=1"])
    result = finished(run, job, env)
    first, second = (e["blamed"][0] for e in events(run, "attempt_end"))
    assert first != second and job_state(job, env) == "FAILED"
    assert result["outcome"] == "failed" and "max_failures=1" in result["reason"], result
    assert [e["decision"] for e in events(run, "attempt_end")] == ["requeue", "fail"]


def test_a_hang_is_blamed_on_the_stuck_ranks_node(slurm_env: dict[str, str], tmp_path: Path, reference: str) -> None:
    run = tmp_path / "run"
    env = {**slurm_env, **faults(at={"0": {"hang_at_step": 6, "hang_rank": 1}}),
           "TRAINER_SUSPECTS": str(tmp_path / "suspects.json")}
    job = submit(env, "sbatch", [*SLOW, f"run.dir={run}", "dist.heartbeat_timeout_s=15"])
    result = finished(run, job, env)
    assert result["outcome"] == "finished" and result["param_checksums"] == [reference, reference], result
    first = events(run, "attempt_end")[0]
    stuck = json.loads((run / "exits" / f"{job}.0" / "train-1.json").read_text())["node"]
    assert first["class"] == "infrastructure" and first["blamed"] == [stuck] and "hang" in first["cause"], first
    assert stuck in excluded(job, env)


def test_a_node_failing_the_doctor_is_excluded_and_the_job_runs_on_the_others(
        slurm_env: dict[str, str], tmp_path: Path) -> None:
    """The doctor fails on rank 1's node in the first attempt (wherever Slurm put it)."""
    run = tmp_path / "run"
    env = {**slurm_env, **faults(at={"0": {"doctor_fail_rank": 1}}), "DOCTOR": "1",
           "TRAINER_SUSPECTS": str(tmp_path / "suspects.json")}
    job = submit(env, "sbatch", [*SMALL, f"run.dir={run}"])
    result = finished(run, job, env)
    assert result["outcome"] == "finished", result
    first = events(run, "attempt_end")[0]
    node = json.loads((run / "exits" / f"{job}.0" / "doctor-1.json").read_text())["node"]
    assert (first["phase"], first["class"], first["blamed"], first["hard"]) == ("doctor", "infrastructure", [node],
                                                                                 True), first
    assert node in excluded(job, env)
    listed = sh([sys.executable, "-m", "cluster", "suspects"], env).stdout  # hard evidence: avoided at once
    assert f"{node}: AVOIDED (hard evidence from job" in listed, listed


def test_new_jobs_avoid_nodes_on_evidence_until_cleared_or_expired(slurm_env: dict[str, str], tmp_path: Path) -> None:
    """The partition's first node blamed by two jobs: avoided; its second blamed once: used; the third's evidence
    expired: used. The names are the cluster's own (sinfo)."""
    suspects = tmp_path / "suspects.json"
    env = {**slurm_env, "TRAINER_SUSPECTS": str(suspects)}
    n1, n2, n3 = sh(["sinfo", "-h", "-N", "-o", "%N"], env).stdout.split()[:3]
    now = time.time()

    def blame(job: str, until: float) -> dict[str, Any]:
        return {"t": now - 60, "until": until, "job": job, "cause": "test", "hard": False}

    suspects.write_text(json.dumps({n1: [blame("1", now + 3600), blame("2", now + 3600)],
                                    n2: [blame("3", now + 3600)], n3: [blame("1", now - 1), blame("2", now - 1)]}))
    # Each job is cancelled once Slurm holds its exclusion: running it proves nothing here (other tests run such jobs).
    for launcher in ("sbatch", "submitit"):
        job = submit(env, launcher, [*SMALL, f"run.dir={tmp_path / launcher}"])
        assert excluded(job, env) == n1, launcher
        cancelled(job, env)
    listed = sh([sys.executable, "-m", "cluster", "suspects"], env).stdout
    assert f"{n1}: AVOIDED (blamed by 2 jobs (1, 2)" in listed and f"{n2}: watched" in listed, listed
    assert f"{n3}: expired" in listed, listed
    assert f"cleared: {n1}" in sh([sys.executable, "-m", "cluster", "suspects", "--clear", n1], env).stdout
    job = submit(env, "sbatch", [*SMALL, f"run.dir={tmp_path / 'after'}"])
    assert excluded(job, env) == "(null)"
    cancelled(job, env)


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


def test_single_kills_in_two_jobs_leave_the_partition_usable(slurm_env: dict[str, str], tmp_path: Path) -> None:
    """Two jobs each lose a rank once, on two different nodes: one blame each is no evidence, so a new 2-node job
    is accepted on the 3-node partition and runs, and `suspects` says why the nodes are only watched. (Each job is
    cancelled once its verdict has blamed and requeued it: how a requeued job ends is other tests' concern.)"""
    env = {**slurm_env, **faults(at={"0": {"wait_at_step": 4}}), "TRAINER_SUSPECTS": str(tmp_path / "suspects.json")}
    blamed: list[str] = []
    for name in ("a", "b"):
        run = tmp_path / name
        job = submit(env, "sbatch", [*SLOW, f"run.dir={run}"])
        held(run, ranks=2)
        blamed.append(kill_rank(job, None, 0, not_on=blamed[0] if blamed else ""))
        go(run)
        wait_for(lambda: events(run, "attempt_end"), 240, "the verdict")  # noqa: B023 - called in this iteration
        [end] = events(run, "attempt_end")
        assert (end["blamed"], end["decision"]) == ([blamed[-1]], "requeue"), end
        cancelled(job, env)
    assert blamed[0] != blamed[1]
    fresh = {k: v for k, v in env.items() if k != "TRAINER_FAULTS"}
    job = submit(fresh, "sbatch", [*SMALL, f"run.dir={tmp_path / 'new'}"])
    assert excluded(job, fresh) == "(null)"
    assert finished(tmp_path / "new", job, fresh)["outcome"] == "finished"
    listed = sh([sys.executable, "-m", "cluster", "suspects"], fresh).stdout
    assert all(f"{n}: watched (blamed by 1 job(s)" in listed for n in blamed), listed


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


def test_memory_snapshots_the_nodes_cannot_hold_are_refused_before_submitting(slurm_env: dict[str, str]) -> None:
    """A 900M-parameter model with AdamW: two snapshots need about 20 GiB of /dev/shm per node, more than half of
    the dev nodes' memory; `on` is refused (exit 2, the figures), `auto` goes without, with a note."""
    big = ["model.target=torch.nn.Linear", "model.kwargs.in_features=30000", "model.kwargs.out_features=30000",
           "optim.name=adamw"]
    proc = cluster_cmd(["--launcher", "sbatch", "--dry-run", "--", *big, "checkpoint.memory=on"], slurm_env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "error: checkpoint.memory: memory snapshots need about 20.1 GiB of /dev/shm on each node" in proc.stderr
    assert "HINT: " in proc.stderr and "Traceback" not in proc.stderr
    proc = cluster_cmd(["--launcher", "sbatch", "--dry-run", "--set", "spare_nodes=1", "--", *big], slurm_env)
    assert proc.returncode == 0 and "the job goes without them (checkpoint.memory=auto)" in proc.stdout, proc.stderr
    proc = cluster_cmd(["--launcher", "sbatch", "--nodes", "2-3", "--set", "spare_nodes=1", "--", *SMALL], slurm_env)
    assert proc.returncode == 2 and "error: profile.spare_nodes: NODES=2-3 with spare_nodes=1 needs 4 nodes" in \
        proc.stderr, proc.stderr


@pytest.mark.slurm_compat
def test_a_step_slurm_refuses_to_create_is_an_infrastructure_failure_and_requeued(slurm_env: dict[str, str],
                                                                                   tmp_path: Path) -> None:
    """srun asked for a node outside the allocation: Slurm refuses the step before any task starts, in words that
    differ by version. The verdict calls that the cluster's (never `user_error`), blames no node, and requeues."""
    run, log = tmp_path / "run", tmp_path / "job.log"
    script = tmp_path / "refused.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH --nodes=1 --requeue --output={log}
cd {ROOT}
export RUN_DIR={run}
mkdir -p "$RUN_DIR"
echo "attempt ${{SLURM_RESTART_COUNT:-0}} of job $SLURM_JOB_ID starts on $SLURM_JOB_NODELIST" >&2
if (( ${{SLURM_RESTART_COUNT:-0}} == 0 )); then
  other=$(sinfo -h -N -o %N | grep -vxF "$(scontrol show hostnames "$SLURM_JOB_NODELIST")" | head -n 1)
  srun --nodes=1 --nodelist="$other" true; rc=$?
else
  srun --nodes=1 true; rc=$?
fi
exec {sys.executable} -m cluster.job.verdict --rc "$rc" --max-failures 1 --suspects {tmp_path / "suspects.json"}
""")
    proc = sh(["sbatch", "--parsable", str(script)], slurm_env)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    wait_for(lambda: job_state(job, slurm_env) in ("COMPLETED", "FAILED"), timeout=180, what="the job's end")
    ends = events(run, "attempt_end")
    assert [(e["attempt"], e["class"], e["decision"]) for e in ends][:1] == [("0", "infrastructure", "requeue")], (
        ends, log.read_text())
    assert ends[0]["blamed"] == [] and "could not create the job step" in ends[0]["cause"], ends[0]
    assert job_state(job, slurm_env) == "COMPLETED", log.read_text()
