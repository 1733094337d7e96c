"""Random augmentation in loader workers is the sample's, not the worker's (trainer/data/seeding.py): a loader resumed
mid-epoch, or read by another number of workers or processes, hands out the very same augmented samples."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from trainer.core.env import DistEnv
from trainer.data.loader import Loader, train_loader

from .conftest import SMALL, faults, ok, result_of, run_trainer


class Augmented(Dataset[Any]):
    """Sample i plus a draw from each RNG a transform may use (torch's, ``random``'s, NumPy's)."""

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), torch.rand(()).item(), random.random(), float(np.random.rand())])


def env(rank: int = 0, world: int = 1) -> DistEnv:
    return DistEnv(rank, rank, world, world, 0, 1, "127.0.0.1", 29500, None, "single")


def batches(loader: Loader, n: int) -> list[torch.Tensor]:
    stream = loader.forever()
    return [next(stream) for _ in range(n)]


def make(workers: int, global_batch: int | None = None, rank: int = 0, world: int = 1) -> Loader:
    return train_loader(Augmented(), env(rank, world), 8, global_batch, 7, print, num_workers=workers)


@pytest.mark.parametrize("global_batch", [None, 16])
def test_a_loader_resumed_mid_epoch_draws_the_same_augmentation(global_batch: int | None) -> None:
    """18 batches in one go (two epochs of 12, or of 6 with 16 a step) against 7, a resume from that state with
    workers started afresh, then the rest: the same samples with the same random draws."""
    whole = batches(make(2, global_batch), 18)
    first = make(2, global_batch)
    head = batches(first, 7)
    state = first.state_dict()
    again = make(2, global_batch)
    again.load_state_dict(state)
    rest = batches(again, 11)
    assert all(torch.equal(a, b) for a, b in zip(whole, head + rest, strict=True))
    assert len({round(float(b[0, 1]), 6) for b in whole}) > 1  # it does draw


def test_the_draws_do_not_depend_on_the_number_of_workers_or_processes() -> None:
    """A sample's draws are its own: read by 1 or 2 workers, or as either half of a global batch on 2 processes
    (3 steps of 16: 6 micro-batches of 8 on one process, 3 of 8 on each of two)."""
    one, two = batches(make(1, 16), 6), batches(make(2, 16), 6)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
    alone = {float(row[0]): row for batch in one for row in batch}
    split = {float(row[0]): row for rank in (0, 1) for batch in batches(make(2, 16, rank, 2), 3) for row in batch}
    assert alone.keys() == split.keys() and all(torch.equal(alone[k], split[k]) for k in alone)


def test_the_built_in_trainer_on_augmented_images_resumes_bit_identically_with_workers(tmp_path: Path) -> None:
    """An ImageFolder set (RandomResizedCrop and a flip) read by 2 workers: preempted after step 4 and resumed (new
    workers, mid-epoch), the run ends with the uninterrupted run's weights, bit for bit."""
    from PIL import Image

    gen = torch.Generator().manual_seed(0)
    for part, n in (("train", 24), ("val", 4)):
        for label in ("a", "b"):
            (tmp_path / "images" / part / label).mkdir(parents=True)
            for i in range(n):
                pixels = torch.randint(0, 256, (12, 12, 3), generator=gen, dtype=torch.uint8).numpy()
                Image.fromarray(pixels).save(tmp_path / "images" / part / label / f"{i}.png")
    args = [*SMALL, "data.name=imagefolder", f"data.root={tmp_path / 'images'}", "data.image_size=8",
            "model.num_classes=2", "data.batch_size=8", "data.num_workers=2", "train.epochs=2",
            "checkpoint.poll_steps=1", "train.deterministic=true"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    ok(run_trainer([*args, f"run.dir={ref}"], tmp_path))
    assert run_trainer([*args, f"run.dir={run}"], tmp_path, env=faults(preempt_at_step=3)).returncode == 75
    ok(run_trainer([*args, f"run.dir={run}"], tmp_path))
    a, b = (torch.load(result_of(r)["checkpoint"], weights_only=True)["model"] for r in (ref, run))
    assert result_of(run)["global_step"] == 12 and all(torch.equal(a[k], b[k]) for k in a)


def test_a_random_split_is_seeded_by_sample_and_a_worker_init_reaches_the_users_set() -> None:
    """random_split's Subset reads sample by sample: each seeded by itself whatever its micro-batch (micro-batches
    of 4 on one process, 8 on each of two, a global batch of 16); an attribute a worker_init_fn sets on the worker's
    dataset reaches the user's set."""
    from torch.utils.data import Subset, get_worker_info

    part = Subset(Augmented(), list(range(0, 96, 2)))
    one = {float(r[0]): r for b in batches(train_loader(part, env(), 4, 16, 7, print, num_workers=1), 8) for r in b}
    two = {float(r[0]): r for rank in (0, 1) for b in batches(train_loader(part, env(rank, 2), 8, 16, 7, print,
                                                                           num_workers=1), 2) for r in b}
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)

    class Opened(Augmented):
        handle = "unset"

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.tensor([float(i), float(self.handle == "opened")])

    def init(_: int) -> None:
        info = get_worker_info()
        assert info is not None
        info.dataset.handle = "opened"  # type: ignore[attr-defined]

    got = batches(train_loader(Opened(), env(), 8, None, 7, print, num_workers=1, worker_init_fn=init), 1)[0]
    assert bool((got[:, 1] == 1).all()), got
