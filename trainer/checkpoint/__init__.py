"""Checkpoints with a commit protocol: one interface, two formats (a single file, or DCP shards), the state of the
objects a loop restores, and finding the newest complete checkpoint to resume from. Imports only ``trainer.core``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from trainer.checkpoint.base import Checkpointer


def sharded_format(format: str, sharded_model: bool) -> bool:
    """Whether checkpoints are DCP shards (every rank writes its part): ``checkpoint.format`` dcp, or auto under fsdp."""
    return format == "dcp" or (format == "auto" and sharded_model)


def open_checkpointer(sharded: bool, folder: Path, is_main: bool, keep: int,
                      on_write: Callable[[], None] | None = None, model: nn.Module | None = None) -> Checkpointer:
    """The sharded (DCP) checkpointer for ``model``'s shards, else the single-file one (``on_write``: a sign of life
    for the hang watchdog while rank 0 writes)."""
    if sharded:
        from trainer.checkpoint.sharded import ShardedCheckpointer

        return ShardedCheckpointer(folder, is_main, keep, model)
    from trainer.checkpoint.file import FileCheckpointer

    return FileCheckpointer(folder, is_main, keep, on_write)
