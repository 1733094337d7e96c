"""DDP training that runs the same on a laptop, under torchrun, and on Slurm nodes.

The public API for your own loop (see trainer/runtime/session.py and examples/char_lm/):

- ``Session(args)``: process group, device, signals and run folder from the environment and ``key=value`` overrides.
- ``PerRank(obj)``: checkpoint an object whose state differs per rank (or a ``torch.Generator``).
- ``Task``: the protocol a ``task.target`` implements for the built-in loop.
- ``main(fn)``: run ``fn()`` and exit with its code; bad input prints its error and HINT and exits 2.
- ``UserError``: raise it for bad input of your own (field, message, hint); ``main`` prints it and exits 2.
- ``Shards(paths, reader, transform)``: shard files (WebDataset tar, JSONL, Parquet, Arrow, tokens) as one data set
  that ``Session.loader`` resumes exactly on any world size (trainer/data/).

The packages, each importing only those below it: ``builtin`` and the tools (``doctor``, ``report``, ``export``,
``launch``) → ``runtime`` → ``checkpoint``, ``testing``, ``data`` → ``core`` (docs/architecture.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["PerRank", "Session", "Shards", "Task", "UserError", "main"]

if TYPE_CHECKING:
    from trainer.builtin.task import Task
    from trainer.core.errors import UserError, main
    from trainer.data.shards import Shards
    from trainer.runtime.session import PerRank, Session

# Imported on first use: `import trainer` loads no torch, so `python -m trainer` checks its config and the
# command-line tools start before torch is loaded.
_EXPORTS = {"Session": "trainer.runtime.session", "PerRank": "trainer.runtime.session", "Task": "trainer.builtin.task",
            "main": "trainer.core.errors", "UserError": "trainer.core.errors",
            "Shards": "trainer.data.shards"}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
