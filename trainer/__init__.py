"""DDP training that runs the same on a laptop, under torchrun, and on Slurm nodes.

The public API for your own loop (see trainer/session.py and examples/char_lm/):

- ``Session(args)``: process group, device, signals and run folder from the environment and ``key=value`` overrides.
- ``PerRank(obj)``: checkpoint an object whose state differs per rank.
- ``Task``: the protocol a ``task.target`` implements for the built-in loop.
- ``main(fn)``: run ``fn()`` and exit with its code; bad input prints its error and HINT and exits 2.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["PerRank", "Session", "Task", "main"]

if TYPE_CHECKING:
    from trainer.entry import main
    from trainer.session import PerRank, Session
    from trainer.task import Task


def __getattr__(name: str) -> Any:
    # Imported on first use: `python -m trainer` checks its config before torch is loaded.
    if name in ("Session", "PerRank"):
        from trainer import session

        return getattr(session, name)
    if name == "Task":
        from trainer.task import Task

        return Task
    if name == "main":
        from trainer.entry import main

        return main
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
