"""Fail-slow and silent corruption (``audit.*``): ranks that keep running, but slowly or wrongly.

Stragglers: each rank times its own computation (training forwards and optimizer steps; collectives aside, where the
fast ranks wait for the slow one) and the ranks share it at the signal polls, in the flags' all-reduce. A rank whose
time per step stays above ``straggler_ratio`` × the others' median for ``straggler_steps`` steps is named once.
Replicas: under DDP every rank holds the same parameters, bit for bit; before each save (and every
``replicas_every_steps``) the ranks compare a digest of them, and the ranks outside the majority are named. What
follows is the Session's: report, or end the attempt blaming the node (``Stop``) so the self-healing rules go on
without it; a disagreement never saves the state it found.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.core import exits, hooks
from trainer.core.dist import host_group
from trainer.core.env import DistEnv
from trainer.core.errors import UserError
from trainer.core.schema import Config
from trainer.runtime.health.replay import Replay, digest
from trainer.runtime.poll import Layout, Message

EXIT_AUDIT = 4
"""An audit ended the attempt (a straggler with ``on_straggler: restart``, replicas that disagree)."""


@dataclass(frozen=True)
class Straggler:
    rank: int
    node: str
    ratio: float
    """Its compute time per step over the others' median, on average since ``since``."""
    since: int
    """The first step of the slow stretch."""
    step: int
    """The step at which it was named."""
    ms: dict[str, float]
    """Compute milliseconds per step of each node (the median of its ranks) in the last window."""

    def describe(self) -> str:
        return (f"straggler: rank {self.rank} on {self.node} computes {self.ratio:.2f}× the others' time per step "
                f"since step {self.since}")


@dataclass(frozen=True)
class Stop:
    """The attempt ends for an audit: ``cause`` in one line, the nodes blamed, and whether to save first."""

    cause: str
    blame: list[str]
    save: bool


class Meter:
    """This rank's seconds of computation: the model's training forwards (``forward``; FSDP's gather parameters from
    the other ranks, so there only the optimizer steps count) and every optimizer step. CUDA events on a GPU, read
    once they are done (never a sync); the clock on the CPU, where the ``slow_rank`` test fault stretches them. Every
    rank's time per step rides on the polls (a per-rank field), and ``agreed`` holds the last poll's."""

    def __init__(self, model: nn.Module | None, optimizers: list[torch.optim.Optimizer], forward: bool,
                 device: torch.device, rank: int) -> None:
        self.gpu, self.rank, self.step = device.type == "cuda", rank, 0
        self.agreed: tuple[float, ...] = ()
        self.seconds, self.t0, self.last_step = 0.0, 0.0, -1
        self.open: Any = None
        self.pending: list[tuple[Any, Any]] = []
        self.handles: list[Any] = []
        if forward and model is not None:
            self.handles += [model.register_forward_pre_hook(lambda m, a: self._start() if m.training else None),
                             model.register_forward_hook(lambda m, a, o: self._end() if m.training else None)]
        for opt in optimizers:
            self.handles += [opt.register_step_pre_hook(lambda *a: self._start()),
                             opt.register_step_post_hook(lambda *a: self._end())]

    def _start(self) -> None:
        if self.gpu:
            self.open = torch.cuda.Event(enable_timing=True)
            self.open.record()
        else:
            self.t0 = time.perf_counter()

    def _end(self) -> None:
        if self.gpu:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pending.append((self.open, end))
            return
        hooks.current().stretch(time.perf_counter() - self.t0, self.rank, self.step)
        self.seconds += time.perf_counter() - self.t0

    def take(self, step: int) -> float:
        """Seconds of computation per step since the last call (0 on the first: no window yet)."""
        if self.gpu:
            done = [p for p in self.pending if p[1].query()]
            self.pending = [p for p in self.pending if p not in done]
            self.seconds += sum(s.elapsed_time(e) for s, e in done) / 1000
        span, first, self.last_step = step - self.last_step, self.last_step < 0, step
        per_step, self.seconds = 0.0 if first or span <= 0 else self.seconds / span, 0.0
        return per_step

    def register(self, layout: Layout) -> None:
        self.field = layout.add("compute seconds per step", per_rank=True)

    def send(self, message: Message, step: int) -> None:
        message.put(self.field, self.take(step))

    def receive(self, message: Message, step: int) -> None:
        self.agreed = message.each(self.field)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


