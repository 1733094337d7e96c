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
from pathlib import Path
from typing import Any

import pytest

from benchmarks.procfs import PARENT, processes, stat
from cluster.job.nodes import parse_fields

from .conftest import ROOT, SMALL, faults, go, held
from .test_slurm import cluster_cmd, job_id_of, job_runs, job_state, reference, sh, slurm_env, wait_for

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
