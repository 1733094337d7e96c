"""The replay audit (``audit.replay_every_steps``): every N steps each rank's step is computed again by the next rank,
from the same inputs, output gradient, parameters and random state, and the two local gradients are compared bit for
bit; where they differ a third rank computes it too and the odd one out is blamed (silent data corruption in the
arithmetic, which replicas comparing their parameters cannot see: DDP averages a wrong gradient into every replica).

What a rank captures, at a replay step only: the first training forward's inputs and random state (a forward pre-hook
on the model), the gradient of its output (a hook on the output tensor), and the digest of each parameter's local
gradient before DDP reduces it (hooks on the parameters). The exchange and the replay run in the first optimizer
step's pre-hook, on every rank at once, while the parameters are still those of the forward. DDP only, on a step of
one forward whose output is a tensor (a step of several forwards, e.g. gradient accumulation, is skipped, said once).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.core.dist import host_group
from trainer.core.env import DistEnv

Capture = dict[str, Any]
"""A source rank's step: ``args``/``kwargs`` (CPU), ``grad_out``, ``rng`` (CPU and CUDA states), ``digests``."""


def digest(params: list[torch.Tensor]) -> int:
    """A number that changes with any single flipped bit of the parameters: each one's bytes summed, weighted by its
    position (on the parameters' device; one read back)."""
    total = torch.zeros((), dtype=torch.int64, device=params[0].device) if params else torch.zeros((), dtype=torch.int64)
    for i, p in enumerate(params):
        total += p.detach().contiguous().view(-1).view(torch.uint8).sum() * (i + 1)
    return int(total)


def _cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().clone()
    if isinstance(x, list | tuple):
        return type(x)(_cpu(v) for v in x)
    if isinstance(x, dict):
        return {k: _cpu(v) for k, v in x.items()}
    return x


