"""Random augmentation in loader workers, decided by the sample and not by the worker that read it.

A worker draws from RNGs seeded when it started, so a crop or a flip depends on which worker read the sample and how
many it read before: a resumed run (whose workers start afresh mid-epoch), another ``num_workers`` or another number
of processes would draw other ones. Here each sample is read under seeds made from (the loader's seed, the epoch, the
sample), so those runs see the very same augmented samples as the uninterrupted one. In the training process itself
(``num_workers=0``) nothing is reseeded: its RNG is the model's, saved and restored with every checkpoint.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import numpy as np
import torch
import xxhash
from torch.utils.data import Dataset, Sampler, Subset


class Epoched(Protocol):
    """A sampler that knows the epoch it orders (``start_epoch`` sets it before each epoch)."""

    epoch: int


def reseed(seed: int, epoch: int, key: Any) -> None:
    """Seed this process's torch, ``random`` and NumPy RNGs for reading sample ``key`` of ``epoch``."""
    value = xxhash.xxh64_intdigest(f"{seed}:{epoch}:{key}".encode())
    torch.default_generator.manual_seed(value >> 1)  # torch.manual_seed also seeds each GPU backend: 20× the time
    random.seed(value)
    np.random.seed(value % 2**32)


class Seeded(Dataset[Any]):
    """``dataset`` read by ``(epoch, key)``: each sample under its own seeds (:func:`reseed`)."""

    dataset: Dataset[Any]
    seed: int

    def __init__(self, dataset: Dataset[Any], seed: int) -> None:
        self.__dict__.update(dataset=dataset, seed=seed)
        # A Subset (random_split's) reads sample by sample anyway: through __getitem__, each sample seeded. Only a set
        # that truly reads a batch at once (its __getitems__ its own) is seeded once a batch, from its first sample.
        if isinstance(dataset, Subset) or not callable(getattr(dataset, "__getitems__", None)):
            self.__dict__["__getitems__"] = None  # DataLoader's fetcher then reads sample by sample, through __getitem__

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, tagged: tuple[int, Any]) -> Any:
        epoch, key = tagged
        reseed(self.seed, epoch, key)
        return self.dataset[key]

    def __getitems__(self, tagged: list[tuple[int, Any]]) -> Any:
        """A set that reads a batch at once: one seed for the batch, from its first sample."""
        reseed(self.seed, *tagged[0])
        return self.dataset.__getitems__([key for _, key in tagged])  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:  # the user's set's own attributes (classes, …) through the loader
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __setattr__(self, name: str, value: Any) -> None:
        """To the user's set: a worker_init_fn's ``get_worker_info().dataset.handle = open(…)`` reaches it."""
        setattr(self.dataset, name, value)


class Tagged(Sampler[list[tuple[int, Any]]]):
    """``batches`` (lists of sample keys) as ``(epoch, key)`` pairs, the epoch read from ``sampler`` as each pass
    starts (the loader sets it just before)."""

    def __init__(self, batches: Iterable[list[Any]], sampler: Epoched) -> None:
        self.batches, self.sampler = batches, sampler

    def __iter__(self) -> Iterator[list[tuple[int, Any]]]:
        epoch = self.sampler.epoch
        for batch in self.batches:
            yield [(epoch, key) for key in batch]

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]
