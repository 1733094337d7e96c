"""Data: deterministic synthetic set, samplers that shard exactly, resumable order, missing-path errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.builtin.data import build_data
from trainer.core.config import load
from trainer.core.env import DistEnv
from trainer.core.errors import UserError
from trainer.data.samplers import ResumableSampler, ShardSampler

from .conftest import ROOT, SMALL, ok, run_trainer, spawn_ranks, wait_ranks


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


def test_an_eval_loaders_workers_start_early_and_its_first_pass_is_unchanged() -> None:
    """Session.restore forks an evaluation loader's workers before the loop starts (start_workers): the batches read
    ahead then are dropped, so each pass over the set is exactly an unprimed loader's."""
    from trainer.data.loader import eval_loader
    from trainer.data.workers import start_workers

    env = env_of(1, 2)
    data = torch.utils.data.TensorDataset(torch.arange(40.0).view(20, 2), torch.arange(20))
    plain, early = (eval_loader(data, env, 3, num_workers=1, persistent_workers=True) for _ in range(2))
    start_workers(early)
    workers = early._iterator._workers  # type: ignore[attr-defined]
    assert [w.is_alive() for w in workers] == [True]
    try:
        for _ in range(2):
            assert [b[1].tolist() for b in early] == [b[1].tolist() for b in plain]
        assert early._iterator._workers == workers  # type: ignore[attr-defined]  # the same process: not forked again
    finally:
        for loader in (early, plain):
            loader._iterator._shutdown_workers()  # type: ignore[attr-defined]


HUNG_FORK = """
import os, sys, time, torch
from trainer.data import workers
from trainer.data.workers import checked_iter, worker_init

workers.START_S = 5.0
armed = [1]  # the first fork's child hangs inside fork, as CPython gh-112275's does; later ones start
os.register_at_fork(after_in_child=lambda: armed[0] and time.sleep(3600),
                    after_in_parent=lambda: armed.__setitem__(0, 0))
data = torch.utils.data.TensorDataset(torch.arange(12))
loader = torch.utils.data.DataLoader(data, batch_size=3, num_workers=1, persistent_workers=sys.argv[1] == "1",
                                     worker_init_fn=worker_init((), None))
print([b[0].tolist() for b in checked_iter(loader)], flush=True)
"""


@pytest.mark.parametrize("persistent", ["1", "0"])
def test_a_loader_worker_hung_inside_fork_is_killed_and_forked_again(tmp_path: Path, persistent: str) -> None:
    """A worker that never gets out of fork (held there from outside, in an after-fork hook) is found by its missing
    start report, killed, and the loader's workers forked again: the pass yields every batch."""
    proc = ok(subprocess.run([sys.executable, "-c", HUNG_FORK, persistent], cwd=ROOT, capture_output=True, text=True,
                             timeout=240))
    assert proc.stdout.strip() == "[[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]"
    assert "warning: a loader worker did not start within 5 s (try 1 of 3)" in proc.stderr


@pytest.mark.parametrize(("version", "affected"), [((3, 11, 7), True), ((3, 11, 9), True), ((3, 11, 10), False),
                                                   ((3, 12, 0), True), ((3, 12, 1), False), ((3, 13, 0), False)])
def test_the_fork_hang_is_named_only_on_the_interpreters_that_have_it(version: tuple[int, int, int],
                                                                      affected: bool) -> None:
    from trainer.data.workers import python_note

    assert ("gh-112275" in python_note(version)) is affected


EMPTY = '''
import torch
from torch.utils.data import TensorDataset


def build(keep: str = "nothing"):
    """A filter that kept no sample of the training set (the evaluation set is whole)."""
    x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))  # the shape an empty set gets its model for
    train = TensorDataset(x[:0], y[:0]) if keep == "nothing" else TensorDataset(x, y)
    return train, TensorDataset(x, y)
'''


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case: train.device=auto finds no GPU")
def test_fp16_on_the_cpu_that_auto_picked_is_refused_before_the_run(tmp_path: Path) -> None:
    """train.device=auto on a machine without a GPU: fp16 trained anyway (torch's GradScaler only warned)."""
    run = tmp_path / "run"
    proc = ok(run_trainer([*SMALL, "train.precision=fp16", f"run.dir={run}"], tmp_path), code=2)
    assert "error: train.precision: fp16 needs CUDA (GradScaler), and this run's device is cpu" in proc.stderr, \
        proc.stderr
    assert not (run / "checkpoints").exists() and not (run / "result.json").exists()


@pytest.mark.parametrize("batch", ["data.batch_size=8", "data.global_batch_size=16"])
def test_a_training_set_without_a_sample_fails_before_the_run_instead_of_finishing_at_once(
        tmp_path: Path, batch: str) -> None:
    """A wrong path or a filter that keeps nothing: zero steps an epoch would be a run that "finishes" (exit 0) having
    trained nothing."""
    (tmp_path / "emptydata.py").write_text(EMPTY)
    run = tmp_path / "run"
    proc = ok(run_trainer([*SMALL, "data.target=emptydata:build", batch, f"run.dir={run}"], tmp_path), code=2)
    assert "error: data: the training set holds no sample" in proc.stderr and "HINT: " in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (run / "result.json").exists()