def _to(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, list | tuple):
        return type(x)(_to(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x


def _rng(device: torch.device) -> dict[str, Any]:
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def _set_rng(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


def recompute(model: nn.Module, capture: Capture, device: torch.device) -> list[int]:
    """The local gradients' digests of ``capture``'s step computed here; this rank's gradients, buffers and random
    state are put back after."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    buffers = [b.detach().clone() for b in model.buffers()]
    mine = _rng(device)
    try:
        for p in params:
            p.grad = None
        _set_rng(capture["rng"], device)
        with torch.enable_grad():
            out = model(*_to(capture["args"], device), **_to(capture["kwargs"], device))
            out.backward(capture["grad_out"].to(device))
        return [digest([p.grad]) if p.grad is not None else 0 for p in params]
    finally:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        with torch.no_grad():
            for b, saved in zip(model.buffers(), buffers, strict=True):
                b.copy_(saved)
        _set_rng(mine, device)


def _ring(payload: bytes) -> bytes:
    """Send ``payload`` to the next rank, receive the previous rank's (host group, sizes first)."""
    world, rank, group = dist.get_world_size(), dist.get_rank(), host_group()
    sizes = torch.zeros(world, dtype=torch.int64)
    sizes[rank] = len(payload)
    dist.all_reduce(sizes, group=group)
    out = torch.empty(int(sizes[(rank - 1) % world]), dtype=torch.uint8)
    ops = [dist.P2POp(dist.isend, torch.frombuffer(bytearray(payload), dtype=torch.uint8), (rank + 1) % world, group),
           dist.P2POp(dist.irecv, out, (rank - 1) % world, group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return out.numpy().tobytes()


def _bcast(obj: Any, src: int) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=host_group())
    return box[0]


def judge(source: list[int], replay: list[int], third: list[int] | None) -> str:
    """Who computed wrongly: "source", "replay", or "unknown" (no third opinion, or three different answers)."""
    if third is None:
        return "unknown"
    if third == replay != source:
        return "source"
    if third == source != replay:
        return "replay"
    return "unknown"


class Replay:
    """The hooks and the exchange of one run (see the module docstring); ``on_mismatch(cause, blamed nodes)``."""

    def __init__(self, model: nn.Module, optimizers: list[torch.optim.Optimizer], env: DistEnv, every: int,
                 device: torch.device, nodes: list[str], flip: Callable[[torch.Tensor, int, int, int], torch.Tensor],
                 on_mismatch: Callable[[str, list[str], int], None], say: Callable[[str], None]) -> None:
        self.model, self.env, self.every, self.device, self.nodes = model, env, every, device, nodes
        self.flip, self.on_mismatch, self.say = flip, on_mismatch, say
        self.step = 0
        """The last finished step (set by the audit after each): the one being computed is ``step + 1``."""
        self.forwards, self.said, self.replaying = 0, False, False
        self.capture: Capture | None = None
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.digests: list[int] = [0] * len(self.params)
        self.handles = [model.register_forward_pre_hook(self._before, with_kwargs=True),
                        model.register_forward_hook(self._after)]
        self.handles += [p.register_hook(self._grad_hook(i)) for i, p in enumerate(self.params)]
        self.handles += [optimizers[0].register_step_pre_hook(lambda *a: self._exchange())] if optimizers else []

    def due(self) -> bool:
        return (self.step + 1) % self.every == 0

    def _before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not module.training or not self.due() or self.replaying:
            return
        self.forwards += 1
        if self.forwards == 1:
            self.capture = {"args": _cpu(args), "kwargs": _cpu(kwargs), "rng": _rng(self.device), "grad_out": None}

    def _after(self, module: nn.Module, args: Any, out: Any) -> None:
        if self.capture is not None and self.forwards == 1 and not self.replaying and isinstance(out, torch.Tensor) \
                and out.requires_grad:
            out.register_hook(self._keep_grad_out)

    def _keep_grad_out(self, g: torch.Tensor) -> None:
        if self.capture is not None:
            self.capture["grad_out"] = _cpu(g)

    def _grad_hook(self, i: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def hook(g: torch.Tensor) -> torch.Tensor:
            g = self.flip(g, i, len(self.params), self.step + 1)  # the test fault (its replays too), before DDP
            if self.capture is not None and self.forwards == 1 and not self.replaying:
                self.digests[i] = digest([g])
            return g
        return hook

    def _exchange(self) -> None:
        """Collective, in the optimizer step's pre-hook of a replay step: ship, replay, compare, decide."""
        if not self.due():
            return
        ok = self.capture is not None and self.capture["grad_out"] is not None and self.forwards == 1
        flags = torch.tensor([int(not ok)], dtype=torch.int64)
        dist.all_reduce(flags, group=host_group())
        if int(flags[0]):  # some rank cannot replay this step: every rank skips it alike
            if not self.said:
                self.said = True
                self.say(f"audit: replay skipped at step {self.step + 1}: it replays steps of one forward whose "
                         "output is a tensor (not several forwards, as gradient accumulation makes)")
            self._reset()
            return
        assert self.capture is not None
        self.capture["digests"] = list(self.digests)
        theirs = pickle.loads(_ring(pickle.dumps(self.capture)))  # the previous rank's step, replayed here
        same = self._recompute(theirs) == theirs["digests"]
        verdicts: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(verdicts, same, group=host_group())
        for replayer in [r for r, agreed in enumerate(verdicts) if not agreed]:
            self._decide((replayer - 1) % self.env.world_size, theirs)
        self._reset()

    def _recompute(self, capture: Capture) -> list[int]:
        self.replaying = True
        try:
            return recompute(self.model, capture, self.device)
        finally:
            self.replaying = False

    def _decide(self, source: int, received: Capture) -> None:
        """Collective: rank ``source``'s step differed from its replay on the next rank (which ``received`` it); a
        third rank decides where one exists."""
        world = self.env.world_size
        replayer, third = (source + 1) % world, (source + 2) % world
        capture = _bcast(received if self.env.rank == replayer else None, replayer)
        replayed = _bcast(self._recompute(capture) if self.env.rank == replayer else None, replayer)
        opinion = None
        if third not in (source, replayer):
            opinion = _bcast(self._recompute(capture) if self.env.rank == third else None, third)
        odd = judge(capture["digests"], replayed, opinion)
        step = self.step + 1
        if odd == "unknown":
            self.on_mismatch(f"silent corruption: rank {source}'s gradients at step {step} differ from their replay on "
                             f"rank {replayer}, and no third rank tells which is right", [], step)
        else:
            rank = source if odd == "source" else replayer
            self.on_mismatch(f"silent corruption: rank {rank} on {self.nodes[rank]} computed step {step}'s gradients "
                             f"wrongly (replayed on ranks {replayer} and {third})", [self.nodes[rank]], step)

    def _reset(self) -> None:
        self.forwards, self.capture = 0, None

    def close(self) -> None:
        for h in self.handles:
            h.remove()
