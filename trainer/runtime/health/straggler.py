"""Fail-slow: who makes the others wait, measured by each rank and judged node against node.

The measure (``Meter``): each rank's **own time** per step, everything it spends outside waiting for the others.
Under DDP that is the time from leaving one synchronisation to arriving at the next: data loading, host work,
forward, backward up to its last gradient, the optimizer step, evaluation aside. A rank arrives at the gradient
all-reduce when its last gradient is ready and leaves it when backward returns (the optimizer step begins); it
arrives at the signal poll when the poll starts and leaves it when the poll's all-reduce returns. The slow rank
waits least, so its own time is the job's time per step and the others' is shorter by what they wait. A throttled
process, a slow data loader on one rank, a slow host phase and slow kernels all land in it. What it cannot see:
a slow link or switch that every rank waits on alike (the all-reduce itself is slow for all), and slowness inside
a collective. Under FSDP every forward and backward gathers shards from the other ranks, so waits hide inside
them: there only the optimizer steps are timed (as before). On a GPU the same points are CUDA events, read once
they are complete (never a sync); on the CPU the clock.

The judgement (``Detector``): ranks grouped by node, a node's time is its slowest rank's (one throttled GPU makes
its whole node late at every all-reduce), and a node whose time stays above ``ratio`` × the other nodes' median,
and above it by ``floor_s``, for ``steps`` steps is named, with the time the job lost to it. A job on one node
compares its ranks and blames no node.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trainer.runtime.poll import Layout, Message


@dataclass(frozen=True)
class Straggler:
    rank: int
    """The slowest rank of the slow node (or the slow rank, on one node)."""
    node: str
    ratio: float
    """Its time per step over the others' median, on average since ``since``."""
    since: int
    """The first step of the slow stretch."""
    step: int
    """The step at which it was named."""
    ms: dict[str, float]
    """Milliseconds per step of each node (its slowest rank's) in the last window."""
    lost_s: float = 0.0
    """Seconds the others spent waiting for it since ``since`` (per step, its time over theirs)."""
    lost_pct: float = 0.0
    """``lost_s`` as a share of the job's time over the stretch."""
    blame: bool = True
    """Whether its node is to blame: False when the job has one node (then no node is)."""

    def describe(self) -> str:
        who = f"rank {self.rank} on {self.node}" if self.blame else f"rank {self.rank}"
        return (f"straggler: {who} takes {self.ratio:.2f}× the others' time per step since step {self.since}; "
                f"the job lost {self.lost_s:.1f} s ({self.lost_pct:.0f} %) waiting for it"
                + ("" if self.blame else " (one node: no node blamed)"))


class Meter:
    """This rank's own time per step (see the module): rides on the polls as a per-rank field; ``agreed`` holds the
    last poll's. ``own=False`` (FSDP): the optimizer steps only. ``stretch`` is the compute slowdown test fault,
    called after each training forward and optimizer step with its seconds."""

    def __init__(self, model: nn.Module | None, optimizers: list[torch.optim.Optimizer], own: bool,
                 device: torch.device, stretch: Callable[[float], None] = lambda s: None,
                 clock: Callable[[], float] = time.perf_counter, wrapper: nn.Module | None = None) -> None:
        self.gpu, self.own, self.stretch, self.clock = device.type == "cuda", own, stretch, clock
        self.agreed: tuple[float, ...] = ()
        self.seconds, self.last_step, self.skip = 0.0, -1, False
        self.mark: Any = None
        """Where this rank last left a synchronisation (a time, or a CUDA event); None: inside the poll."""
        self.arrived: Any = None
        """Where its last gradient of this step was ready (a time, or a CUDA event recorded again at each)."""
        self.opened: float | Any = 0.0
        self.pending: list[tuple[Any, Any]] = []
        self.handles: list[Any] = []
        if model is not None:
            self.handles += [model.register_forward_pre_hook(lambda m, a: self._forward(m.training, True)),
                             model.register_forward_hook(lambda m, a, o: self._forward(m.training, False))]
            if own:
                self.handles += [p.register_post_accumulate_grad_hook(lambda p: self._arrive())
                                 for p in model.parameters() if p.requires_grad]
        if own and wrapper is not None and model is not None:  # DDP's forward broadcasts buffers before the model's
            self.handles += [wrapper.register_forward_pre_hook(lambda m, a: self._reached() if m.training else None),
                             model.register_forward_pre_hook(lambda m, a: self.resync() if m.training else None)]
        for opt in optimizers:
            self.handles += [opt.register_step_pre_hook(lambda *a: self._optimizer(True)),
                             opt.register_step_post_hook(lambda *a: self._optimizer(False))]

    def _now(self) -> Any:
        if not self.gpu:
            return self.clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _forward(self, training: bool, begins: bool) -> None:
        if not training:
            self.skip = True  # evaluation: not training time, and ranks evaluate unequal shards
        elif self.own and not self.gpu:
            self._phase(begins)

    def _phase(self, begins: bool) -> None:
        """The test fault's phases (CPU): a training forward or an optimizer step, timed to stretch it."""
        if begins:
            self.opened = self.clock()
        else:
            self.stretch(self.clock() - self.opened)

    def _reached(self) -> None:
        """Arrived at a synchronisation the meter knows (DDP's buffer broadcast): the time since the mark was own."""
        if self.mark is not None:
            self._add(self.mark, self._now())
        self.mark = None

    def resync(self) -> None:
        """Left a synchronisation: own time starts again from here (what came since the last mark is dropped)."""
        if self.own:
            self.mark = self._now()

    def _arrive(self) -> None:
        if self.gpu:
            if self.arrived is None:
                self.arrived = torch.cuda.Event(enable_timing=True)
            self.arrived.record()
        else:
            self.arrived = self.clock()

    def _optimizer(self, begins: bool) -> None:
        if not self.gpu and not begins:
            self._phase(False)  # the test fault stretches the step before it is timed
        if not self.own:  # FSDP: the optimizer step is the measure
            now = self._now()
            if begins:
                self.mark = now
            elif self.mark is not None:
                self._add(self.mark, now)
        elif begins:  # backward returned: this rank left the gradient all-reduce
            now = self._now()
            if self.mark is not None:
                self._add(self.mark, self.arrived if self.arrived is not None else now)
            self.mark, self.arrived = now, None
        if not self.gpu and begins:
            self._phase(True)

    def _add(self, start: Any, end: Any) -> None:
        if self.gpu:
            self.pending.append((start, end))
        else:
            self.seconds += max(0.0, end - start)

    def take(self, step: int) -> float:
        """Own seconds per step since the last call; 0 on the first (no window yet) and for a window with an
        evaluation or a save in it (the detector skips it)."""
        span, first, skip, self.last_step, self.skip = step - self.last_step, self.last_step < 0, self.skip, step, False
        if self.gpu:
            done = [p for p in self.pending if p[1].query()]
            # a step still running on the GPU counts in the next window, unless this one is dropped: then it goes too
            self.pending = [] if first or skip else [p for p in self.pending if p not in done]
            self.seconds += sum(s.elapsed_time(e) for s, e in done) / 1000
        per_step, self.seconds = 0.0 if first or skip or span <= 0 else self.seconds / span, 0.0
        return per_step

    def register(self, layout: Layout) -> None:
        self.field = layout.add("own seconds per step", per_rank=True)

    def send(self, message: Message, step: int) -> None:
        if self.own and not self.gpu and self.mark is not None:  # arrived at the poll (on a GPU the stream waits)
            self._add(self.mark, self.clock())
            self.mark = None
        message.put(self.field, self.take(step))

    def receive(self, message: Message, step: int) -> None:
        self.agreed = message.each(self.field)
        if self.own and not self.gpu:
            self.mark = self.clock()  # left the poll

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@dataclass
class _Stretch:
    first: int
    weighted: float = 0.0
    lost: float = 0.0
    total: float = 0.0


