"""The one checkpointer interface: save (blocking or in the background), wait, latest, prune. The session calls it
without knowing the format; ``trainer.checkpoint.open_checkpointer`` picks the single-file or the sharded (DCP) one."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.checkpoint import layout
from trainer.core.dist import on_main


class Checkpointer(ABC):
    """Saves ``step_<N>`` checkpoints in ``folder`` under the commit protocol; only rank 0 commits."""

    every_rank_writes = False
    """Whether every rank writes its own part of a save (sharded), or rank 0 writes while the others wait."""

    def __init__(self, folder: Path, is_main: bool, keep: int) -> None:
        self.folder, self.is_main, self.keep = folder, is_main, keep
        self.last_path: Path | None = None
        self._error: BaseException | None = None

    @abstractmethod
    def save(self, state: dict[str, Any], step: int, blocking: bool = True,
             sharded: dict[str, Any] | None = None) -> Path:
        """Collective: commit ``state`` (rank 0's: step, loaders, user dicts) and ``sharded`` (models and optimizers
        that every rank holds a part of; the single-file format takes them from ``state``) as step ``step``.
        ``blocking=False`` returns once the state is copied and writes in the background, one save at a time."""

    @abstractmethod
    def _join(self) -> None:
        """Block until the background save in flight, if any, has ended (committed or failed into ``_error``)."""

    def wait(self) -> None:
        """Block until a background save has committed; re-raise its error here."""
        self._join()
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"background checkpoint save failed: {err}") from err

    def wait_all(self) -> None:
        """Collective: :meth:`wait` on every rank, rank 0's error raised on every rank (only rank 0 commits: a
        failure it alone saw must not leave the others in the next collective)."""
        own: RuntimeError | None = None
        if not self.is_main:
            try:
                self.wait()  # this rank's part of a sharded save (DCP fails on every rank alike)
            except RuntimeError as exc:
                own = exc
        self._on_main(self.wait, "background save")
        if own is not None:
            raise own

    def latest(self) -> Path | None:
        """The newest committed checkpoint in the folder, or None."""
        return layout.latest(self.folder)

    def prune(self) -> None:
        """Keep the newest ``keep`` committed checkpoints (rank 0; each commit prunes by itself)."""
        if self.is_main:
            layout.prune(self.folder, self.keep)

    def _on_main(self, fn: Callable[[], None], what: str) -> None:
        """Collective: run ``fn`` on rank 0 and tell every rank how it went, so that no rank waits at a barrier for a
        rank 0 that failed (a full disk): rank 0 re-raises its error, the others raise a RuntimeError naming it."""
        on_main(self.is_main, fn, f"checkpoint {what}")
