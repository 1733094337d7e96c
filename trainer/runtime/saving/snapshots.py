"""Memory snapshots as the session takes them: whether (``checkpoint.memory``), how often (``memory_every_steps``, or
Young/Daly's interval from their measured stall), and what they cost; the store itself is
``trainer.checkpoint.memory``. A snapshot that cannot be taken is a warning and the end of snapshots for the run,
never of the run."""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer.checkpoint.memory import KEEP, MemorySnapshots, place
from trainer.core.dist import host_group
from trainer.core.env import DistEnv, JobInfo
from trainer.core.errors import UserError
from trainer.core.schema import Config, takes_snapshots
from trainer.runtime.poll import Layout, Message
from trainer.runtime.saving.cadence import history

FIRST_EVERY = 10
"""Steps between snapshots before their stall is measured (checkpoint.memory_every_steps=0)."""
MAX_OVERHEAD = 0.02
"""Snapshots never take more than 2 % of the training time."""


def wanted(cfg: Config, job: JobInfo) -> bool:
    """Whether this run takes memory snapshots (``takes_snapshots``: a job with the store regroups in place)."""
    return takes_snapshots(cfg, job.in_place, job.store is not None)


def interval_steps(stall_s: float, step_s: float, mtbf_s: float) -> int:
    """Young/Daly's √(2·C·M) in steps, at least one step and at least C / MAX_OVERHEAD."""
    if step_s <= 0:
        return FIRST_EVERY
    seconds = max(math.sqrt(2 * stall_s * mtbf_s), stall_s / MAX_OVERHEAD)
    return max(1, min(100_000, round(seconds / step_s)))


