"""Against a real Slurm (the dev cluster): submitit and sbatch launches, preemption, requeue.

CI starts the cluster (.ci/run); locally `make dev-cluster` does. Under CI=true these tests must run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import CLUSTER_OF, CLUSTERS, ROOT, SMALL, exported, faults, held, ok, run_trainer

SCRIPT = ROOT / "slurm" / "dev-cluster.sh"


@pytest.fixture(scope="module")
def slurm_env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment that talks to this file's dev cluster (conftest.CLUSTER_OF), or a skip (a failure under CI)
    when it is down. SLURM (a version) stays: with it, that version's cluster (SLURM=24.11 pytest -m slurm_compat)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    if CLUSTERS:
        base["DEV_CLUSTER_DIR"] = CLUSTERS[CLUSTER_OF.get(request.node.nodeid.split("::")[0], 0)]
    status = subprocess.run(["bash", str(SCRIPT), "status"], capture_output=True, text=True, env=base)
    if status.returncode:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the dev cluster is not up under CI: {status.stdout}{status.stderr}")
        pytest.skip("dev cluster is down: `make dev-cluster` starts it")
    env = exported(SCRIPT, base)
    env["PYTHONUNBUFFERED"] = "1"
    env["TRAINER_CHECKSUM"] = "1"  # sbatch passes it on: every rank's parameter hash in result.json
    # Blame evidence stays with this file's jobs, never in the checkout's runs/suspects.json (tests pass their own).
    env["TRAINER_SUSPECTS"] = str(tmp_path_factory.mktemp("suspects") / "suspects.json")
    return env


def sh(cmd: list[str], env: dict[str, str], timeout: float = 300, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def job_id_of(out: str) -> str:
    m = re.search(r"submitted job (\d+)", out)
    assert m, out
    return m.group(1)


def wait_for(pred, timeout: float = 180, what: str = "") -> None:  # type: ignore[no-untyped-def]
    """Poll ``pred`` until it holds. A costly one (a Slurm command, the cluster CLI: a new interpreter) waits four
    times as long as it took between polls, so polling takes a fifth of a core at most, not half."""
    deadline = time.monotonic() + timeout
    while True:
        start = time.monotonic()
        if pred():
            return
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(max(0.5, 4 * (time.monotonic() - start)))


def idle(env: dict[str, str], nodes: int, timeout: float = 180) -> None:
    """Wait until the partition has ``nodes`` idle nodes (a finished job's may still be completing)."""
    def count() -> int:
        return sum(int(n) for n in sh(["sinfo", "-h", "-t", "idle", "-o", "%D"], env).stdout.split())

    wait_for(lambda: count() >= nodes, timeout, f"{nodes} idle nodes")


def job_runs(job: str, env: dict[str, str]) -> list[str]:
    """The state of each of the job's runs, the first first (a requeue starts a run: sacct --duplicates)."""
    return sh(["sacct", "-j", job, "-X", "-n", "-P", "--duplicates", "--format=State"], env).stdout.split()


def job_state(job: str, env: dict[str, str]) -> str:
    lines = sh(["sacct", "-j", job, "-X", "-n", "-P", "--format=State"], env).stdout.strip().splitlines()
    return lines[-1].split()[0] if lines else ""  # "CANCELLED by 0" → "CANCELLED"


def cluster_cmd(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return sh([sys.executable, "-m", "cluster", "submit", "--cluster", "dev", *args], env, timeout)


def test_make_submit_submitit_two_nodes(slurm_env: dict[str, str]) -> None:
    env = {**slurm_env, "DOCTOR": "1"}  # sbatch passes it on: the batch script runs the preflight doctor first
    proc = sh(["make", "submit", "NODES=2", "CLUSTER=dev", "WAIT=1", f"ARGS={' '.join(SMALL)}"], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = re.findall(r"rank (\d): world size (\d), parameter checksum (\w+)", proc.stdout)
    assert [r[0] for r in ranks] == ["0", "1"] and {r[1] for r in ranks} == {"2"}
    assert ranks[0][2] == ranks[1][2]
    logs = re.search(r"logs:\s+(\S+)", proc.stdout)
    assert logs
    rank0 = Path(logs.group(1))
    rank1 = Path(str(rank0).replace("_0_log.out", "_1_log.out"))
    assert "done: test accuracy" in rank0.read_text()
    assert "doctor: 2 rank(s) on 2 node(s)" in rank0.read_text() and "doctor: all checks passed" in rank0.read_text()
    assert "epoch" not in rank1.read_text() and "done:" not in rank1.read_text()  # only rank 0 speaks


@pytest.mark.parametrize("launch", ["srun", "torchrun"])
def test_sbatch_launcher_two_nodes(slurm_env: dict[str, str], tmp_path: Path, launch: str) -> None:
    run = tmp_path / "run"
    env = {**slurm_env, "WANDB_API_KEY": "secret-key-7f3a"}  # must never reach a script or a log
    args = [a for a in SMALL if not a.startswith("tracking.")] + ["tracking.mode=auto"]
    proc = cluster_cmd(["--launcher", "sbatch", "--wait", "--set", f"launch={launch}", "--set", "doctor=true", "--", *args,
                        f"run.dir={run}"], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((run / "result.json").read_text())
    assert result["world_size"] == 2 and len(set(result["param_checksums"])) == 1
    log = ROOT / re.search(r"log:\s+(\S+)", proc.stdout).group(1)  # type: ignore[union-attr]
    text = log.read_text()
    assert f"via {'torchrun' if launch == 'torchrun' else 'slurm'}" in text
    assert "doctor: all checks passed" in text and text.index("doctor:") < text.index("done: test accuracy")
    for f in [log, *run.rglob("*")]:
        if f.is_file():
            assert b"secret-key-7f3a" not in f.read_bytes(), f


DEV_THREADS = {"OMP_NUM_THREADS": "1"}
"""What the dev profile gives every task (cluster/profiles/dev.yaml): a local run with it does a dev job's arithmetic."""


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The parameter checksum of 2 epochs on 2 ranks, uninterrupted, which every file's faulted 2-node jobs compare
    with (when and how often they save changes no parameter). Trained here, once per test process, in warm ranks with
    a dev task's threads: a job on the cluster would cost every cluster test's worker a job of rank start-ups."""
    cached = tmp_path_factory.getbasetemp() / "reference.txt"
    if not cached.exists():
        ref = tmp_path_factory.mktemp("ref")
        ok(run_trainer([*SMALL, "train.epochs=2", f"run.dir={ref / 'run'}"], ref, nproc=2, env=DEV_THREADS))
        cached.write_text(str(json.loads((ref / "run" / "result.json").read_text())["param_checksums"][0]))
    return cached.read_text()


OFFLINE = [a for a in SMALL if not a.startswith("tracking.")] + ["tracking.mode=offline", "train.epochs=2"]


@pytest.mark.slurm_compat
@pytest.mark.parametrize("launcher", ["sbatch", "submitit"])
def test_a_preempted_job_saves_requeues_and_every_tool_sees_one_run_of_two_attempts(
        slurm_env: dict[str, str], tmp_path: Path, launcher: str, reference: str) -> None:
    """Slurm's warning signal (scancel --signal) reaches ranks held after step 6: they save at the next poll (10)
    and exit 75; the job is requeued (expedited where this Slurm offers it and the script asks) and ends as if
    uninterrupted. The run tools (squeue and sacct read), the report and W&B (offline) see one run of two attempts."""
    from tests.test_tracking import run_files
    from tests.wandb_records import summary

    run = tmp_path / "run"
    proc = cluster_cmd(["--launcher", launcher, "--", *OFFLINE, f"run.dir={run}"],
                       {**slurm_env, **faults(at={"0": {"wait_at_step": 5}})})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = job_id_of(proc.stdout)
    held(run, ranks=2)
    assert sh(["scancel", "--signal=USR2", job], slurm_env).returncode == 0
    wait_for(lambda: (run / "result.json").exists(), timeout=300, what="the requeued run to finish")
    wait_for(lambda: job_state(job, slurm_env) == "COMPLETED", timeout=120, what="COMPLETED")
    result = json.loads((run / "result.json").read_text())
    assert Path(result["resumed_from"]).name == "step_00000010.pt", result
    assert result["param_checksums"] == [reference, reference]
    restarts = job_runs(job, slurm_env)
    assert len(restarts) == 2, restarts  # one requeue: the first attempt, then the finished one
    script = sh(["scontrol", "write", "batch_script", job, "-"], slurm_env).stdout
    asked = "--requeue=expedite" in script or "'requeue': 'expedite'" in script or "--requeue=expedite" in proc.stdout
    assert asked == _offers_expedited_requeue(slurm_env), script[:2000]
    row = next(r for r in json.loads(sh([sys.executable, "-m", "cluster", "runs", "--json"], slurm_env).stdout)
               if r["job"] == job)
    assert (row["state"], row["attempts"], row["progress"]) == ("finished", 2, "32/32"), row
    status = sh([sys.executable, "-m", "cluster", "status", job], slurm_env).stdout
    assert "attempts (2):" in status and "preempted" in status, status
    report = sh([sys.executable, "-m", "trainer.report", str(run)], slurm_env).stdout
    assert "attempt 1: preempted: saved after the warning signal" in report, report
    tracked = [summary(f) for f in run_files(run)]  # one offline folder per attempt, one run id
    assert len(tracked) == 2 and len({t["run_id"] for t in tracked}) == 1, tracked
    steps = [s for t in tracked for s in sorted(t["history"])]
    assert steps == sorted(steps) and steps[-1] == 32, steps


def _offers_expedited_requeue(env: dict[str, str]) -> bool:
    """Asked of this Slurm as the submit step asks it (cluster/job/nodes.py), in a process with its environment."""
    code = "from cluster.job.nodes import offers_expedited_requeue as o; print(o())"
    return sh([sys.executable, "-c", code], env).stdout.strip() == "True"


def test_scontrol_requeue_without_warning_resumes_from_a_periodic_checkpoint(
        slurm_env: dict[str, str], tmp_path: Path) -> None:
    """`scontrol requeue`: no warning signal, SIGTERM then SIGKILL; the run goes on from what it had saved."""
    run = tmp_path / "run"
    proc = cluster_cmd(["--launcher", "sbatch", "--", *SMALL, "train.epochs=2", f"run.dir={run}",
                        "checkpoint.every_steps=3"], {**slurm_env, **faults(at={"0": {"wait_at_step": 3}})})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = job_id_of(proc.stdout)
    held(run, ranks=2)  # after step 4, step 3 saved
    assert sh(["scontrol", "requeue", job], slurm_env).returncode == 0
    wait_for(lambda: (run / "result.json").exists(), timeout=240, what="the requeued run to finish")
    result = json.loads((run / "result.json").read_text())
    assert result["resumed_from"] and result["global_step"] == 32  # 2 epochs of 16 steps
