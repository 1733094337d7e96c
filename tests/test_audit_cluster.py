"""A straggler on the real dev cluster: one node's job processes held to a CPU quota from outside (a cgroup, as a
noisy neighbour or a throttled host) are named with their Slurm node, and with ``audit.on_straggler=restart`` the job
saves, the verdict blames that node, the spare node takes over inside the allocation, and the job ends as if nothing
had happened."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.outside import CpuQuota
from benchmarks.procfs import processes

from .conftest import faults, go, held
from .test_healing import SLOW, events, finished, reference, submit
from .test_slurm import slurm_env, wait_for

__all__ = ["reference", "slurm_env"]  # the fixtures


def node_processes(job: str, rank: int) -> tuple[str, list[int]]:
    """The node that runs ``rank`` of ``job``, and every process of the job on it (the rank, and srun's or the batch
    script's own if they are there): what a CPU quota on that node's share of the job would hold."""
    found = [(pid, env) for pid, env, _ in processes() if env.get("SLURM_JOB_ID") == job]
    node = next(env["SLURMD_NODENAME"] for _, env in found if env.get("SLURM_PROCID") == str(rank))
    return node, [pid for pid, env in found if env.get("SLURMD_NODENAME") == node]


@pytest.mark.skipif(not CpuQuota.possible(), reason="no writable CPU cgroup controller here")
def test_a_node_held_to_a_cpu_quota_is_restarted_without_and_the_job_ends_as_if_uninterrupted(
        slurm_env: dict[str, str], tmp_path: Path, reference: str) -> None:
    """The ranks are held after step 4; rank 1's node's job processes get 5 % of a CPU (a share no busy machine
    gives a process running free), and go on. The floor (20 ms a step above the other node) is far below what the
    quota costs (about 19 × a step's CPU time) and far above what a busy CI machine costs a clean node. When it is
    named is the detector's rule (tests/test_audit.py); here, that a slowdown from outside every measured phase is
    seen, and what the job does about it."""
    run = tmp_path / "run"
    env = {**slurm_env, **faults(at={"0": {"wait_at_step": 4}}), "TRAINER_SUSPECTS": str(tmp_path / "suspects.json")}
    job = submit(env, "sbatch", [*SLOW, f"run.dir={run}", "checkpoint.poll_steps=2", "audit.straggler_steps=8",
                                 "audit.straggler_floor_ms=20", "audit.on_straggler=restart"], ["spare_nodes=1"])
    held(run, ranks=2)
    node, pids = node_processes(job, 1)
    with CpuQuota(pids, 0.05):
        go(run)
        wait_for(lambda: events(run, "straggler"), 240, "the straggler event")
    result = finished(run, job, env)
    assert result["outcome"] == "finished" and result["param_checksums"] == [reference, reference], result
    s = events(run, "straggler")[0]  # what a busy machine does to the next attempt is not this test's claim
    assert (s["rank"], s["node"], s["action"]) == (1, node, "restart"), s
    ends = events(run, "attempt_end")
    assert (ends[0]["attempt"], ends[0]["decision"], ends[-1]["decision"]) == ("0", "restart_here", "done"), ends
    assert ends[0]["class"] == "infrastructure" and ends[0]["blamed"] == [node], ends[0]
    assert f"straggler: rank 1 on {node} takes" in ends[0]["cause"], ends[0]
    second = {json.loads(p.read_text())["node"] for p in (run / "exits").glob(f"{job}.0.1/train-*.json")}
    assert len(second) == 2 and node not in second, second
    assert events(run, "attempt")[1]["resumed_step"] == s["step"]  # saved when named: nothing recomputed