class Snapshots:
    """A run's memory snapshots on this rank: the store, the agreed interval, the stalls (rank 0 proposes the
    interval from its measurements; the save policy's poll agrees it)."""

    def __init__(self, store: MemorySnapshots, cfg: Config, env: DistEnv, job: JobInfo,
                 emit: Callable[..., None]) -> None:
        self.store, self.env, self.emit = store, env, emit
        self.fixed = cfg.checkpoint.memory_every_steps
        self.every = self.fixed or FIRST_EVERY
        self.mtbf_s = (cfg.checkpoint.mtbf_hours or job.mtbf_hours) * 3600 / max(1, env.num_nodes)
        self.stall_s: float | None = None
        self.taken = 0
        self.fetched = 0
        """Bytes this node received from other nodes to restore a snapshot."""
        self.off: str | None = None
        self._clock: tuple[float, int] | None = None

    @classmethod
    def open(cls, cfg: Config, env: DistEnv, job: JobInfo, run_dir: Path, sharded: bool, model: torch.nn.Module | None,
             emit: Callable[..., None]) -> Snapshots | None:
        """The run's snapshots (``emit``: the event log's), or None when not wanted."""
        if not wanted(cfg, job):
            return None
        folder = place(job.memory_dir, env.job_id, job.restart_count, run_dir)
        made = cls(MemorySnapshots(env, folder, sharded, model), cfg, env, job, emit)
        if env.is_main:  # as the auto cadence does: the prior, corrected by the interruptions this run has seen
            ran, lost, _ = history(run_dir)
            made.mtbf_s = (ran + made.mtbf_s) / (lost + 1)
        return made

    def check_room(self, objects: dict[str, Any], explicit: bool) -> None:
        """Collective, before the first step: every node has room for the snapshots it will hold, else a UserError
        (``checkpoint.memory=on``: how much is needed and how much there is) or, for ``auto``, one note and none."""
        need = KEEP * 2 * _bytes(objects) * (self.env.local_world_size if self.store.sharded else 1)
        free = shutil.disk_usage(_existing(self.store.folder)).free if self.store.lead else need
        short = torch.tensor([need - free if free < need else 0, need], dtype=torch.int64)
        if self.env.world_size > 1:
            dist.all_reduce(short, op=dist.ReduceOp.MAX, group=host_group())
        if short[0] <= 0:
            return
        what = (f"snapshots need about {short[1] / 2**20:.0f} MiB in {self.store.folder.parents[2]} on each node, "
                f"{(short[1] - short[0]) / 2**20:.0f} MiB free on the fullest")
        if explicit:
            raise UserError("checkpoint.memory", what, "free memory there (TRAINER_MEMORY_DIR: another RAM-backed "
                            "folder), or checkpoint.memory=off")
        self.off = what
        if self.env.is_main:
            print(f"note: no memory snapshots: {what} (checkpoint.memory=auto)", flush=True)

    def register(self, layout: Layout) -> None:
        self.field = layout.add("snapshot interval")

    def send(self, message: Message, step: int) -> None:
        message.put(self.field, self.propose(step))

    def receive(self, message: Message, step: int) -> None:
        """The interval rank 0 proposed, on every rank."""
        if message.get(self.field):
            self.every = int(message.get(self.field))

    def propose(self, step: int) -> int:
        """Rank 0's interval in steps for the next poll to agree (0 from the other ranks)."""
        now = time.monotonic()
        if not self.env.is_main or self.fixed:
            return self.fixed if self.env.is_main else 0
        if self._clock is not None and step > self._clock[1] and self.stall_s is not None:
            step_s = (now - self._clock[0]) / (step - self._clock[1])
            self.every = interval_steps(self.stall_s, step_s, self.mtbf_s)
        self._clock = (now, step)
        return self.every

    def due(self, step: int) -> bool:
        """Whether to snapshot after ``step`` (the same answer on every rank)."""
        return self.off is None and step % self.every == 0

    def take(self, state: dict[str, Any], sharded: dict[str, Any], step: int) -> None:
        """Collective: one snapshot; a failure on any rank (a full /dev/shm) ends snapshots on every rank, with a
        warning, and training goes on."""
        started = time.perf_counter()
        # The last background write (a node's lead's alone) fails in wait(); every rank then takes part in the
        # save's collectives all the same, and both outcomes are agreed below.
        waited = _failure(self.store.wait)
        failed = _failure(lambda: self.store.save(state, sharded, step))
        failed = waited or failed
        stall = time.perf_counter() - started
        flag = torch.tensor([int(bool(failed))], dtype=torch.int32)
        if self.env.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=host_group())
        if flag.item():
            self.off = failed or "another rank could not take one"
            if self.env.is_main or failed:
                print(f"warning: memory snapshots stop ({self.off}); durable checkpoints go on", flush=True)
            return
        self.stall_s = stall if self.stall_s is None else 0.5 * (self.stall_s + stall)
        self.taken += 1
        self.emit("snapshot", step=step, stall_s=round(stall, 4), every=self.every)

    def close(self, finished: bool) -> None:
        """Wait for a background write; a run that ended (finished, or saved for a requeue) removes its snapshots."""
        try:
            self.store.wait()
        except (OSError, RuntimeError) as exc:
            print(f"warning: the last memory snapshot failed ({exc})", flush=True)
        if finished:
            self.store.clear()


def _failure(fn: Callable[[], Any]) -> str:
    """``fn()``'s error in a line ("" when none): any error of one rank's (a write, a pickle, memory) is agreed by
    the caller, never raised past a collective."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"[:200]
    return ""


def _bytes(objects: dict[str, Any]) -> int:
    """The bytes of the objects' tensors as a snapshot holds them (optimizers without state yet: as many again as
    the parameters per moment they will keep)."""
    total = 0
    for obj in objects.values():
        inner = getattr(obj, "module", obj)
        if isinstance(inner, torch.nn.Module):
            total += sum(t.numel() * t.element_size() for t in inner.state_dict().values() if isinstance(t, torch.Tensor))
        elif isinstance(inner, torch.optim.Optimizer):
            params = sum(p.numel() * p.element_size() for g in inner.param_groups for p in g["params"])
            total += params * (2 if "betas" in inner.defaults else 1)
    return total


def _existing(folder: Path) -> Path:
    """The nearest folder above ``folder`` that exists (for its free space before the first snapshot)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder

