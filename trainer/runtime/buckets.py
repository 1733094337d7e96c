"""A resumed process's first step reduces its gradients in the buckets the uninterrupted run used at that step.

DDP packs every gradient into one bucket for a process's first backward and rebuilds its buckets, in the order the
gradients became ready, before the second forward. An all-reduce over 3 or more processes sums each element in an
order that depends on where it lies in its bucket (a ring reduces chunk by chunk), so a process resumed at step k
would sum step k's gradients in another order than the uninterrupted run did, and the runs would agree only to
float rounding. Priming: before the first forward with gradients of a resumed process, one forward and backward of
that same input, its outputs multiplied by zero, records the order (the all-reduce then sums zeros); the gradients,
buffers (batch-norm statistics) and random generators are put back, so the state is as it was and the real step
runs on the rebuilt buckets. With 2 processes every order gives the same sum: nothing to do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def prime_when_resumed(ddp: DDP, resumed: Callable[[], bool]) -> None:
    """Prime ``ddp``'s buckets before its first forward with gradients, if ``resumed()`` says this process continues
    a run (asked then: ``restore`` comes after ``wrap``); the hook removes itself after that forward."""
    handle: Any = None

    def before_forward(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():  # evaluation: DDP rebuilds nothing either;
            return  # a compiled model's first forward is traced, not run (priming is for eager DDP)
        handle.remove()
        if resumed():
            prime(ddp, args, kwargs)

    handle = ddp.register_forward_pre_hook(before_forward, with_kwargs=True)


def prime(ddp: DDP, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """One synchronised forward and zero-weighted backward of ``args``, then every gradient, buffer and random
    generator as before it (collective: every rank primes with its own input)."""
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
    buffers = [b.detach().clone() for b in ddp.module.buffers()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    sync = ddp.require_backward_grad_sync
    ddp.require_backward_grad_sync = True  # inside no_sync (accumulation) DDP would record no order
    try:
        outputs = [t for t in _tensors(ddp.forward(*args, **kwargs)) if t.requires_grad]  # forward: not this hook
        if outputs:
            torch.stack([t.float().sum() for t in outputs]).sum().mul(0).backward()
    finally:
        ddp.require_backward_grad_sync = sync
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            for b, saved in zip(ddp.module.buffers(), buffers, strict=True):
                b.copy_(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _tensors(out: Any) -> Iterator[torch.Tensor]:
    """The tensors in a forward's output (a tensor, or tuples, lists and dicts of them, as far down as they go)."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, dict):
        for v in out.values():
            yield from _tensors(v)
    elif isinstance(out, (list, tuple)):
        for v in out:
            yield from _tensors(v)
