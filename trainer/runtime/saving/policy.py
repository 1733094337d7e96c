"""The save policy: when to save (every N steps, every M minutes or at the auto cadence, on request, before the time
limit, when any rank was signalled), agreed by every rank at the polls (trainer/runtime/poll.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from trainer.core.env import DistEnv
from trainer.core.schema import CheckpointConfig
from trainer.runtime.poll import Layout, Message, PollPart
from trainer.runtime.saving.cadence import FIRST_STALL_S, SIGNAL_EARLY_S, SLACK_S, Cadence, Deadline, longest_save_s
from trainer.runtime.saving.signals import Preemption


@dataclass(frozen=True)
class Poll:
    """What the ranks agreed at a step boundary."""

    signum: int = 0
    """A preemption signal any rank received (0: none)."""
    due: bool = False
    """A scheduled save (every_steps, every_minutes, the auto cadence, or asked for with a save-now file)."""
    deadline: bool = False
    """The time limit is closer than one save and the steps to the next agreement: save, exit, requeue."""
    polled: bool = False
    """The ranks agreed at this step (the parts read what they agreed): every ``poll_steps``, or when asked."""


class SavePolicy:
    """When to save: every N steps, every M minutes or at the auto cadence (rank 0's clock), when asked to (a
    ``save-now`` file in the run folder), before the job's time limit, and when any rank was signalled.

    Every ``poll_steps`` steps (and when asked, e.g. at an epoch end) one small all-reduce of host tensors tells every
    rank whether anyone was signalled and whether a save is due, so all ranks stop or save together; the ``parts``
    (memory snapshots, the straggler meter) agree what they need in the same all-reduce.
    """

    def __init__(self, cfg: CheckpointConfig, env: DistEnv, preemption: Preemption, cadence: Cadence | None = None,
                 deadline: Deadline | None = None, save_now: Path | None = None, save_s: float = FIRST_STALL_S,
                 clock: Callable[[], float] = time.monotonic, parts: Sequence[PollPart | None] = ()) -> None:
        self.cfg, self.env, self.preemption, self.clock = cfg, env, preemption, clock
        self.cadence, self.deadline, self.save_now = cadence, deadline, save_now
        self.last_save = self.last_poll = clock()
        self.polls = 0
        self.poll_span_s = 0.0
        """The longest time between two polls so far (the first, after start-up and compiling, aside): how late the
        ranks may learn of a deadline."""
        self.save_s = save_s
        """The longest blocking save seen (this run's event log included): what a last save may take."""
        self.layout = Layout(env.world_size)
        self.signal, self.timed, self.near = (self.layout.add(n) for n in ("signal", "timed save", "deadline"))
        self.parts = [p for p in parts if p is not None]
        for part in self.parts:
            part.register(self.layout)

    def margin_s(self) -> float:
        """Time a last save needs before the limit: twice (one save, after a background write still running when
        saves are async, + the steps to the next poll), plus SLACK_S for the exit, the verdict and the requeue."""
        save = max(self.save_s, self.cadence.stall_s if self.cadence else 0.0) * (2 if self.cfg.async_save else 1)
        return 2 * (save + self.poll_span_s) + SLACK_S

    def deadline_facts(self) -> dict[str, float | None]:
        """For the ``deadline`` event: seconds left to the time limit, and the margin a last save keeps."""
        left = self.deadline.left_s() if self.deadline else None
        return {"left_s": None if left is None else round(left, 1), "margin_s": round(self.margin_s(), 1)}

    def signal_at_limit(self, grace_s: float) -> bool:
        """Rank 0: a warning signal now is the time limit's, not a preemption: it came within the job's signal grace
        of the limit (Slurm may send it up to SIGNAL_EARLY_S early) plus the margin."""
        left = self.deadline.left_s() if self.deadline else None
        return left is not None and left < grace_s + SIGNAL_EARLY_S + self.margin_s()

    def _rank0_flags(self) -> tuple[bool, bool]:
        """(a save is due by the clock or on request, the deadline is near): rank 0's view."""
        since = self.clock() - self.last_save
        timed = self.cfg.every_minutes > 0 and since >= 60 * self.cfg.every_minutes
        if self.cadence is not None:
            timed = timed or since >= self.cadence.interval()
        if self.save_now is not None and self.save_now.exists():
            self.save_now.unlink(missing_ok=True)
            timed = True
        left = self.deadline.left_s() if self.deadline else None
        return timed, left is not None and left < self.margin_s()

    def polls_at(self, step: int, force: bool = False) -> bool:
        """Whether the ranks agree at ``step`` (every ``poll_steps``, or when asked)."""
        return force or step % self.cfg.poll_steps == 0

    def poll(self, step: int, force: bool = False) -> Poll:
        """Collective at a step boundary: what the ranks agree on (see :class:`Poll`)."""
        every = self.cfg.every_steps
        due_by_steps = bool(every and step % every == 0)
        if not self.polls_at(step, force):
            return Poll(due=due_by_steps)
        now, self.polls = self.clock(), self.polls + 1
        if self.polls > 1:
            self.poll_span_s = max(self.poll_span_s, now - self.last_poll)
        self.last_poll = now
        timed, near = self._rank0_flags() if self.env.is_main else (False, False)
        message = Message(self.layout, self.env.rank)
        message.put(self.signal, self.preemption.signum)
        message.put(self.timed, timed)
        message.put(self.near, near)
        for part in self.parts:
            part.send(message, step)
        message.agree(self.env.world_size)
        for part in self.parts:
            part.receive(message, step)
        return Poll(int(message.get(self.signal)), due_by_steps or bool(message.get(self.timed)),
                    bool(message.get(self.near)), polled=True)

    def saved(self, stall_s: float, blocking: bool = True) -> None:
        """A save just finished, stalling training ``stall_s``: the timed interval starts again."""
        self.last_save = self.clock()
        if blocking:
            self.save_s = max(self.save_s, stall_s)
        if self.cadence is not None:
            self.cadence.saved(stall_s)


def save_policy(cfg: CheckpointConfig, env: DistEnv, preemption: Preemption, run_dir: Path, mtbf_hours: float,
                end_in_s: float = 0.0, known_end: float | None = None,
                parts: Sequence[PollPart | None] = ()) -> SavePolicy:
    """A run's save policy: rank 0 keeps the clocks (the auto cadence, the job's end time) and the save-now file."""
    if not env.is_main:
        return SavePolicy(cfg, env, preemption, parts=parts)
    (run_dir / "save-now").unlink(missing_ok=True)  # a request left for an earlier job is not this one's
    cadence = Cadence(run_dir, env.num_nodes, cfg.mtbf_hours or mtbf_hours) if cfg.cadence == "auto" else None
    return SavePolicy(cfg, env, preemption, cadence, Deadline(env.job_id, end_in_s, known_end), run_dir / "save-now",
                      longest_save_s(run_dir), parts=parts)
