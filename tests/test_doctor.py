"""The preflight doctor in real processes: a passing job, and failures that must be clear (and exit non-zero)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config import load
from trainer.doctor import FAIL, PASS, SKIP, WARN, Check, check_gpus, merge, render
from trainer.env import DistEnv, HostFacts, JobInfo

from .conftest import clean_env, spawn_ranks
from .test_slurm import sh, slurm_env  # noqa: F401  (the fixture)


def doctor(args: list[str], cwd: Path, nproc: int = 2) -> subprocess.CompletedProcess[str]:
    """``make doctor``'s way: N local ranks started by the doctor itself."""
    return subprocess.run([sys.executable, "-m", "trainer.doctor", "--local", str(nproc), *args], cwd=cwd, env=clean_env(),
                          capture_output=True, text=True, timeout=180)


def row(out: str, name: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(f"{name} "))


def test_two_local_ranks_pass_and_the_table_is_printed_once(tmp_path: Path) -> None:
    proc = doctor([f"run.dir={tmp_path / 'runs'}", "tracking.mode=offline"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("doctor: all checks passed") == 1
    assert "PASS" in row(proc.stdout, "all-reduce") and "GB/s" in row(proc.stdout, "all-reduce")
    assert "writable by all 2 rank(s)" in row(proc.stdout, "run folder")
    assert not list((tmp_path / "runs").iterdir())  # probe files cleaned up


def test_unwritable_run_folder_fails_clearly_on_every_rank(tmp_path: Path) -> None:
    blocker = tmp_path / "a file"
    blocker.write_text("")  # a folder cannot be made under a file: fails even for root
    proc = doctor([f"run.dir={blocker}/runs"], tmp_path)
    assert proc.returncode != 0
    line = row(proc.stdout, "run folder")
    assert "FAIL" in line and "rank 0" in line and "rank 1" in line and "Not a directory" in line
    assert "HINT: set run.dir" in proc.stdout and "doctor: 1 check(s) failed: run folder" in proc.stdout
    assert proc.returncode == 1 and "Traceback" not in proc.stdout + proc.stderr


def test_unresolvable_master_fails_fast_without_a_traceback(tmp_path: Path) -> None:
    procs = spawn_ranks(["--timeout=20"], tmp_path, env={"MASTER_ADDR": "no-such-host.invalid"}, module="trainer.doctor")
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [1, 1], outs
    assert "FAIL    'no-such-host.invalid' does not resolve" in row(outs[0], "master")
    assert "HINT: every node must resolve" in outs[0] and "Traceback" not in outs[0] + outs[1]
    assert "doctor: rank 1" in outs[1]  # without a process group each rank reports its own failures


def test_bad_override_is_exit_2(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "trainer.doctor", "dist.backend=mpi"], cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error: dist.backend:")


ENV = DistEnv(rank=0, local_rank=0, world_size=4, local_world_size=4, node_rank=0, num_nodes=1, master_addr="n1",
              master_port=15000, job_id="7", source="slurm")


@pytest.mark.parametrize(("gpus", "tasks", "slurm_gpus", "device", "status", "words"), [
    (0, 4, 0, "auto", SKIP, "training runs on the CPU"),
    (0, 4, 4, "auto", FAIL, "torch sees no GPU"),
    (0, 1, 0, "cuda", FAIL, "torch sees no GPU"),
    (2, 4, 4, "auto", FAIL, "4 processes on this node but 2 GPUs visible"),
    (1, 4, 4, "auto", PASS, "cuda:0"),  # Slurm's per-task binding: each task sees its own GPU
    (8, 4, 8, "auto", WARN, "4 idle"),
    (4, 4, 4, "auto", PASS, "4 visible"),
])
def test_gpu_check(monkeypatch: pytest.MonkeyPatch, gpus: int, tasks: int, slurm_gpus: int, device: str, status: str,
                   words: str) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    env = DistEnv(**{**ENV.__dict__, "local_world_size": tasks})
    info = JobInfo(job_name=None, array_job_id=None, array_task_id=None, restart_count=0, gpus_on_node=slurm_gpus,
                   wandb_key=False)
    check = check_gpus(load([f"train.device={device}"]), env, HostFacts("0,1,2,3", None, "n1"), info)
    assert (check.status, words in check.detail) == (status, True), check
    assert check.status not in (FAIL, WARN) or check.hint


def test_merge_names_failing_ranks_and_keeps_hints() -> None:
    ok = Check("run folder", PASS, "writable")
    bad = Check("run folder", FAIL, "cannot write", "fix it")
    rows = merge([[ok], [bad], [ok], [bad]], ["n1", "n1", "n2", "n2"])
    assert rows[0].status == FAIL and rows[0].detail == "rank 1 (n1): cannot write; rank 3 (n2): cannot write"
    text = render(rows, "doctor")
    assert "HINT: fix it" in text and text.endswith("doctor: 1 check(s) failed: run folder")


def test_dev_cluster_two_nodes_and_an_unwritable_folder(slurm_env: dict[str, str], tmp_path: Path) -> None:  # noqa: F811
    srun = ["srun", "-N2", "--ntasks-per-node=1", "--time=5", sys.executable, "-m", "trainer.doctor"]
    good = sh([*srun, f"run.dir={tmp_path}/runs"], slurm_env, timeout=180)
    assert good.returncode == 0, good.stdout + good.stderr
    assert "2 rank(s) on 2 node(s) (Slurm job" in good.stdout and "PASS    reaches slurmctld" in good.stdout
    blocker = tmp_path / "file"
    blocker.write_text("")
    bad = sh([*srun, f"run.dir={blocker}/runs"], slurm_env, timeout=180)
    assert bad.returncode != 0 and "rank 0 (n1)" in row(bad.stdout, "run folder") and "(n2)" in row(bad.stdout, "run folder")