class Detector:
    """Names a rank whose compute time per step stays above ``ratio`` × the others' median, and above it by ``floor_s``,
    for ``steps`` steps, on average over that stretch. A stretch starts at a window above both and goes on through
    windows above half of each margin (1.15 for 1.3: one noisy window does not hide a straggler, nor does one make
    one). The first window of an attempt (compiling, warming the allocator) and windows a rank computed nothing in
    are skipped."""

    def __init__(self, ratio: float, steps: int, nodes: list[str], start: int, floor_s: float = 0.0) -> None:
        self.ratio, self.steps, self.nodes, self.last, self.floor_s = ratio, steps, nodes, start, floor_s
        self.windows = 0
        self.slow: dict[int, tuple[int, float]] = {}
        """Rank → (first step of its slow stretch, Σ ratio × steps over it)."""
        self.named: set[int] = set()

    def observe(self, step: int, times: list[float]) -> list[Straggler]:
        since, span = self.last, step - self.last
        if span <= 0:
            return []
        self.last, self.windows = step, self.windows + 1
        if self.windows == 1 or min(times) <= 0:
            return []
        out = []
        for rank, t in enumerate(times):
            others = statistics.median(times[:rank] + times[rank + 1:])
            ratio, part = t / others, 1.0 if rank not in self.slow else 0.5  # a stretch goes on at half the margins
            if ratio <= 1 + part * (self.ratio - 1) or t - others <= part * self.floor_s:
                self.slow.pop(rank, None)
                continue
            first, weighted = self.slow.get(rank, (since, 0.0))
            self.slow[rank] = (first, weighted + ratio * span)
            mean = (weighted + ratio * span) / (step - first)
            if step - first >= self.steps and mean > self.ratio and rank not in self.named:
                self.named.add(rank)
                out.append(Straggler(rank, self.nodes[rank], round(mean, 2), first + 1, step, self.per_node(times)))
        return out

    def per_node(self, times: list[float]) -> dict[str, float]:
        nodes: dict[str, list[float]] = {}
        for node, t in zip(self.nodes, times, strict=True):
            nodes.setdefault(node, []).append(t)
        return {n: round(1000 * statistics.median(ts), 2) for n, ts in nodes.items()}


def outliers(digests: list[int]) -> tuple[list[int], bool]:
    """The ranks whose digest differs from the majority's, and whether there is a majority (more than half agree)."""
    counts: dict[int, int] = {}
    for d in digests:
        counts[d] = counts.get(d, 0) + 1
    common, n = max(counts.items(), key=lambda kv: kv[1])
    if n == len(digests):
        return [], True
    if 2 * n <= len(digests):
        return list(range(len(digests))), False
    return [r for r, d in enumerate(digests) if d != common], True


def _gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=host_group())
    return out


