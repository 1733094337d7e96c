"""Jobs that go on in place on the real dev cluster (3 nodes, `regroup: true`): a rank killed or stopped from outside
is lost without a restart, the others regroup on the job's store, and a warm spare (on a spare node, or started on
a live node) takes its place. Apart from tests/test_healing*.py, whose restarts take longer, so that CI's dev
clusters share the cluster tests out more evenly (tests/conftest.py CLUSTER_SECONDS).
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from .conftest import faults, go, held
from .test_healing import SLOW, events, finished, kill_rank, submit
from .test_slurm import job_runs, sh, slurm_env, wait_for

__all__ = ["slurm_env"]  # the fixture


def held_job(env: dict[str, str], tmp_path: Path, sets: list[str], ranks: int,
             args: Sequence[str] = ()) -> tuple[Path, dict[str, str], str]:
    """A job of SLOW training (and ``args``) with ``regroup=true`` and the profile ``sets``, submitted with ``env`` (its
    test faults) and a suspects list of its own, once its ``ranks`` ranks hold; its run folder, environment and id."""
    run = tmp_path / "run"
    env = {**env, "TRAINER_SUSPECTS": str(tmp_path / "suspects.json")}
    job = submit(env, "sbatch", [*SLOW, *args, f"run.dir={run}"], [*sets, "regroup=true"])
    held(run, ranks=ranks)
    return run, env, job


@pytest.mark.slurm_compat  # what srun --kill-on-bad-exit=0 keeps, and how it reports the loss, on each version
def test_a_killed_rank_is_lost_without_a_restart_when_the_job_regroups(slurm_env: dict[str, str],
                                                                       tmp_path: Path) -> None:
    """regroup: true on three nodes: rank 2 SIGKILLed from outside while the ranks are held after step 5. srun keeps
    the step, the two others regroup on the job's store in their own processes and finish the run on two nodes; the
    verdict calls the attempt finished, naming the lost rank's node, and nothing is requeued or restarted."""
    run, env, job = held_job({**slurm_env, **faults(at={"0": {"wait_at_step": 4}})}, tmp_path, ["nodes=3"], 3)
    node, killed_at = kill_rank(job, 2, 0), time.time()
    go(run)
    result = finished(run, job, env)
    assert result["outcome"] == "finished" and result["world_size"] == 2 and not result["resumed_from"], result
    assert len(set(result["param_checksums"])) == 1, result  # the two replicas agree
    [regroup] = events(run, "regroup")
    assert (regroup["lost"], regroup["world_size"], regroup["step"]) == ([2], 2, 5), regroup
    [end] = events(run, "attempt_end")
    assert end["class"] == "finished" and f"rank 2 on {node} lost" in end["cause"] and end["blamed"] == [node], end
    assert node in json.loads((tmp_path / "suspects.json").read_text())  # evidence against the node, kept
    runs = job_runs(job, env)
    assert runs == ["COMPLETED"], runs  # one run of the job, one attempt: no requeue, no restart
    starts = [(e["attempt"], e.get("regroup", False), e["nodes"]) for e in events(run, "attempt")]
    assert starts == [("0", False, 3), ("0.1", True, 2)], starts  # the recovery: the next attempt, on two nodes
    first_step = next(e["t"] for e in events(run, "first_step") if e["t"] > killed_at)
    print(f"kill → first step after the regroup: {first_step - killed_at:.2f} s (in place, no process started)")
    report = sh([sys.executable, "-m", "trainer.report", str(run)], env).stdout
    assert "recovered in place after attempt 1 (rank 2 lost, 2 of 3 processes went on" in report, report


@pytest.mark.slurm_compat  # srun --overlap on a node of the running step, started by the store, on each version
def test_a_rank_killed_on_a_live_node_is_replaced_there_and_the_job_grows_back(slurm_env: dict[str, str],
                                                                              tmp_path: Path) -> None:
    """regroup: true on three nodes, no spare node: rank 2 SIGKILLed from outside (its node lives). The two others go
    on at once; the job's store starts a warm spare on that node (--on-lost: srun --overlap), which the group takes in
    at a step boundary: the job finishes on three processes, in one attempt of Slurm's, the replicas equal. The two
    hold again after step 9 until the spare is up (its start-up takes what it takes), so that it joins a running
    group, whatever the machine's speed."""
    hold = faults(at={"0": {"wait_at_step": 4, "wait_again_at_step": 8}})
    run, env, job = held_job({**slurm_env, **hold}, tmp_path, ["nodes=3"], 3)
    node = kill_rank(job, 2, 0)
    go(run)
    held(run, ranks=2, attempt="0-again")  # the two went on in place, and hold again
    wait_for(lambda: "waiting for a place" in (run / "store.log").read_text(), 240, "the warm spare to be up")
    go(run, "0-again")
    result = finished(run, job, env)
    assert result["outcome"] == "finished" and result["world_size"] == 3 and not result["resumed_from"], result
    assert len(result["param_checksums"]) == 3 and len(set(result["param_checksums"])) == 1, result
    shrink, grow = events(run, "regroup")
    assert (shrink["lost"], shrink["world_size"], grow["lost"], grow["world_size"]) == ([2], 2, [], 3), (shrink, grow)
    assert grow["members"][:2] == [0, 1] and grow["members"][2] >= 1_000_000, grow  # the replacement, a spare
    starts = [(e["attempt"], e.get("regroup"), e.get("grew")) for e in events(run, "attempt")]
    assert starts == [("0", None, None), ("0.1", True, None), ("0.2", None, True)], starts
    assert f"rank 2 lost on {node}" in (run / "store.log").read_text()
    runs = job_runs(job, env)
    assert runs == ["COMPLETED"], runs
    print(f"grew back {grow['t'] - shrink['t']:.1f} s after the regroup (the replacement's start-up; the two held meanwhile)")


