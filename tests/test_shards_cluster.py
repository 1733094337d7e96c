"""Exactly once on the dev cluster: the built-in trainer on WebDataset shards (examples/shards), a node-range job
that loses a rank and shrinks in place from 3 nodes to 2, trains each step on the samples of the uninterrupted
3-node run, every sample of an epoch once, as a per-sample ledger written by the loader shows."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from .conftest import ROOT, faults, go, held, ok, run_trainer
from .test_healing import finished, kill_rank
from .test_slurm import DEV_THREADS, cluster_cmd, idle, job_id_of, slurm_env

__all__ = ["slurm_env"]

STEPS_PER_EPOCH, GLOBAL = 20, 48  # 960 samples in 15 shards of 64


def _ledger(folder: Path) -> list[dict[str, Any]]:
    return [dict(json.loads(line), rank=int(f.stem[4:])) for f in sorted(folder.glob("rank*.jsonl"))
            for line in f.read_text().splitlines()]


def _steps(entries: list[dict[str, Any]]) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """The samples of each step, (epoch, stream position of its start) → sorted (shard, sample) pairs, counting only
    what the run kept: an attempt's steps after the point the next one resumed from were trained again."""
    resumed: dict[str, tuple[int, int]] = {}
    attempts = sorted({e["attempt"] for e in entries}, key=lambda a: [int(x) for x in a.split(".")])
    for before, after in zip(attempts, attempts[1:], strict=False):
        resumed[before] = min((e["epoch"], e["step_start"]) for e in entries if e["attempt"] == after)
    steps: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for e in entries:
        at = (e["epoch"], e["step_start"])
        if e["attempt"] not in resumed or at < resumed[e["attempt"]]:
            steps[at] += [tuple(i) for i in e["items"]]
    return {k: sorted(v) for k, v in steps.items()}


def test_a_node_range_job_on_shards_shrinks_and_trains_each_sample_once(slurm_env: dict[str, str],
                                                                       tmp_path: Path) -> None:
    wds = tmp_path / "wds"
    subprocess.run([sys.executable, str(ROOT / "examples" / "shards" / "make_shards.py"), str(wds), "--train", "960",
                    "--val", "96", "--per-shard", "64"], check=True, capture_output=True)
    args = ["data.name=shards", f"data.root={wds}", f"data.global_batch_size={GLOBAL}", "data.batch_size=16",
            "train.epochs=2", "tracking.mode=disabled", "optim.warmup_steps=2", "train.log_every=10"]
    env = {**slurm_env, "TRAINER_SUSPECTS": str(tmp_path / "suspects.json")}
    ref, run = tmp_path / "ref", tmp_path / "run"
    (tmp_path / "ref-ledger").mkdir(), (tmp_path / "ledger").mkdir()
    # The uninterrupted run on 3 processes, here: which samples make each step is the data's arithmetic, not Slurm's.
    ok(run_trainer([*args, f"run.dir={ref}", "data.num_workers=0"], tmp_path, nproc=3,
                   env={**DEV_THREADS, **faults(ledger=tmp_path / "ref-ledger")}))
    idle(env, 3)  # a node range starts on as many as are free: all three, to lose one
    proc = cluster_cmd(["--launcher", "sbatch", "--nodes", "2-3", "--", *args, f"run.dir={run}", "data.num_workers=2",
                        "checkpoint.every_steps=10", "checkpoint.memory_every_steps=4"],
                       {**env, **faults(ledger=tmp_path / "ledger", at={"0": {"wait_at_step": 5}})})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = job_id_of(proc.stdout)
    held(run, ranks=3)  # after step 6, a snapshot of step 4 in memory
    kill_rank(job, 1, 0)
    go(run)
    result = finished(run, job, env)
    assert result["outcome"] == "finished" and result["world_size"] == 2, result

    want, got = _ledger(tmp_path / "ref-ledger"), _ledger(tmp_path / "ledger")
    assert {e["world"] for e in got} == {3, 2} and {e["attempt"] for e in got} == {"0", "0.1"}
    assert _steps(got) == _steps(want) and len(_steps(want)) == 2 * STEPS_PER_EPOCH  # each step, the same samples
    for epoch in (0, 1):
        seen = Counter(i for (e, _), items in _steps(got).items() if e == epoch for i in items)
        assert len(seen) == STEPS_PER_EPOCH * GLOBAL and max(seen.values()) == 1
    first = [(e["rank"], e["items"]) for e in got if e["attempt"] == "0"]  # on 3 nodes, as the reference
    assert first and all(item in [(w["rank"], w["items"]) for w in want] for item in first)
    recomputed = [e for e in got if e["attempt"] == "0" and (e["epoch"], e["step_start"]) >= min(
        (x["epoch"], x["step_start"]) for x in got if x["attempt"] == "0.1")]
    print(f"micro-batches trained again after the kill: {len(recomputed)}")
