"""Fail-slow and silent corruption (``audit.*``): ranks that keep running, but slowly or wrongly.

Stragglers (``straggler.py``): each rank measures its own time per step, everything outside waiting for the others,
and the ranks share it at the signal polls, in the flags' all-reduce. A node whose time per step stays above
``straggler_ratio`` × the other nodes' median for ``straggler_steps`` steps is named once (on one node: a rank, and no
node is blamed).
Replicas: under DDP every rank holds the same parameters, bit for bit; before each save (and every
``replicas_every_steps``) the ranks compare a digest of them, and the ranks outside the majority are named. What
follows is the Session's: report, or end the attempt blaming the node (``Stop``) so the self-healing rules go on
without it; a disagreement never saves the state it found.
"""

from __future__ import annotations

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
from trainer.runtime.health.straggler import Detector, Meter, Straggler

EXIT_AUDIT = 4
"""An audit ended the attempt (a straggler with ``on_straggler: restart``, replicas that disagree)."""


@dataclass(frozen=True)
class Stop:
    """The attempt ends for an audit: ``cause`` in one line, the nodes blamed, and whether to save first."""

    cause: str
    blame: list[str]
    save: bool


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
                 device: torch.device, start: int, emit: Callable[..., None], say: Callable[[str], None],
                 wrapper: nn.Module | None = None) -> None:
        self.cfg, self.env, self.model, self.emit, self.say = cfg.audit, env, model, emit, say
        self.stop: Stop | None = None
        self.step = start
        multi = env.world_size > 1
        self.nodes: list[str] = _gather(exits.node_name()) if multi else [exits.node_name()]
        self.detector = Detector(self.cfg.straggler_ratio, self.cfg.straggler_steps, self.nodes, start,
                                 self.cfg.straggler_floor_ms / 1000) \
            if multi and self.cfg.straggler_steps else None
        optimizers = [o for o in objects.values() if isinstance(o, torch.optim.Optimizer)]
        stretch = lambda s: hooks.current().stretch(s, env.rank, self.step)  # noqa: E731 - the compute slowdown fault
        self.meter = Meter(model, optimizers, not cfg.dist.sharded, device, stretch, wrapper=wrapper) \
            if self.detector else None
        self.replicas = multi and self.cfg.replicas_every_steps >= 0 and model is not None
        if self.replicas and cfg.dist.sharded:
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
        if env.world_size == 1 or cfg.dist.sharded or model is None:
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
        """Stragglers named (once each): an event and a line; with ``on_straggler: restart`` the first stops (not on
        one node: there is no node to restart without)."""
        for s in named:
            restart = self.cfg.on_straggler == "restart"
            self.emit("straggler", durable=True, rank=s.rank, node=s.node, ratio=s.ratio, since=s.since, step=step,
                      ms=s.ms, lost_s=s.lost_s, lost_pct=s.lost_pct, blame=s.blame,
                      action=self.cfg.on_straggler if s.blame else "report")
            then = ("; saving, then restarting without it" if s.blame else
                    "; not restarting (audit.on_straggler=restart): the job has no other node")
            self.say(f"{s.describe()} ({', '.join(f'{n} {ms:g} ms' for n, ms in s.ms.items())})"
                     + (then if restart else ""))
            if restart and s.blame and self.stop is None:
                self.stop = Stop(s.describe(), [s.node], save=True)

    def synced(self) -> None:
        """After a collective the meter does not see (a save, a snapshot): its time and waits are no rank's own."""
        if self.meter is not None:
            self.meter.resync()

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
                    step=self.step)  # under this process's rank as started (a regroup renumbers)
        self.emit("exit", durable=True, code=EXIT_AUDIT, step=self.step, cause=self.stop.cause)
        return EXIT_AUDIT

    def close(self) -> None:
        for part in (self.meter, self.replay):
            if part is not None:
                part.close()
