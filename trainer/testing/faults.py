"""Faults the tests inject from outside the public config: ``TRAINER_FAULTS="preempt_at_step=5 step_delay_s=0.1"``.

Read once per process from the environment (``trainer.core.env.fault_spec``), so they never appear in ``--help``,
a saved ``config.yaml``, a checkpoint or a W&B config. Unset, every hook is a no-op. A word ``ATTEMPT:name=value``
applies only in that attempt of a Slurm job (``0``, ``0.1`` for the first restart inside the allocation, ``1`` after
a requeue): ``"0:kill_at_step=4 0.1:hang_at_step=3 1:preempt_at_step=2"`` gives each attempt its own fault.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from trainer.core import hooks
from trainer.core.env import fault_spec
from trainer.core.errors import UserError
from trainer.core.exits import attempt_id


@dataclass(frozen=True)
class Faults(hooks.Hooks):
    """The test faults of this process: each field one fault (unset: off), each method a point of the runtime's one
    seam (trainer/core/hooks.py) where the fault acts."""

    preempt_at_step: int = -1
    """Behave as if the preemption signal arrived during this process's step N+1 (-1: never)."""
    save_delay_s: float = 0.0
    """Sleep this long in the middle of writing a checkpoint file (a kill then lands mid-save)."""
    save_delay_from_step: int = 0
    """Only saves of this step or later sleep (earlier ones commit at once, so a test need not wait them out)."""
    step_delay_s: float = 0.0
    """Sleep this long after every optimizer step (slows a run so signals land mid-training)."""
    oom_at_step: int = -1
    """Raise torch.OutOfMemoryError at the end of this process's step N+1 (-1: never), through the real handler."""
    oom_rank: int = -1
    """The rank that ``oom_at_step`` fails (-1: every rank)."""
    hang_at_step: int = -1
    """Rank ``hang_rank`` stops forever as this process's step N+1 starts (-1: never)."""
    hang_rank: int = 1
    """The rank that ``hang_at_step`` stops."""
    kill_at_step: int = -1
    """Rank ``kill_rank`` SIGKILLs itself at the end of this process's step N+1, before the ranks agree on saving
    (-1: never): an unannounced end, as the OOM-killer or a dying node gives."""
    kill_rank: int = 1
    """The rank that ``kill_at_step`` kills."""
    only_restart: int = -1
    """Inject the faults only in this attempt of a Slurm job (its restart count; -1: in every attempt), so a retried
    attempt runs clean (a restart inside the allocation, attempt "0.1", too)."""
    end_in_s: float = 0.0
    """The job's time limit is this many seconds after the session starts (what squeue reports under Slurm)."""
    doctor_fail_node: str = ""
    """The preflight doctor fails on the node of this name (Slurm's), as a broken GPU or mount would."""
    doctor_fail_rank: int = -1
    """...or on the node of this rank, wherever Slurm placed it (-1: none)."""
    slow_rank: int = -1
    """This rank computes ``slow_factor`` times slower from step ``slow_from_step`` on (-1: none): a throttled GPU."""
    slow_from_step: int = 0
    """The first step (the run's, not this process's) of the slowdown."""
    slow_factor: float = 1.5
    """How much longer the slow rank's forward and optimizer steps take."""
    flip_at_step: int = -1
    """Rank ``flip_rank`` flips one bit of a parameter after this step (the run's; -1: never): silent corruption."""
    flip_rank: int = 1
    """The rank whose parameter ``flip_at_step`` corrupts."""
    grad_flip_from_step: int = -1
    """Rank ``grad_flip_rank`` flips one bit of a local gradient in every step from this one on (-1: never): a faulty
    device, whose every computation is wrong the same way (its replays of other ranks' steps too)."""
    grad_flip_rank: int = 1
    """The faulty rank of ``grad_flip_from_step``."""
    grad_flip_seed: int = 0
    """Which parameter, value and mantissa bit the faulty rank flips (seeded)."""
    wait_at_step: int = -1
    """Every rank waits at the end of this process's step N+1 (-1: never), before the ranks agree on saving, until a
    signal reaches it or the file ``faults/go.<attempt>`` appears in the run folder; it first writes
    ``faults/waiting.<attempt>.<rank>`` there. A test then acts from outside (a signal, a kill, SIGSTOP) on a run
    held at a known step, instead of guessing how far it got."""
    wait_again_at_step: int = -1
    """A second hold, later in the same process (-1: none): as ``wait_at_step``, with ``<attempt>-again`` for the
    attempt in the files' names. A group that went on in place (regroup) keeps its processes, and with them this plan."""
    ledger: str = ""
    """A folder: a sharded set's loader appends the samples of every micro-batch it hands out (epoch, micro-batch,
    (shard, sample) pairs) to rank<r>.jsonl there, the per-sample ledger of the exactly-once tests."""

    @property
    def records(self) -> bool:  # type: ignore[override]
        return bool(self.ledger)

    def record(self, rank: int, entry: dict[str, Any]) -> None:
        """One line of the per-sample ledger (nothing when ``ledger`` is unset)."""
        if self.ledger:
            with open(os.path.join(self.ledger, f"rank{rank}.jsonl"), "a") as f:
                f.write(json.dumps(entry) + "\n")

    def flip_grad(self, grad: torch.Tensor, index: int, count: int, rank: int, step: int) -> torch.Tensor:
        """Parameter ``index`` of ``count``'s local gradient as the faulty rank computes it: one bit of one value
        flipped (a copy)."""
        if rank != self.grad_flip_rank or self.grad_flip_from_step < 0 or step < self.grad_flip_from_step:
            return grad
        pick = random.Random(self.grad_flip_seed)
        if index != pick.randrange(count):
            return grad
        out = grad.detach().clone().contiguous()
        flat = out.view(-1)
        at = pick.randrange(flat.numel())
        bits = flat[at:at + 1].view(torch.uint8)
        bit = pick.randrange(8 * (bits.numel() - 1))  # a mantissa's bytes (all but the top one)
        with torch.no_grad():
            bits[bit // 8] ^= 1 << (bit % 8)
        return out

    def stretch(self, seconds: float, rank: int, step: int) -> None:
        """Inside a measured compute phase that took ``seconds``: the slow rank takes ``slow_factor`` times as long."""
        if rank == self.slow_rank and step >= self.slow_from_step:
            time.sleep(seconds * (self.slow_factor - 1))

    def flip(self, model: torch.nn.Module, rank: int, step: int) -> None:
        """After ``flip_at_step`` on ``flip_rank``: one bit of the first parameter's first value, as faulty memory
        flips it (a mantissa bit: bit 20 of a float32, the value changes a little, the bits differ)."""
        first_param = next(iter(model.parameters()), None)
        if step == self.flip_at_step and rank == self.flip_rank and first_param is not None:
            first = first_param.detach().view(-1)[:1].view(torch.uint8)
            with torch.no_grad():
                first[first.numel() - 2] ^= 16

    def write_pause(self, step: int) -> float:
        """``save_delay_s`` in saves of ``save_delay_from_step`` and later."""
        return self.save_delay_s if step >= self.save_delay_from_step else 0.0

    def doctor_fails(self, node: str, rank: int) -> bool:
        return node == self.doctor_fail_node or rank == self.doctor_fail_rank

    def step_begin(self, done: int, rank: int) -> None:
        """A rank stuck outside any collective (a dead file system, a deadlock); ``done``: steps finished so far."""
        if done == self.hang_at_step and rank == self.hang_rank:
            _stuck_for_test()

    def step_end(self, done: int, rank: int, preemption_signal: str, run_dir: Path, alive: Callable[[], None],
                 signalled: Callable[[], bool]) -> int:
        """At the end of this process's step ``done`` (counted in this process, as a signal arrives some time after a
        start), before the ranks agree on saving: the faults of that moment; a signal number to act on (0: none)."""
        signum = self.after_step(done, preemption_signal, rank)
        self.wait(done, rank, run_dir, alive, signalled)
        return signum

    def after_step(self, done: int, preemption_signal: str, rank: int = -1) -> int:
        """Called with the count of finished steps; returns a signal number to act on (0: none)."""
        if done == self.kill_at_step + 1 and rank == self.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        if done == self.oom_at_step + 1 and self.oom_rank in (-1, rank):
            raise torch.OutOfMemoryError("simulated out of memory (TRAINER_FAULTS oom_at_step)")
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        if done == self.preempt_at_step + 1:
            return int(getattr(signal, preemption_signal))
        return 0


    def wait(self, done: int, rank: int, run_dir: Path, alive: Callable[[], None], released: Callable[[], bool]) -> None:
        """``wait_at_step`` (and ``wait_again_at_step``): hold this rank until ``released()`` (a signal came) or
        ``faults/go.<attempt>`` exists, calling ``alive()`` meanwhile (a held rank is no hang)."""
        if done not in (self.wait_at_step + 1, self.wait_again_at_step + 1) or done == 0:
            return
        folder, attempt = run_dir / "faults", attempt_id() + ("-again" if done == self.wait_again_at_step + 1 else "")
        folder.mkdir(exist_ok=True)
        (folder / f"waiting.{attempt}.{rank}").touch()
        while not released() and not (folder / f"go.{attempt}").exists():
            alive()
            time.sleep(0.05)


def _stuck_for_test() -> None:
    """Named so that a hang report's stack shows where the test made this rank stop."""
    while True:
        time.sleep(1)


def install() -> Faults:
    """This process's faults (TRAINER_FAULTS), installed as the runtime's hooks; a bad spec is a UserError."""
    faults = load()
    hooks.install(faults)
    return faults


def load(spec: str | None = None, attempt: str | None = None) -> Faults:
    """Parse ``name=value`` words (from TRAINER_FAULTS when ``spec`` is None); ``ATTEMPT:name=value`` words only in
    that attempt (this one's, ``exits.attempt_id()``, when ``attempt`` is None)."""
    spec = fault_spec() if spec is None else spec
    attempt = attempt_id() if attempt is None else attempt
    known = {f.name: f.type for f in fields(Faults)}
    values: dict[str, float | int | str] = {}
    for word in spec.split():
        scope, colon, word = word.rpartition(":") if ":" in word.partition("=")[0] else ("", "", word)
        name, _, raw = word.partition("=")
        if colon and scope != attempt:
            if name not in known:
                raise UserError("TRAINER_FAULTS", f"unknown fault {name!r}", f"use one of: {', '.join(known)}")
            continue
        if name not in known:
            raise UserError("TRAINER_FAULTS", f"unknown fault {name!r}", f"use one of: {', '.join(known)}")
        try:
            values[name] = float(raw) if known[name] == "float" else raw if known[name] == "str" else int(raw)
        except ValueError:
            raise UserError("TRAINER_FAULTS", f"{name} needs a number, got {raw!r}", f"e.g. {name}=3") from None
    faults = Faults(**values)  # type: ignore[arg-type]
    if faults.only_restart >= 0 and str(faults.only_restart) != attempt:
        return Faults()
    return faults