class Audit:
    """A run's audits, as the Session calls them: ``after_step`` after each step's poll (whose all-reduce carries the
    meter's times: the meter is one of the poll's parts), ``agree`` before a save; ``stop`` once one ends the attempt,
    ``end`` then. ``check`` refuses, before the run folder is opened, an audit that cannot run."""

    def __init__(self, cfg: Config, env: DistEnv, model: nn.Module | None, objects: dict[str, Any],
                 device: torch.device, start: int, emit: Callable[..., None], say: Callable[[str], None]) -> None:
        self.cfg, self.env, self.model, self.emit, self.say = cfg.audit, env, model, emit, say
        self.stop: Stop | None = None
        self.step = start
        multi = env.world_size > 1
        self.nodes: list[str] = _gather(exits.node_name()) if multi else [exits.node_name()]
        self.detector = Detector(self.cfg.straggler_ratio, self.cfg.straggler_steps, self.nodes, start,
                                 self.cfg.straggler_floor_ms / 1000) \
            if multi and self.cfg.straggler_steps else None
        optimizers = [o for o in objects.values() if isinstance(o, torch.optim.Optimizer)]
        self.meter = Meter(model, optimizers, cfg.dist.strategy != "fsdp", device, env.rank) if self.detector else None
        self.replicas = multi and self.cfg.replicas_every_steps >= 0 and model is not None
        if self.replicas and cfg.dist.strategy == "fsdp":
            self.replicas = False
            say("audit: replica agreement is off under dist.strategy=fsdp (each rank holds its own shard, no replica)")
        self.replay = Replay(model, optimizers, env, self.cfg.replay_every_steps, device, self.nodes,
                             lambda g, i, n, step: hooks.current().flip_grad(g, i, n, env.rank, step),
                             self._replayed_wrong, say) if self.cfg.replay_every_steps and model is not None else None

    @staticmethod
    def check(cfg: Config, env: DistEnv, model: nn.Module | None, device: torch.device) -> None:
        """A UserError for an audit that cannot run here (before anything is written)."""
        key = "audit.replay_every_steps"
        if not cfg.audit.replay_every_steps:
            return
        if env.world_size == 1 or cfg.dist.strategy == "fsdp" or model is None:
            raise UserError(key, "needs DDP replicas: another process to compute each step again", "run 2 or more "
                            "processes with dist.strategy=ddp (and Session.wrap), or audit.replay_every_steps=0")
        if device.type == "cuda" and not torch.are_deterministic_algorithms_enabled():
            raise UserError(key, "needs deterministic algorithms on the GPU: a replay would differ without a fault",
                            "call torch.use_deterministic_algorithms(True) with CUBLAS_WORKSPACE_CONFIG=:4096:8 set, "
                            "or audit.replay_every_steps=0")

    def _replayed_wrong(self, cause: str, nodes: list[str], step: int) -> None:
        self.emit("corruption", durable=True, step=step, kind="replay", nodes=nodes, cause=cause)
        self.say(f"{cause}; not saving: the attempt ends and the run goes on from the last checkpoint")
        if self.stop is None:
            self.stop = Stop(cause, nodes, save=False)

    def after_step(self, step: int) -> None:
        """After each step's poll (collective): the test fault's flipped bit; every ``replicas_every_steps`` the
        replicas compared; after a poll, every rank's compute per step (the meter's) names stragglers."""
        self.step = step
        if self.meter is not None:
            self.meter.step = step
        if self.replay is not None:
            self.replay.step = step
        if self.model is not None:
            hooks.current().flip(self.model, self.env.rank, step)
        every = self.cfg.replicas_every_steps
        if self.replicas and every > 0 and step % every == 0:
            self.agree(step)
        if self.detector is not None and self.meter is not None and self.meter.agreed:
            times, self.meter.agreed = self.meter.agreed, ()
            self.observe(self.detector.observe(step, list(times)), step)

    def observe(self, named: list[Straggler], step: int) -> None:
        """Stragglers named (once each): an event and a line; with ``on_straggler: restart`` the first stops."""
        for s in named:
            self.emit("straggler", durable=True, rank=s.rank, node=s.node, ratio=s.ratio, since=s.since, step=step,
                      ms=s.ms, action=self.cfg.on_straggler)
            self.say(f"{s.describe()} ({', '.join(f'{n} {ms:g} ms' for n, ms in s.ms.items())})"
                     + ("; saving, then restarting without it" if self.cfg.on_straggler == "restart" else ""))
            if self.cfg.on_straggler == "restart" and self.stop is None:
                self.stop = Stop(s.describe(), [s.node], save=True)

    def agree(self, step: int) -> bool:
        """Collective: whether the replicas hold the same parameters (True when not compared). A disagreement is a
        ``corruption`` event and a ``Stop`` blaming the nodes outside the majority, without a save."""
        if self.stop and not self.stop.save:  # disputed already: the attempt is ending
            return False
        if not self.replicas or self.model is None:
            return True
        digests = _gather(digest(list(self.model.parameters())))
        odd, majority = outliers(digests)
        if not odd:
            return True
        nodes = sorted({self.nodes[r] for r in odd}) if majority else []
        who = ", ".join(f"rank {r} on {self.nodes[r]}" for r in odd)
        cause = (f"silent corruption: the parameters of {who} differ from the other replicas' at step {step}"
                 if majority else f"silent corruption: the replicas disagree at step {step} with no majority ({who})")
        self.emit("corruption", durable=True, step=step, ranks=odd, nodes=nodes, majority=majority)
        self.say(f"{cause}; not saving: the attempt ends and the run goes on from the last checkpoint")
        self.stop = Stop(cause, nodes, save=False)
        return False

    def end(self) -> int:
        """This rank's exit record for a stop (infrastructure, the named nodes blamed) and the exit code (the session
        has cleared the memory snapshots: after a disagreement they may hold the disputed state)."""
        assert self.stop is not None
        exits.ended(EXIT_AUDIT, exits.outcome(exits.INFRASTRUCTURE, self.stop.cause, blame=self.stop.blame),
                    rank=self.env.rank, step=self.step)
        self.emit("exit", durable=True, code=EXIT_AUDIT, step=self.step, cause=self.stop.cause)
        return EXIT_AUDIT

    def close(self) -> None:
        for part in (self.meter, self.replay):
            if part is not None:
                part.close()
