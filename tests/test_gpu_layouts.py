"""GPU placement against Slurm's own GRES. The dev cluster's nodes have four GPUs that are files (gres.conf,
slurm/dev-cluster.sh), so Slurm allocates, binds and exports them as it does at a site. Each layout users submit runs
a probe on every task. What Slurm gave each task is kept as a golden file per Slurm version, and the trainer's choice
made from the same variables (``discover``, ``job_info``, ``gpu_index``) gives every rank a GPU of its own, or
refuses the layout that would share one, with a HINT."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from trainer.core.dist import gpu_index
from trainer.core.env import discover, job_info
from trainer.core.errors import UserError

from .conftest import ROOT
from .test_slurm import sh, slurm_env, wait_for

__all__ = ["slurm_env"]  # the fixture

# name → sbatch options; every node has 4 GPUs and room for 2 tasks.
LAYOUTS = {
    "a task per GPU (--gpus-per-node)": ["-N2", "--ntasks-per-node=2", "--gpus-per-node=2"],
    "a GPU per task (--gpus-per-task)": ["-N2", "--ntasks-per-node=2", "--gpus-per-task=1"],
    "bound one each (--gpu-bind=single:1)": ["-N2", "--ntasks-per-node=2", "--gpus-per-node=2", "--gpu-bind=single:1"],
    "two GPUs per task (--gpus-per-task=2)": ["-N1", "--ntasks-per-node=2", "--gpus-per-task=2"],
    "one torchrun per node (--gres=gpu:2)": ["-N2", "--ntasks-per-node=1", "--gres=gpu:2"],
    "two tasks, one GPU (refused)": ["-N1", "--ntasks-per-node=2", "--gpus-per-node=1"],
}
TORCHRUN = "one torchrun per node (--gres=gpu:2)"
REFUSED = "two tasks, one GPU (refused)"
KEPT = ("SLURM_LOCALID", "CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "SLURM_GPUS_ON_NODE",
        "SLURM_GPUS_PER_TASK", "SLURM_TRES_PER_TASK", "SLURM_GPUS_PER_NODE")
PROBE = "import json, os; print(json.dumps(dict(os.environ)), flush=True)"


def submit(env: dict[str, str], options: list[str], out: Path, hold: Path | None = None, task: str = "") -> str:
    """One job of ``options`` whose every task writes one JSON line into ``out/<task>``: ``task`` (srun's options and
    the command), by default its environment; ``hold``: it keeps its GPUs until that file exists."""
    out.mkdir()
    wait = f"; while [ ! -e {hold} ]; do sleep 0.2; done" if hold else ""
    proc = sh(["sbatch", "--parsable", "-o", str(out / "job.log"), *options, "--wrap",
               f"srun -o {out}/task-%t {task or 'python3 -c ' + _quoted(PROBE)}{wait}"], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip().split(";")[0]


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


def written(out: Path) -> list[dict[str, Any]]:
    """The tasks' JSON lines written so far (srun makes a task's file before the task writes its line; other lines,
    a library's warnings on stderr, are not it)."""
    lines = (line for p in out.glob("task-*") for line in p.read_text().splitlines(keepends=True))
    return [json.loads(line) for line in lines if line.startswith("{") and line.endswith("\n")]


def tasks_of(out: Path, job: str, env: dict[str, str]) -> list[dict[str, Any]]:
    wait_for(lambda: sh(["squeue", "-h", "-j", job], env).stdout.strip() == "", 120, f"job {job} to end")
    tasks = written(out)
    assert tasks and len(tasks) == len(list(out.glob("task-*"))), (out / "job.log").read_text()
    return sorted(tasks, key=lambda t: int(t["SLURM_PROCID"]))


