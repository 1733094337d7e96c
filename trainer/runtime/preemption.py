"""Preemption signals and the save policy, agreed across ranks at step boundaries (never acted on in a handler)."""

from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist

from trainer.core.config import CheckpointConfig
from trainer.core.dist import host_group
from trainer.core.env import DistEnv


class Preemption:
    """Sets a flag when a preemption signal arrives; the loop acts on it at the next step boundary."""

    def __init__(self, signals: tuple[int, ...]) -> None:
        self.signum = 0
        self.previous = {sig: signal.signal(sig, self._handle) for sig in signals}

    def _handle(self, signum: int, frame: object) -> None:
        self.signum = signum  # no I/O in a handler: it may interrupt a write

    def restore(self) -> None:
        """Put back the handlers that were there before (e.g. submitit's)."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class SavePolicy:
    """When to save: every N steps, every M minutes (rank 0's clock), and when any rank was signalled.

    Every ``poll_steps`` steps (and when asked, e.g. at an epoch end) one small all-reduce of host tensors tells every
    rank whether anyone was signalled and whether a timed save is due, so all ranks stop or save together.
    """

    def __init__(self, cfg: CheckpointConfig, env: DistEnv, preemption: Preemption) -> None:
        self.cfg, self.env, self.preemption = cfg, env, preemption
        self.last_save = time.monotonic()

    def poll(self, step: int, force: bool = False) -> tuple[int, bool]:
        """Collective at a step boundary: (signal number any rank received or 0, whether a save is due now)."""
        every = self.cfg.every_steps
        due_by_steps = bool(every and step % every == 0)
        if not force and step % self.cfg.poll_steps:
            return 0, due_by_steps
        timed = (self.cfg.every_minutes > 0 and self.env.is_main
                 and time.monotonic() - self.last_save >= 60 * self.cfg.every_minutes)
        flags = torch.tensor([self.preemption.signum, int(timed)], dtype=torch.int32)
        if self.env.world_size > 1:  # on the host: a device tensor read here would wait for every queued kernel
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=host_group())
        signum, timed_any = flags.tolist()
        return signum, due_by_steps or bool(timed_any)

    def saved(self) -> None:
        """A save just finished: the timed interval starts again."""
        self.last_save = time.monotonic()
