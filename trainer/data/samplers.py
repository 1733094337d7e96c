"""Samplers a loader resumes from: the training set's (exact resume; per rank, by global batch, or a sharded set's
stream) and an evaluation set's (disjoint parts)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, DistributedSampler, Sampler

from trainer.core.env import DistEnv
from trainer.core.exits import attempt_id
from trainer.data.batches import BatchPlan
from trainer.data.shards import Order, Shards


class ResumableSampler(DistributedSampler):  # type: ignore[type-arg]
    """DistributedSampler that can start an epoch part-way through, skipping samples already trained on.

    The permutation depends only on (seed, epoch), not on the number of processes, so a resumed run
    sees exactly the batches the uninterrupted run would have seen.
    """

    def __init__(self, dataset: Dataset[Any], env: DistEnv, seed: int, shuffle: bool = True) -> None:
        super().__init__(dataset, num_replicas=env.world_size, rank=env.rank, shuffle=shuffle, seed=seed)
        self.skip = 0

    def start_epoch(self, epoch: int, skip_samples: int = 0) -> None:
        """Call before each epoch: reshuffles for ``epoch`` and skips this rank's first ``skip_samples``."""
        self.set_epoch(epoch)
        self.skip = skip_samples

    def __iter__(self) -> Iterator[int]:
        return iter(list(super().__iter__())[self.skip:])

    def __len__(self) -> int:
        return self.num_samples - self.skip


class GlobalBatchSampler(Sampler[list[int]]):
    """This rank's micro-batches of each global batch: the epoch's order is a function of (seed, epoch) alone, global
    batch k is its k-th slice of ``plan.global_batch`` samples, and rank r takes the r-th equal part of it. So any
    number of processes that can share the global batch trains on the same samples at every optimizer step, and a
    position is a count of global samples. The last partial global batch of an epoch is dropped (no padding)."""

    def __init__(self, n: int, plan: BatchPlan, rank: int, seed: int, shuffle: bool = True) -> None:
        self.n, self.plan, self.rank, self.seed, self.shuffle = n, plan, rank, seed, shuffle
        self.steps_per_epoch = n // plan.global_batch
        self.epoch, self.skip = 0, 0

    def start_epoch(self, epoch: int, skip_micro: int = 0) -> None:
        """Call before each epoch: its order, and this rank's first ``skip_micro`` micro-batches skipped."""
        self.epoch, self.skip = epoch, skip_micro

    def order(self, epoch: int) -> list[int]:
        """The epoch's sample order (DistributedSampler's: a permutation seeded with seed + epoch; else the set's)."""
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        order, p = self.order(self.epoch), self.plan
        share = p.micro * p.accumulation
        for k in range(self.skip, self.steps_per_epoch * p.accumulation):
            step, i = divmod(k, p.accumulation)
            start = step * p.global_batch + self.rank * share + i * p.micro
            yield order[start:start + p.micro]

    def __len__(self) -> int:
        return self.steps_per_epoch * self.plan.accumulation - self.skip


class ShardSampler(Sampler[int]):
    """Every rank takes ``rank::world_size``: disjoint shards that cover the set exactly once, no padding,
    so all-reduced evaluation sums count each sample once (DistributedSampler pads with repeats)."""

    def __init__(self, n: int, env: DistEnv) -> None:
        self.indices = range(env.rank, n, env.world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class StreamSampler(Sampler[list[tuple[int, int]]]):
    """This rank's micro-batches of a sharded set's stream (trainer/data/shards.py). Global batch k of an epoch is
    stream positions ``base + k·G … base + (k+1)·G - 1`` and rank r takes the r-th equal part of it, so the samples
    of every step, and the step at which an epoch ends, do not depend on how many processes or workers read them.
    ``base`` is where this split of the epoch began: a resume on another world size starts at the next unread
    sample, exactly."""

    def __init__(self, shards: Shards, plan: BatchPlan, rank: int, seed: int) -> None:
        self.shards, self.plan, self.rank, self.seed = shards, plan, rank, seed
        self.epoch, self.skip, self.base = 0, 0, 0

    def steps(self, base: int) -> int:
        """Whole global batches left in an epoch split from ``base`` on."""
        return (len(self.shards) - base) // self.plan.global_batch

    @property
    def steps_per_epoch(self) -> int:
        """Whole global batches left in the epoch from ``base``."""
        return self.steps(self.base)

    def start_epoch(self, epoch: int, skip_micro: int = 0, base: int = 0) -> None:
        """Call before each epoch: its order, where this split began, and this rank's micro-batches to skip."""
        self.epoch, self.skip, self.base = epoch, skip_micro, base

    def items(self, k: int, order: Order | None = None) -> list[tuple[int, int]]:
        """This rank's micro-batch ``k`` of the epoch's split: (shard, sample) pairs."""
        p = self.plan
        step, i = divmod(k, p.accumulation)
        start = self.base + step * p.global_batch + self.rank * p.micro * p.accumulation + i * p.micro
        return (order or self.shards.order(self.seed, self.epoch)).take(start, p.micro)

    def ledger_entry(self, epoch: int, k: int) -> dict[str, object]:
        """Micro-batch ``k`` as the exactly-once tests' ledger records it: where its step starts in the stream."""
        step_start = self.base + k // self.plan.accumulation * self.plan.global_batch
        return {"attempt": attempt_id(), "epoch": epoch, "step_start": step_start, "world": self.plan.world_size,
                "items": self.items(k)}

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        order = self.shards.order(self.seed, self.epoch)
        for k in range(self.skip, self.steps_per_epoch * self.plan.accumulation):
            yield self.items(k, order)

    def __len__(self) -> int:
        return self.steps_per_epoch * self.plan.accumulation - self.skip
