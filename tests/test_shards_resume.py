"""Exactly once, proven by a per-sample ledger: an own loop over sharded data, preempted 12 times and resumed on world
sizes 3 → 2 → 3 → 1 and 0, 2 and 4 loader workers (12: every pairing of the two cycles once), trains every sample of
every epoch once, none twice, and each step on the very samples of the uninterrupted run (real processes, gloo)."""

from __future__ import annotations

import json
import random
from collections import Counter
from itertools import cycle
from pathlib import Path

from .conftest import ROOT, faults, spawn_ranks, wait_ranks
from .shard_files import write

LOOP = ROOT / "tests" / "scripts" / "elastic_loop.py"
SIZES = [23, 0, 31, 7, 40, 3, 19]  # 123 samples: 10 steps of 12 an epoch, 3 left out of each epoch's order
STEPS, PER_EPOCH = 40, 10


def _attempt(shards: Path, run: Path, tmp: Path, world: int, workers: int, preempt: int | None) -> str:
    args = ["--shards", str(shards), "--workers", str(workers), f"run.dir={run}", "checkpoint.poll_steps=1",
            "tracking.mode=disabled", "run.report=false", "train.device=cpu"]
    ranks = spawn_ranks(args, tmp, world, faults(preempt_at_step=preempt) if preempt is not None else None,
                        script=LOOP)
    done = wait_ranks(ranks, args, 240)
    assert done.returncode == (75 if preempt is not None else 0), done.stdout + done.stderr
    return done.stdout


def _ledger(run: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (run / "trace.jsonl").read_text().splitlines()]


def test_a_dozen_preemptions_across_world_sizes_and_workers_train_each_sample_once(tmp_path: Path) -> None:
    shards = write(tmp_path / "shards", "jsonl", SIZES)
    ref, run = tmp_path / "ref", tmp_path / "run"
    _attempt(shards, ref, tmp_path, 3, 0, None)
    rng, worlds, workers = random.Random(5), cycle([3, 2, 3, 1]), cycle([0, 2, 4])
    splits = []
    for _ in range(12):
        splits.append((next(worlds), next(workers)))
        out = _attempt(shards, run, tmp_path, *splits[-1], preempt=rng.choice([0, 1]))
        assert f"global batch 12 = {splits[-1][0]} process(es)" in out
    _attempt(shards, run, tmp_path, 2, 4, None)

    got, want = _ledger(run), _ledger(ref)
    assert [e["step"] for e in got] == list(range(1, STEPS + 1))  # every step once: nothing trained twice or lost
    assert {e["world"] for e in got} == {1, 2, 3}
    for g, w in zip(got, want, strict=True):
        assert sorted(sum(g["ranks"], [])) == sorted(sum(w["ranks"], [])), g["step"]  # type: ignore[arg-type]
        if g["world"] == 3:  # at the same world size, the same samples on the same ranks in the same order
            assert g["ranks"] == w["ranks"], g["step"]
    for epoch in range(STEPS // PER_EPOCH):
        seen = Counter(i for e in got[epoch * PER_EPOCH:(epoch + 1) * PER_EPOCH] for r in e["ranks"] for i in r)  # type: ignore[attr-defined]
        assert len(seen) == 120 and max(seen.values()) == 1, epoch  # 123 - 3 left out of this epoch's order
