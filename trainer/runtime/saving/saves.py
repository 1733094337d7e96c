"""A run's saves as the session takes them: the checkpointer (either format), when to save (the policy), and what
each save cost the training ranks (its stall), recorded in the event log and fed to the save policy's cadence."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.base import Checkpointer
from trainer.checkpoint.resume import Resumed
from trainer.core.errors import EXIT_REQUEUE
from trainer.core.events import EventLog
from trainer.core.records import RequeueMarker
from trainer.runtime.health.heartbeat import Heartbeat
from trainer.runtime.records.rundir import RunDir
from trainer.runtime.saving.policy import SavePolicy


class Saves:
    """Saves through ``checkpointer`` under the hang watchdog; remembers the last one and the stalls so far."""

    def __init__(self, checkpointer: Checkpointer, policy: SavePolicy, heartbeat: Heartbeat, events: EventLog,
                 is_main: bool, resumed: Resumed | None) -> None:
        self.checkpointer, self.policy, self.heartbeat, self.events = checkpointer, policy, heartbeat, events
        self.is_main = is_main
        durable = resumed if resumed and not resumed.memory else None  # a snapshot is no save: the end saves durably
        self.saved_step: int | None = int(durable.state["step"]) if durable else None
        """The step of the newest durable checkpoint this run has (saved or resumed from)."""
        self.last_path: Path | None = durable.path if durable else None
        self.stall_s = 0.0
        """Seconds this process spent in ``save`` (result.json: checkpoint_stall_s)."""

    def save(self, state: dict[str, Any], sharded: dict[str, Any], step: int, blocking: bool) -> Path:
        """Collective: commit ``state`` (and the ``sharded`` objects) as step ``step``; the event log gets its stall."""
        self.heartbeat.beat("checkpoint save", step)
        started = time.perf_counter()
        # Sharded: every rank writes its shards, no rank waits on another. One file: rank 0 beats while it writes.
        with self.heartbeat.waiting(self.checkpointer.every_rank_writes or not self.is_main):
            path = self.checkpointer.save(state, step, blocking=blocking, sharded=sharded)
        stall = time.perf_counter() - started  # training waited this long (the copy, for async saves)
        self.stall_s += stall
        self.saved_step, self.last_path = step, path
        if self.is_main:  # a background save's size is not known yet: its time is the stall
            size = _size_on_disk(path) if blocking else None
            self.events.emit("checkpoint", durable=True, step=step, stall_s=round(stall, 4), blocking=blocking,
                             bytes=size, path=str(path))
        self.policy.saved(stall, blocking)
        self.say_cadence()
        return path

    def requeue(self, run: RunDir, step: int, signal: str | None, at_limit: bool) -> int:
        """Collective, after the save a preemption ``signal`` (None: the time limit near) asked for: the requeue
        marker, one line, the exit event; the exit code that asks the launcher to requeue."""
        run.mark_requeue(RequeueMarker("deadline" if at_limit or not signal else signal, step, str(self.last_path)))
        torch.distributed.barrier()  # the marker exists before any rank exits (srun may then kill the rest)
        head = f"{signal} received" if signal else "the time limit is near"
        if self.is_main:
            print(f"\n{head}: saved {self.last_path} at step {step}; exiting with {EXIT_REQUEUE} so the launcher "
                  "requeues", flush=True)
        self.events.emit("exit", durable=True, code=EXIT_REQUEUE, step=step)
        return EXIT_REQUEUE

    def say_cadence(self) -> None:
        """The auto cadence's interval when new or moved: one printed line, and a ``cadence`` event for the report."""
        cadence = self.policy.cadence
        news = cadence.news() if cadence else None
        if cadence and news:
            print(news, flush=True)
            self.events.emit("cadence", interval_s=round(cadence.interval(), 1), stall_s=round(cadence.stall_s, 3),
                             mtbf_s=round(cadence.mtbf_s))


def _size_on_disk(path: Path) -> int:
    """Bytes of a checkpoint: one file, or a sharded step folder's files."""
    return sum(f.stat().st_size for f in path.iterdir()) if path.is_dir() else path.stat().st_size
