"""Data: deterministic synthetic set, samplers that shard exactly, resumable order, missing-path errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainer.builtin.data import build_data
from trainer.core.config import load
from trainer.core.env import DistEnv
from trainer.core.errors import UserError
from trainer.data.samplers import ResumableSampler, ShardSampler

from .conftest import ROOT, ok, spawn_ranks, wait_ranks


def env_of(rank: int, world: int) -> DistEnv:
    return DistEnv(rank, rank, world, world, 0, 1, "127.0.0.1", 29500, None, "torchrun")


def test_synthetic_is_deterministic_from_the_seed() -> None:
    a = build_data(load(["train.seed=3"])).train
    b = build_data(load(["train.seed=3"])).train
    c = build_data(load(["train.seed=4"])).train
    assert torch.equal(a.tensors[0], b.tensors[0]) and torch.equal(a.tensors[1], b.tensors[1])  # type: ignore[attr-defined]
    assert not torch.equal(a.tensors[0], c.tensors[0])  # type: ignore[attr-defined]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_eval_shards_are_disjoint_and_cover_once(world: int) -> None:
    shards = [list(ShardSampler(10, env_of(r, world))) for r in range(world)]
    flat = [i for s in shards for i in s]
    assert sorted(flat) == list(range(10))


def test_resumable_sampler_skips_exactly_what_was_consumed() -> None:
    ds = list(range(64))
    full = ResumableSampler(ds, env_of(1, 2), seed=5)  # type: ignore[arg-type]
    full.start_epoch(3)
    order = list(full)
    resumed = ResumableSampler(ds, env_of(1, 2), seed=5)  # type: ignore[arg-type]
    resumed.start_epoch(3, skip_samples=8)
    assert list(resumed) == order[8:] and len(resumed) == len(order) - 8
    resumed.start_epoch(4)
    assert len(resumed) == len(order)


def test_permutation_does_not_depend_on_world_size() -> None:
    ds = list(range(64))
    one = ResumableSampler(ds, env_of(0, 1), seed=0)  # type: ignore[arg-type]
    two = [ResumableSampler(ds, env_of(r, 2), seed=0) for r in range(2)]  # type: ignore[arg-type]
    perm = list(one)
    assert list(two[0]) == perm[0::2] and list(two[1]) == perm[1::2]


def test_two_real_processes_get_disjoint_covering_shards_that_change_with_the_epoch() -> None:
    script = ROOT / "tests" / "scripts" / "sampler_check.py"
    proc = ok(wait_ranks(spawn_ranks([], ROOT, 2, script=script, split=True), [str(script)], 180))
    report = json.loads(next(line for line in reversed(proc.stdout.splitlines()) if line.startswith("{")))
    n = report["n"]
    for ranks in report["epochs"]:
        r0, r1 = ranks
        assert not set(r0) & set(r1)
        assert set(r0) | set(r1) == set(range(n))
        assert len(r0) == len(r1) == (n + 1) // 2
    assert report["epochs"][0] != report["epochs"][1]  # set_epoch reshuffles


@pytest.mark.parametrize(("name", "expected"), [("mnist", "MNIST/raw"), ("cifar10", "cifar-10-batches-py"),
                                                ("imagefolder", "/train/<class>")])
def test_missing_dataset_says_where_the_files_must_be(tmp_path: Path, name: str, expected: str) -> None:
    with pytest.raises(UserError) as info:
        build_data(load([f"data.name={name}", f"data.root={tmp_path}"]))
    assert info.value.field == "data.root"
    assert expected in info.value.message
    assert "nothing is downloaded" in info.value.hint
