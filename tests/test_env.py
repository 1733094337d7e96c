"""Environment discovery: table-driven over torchrun, Slurm and lone processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.core.dist import cpu_threads
from trainer.core.env import PORT_BASE, PORT_SPAN, DistEnv, discover, expand_nodelist, port_from_job_id, tasks_per_node
from trainer.core.errors import UserError

from .conftest import SMALL, clean_env, outputs, spawn_ranks

TORCHRUN = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
            "MASTER_ADDR": "node7", "MASTER_PORT": "29400"}
SLURM = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_NODEID": "1", "SLURM_NNODES": "2",
         "SLURM_JOB_NODELIST": "gpu-[01-02]", "SLURM_JOB_ID": "123456", "SLURM_NTASKS_PER_NODE": "2",
         "SLURM_STEP_ID": "0"}

CASES = [
    ("torchrun", TORCHRUN, DistEnv(3, 1, 4, 2, 1, 2, "node7", 29400, None, "torchrun")),
    ("torchrun's agent", {**TORCHRUN, "TORCHELASTIC_RUN_ID": "none"},
     DistEnv(3, 1, 4, 2, 1, 2, "node7", 29400, None, "torchrun", agent=True)),
    ("torchrun wins over slurm", {**SLURM, **TORCHRUN}, DistEnv(3, 1, 4, 2, 1, 2, "node7", 29400, "123456", "torchrun")),
    ("slurm", SLURM, DistEnv(3, 1, 4, 2, 1, 2, "gpu-01", PORT_BASE + 123456 % PORT_SPAN, "123456", "slurm")),
    ("slurm step nodelist wins", {**SLURM, "SLURM_STEP_NODELIST": "b[5-6]"},
     DistEnv(3, 1, 4, 2, 1, 2, "b5", PORT_BASE + 123456 % PORT_SPAN, "123456", "slurm")),
    ("slurm explicit master", {**SLURM, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "2222"},
     DistEnv(3, 1, 4, 2, 1, 2, "10.0.0.1", 2222, "123456", "slurm")),
    ("slurm uneven tasks per node", {**SLURM, "SLURM_NTASKS": "3", "SLURM_PROCID": "2", "SLURM_LOCALID": "0",
                                     "SLURM_NTASKS_PER_NODE": "", "SLURM_STEP_TASKS_PER_NODE": "2,1"},
     DistEnv(2, 0, 3, 1, 1, 2, "gpu-01", PORT_BASE + 123456 % PORT_SPAN, "123456", "slurm")),
    ("slurm compressed tasks per node", {**SLURM, "SLURM_NTASKS_PER_NODE": "", "SLURM_TASKS_PER_NODE": "2(x2)"},
     DistEnv(3, 1, 4, 2, 1, 2, "gpu-01", PORT_BASE + 123456 % PORT_SPAN, "123456", "slurm")),
    ("slurm batch shell is one process", {**SLURM, "SLURM_PROCID": "0", "SLURM_STEP_ID": ""},
     DistEnv(0, 0, 1, 1, 0, 1, "127.0.0.1", PORT_BASE + 123456 % PORT_SPAN, "123456", "single")),
    ("nothing set", {}, DistEnv(0, 0, 1, 1, 0, 1, "127.0.0.1", 29500, None, "single")),
]


@pytest.mark.parametrize(("name", "environ", "expected"), CASES, ids=[c[0] for c in CASES])
def test_discover(name: str, environ: dict[str, str], expected: DistEnv) -> None:
    env = {k: v for k, v in environ.items() if v != ""}
    assert discover(env) == expected


def test_reads_os_environ_and_never_writes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("SLURM_") or k in TORCHRUN:
            monkeypatch.delenv(k)
    for k, v in SLURM.items():
        monkeypatch.setenv(k, v)
    before = dict(os.environ)
    assert discover().rank == 3
    assert dict(os.environ) == before


ERRORS = [
    ("rank >= world size", {**TORCHRUN, "RANK": "4"}, "RANK", "outside world size 4"),
    ("torchrun missing master", {k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"}, "MASTER_ADDR", "not set"),
    ("torchrun missing world", {k: v for k, v in TORCHRUN.items() if k != "WORLD_SIZE"}, "WORLD_SIZE", "not set"),
    ("torchrun non-integer", {**TORCHRUN, "LOCAL_RANK": "one"}, "LOCAL_RANK", "must be an integer"),
    ("local rank too big", {**TORCHRUN, "LOCAL_RANK": "2"}, "LOCAL_RANK", "outside 2 local processes"),
    ("bad port", {**TORCHRUN, "MASTER_PORT": "70000"}, "MASTER_PORT", "must be a TCP port"),
    ("slurm procid >= ntasks", {**SLURM, "SLURM_PROCID": "9"}, "SLURM_PROCID", "outside world size 4"),
    ("slurm missing ntasks", {k: v for k, v in SLURM.items() if k != "SLURM_NTASKS"}, "SLURM_NTASKS", "not set"),
    ("slurm missing nodelist", {k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"},
     "SLURM_JOB_NODELIST", "not set"),
    ("slurm bad nodelist", {**SLURM, "SLURM_JOB_NODELIST": "n[1-"}, "SLURM_JOB_NODELIST", "cannot expand"),
    ("slurm node id too big", {**SLURM, "SLURM_NODEID": "2"}, "SLURM_NODEID", "outside 2 nodes"),
    ("slurm bad tasks per node", {**SLURM, "SLURM_NTASKS_PER_NODE": "two"}, "SLURM_NTASKS_PER_NODE", "cannot parse"),
]


@pytest.mark.parametrize(("name", "environ", "field", "text"), ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_name_the_variable(name: str, environ: dict[str, str], field: str, text: str) -> None:
    with pytest.raises(UserError) as info:
        discover(environ)
    assert info.value.field == field
    assert text in info.value.message
    assert info.value.render().splitlines()[1].startswith("HINT: ")


NODELISTS = {
    "n[1-2]": ["n1", "n2"],
    "gpu-[01-03,10],cpu7": ["gpu-01", "gpu-02", "gpu-03", "gpu-10", "cpu7"],
    "node[001-003]": ["node001", "node002", "node003"],
    "a1b[2-3]": ["a1b2", "a1b3"],
    "x-[1,5-7]": ["x-1", "x-5", "x-6", "x-7"],
    "rack1-n[08-11]": ["rack1-n08", "rack1-n09", "rack1-n10", "rack1-n11"],
    "single": ["single"],
}


@pytest.mark.parametrize("nodelist", list(NODELISTS))
def test_nodelist_expansion(nodelist: str) -> None:
    assert expand_nodelist(nodelist) == NODELISTS[nodelist]


@pytest.mark.parametrize("nodelist", list(NODELISTS))
def test_nodelist_agrees_with_scontrol(nodelist: str, tmp_path: Path) -> None:
    if shutil.which("scontrol") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("scontrol is missing under CI: .ci/run installs slurm-client")
        pytest.skip("scontrol not installed (apt-get install slurm-client)")
    conf = tmp_path / "slurm.conf"  # scontrol needs some config, even just to expand names
    conf.write_text("ClusterName=t\nSlurmctldHost=localhost\nNodeName=n1 CPUs=1\nPartitionName=p Nodes=n1\n")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True,
                         env={**os.environ, "SLURM_CONF": str(conf)}).stdout.split()
    assert expand_nodelist(nodelist) == out
    assert discover({**SLURM, "SLURM_JOB_NODELIST": nodelist, "SLURM_NODEID": "0"}).master_addr == out[0]


def test_port_is_derived_in_a_safe_range_and_differs_between_jobs() -> None:
    ports = {port_from_job_id(str(j)) for j in range(1000, 1100)}
    assert len(ports) == 100
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN < 32768 for p in ports)
    assert port_from_job_id("4242_7") == port_from_job_id("42427")  # array ids still give a number
    assert port_from_job_id(None) == 29500


@pytest.mark.parametrize(("spec", "node", "expected"), [("4", 0, 4), ("2(x3),1", 2, 2), ("2(x3),1", 3, 1), ("3,1", 1, 1)])
def test_tasks_per_node(spec: str, node: int, expected: int) -> None:
    assert tasks_per_node(spec, node, "SLURM_TASKS_PER_NODE") == expected


@pytest.mark.parametrize(("gpus", "local_rank", "agent", "on_node", "want", "expected"), [
    (0, 1, True, 0, "auto", "cpu"),
    (2, 1, True, 0, "auto", "cuda:1"),
    (1, 1, False, 0, "auto", "cuda:0"),  # srun with per-task GPU binding: each task sees only its own GPU
    (1, 1, False, 3, "auto", "cuda:0"),  # ... and Slurm says so: 3 GPUs on the node for its 3 tasks
    (2, 2, False, 6, "auto", "cuda:0"),  # --gpus-per-task=2: each task's own two, the first trains
    (1, 1, False, 1, "auto", "LOCAL_RANK"),  # 3 tasks, 1 GPU allocated on the node: they would share it
    (3, 2, False, 3, "auto", "cuda:2"),  # every task sees the node's 3 GPUs (no binding): rank r takes GPU r
    (1, 1, True, 0, "auto", "LOCAL_RANK"),  # torchrun's 2 processes would share the one GPU: NCCL refuses that
    (2, 2, False, 0, "cuda", "LOCAL_RANK"),
    (2, 1, False, 0, "cuda", "cuda:1"),  # not Slurm: the ranks see the same 2 GPUs, ranks 0 and 1 take one each
    (0, 0, False, 0, "cuda", "train.device"),
    (4, 1, True, 0, "cpu", "cpu"),
])
def test_each_process_gets_a_gpu_of_its_own_or_a_clear_error(monkeypatch: pytest.MonkeyPatch, gpus: int,
                                                              local_rank: int, agent: bool, on_node: int, want: str,
                                                              expected: str) -> None:
    """Three processes on the node; ``gpus`` visible to each; ``on_node``: SLURM_GPUS_ON_NODE (0: not Slurm)."""
    import torch

    from trainer.core.dist import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    env = DistEnv(local_rank, local_rank, 3, 3, 0, 1, "127.0.0.1", 29500, None, "torchrun", agent=agent)
    if "." in expected or expected.isupper():
        with pytest.raises(UserError) as err:
            pick_device(env, want, on_node)
        assert err.value.field == expected and err.value.hint
    else:
        assert str(pick_device(env, want, on_node)) == expected


def _local(tasks: int) -> DistEnv:
    return DistEnv(0, 0, tasks, tasks, 0, 1, "127.0.0.1", 29500, None, "slurm")


@pytest.mark.parametrize(("tasks", "allowed", "node", "omp", "threads"), [
    (8, 16, 128, None, 16),  # bound to its own 16 CPUs (--cpu-bind=cores): all of them
    (8, 128, 128, None, 16),  # unbound: the node's CPUs shared by its 8 ranks (torch alone: 128 each)
    (1, 128, 128, None, 128),
    (4, 2, 2, None, 1),  # more ranks than CPUs: one thread each, never 0
    (3, 8, 8, None, 2),
    (8, 128, 128, "4", None),  # OMP_NUM_THREADS decides (torch reads it)
    (8, 128, 128, "", 16),  # set but empty: not a decision
])
def test_cpu_threads(tasks: int, allowed: int, node: int, omp: str | None, threads: int | None) -> None:
    assert cpu_threads(_local(tasks), allowed, node, omp) == threads


def test_unbound_ranks_share_the_nodes_cpus(tmp_path: Path) -> None:
    """Two ranks that see every CPU and no OMP_NUM_THREADS: each runs its share of the node's CPUs (the attempt
    event records rank 0's), where torch alone would give each every core."""
    run = tmp_path / "run"
    ranks = spawn_ranks([*SMALL, f"run.dir={run}", "run.report=false"], tmp_path, env={"OMP_NUM_THREADS": ""})
    outs = outputs(ranks, timeout=180)
    assert [p.returncode for p in ranks] == [0, 0], outs
    attempt = next(e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines()) if e["event"] == "attempt")
    assert attempt["cpu_threads"] == max(1, (os.cpu_count() or 1) // 2), attempt


def test_a_thread_count_the_users_code_set_stands(tmp_path: Path) -> None:
    """An own loop that chose its threads before the session keeps them (one rank on this machine would get all)."""
    code = ("import torch, trainer\ntorch.set_num_threads(1)\nsess = trainer.Session(['tracking.mode=disabled'])\n"
            "print('threads', torch.get_num_threads(), flush=True)\n")
    env = clean_env()
    del env["OMP_NUM_THREADS"]
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert "threads 1" in proc.stdout, proc.stdout + proc.stderr[-2000:]