def test_a_stopped_rank_is_killed_on_its_node_and_the_others_go_on(slurm_env: dict[str, str], tmp_path: Path) -> None:
    """regroup: true on three nodes, the model sharded (dist.strategy=fsdp): rank 2 SIGSTOPped from outside (a hang
    its own watchdog cannot report). The others' watchdogs find it stuck, the job's store kills it on its node (srun
    --overlap kill), and the two go on in place from the newest snapshot in their nodes' memory (the stopped rank's
    shard: its partner node's copy, or its own node's folder): the job finishes in one attempt, the verdict blaming
    the stuck rank's node."""
    run, env, job = held_job({**slurm_env, **faults(at={"0": {"wait_at_step": 4}})}, tmp_path, ["nodes=3"], 3,
                             ["dist.heartbeat_timeout_s=4", "dist.strategy=fsdp", "checkpoint.memory_every_steps=2"])
    node = kill_rank(job, 2, 0, sig=signal.SIGSTOP)
    go(run)
    result = finished(run, job, env)
    assert result["outcome"] == "finished" and result["world_size"] == 2 and not result["resumed_from"], result
    [regroup] = events(run, "regroup")
    assert (regroup["lost"], regroup["step"], regroup["restored_from"]) == ([2], 4, "memory"), regroup
    [end] = events(run, "attempt_end")
    assert end["class"] == "finished" and f"rank 2 on {node} lost" in end["cause"] and end["blamed"] == [node], end
    assert f"rank 2 on {node}" in (run / "store.log").read_text() and "is stuck" in (run / "store.log").read_text()
    runs = job_runs(job, env)
    assert runs == ["COMPLETED"], runs


@pytest.mark.slurm_compat  # a second step beside the training one (the spare), on each version
def test_a_warm_spare_on_the_spare_node_takes_the_killed_ranks_place(slurm_env: dict[str, str],
                                                                     tmp_path: Path) -> None:
    """regroup: true with a spare node: a process waits on the third node (TRAINER_SPARE) while two train; rank 1
    SIGKILLed from outside after step 5: the spare takes its place, the job finishes on two processes in one
    attempt, and the replicas agree."""
    run, env, job = held_job({**slurm_env, **faults(at={"0": {"wait_at_step": 4}})}, tmp_path, ["spare_nodes=1"], 2)
    node, killed_at = kill_rank(job, 1, 0), time.time()
    go(run)
    result = finished(run, job, env)
    assert result["outcome"] == "finished" and result["world_size"] == 2 and not result["resumed_from"], result
    assert len(set(result["param_checksums"])) == 1, result
    [regroup] = events(run, "regroup")
    assert (regroup["lost"], regroup["world_size"], regroup["step"]) == ([1], 2, 5), regroup
    assert regroup["members"][1] >= 1_000_000, regroup  # the spare, by its own number
    [end] = events(run, "attempt_end")
    assert end["class"] == "finished" and f"rank 1 on {node} lost" in end["cause"], end
    runs = job_runs(job, env)
    assert runs == ["COMPLETED"], runs
    first_step = next(e["t"] for e in events(run, "first_step") if e["t"] > killed_at)
    print(f"kill → first step with the warm spare: {first_step - killed_at:.2f} s (no process started)")


def test_spares_that_took_both_first_ranks_places_finish_the_attempt(slurm_env: dict[str, str],
                                                                     tmp_path: Path) -> None:
    """regroup: true with a spare node: rank 1 SIGKILLed (the spare on the third node takes its place), then rank 0
    (rank 1's node still runs: a replacement started there may take it). srun's training step then has no task
    left, yet spares train on: the batch script waits while the store counts them, and the job finishes in its first
    attempt, without a restart."""
    slowed = faults(at={"0": {"wait_at_step": 4, "step_delay_s": 0.4}})
    run, env, job = held_job({**slurm_env, **slowed}, tmp_path, ["spare_nodes=1"], 2, ["train.epochs=3"])
    kill_rank(job, 1, 0)
    go(run)
    wait_for(lambda: events(run, "regroup"), timeout=120, what="the spare to take rank 1's place")
    kill_rank(job, 0, 0)
    result = finished(run, job, env)
    assert result["outcome"] == "finished" and not result["resumed_from"], result
    assert len(set(result["param_checksums"])) == 1, result
    assert [e["lost"] for e in events(run, "regroup")][:2] == [[1], [0]], events(run, "regroup")
    assert [e.get("attempt") for e in events(run, "job_start") if "attempt" in e] == ["0"]  # no restart
    [end] = events(run, "attempt_end")
    assert end["class"] == "finished" and "rank 0 on" in end["cause"] and "rank 1 on" in end["cause"], end
    runs = job_runs(job, env)
    assert runs == ["COMPLETED"], runs