@dataclass
class Detector:
    """Names a node (on one node: a rank) whose time per step stays above ``ratio`` × the others' median, and above
    it by ``floor_s``, for ``steps`` steps, on average over that stretch. A stretch starts at a window above both and
    goes on through windows above half of each margin (1.1 for 1.2: one noisy window does not hide a straggler, nor
    does one make one). The first window of an attempt (compiling, warming the allocator) and windows a rank
    measured nothing in (an evaluation, a save) are skipped."""

    ratio: float
    steps: int
    nodes: list[str]
    last: int
    floor_s: float = 0.0
    windows: int = 0
    slow: dict[int, _Stretch] = field(default_factory=dict)
    named: set[int] = field(default_factory=set)

    @property
    def by_node(self) -> bool:
        return len(set(self.nodes)) > 1

    def units(self, times: list[float]) -> list[tuple[int, float]]:
        """(the rank that sets it, its time) per unit: each node's slowest rank, or each rank on one node."""
        return list(self.slowest(times).values()) if self.by_node else list(enumerate(times))

    def slowest(self, times: list[float]) -> dict[str, tuple[int, float]]:
        """Each node's slowest rank and its time."""
        out: dict[str, tuple[int, float]] = {}
        for rank, (node, t) in enumerate(zip(self.nodes, times, strict=True)):
            if node not in out or t > out[node][1]:
                out[node] = (rank, t)
        return out

    def observe(self, step: int, times: list[float]) -> list[Straggler]:
        since, span = self.last, step - self.last
        if span <= 0:
            return []
        self.last, self.windows = step, self.windows + 1
        if self.windows == 1 or min(times) <= 0:
            return []
        units, out = self.units(times), []
        for u, (rank, t) in enumerate(units):
            others = statistics.median(v for i, (_, v) in enumerate(units) if i != u)
            ratio, part = t / others, 1.0 if u not in self.slow else 0.5  # a stretch goes on at half the margins
            if ratio <= 1 + part * (self.ratio - 1) or t - others <= part * self.floor_s:
                self.slow.pop(u, None)
                continue
            s = self.slow.setdefault(u, _Stretch(since))
            s.weighted, s.lost, s.total = s.weighted + ratio * span, s.lost + (t - others) * span, s.total + t * span
            mean = s.weighted / (step - s.first)
            if step - s.first >= self.steps and mean > self.ratio and u not in self.named:
                self.named.add(u)
                out.append(Straggler(rank, self.nodes[rank], round(mean, 2), s.first + 1, step, self.per_node(times),
                                     round(s.lost, 3), round(100 * s.lost / s.total, 1), self.by_node))
        return out

    def per_node(self, times: list[float]) -> dict[str, float]:
        return {n: round(1000 * t, 2) for n, (_, t) in self.slowest(times).items()}
