"""CPU binding against Slurm's own: the dev cluster binds a task to CPUs when the job asks (``--cpu-bind``;
task/affinity, no binding by default, slurm/dev-cluster.sh). A session's rank (tests/scripts/cpu_probe.py) runs torch's
threads on its own CPUs only (``trainer.core.dist.cpu_threads``), and its loader workers stay inside the same set with
one thread each: a rank bound to one core never runs two threads there, and ranks unbound share the node's cores
instead of each taking all of them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from .conftest import ROOT
from .test_gpu_layouts import submit, tasks_of
from .test_slurm import slurm_env

__all__ = ["slurm_env"]  # the fixture

PROBE = ROOT / "tests" / "scripts" / "cpu_probe.py"
CPUS = os.sched_getaffinity(0)  # the dev cluster's nodes share this machine's CPUs
# name → (srun options, what each rank must see: (its CPUs, torch's threads)); one task alone: tests/test_env.py
LAYOUTS: dict[str, tuple[list[str], list[tuple[set[int], int]]]] = {
    "a core per task (--cpu-bind=map_cpu:0,1)": (["--cpu-bind=map_cpu:0,1"], [({0}, 1), ({1}, 1)]),
    "two tasks unbound (--cpu-bind=none)": (["--cpu-bind=none"], [(CPUS, len(CPUS) // 2)] * 2),
}


@pytest.mark.slurm_compat
@pytest.mark.skipif(not {0, 1} <= CPUS, reason="needs CPUs 0 and 1")
def test_a_rank_and_its_loader_workers_stay_on_the_cpus_slurm_bound_it_to(slurm_env: dict[str, str],
                                                                        tmp_path: Path) -> None:
    jobs = {}
    for i, (name, (options, _)) in enumerate(LAYOUTS.items()):  # one node, two tasks: srun binds them as asked
        out = tmp_path / str(i)
        task = f"{' '.join(options)} {sys.executable} {PROBE} {out / 'run'}"
        jobs[name] = (submit(slurm_env, ["-N1", "-n2"], out, task=task), out)
    for name, (job, out) in jobs.items():
        ranks = tasks_of(out, job, slurm_env)
        got = [(set(r["cpus"]), r["threads"]) for r in ranks]
        assert got == LAYOUTS[name][1], (name, got)
        for rank in ranks:  # each worker: [its CPUs…, its threads]
            assert all(set(w[:-1]) == set(rank["cpus"]) and w[-1] == 1 for w in rank["workers"]), (name, rank)
