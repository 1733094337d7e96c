"""The global batch as the contract: how a number of processes splits it into micro-batches and accumulation steps.

No torch here: `python -m cluster submit` checks a global batch against every world size of a node range with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainer.core.errors import UserError


@dataclass(frozen=True)
class BatchPlan:
    """One optimizer step: ``global_batch`` samples = ``world_size`` processes × ``micro`` × ``accumulation``."""

    global_batch: int
    world_size: int
    micro: int
    """Samples per process per micro-batch."""
    accumulation: int
    """Micro-batches per optimizer step (gradients are reduced on the last one)."""

    def describe(self) -> str:
        return (f"global batch {self.global_batch} = {self.world_size} process(es) × {self.micro} samples × "
                f"{self.accumulation} accumulation step(s)")

    def advice(self, cap: int) -> str:
        """A note when the share of each process splits only into micro-batches well under ``cap`` (slow steps)."""
        if self.accumulation == 1 or 2 * self.micro > cap:
            return ""
        better = max(1, round(self.global_batch / (self.world_size * cap))) * self.world_size * cap
        return (f"; note: {self.micro * self.accumulation} samples per process split into no fuller equal "
                f"micro-batches: a global batch of {better} would run micro-batches of {cap}")


def plan(global_batch: int, world_size: int, max_micro: int, field: str = "data.global_batch_size") -> BatchPlan:
    """Split ``global_batch`` over ``world_size`` processes in the fewest micro-batches of at most ``max_micro``
    samples each; a UserError naming ``field`` when the processes cannot share it equally."""
    if global_batch % world_size:
        fits = [w for w in range(1, min(global_batch, 4 * world_size) + 1) if global_batch % w == 0]
        raise UserError(field, f"{global_batch} samples per step do not split equally across {world_size} processes",
                        f"use a multiple of {world_size} (e.g. {field}={math.ceil(global_batch / world_size) * world_size}), "
                        f"or run on {', '.join(map(str, fits[-6:]))} processes")
    share = global_batch // world_size
    accumulation = math.ceil(share / max_micro)
    while share % accumulation:  # equal micro-batches: a mean of means is then the mean of the global batch
        accumulation += 1
    return BatchPlan(global_batch, world_size, share // accumulation, accumulation)


def kept_plan(global_batch: int, world_size: int, max_micro: int) -> tuple[BatchPlan, str]:
    """The plan of a global batch the job kept from its first attempt (the user set none) on ``world_size``
    processes; where they cannot share it equally, the nearest global batch below that they can, and a note saying
    so (empty otherwise): a node lost from 4 to 3 continues with 126 samples a step rather than failing on 128."""
    if global_batch % world_size == 0:
        return plan(global_batch, world_size, max_micro, "the checkpoint's global batch"), ""
    near = max(global_batch // world_size, 1) * world_size
    return plan(near, world_size, max_micro), (
        f"note: the first attempt's global batch of {global_batch} does not split equally across {world_size} "
        f"processes: {near} samples per step from here on (data.global_batch_size sets one that every size divides)")


def check_worlds(global_batch: int, worlds: list[int], max_micro: int, field: str = "data.global_batch_size") -> None:
    """Every world size in ``worlds`` can share ``global_batch`` (a node range, checked at submit time)."""
    for world in worlds:
        try:
            plan(global_batch, world, max_micro, field)
        except UserError as exc:
            if len(worlds) > 1:
                every = math.lcm(*worlds)
                raise UserError(field, f"{exc.message}, one of the world sizes {worlds[0]}-{worlds[-1]} this job may "
                                f"start with", f"use a multiple of {every}, which each of them divides (e.g. {field}="
                                f"{math.ceil(global_batch / every) * every}), or a narrower node range") from None
            raise
