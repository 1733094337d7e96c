"""The one seam through which tests act inside the runtime: named points the production code passes, each doing
nothing unless a test installed its faults (``TRAINER_FAULTS``, trainer/testing/faults.py, overrides them).

Parts call ``hooks.current().<point>(…)`` where a fault may act; no production constructor takes a test fault.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class Hooks:
    """Every point a test may act at; here, none acts."""

    end_in_s: float = 0.0
    """The job's time limit this many seconds after the session starts (0: Slurm's own)."""
    records: bool = False
    """Whether ``record`` wants the samples of every micro-batch (building the entry has a cost)."""

    def step_begin(self, done: int, rank: int) -> None:
        """As a step starts, ``done`` steps of this process finished."""

    def step_end(self, done: int, rank: int, preemption_signal: str, run_dir: Path, alive: Callable[[], None],
                 signalled: Callable[[], bool]) -> int:
        """At the end of this process's step ``done``, before the ranks agree on saving: a signal number to act on as
        if it had arrived (0: none)."""
        return 0

    def stretch(self, seconds: float, rank: int, step: int) -> None:
        """Inside a measured compute phase that took ``seconds`` (the straggler meter's)."""

    def flip(self, model: torch.nn.Module, rank: int, step: int) -> None:
        """After ``step``'s agreement: the model's parameters as this rank's memory holds them."""

    def flip_grad(self, grad: torch.Tensor, index: int, count: int, rank: int, step: int) -> torch.Tensor:
        """Parameter ``index`` of ``count``'s local gradient as this rank computes it (the replay audit's)."""
        return grad

    def write_pause(self, step: int) -> float:
        """Seconds a checkpoint write of ``step`` pauses half-way (still writing)."""
        return 0.0

    def record(self, rank: int, entry: dict[str, Any]) -> None:
        """A sharded set's loader handed out a micro-batch: its samples (the per-sample ledger)."""

    def doctor_fails(self, node: str, rank: int) -> bool:
        """Whether the preflight doctor fails on this node and rank."""
        return False


_current: Hooks = Hooks()


def current() -> Hooks:
    """The hooks of this process: a test's faults once installed, else the ones that do nothing."""
    return _current


def install(hooks: Hooks) -> Hooks:
    """Make ``hooks`` this process's (the session does, with the faults TRAINER_FAULTS names); returns them."""
    global _current
    _current = hooks
    return hooks