def chosen(task: dict[str, Any], local: tuple[int, int] | None = None) -> tuple[str, str] | str:
    """(node, the physical GPU) the trainer takes in this task (``local``: as torchrun's worker (rank, of n) in it),
    or the error it stops with. Without device cgroups Slurm's CUDA_VISIBLE_DEVICES holds the node's GPU numbers."""
    env = {k: v for k, v in task.items() if isinstance(v, str)}
    if local is not None:
        env.update(LOCAL_RANK=str(local[0]), LOCAL_WORLD_SIZE=str(local[1]), TORCHELASTIC_RUN_ID="x",
                   RANK=str(local[0]), WORLD_SIZE=str(local[1]), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    visible = [g for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
    try:
        index = gpu_index(len(visible), discover(env), job_info(env).gpus_on_node)
    except UserError as err:
        return f"{err.field}: {err.message} HINT: {err.hint}"
    return env["SLURMD_NODENAME"], visible[index]


def facts(layouts: dict[str, list[dict[str, Any]]]) -> str:
    """What each task got and what the trainer takes there, a line a task (a torchrun worker), a job's nodes named in
    rank order (where Slurm puts a job is its choice)."""
    lines = []
    for name, tasks in layouts.items():
        lines.append(name)
        names: dict[str, str] = {}
        for t in tasks:
            node = names.setdefault(t["SLURMD_NODENAME"], f"node{len(names)}")
            got = " ".join(f"{k}={t[k]}" for k in KEPT if t.get(k) is not None)
            for local in [(r, 2) for r in range(2)] if name == TORCHRUN else [None]:
                pick = chosen(t, local)
                took = f"GPU {pick[1]}" if isinstance(pick, tuple) else pick.split(":")[0] + " refused"
                who = f"rank {t['SLURM_PROCID']}" + (f" worker {local[0]}" if local else "")
                lines.append(f"  {who} on {node}: {got} → {took}")
    return "\n".join(lines) + "\n"


@pytest.mark.slurm_compat
def test_every_layout_gives_each_rank_a_gpu_of_its_own_or_is_refused(slurm_env: dict[str, str],
                                                                     tmp_path: Path) -> None:
    jobs = {name: (submit(slurm_env, options, tmp_path / f"{i}.out"), tmp_path / f"{i}.out")
            for i, (name, options) in enumerate(LAYOUTS.items())}
    got = {name: tasks_of(out, job, slurm_env) for name, (job, out) in jobs.items()}
    # Two jobs on one node at once, as on a shared 8-GPU node: the second gets the GPUs the first does not hold.
    hold, one = tmp_path / "release", ["-N1", "--ntasks=1", "--gpus-per-node=2"]
    first = submit(slurm_env, one, tmp_path / "a.out", hold)
    try:
        wait_for(lambda: written(tmp_path / "a.out"), 120, "the first job's task")
        node = written(tmp_path / "a.out")[0]["SLURMD_NODENAME"]  # Slurm's choice
        second = submit(slurm_env, [*one, "-w", node], tmp_path / "b.out")
        shared = tasks_of(tmp_path / "b.out", second, slurm_env)
    finally:
        hold.touch()  # the first job ends whatever happened: the next test gets the node back
    shared = tasks_of(tmp_path / "a.out", first, slurm_env) + shared

    for name, tasks in got.items():
        assert len(tasks) == int(LAYOUTS[name][0][2:]) * int(LAYOUTS[name][1].split("=")[1]), (name, tasks)
        picks = [chosen(t, (r, 2)) for t in tasks for r in range(2)] if name == TORCHRUN else [chosen(t) for t in tasks]
        if name == REFUSED:
            assert all(isinstance(p, str) and p.startswith("LOCAL_RANK") and "share a GPU" in p for p in picks), picks
        else:
            assert all(isinstance(p, tuple) for p in picks) and len(set(picks)) == len(picks), (name, picks)
    shared_picks = [chosen(t) for t in shared]
    assert len(set(shared_picks)) == 2, shared_picks

    golden = ROOT / "tests" / "golden" / "gpu_layouts" / f"slurm-{_version(slurm_env)}.txt"
    text = facts({**got, "two jobs on one node at once": shared})
    if os.environ.get("UPDATE_GOLDEN"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text)
    assert text == golden.read_text(), f"what Slurm gives tasks changed; UPDATE_GOLDEN=1 pytest {__file__} to accept"


def _version(env: dict[str, str]) -> str:
    out = subprocess.run(["sinfo", "-V"], env=env, capture_output=True, text=True).stdout.split()
    return ".".join(out[-1].split(".")[:2])
