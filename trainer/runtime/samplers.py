"""Samplers a loader resumes from: the training set's (exact resume) and an evaluation set's (disjoint shards)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import Dataset, DistributedSampler, Sampler

from trainer.core.env import DistEnv


class ResumableSampler(DistributedSampler):  # type: ignore[type-arg]
    """DistributedSampler that can start an epoch part-way through, skipping samples already trained on.

    The permutation depends only on (seed, epoch), not on the number of processes, so a resumed run
    sees exactly the batches the uninterrupted run would have seen.
    """

    def __init__(self, dataset: Dataset[Any], env: DistEnv, seed: int) -> None:
        super().__init__(dataset, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=seed)
        self.skip = 0

    def start_epoch(self, epoch: int, skip_samples: int = 0) -> None:
        """Call before each epoch: reshuffles for ``epoch`` and skips this rank's first ``skip_samples``."""
        self.set_epoch(epoch)
        self.skip = skip_samples

    def __iter__(self) -> Iterator[int]:
        return iter(list(super().__iter__())[self.skip:])

    def __len__(self) -> int:
        return self.num_samples - self.skip


class ShardSampler(Sampler[int]):
    """Every rank takes ``rank::world_size``: disjoint shards that cover the set exactly once, no padding,
    so all-reduced evaluation sums count each sample once (DistributedSampler pads with repeats)."""

    def __init__(self, n: int, env: DistEnv) -> None:
        self.indices = range(env.rank, n, env.world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
