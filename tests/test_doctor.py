"""The preflight doctor in real processes: a passing job, and failures that must be clear (and exit non-zero)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.core.config import load
from trainer.core.env import DistEnv, HostFacts, JobInfo
from trainer.doctor.checks import (
    BYTECODE_PROBE,
    FAIL,
    PASS,
    SKIP,
    WARN,
    Check,
    check_bytecode,
    check_gpus,
    check_versions,
    container_spec,
    shared_gpus,
)
from trainer.doctor.run import describe, main, merge, render, worst_exit

from . import warm
from .conftest import clean_env, free_port, outputs, spawn_ranks
from .test_slurm import sh, slurm_env  # noqa: F401  (the fixture)


def doctor(args: list[str], cwd: Path, nproc: int = 2) -> subprocess.CompletedProcess[str]:
    """``make doctor``'s way: N local ranks started by the doctor itself."""
    return warm.run([sys.executable, "-m", "trainer.doctor", "--local", str(nproc), *args], cwd=cwd, env=clean_env(),
                    capture_output=True, text=True, timeout=180)


def row(out: str, name: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(f"{name} "))


def test_two_local_ranks_pass_and_the_table_is_printed_once(tmp_path: Path) -> None:
    proc = doctor([f"run.dir={tmp_path / 'runs'}", "tracking.mode=offline"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("doctor: all checks passed") == 1
    assert "PASS" in row(proc.stdout, "all-reduce") and "GB/s" in row(proc.stdout, "all-reduce")
    assert "writable by all 2 rank(s)" in row(proc.stdout, "run folder")
    assert "resolves and binds on the head node" in row(proc.stdout, "master")  # no torchrun agent holds the port
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
    outs = outputs(procs, timeout=60)
    assert [p.returncode for p in procs] == [1, 1], outs
    assert "FAIL    'no-such-host.invalid' does not resolve" in row(outs[0], "master")
    assert "HINT: every node must resolve" in outs[0] and "Traceback" not in outs[0] + outs[1]
    assert "doctor: rank 1" in outs[1]  # without a process group each rank reports its own failures
    assert "): HINT: every node must resolve" in outs[1]  # ... with the hint, as rank 0's table has it


def test_a_taken_port_fails_on_the_head_node_unless_torchruns_agent_holds_it() -> None:
    import socket

    from trainer.doctor.checks import check_master

    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        env = DistEnv(0, 0, 2, 2, 0, 1, "127.0.0.1", held.getsockname()[1], None, "torchrun")
        taken = check_master(env)
        assert taken.status == FAIL and "cannot be bound" in taken.detail and "MASTER_PORT" in taken.hint
        assert check_master(DistEnv(**{**env.__dict__, "agent": True})).status == PASS
        assert check_master(DistEnv(**{**env.__dict__, "rank": 1})).status == PASS  # only the head node binds


@pytest.mark.parametrize("local", [[], ["--local", "2"]])
def test_bad_override_is_exit_2(tmp_path: Path, local: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "trainer.doctor", *local, "dist.backend=mpi"], cwd=tmp_path,
                          env=clean_env(), capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error: dist.backend:")
    assert proc.stderr.count("error:") == 1, proc.stderr  # --local: said once, not by each rank


# A rank that joins the group, takes part in the doctor's first collective (so the group has formed on every
# rank), then dies as a crashed or OOM-killed rank would, or stalls as a hung one would.
PEER = """
import os, sys, time
import torch
import torch.distributed as dist
from trainer.core import dist as tdist
from trainer.core.config import load
from trainer.core.env import discover
tdist.setup(discover(), load(["train.device=cpu"]), torch.device("cpu"))
dist.broadcast_object_list([None], src=0)
os._exit(9) if sys.argv[1] == "exits" else time.sleep(600)
"""


@pytest.mark.parametrize("peer", ["exits", "stalls"])
def test_a_rank_lost_after_setup_fails_every_survivor_without_a_traceback(tmp_path: Path, peer: str) -> None:
    # --timeout bounds both the group's forming (how far apart the ranks may arrive: the doctors run their own checks
    # first, the peer none) and the stalled collective. 15 s failed once in CI, where a loaded machine held a doctor
    # back that long before it joined: the default's 60 s is what users get, and the stall costs the test that long.
    timeout = 60
    port = str(free_port())
    procs = []
    for rank in range(3):  # doctor ranks 0 and 1 survive the peer, rank 2
        cmd = ["-c", PEER, peer] if rank == 2 else ["-m", "trainer.doctor", f"--timeout={timeout}", f"run.dir={tmp_path}"]
        env = clean_env({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3",
                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
        procs.append(warm.Popen([sys.executable, *cmd], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True))
    try:
        outs = outputs(procs[:2], timeout=timeout + 180)  # a hang fails here
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.communicate()
    assert [p.returncode for p in procs[:2]] == [1, 1], outs
    line = row(outs[0], "run folder")
    assert "FAIL    rank 0 on " in line and "Error: " in line, outs[0]  # gloo's own words vary: closed, reset, timed out
    assert "HINT: another rank died or stalled" in outs[0] and "doctor: 1 check(s) failed: run folder" in outs[0]
    assert "doctor: rank 1 (" in outs[1] and ": run folder: FAIL rank 1 on" in outs[1], outs[1]
    assert "): HINT: another rank died or stalled" in outs[1]
    assert "Traceback" not in outs[0] + outs[1]


def test_a_configuration_that_fails_the_process_group_is_the_users_error_not_the_nodes(tmp_path: Path) -> None:
    """dist.backend=nccl on CPU nodes: every rank's process group refuses it. Each rank recorded an infrastructure
    echo, so the job was requeued (and retried until max_failures) for a setting."""
    ranks = spawn_ranks(["dist.backend=nccl", f"run.dir={tmp_path}"], tmp_path, 2, {"RUN_DIR": str(tmp_path)},
                        module="trainer.doctor")
    outs = outputs(ranks, timeout=180)
    assert [r.returncode for r in ranks] == [1, 1], outs
    assert "configuration  FAIL    rank 0 on " in outs[0] and "dist.backend: nccl needs CUDA devices" in outs[0], outs[0]
    records = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("exits/*/doctor-*.json"))]
    assert [(r["class"], r["echo"]) for r in records] == [("user_error", False)] * 2, records


@pytest.mark.parametrize(("args", "field"), [
    (["--local", "0"], "--local"),
    (["--local", "-2"], "--local"),
    (["--timeout", "0"], "--timeout"),
    (["--timeout", "-5"], "--timeout"),
    (["--timeout", "nan"], "--timeout"),
    (["--container", "podman:img"], "--container"),
    (["--container", "trainer.sif"], "--container"),
    (["--container", "docker:"], "--container"),
    (["--container", ""], "--container"),
    (["--local", "2", "--container", "apptainer:"], "--container"),  # checked before any rank starts
])
def test_bad_flags_are_exit_2_with_a_hint(capsys: pytest.CaptureFixture[str], args: list[str], field: str) -> None:
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"error: {field}: ") and "\nHINT: " in err and not out, err


@pytest.mark.parametrize(("spec", "parts"), [
    ("docker:ghcr.io/me/trainer:1.2", ("docker", "ghcr.io/me/trainer:1.2")),  # split at the first colon only
    ("apptainer:/shared/trainer.sif", ("apptainer", "/shared/trainer.sif")),
    ("pyxis:nvcr.io#nvidia/pytorch:24.05-py3", ("pyxis", "nvcr.io#nvidia/pytorch:24.05-py3")),
])
def test_container_spec(spec: str, parts: tuple[str, str]) -> None:
    assert container_spec(spec) == parts


@pytest.mark.parametrize(("codes", "exit_code"), [
    ([0, 0], 0),
    ([0, -9], 1),  # killed by a signal: max() alone said 0
    ([-15, -9], 1),
    ([1, 0], 1),
    ([1, -9, 2], 2),  # the worst positive code (2: bad input) wins
])
def test_worst_exit(codes: list[int], exit_code: int) -> None:
    assert worst_exit(codes) == exit_code


@pytest.mark.parametrize(("seen", "shared"), [
    ([("n1", "GPU-a"), ("n1", "GPU-a")], {0: [1], 1: [0]}),  # one visible GPU per task, but the same one
    ([("n1", "GPU-a"), ("n1", "GPU-b")], {}),
    ([("n1", None), ("n1", None)], {}),  # CPU ranks share no GPU
    ([("n1", "GPU-a"), ("n2", "GPU-a")], {}),  # only ranks on one node can collide
    ([("n1", "GPU-a"), ("n1", "GPU-b"), ("n1", "GPU-a"), ("n1", "GPU-a"), ("n2", "GPU-c")], {0: [2, 3], 2: [0, 3], 3: [0, 2]}),
    ([("n1", "GPU-a")], {}),
])
def test_shared_gpus(seen: list[tuple[str, str | None]], shared: dict[int, list[int]]) -> None:
    assert shared_gpus(seen) == shared


@pytest.mark.parametrize(("cached", "dont_write", "status", "words"), [
    (True, True, PASS, "start from cached bytecode"),
    (True, False, PASS, "start from cached bytecode"),
    (False, False, PASS, "the first start keeps it"),
    (False, True, WARN, "no cached bytecode for torch and PYTHONDONTWRITEBYTECODE is set: every start compiles"),
])
def test_bytecode_row(tmp_path: Path, cached: bool, dont_write: bool, status: str, words: str) -> None:
    """A torch folder on disk, its probe module compiled or not: the row says whether every start compiles it again."""
    import py_compile

    source = tmp_path.joinpath("torch", *BYTECODE_PROBE)
    source.parent.mkdir(parents=True)
    source.write_text("X = 1\n")
    if cached:
        py_compile.compile(str(source), doraise=True)
    row = check_bytecode(tmp_path / "torch", dont_write)
    assert (row.status, row.name) == (status, "bytecode") and words in row.detail, row
    assert (f"python -m compileall -q -j 0 {tmp_path / 'torch'}" in row.hint) == (status == WARN)
    assert check_bytecode(tmp_path / "elsewhere", dont_write).status == SKIP  # a torch laid out otherwise: no guess


@pytest.mark.parametrize(("exc", "text"), [
    (ValueError("first\nsecond"), "ValueError: first"),
    (RuntimeError(), "RuntimeError: "),
    (RuntimeError("NCCL error in: NCCLUtils.cpp:77, invalid usage, NCCL version 2.21.5\nncclInvalidUsage: This usually "
                  "reflects invalid usage of NCCL library.\nLast error:\nDuplicate GPU detected : rank 1 and rank 0 both "
                  "on CUDA device 1a000"),
     "RuntimeError: NCCL error in: NCCLUtils.cpp:77, invalid usage, NCCL version 2.21.5 (last error: Duplicate GPU "
     "detected : rank 1 and rank 0 both on CUDA device 1a000)"),
])
def test_describe_keeps_the_first_line_and_nccls_last_error(exc: Exception, text: str) -> None:
    assert describe(exc) == text


ENV = DistEnv(rank=0, local_rank=0, world_size=4, local_world_size=4, node_rank=0, num_nodes=1, master_addr="n1",
              master_port=15000, job_id="7", source="slurm")


@pytest.mark.parametrize(("gpus", "tasks", "slurm_gpus", "device", "status", "words"), [
    (0, 4, 0, "auto", SKIP, "training runs on the CPU"),
    (0, 4, 4, "auto", FAIL, "torch sees no GPU"),
    (0, 1, 0, "cuda", FAIL, "train.device=cuda, but this task has no GPU"),  # the job's error, not the node's
    (2, 4, 4, "auto", FAIL, "4 tasks on this node each see 2 of the 4 GPU(s)"),
    (2, 4, 8, "auto", PASS, "cuda:0"),  # --gpus-per-task=2: each task's own two
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
    # Each rank named with its node: whichever two nodes Slurm gave (another test's job may hold n1).
    named = re.findall(r"rank (\d) \((n\d)\)", row(bad.stdout, "run folder"))
    assert bad.returncode != 0 and [r for r, _ in named] == ["0", "1"] and len({n for _, n in named}) == 2, bad.stdout


@pytest.mark.parametrize(("python", "status"), [((3, 11, 7), WARN), ((3, 11, 10), PASS), ((3, 12, 1), PASS)])
def test_the_versions_row_warns_where_python_can_hang_a_forked_worker(python: tuple[int, int, int],
                                                                     status: str) -> None:
    row = check_versions(python)
    assert (row.status, "gh-112275" in row.detail, "3.11.10+" in row.hint) == (status, status == WARN, status == WARN)
    assert row.detail.startswith("python " + ".".join(map(str, python)))
