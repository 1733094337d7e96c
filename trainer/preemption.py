"""Preemption signals and the save policy, agreed across ranks at step boundaries (never acted on in a handler)."""

from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist

from trainer.config import CheckpointConfig
from trainer.env import DistEnv


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

    Every ``poll_steps`` steps (and when asked, e.g. at an epoch end) one small all-reduce tells every rank
    whether anyone was signalled and whether a timed save is due, so all ranks stop or save together.
    """

    def __init__(self, cfg: CheckpointConfig, env: DistEnv, device: torch.device, preemption: Preemption) -> None:
        self.cfg, self.env, self.device, self.preemption = cfg, env, device, preemption
        self.last_save = time.monotonic()

    def poll(self, step: int, force: bool = False) -> tuple[int, bool]:
        """Collective at a step boundary: (signal number any rank received or 0, whether a save is due now)."""
        every = self.cfg.every_steps
        due_by_steps = bool(every and step % every == 0)
        if not force and step % self.cfg.poll_steps:
            return 0, due_by_steps
        timed = (self.cfg.every_minutes > 0 and self.env.is_main
                 and time.monotonic() - self.last_save >= 60 * self.cfg.every_minutes)
        flags = torch.tensor([self.preemption.signum, float(timed)], device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return int(flags[0].item()), due_by_steps or bool(flags[1].item())

    def saved(self) -> None:
        """A save just finished: the timed interval starts again."""
        self.last_save = time.monotonic()
