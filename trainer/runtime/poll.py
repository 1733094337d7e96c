"""The poll: what the ranks agree on at a step boundary, in one small all-reduce (MAX) of host tensors.

Each part that takes part registers its fields with the layout (a signal any rank got, rank 0's timed save, the
snapshot interval it proposes, every rank's compute time…); the positions in the tensor are derived from the
registrations, never kept by hand. A part puts its values before the all-reduce and reads the agreed ones after.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from trainer.core.dist import host_group


@dataclass(frozen=True)
class Field:
    """One field of the poll: ``size`` values from ``start`` (one, or one per rank)."""

    name: str
    start: int
    size: int


class Layout:
    """The poll's fields, in the order the parts registered them."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.fields: dict[str, Field] = {}
        self.size = 0

    def add(self, name: str, per_rank: bool = False) -> Field:
        """A new field: one value (the maximum over the ranks), or ``per_rank`` one value per rank."""
        if name in self.fields:
            raise ValueError(f"poll field {name!r} registered twice")
        made = self.fields[name] = Field(name, self.size, self.world_size if per_rank else 1)
        self.size += made.size
        return made


class Message:
    """One poll's values: put before the all-reduce (MAX), read after. float64 holds signal numbers, flags, step
    counts and seconds exactly enough."""

    def __init__(self, layout: Layout, rank: int) -> None:
        self.values = torch.zeros(layout.size, dtype=torch.float64)
        self.rank = rank

    def put(self, field: Field, value: float) -> None:
        """This rank's value: the field's own, or its slot of a per-rank field."""
        self.values[field.start + (self.rank if field.size > 1 else 0)] = value

    def get(self, field: Field) -> float:
        return float(self.values[field.start])

    def each(self, field: Field) -> tuple[float, ...]:
        """A per-rank field's values, in rank order."""
        return tuple(self.values[field.start:field.start + field.size].tolist())

    def agree(self, world_size: int) -> None:
        """Collective: the maximum of every value over the ranks (on the host: a device tensor read here would wait
        for every queued kernel)."""
        if world_size > 1:
            dist.all_reduce(self.values, op=dist.ReduceOp.MAX, group=host_group())


class PollPart(Protocol):
    """A part that has something to agree at the polls."""

    def register(self, layout: Layout) -> None:
        """Add its fields (once, as the poll is built)."""

    def send(self, message: Message, step: int) -> None:
        """Put this rank's values for the poll at ``step``."""

    def receive(self, message: Message, step: int) -> None:
        """Read what the ranks agreed at ``step``."""
