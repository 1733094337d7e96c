"""A straggler on the real dev cluster: a rank slowed from a step on is named with its Slurm node, and with
``audit.on_straggler=restart`` the job saves, the verdict blames that node, the spare node takes over inside the
allocation, and the job ends as if nothing had happened."""

from __future__ import annotations

import json
from pathlib import Path

from .conftest import faults
from .test_healing import SLOW, events, finished, reference, submit
from .test_slurm import slurm_env

__all__ = ["reference", "slurm_env"]  # the fixtures


def test_a_straggler_is_restarted_without_its_node_and_the_job_ends_as_if_uninterrupted(
        slurm_env: dict[str, str], tmp_path: Path, reference: str) -> None:
    run = tmp_path / "run"
    # 10x slower from step 4 of the first attempt: no machine's noise makes or breaks such a stretch. When it is named
    # is the detector's rule (tests/test_audit.py); here, what the job does about it.
    slow = {"slow_rank": 1, "slow_from_step": 4, "slow_factor": 10}
    env = {**slurm_env, **faults(at={"0": slow}), "TRAINER_SUSPECTS": str(tmp_path / "suspects.json")}
    job = submit(env, "sbatch", [*SLOW, f"run.dir={run}", "checkpoint.poll_steps=2", "audit.straggler_steps=8",
                                 "audit.straggler_floor_ms=1", "audit.on_straggler=restart"], ["spare_nodes=1"])
    result = finished(run, job, env)
    assert result["outcome"] == "finished" and result["param_checksums"] == [reference, reference], result
    (s,) = events(run, "straggler")
    assert (s["rank"], s["action"]) == (1, "restart"), s
    ends = events(run, "attempt_end")
    assert [(e["attempt"], e["decision"]) for e in ends] == [("0", "restart_here"), ("0.1", "done")], ends
    assert ends[0]["class"] == "infrastructure" and ends[0]["blamed"] == [s["node"]], ends[0]
    assert f"straggler: rank 1 on {s['node']} takes" in ends[0]["cause"], ends[0]
    second = {json.loads(p.read_text())["node"] for p in (run / "exits").glob(f"{job}.0.1/train-*.json")}
    assert len(second) == 2 and s["node"] not in second, second
    assert events(run, "attempt")[1]["resumed_step"] == s["step"]  # saved when named: nothing recomputed
