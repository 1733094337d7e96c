"""FSDP2 (``fully_shard``): parameters, gradients and optimizer state split across ranks (``dist.strategy=fsdp``).

Each block is sharded on its own, then the root: a block's full parameters exist only while it runs. The
blocks are what the model names (``fsdp_blocks()``), else the repeated sub-modules that hold the parameters
(transformer blocks, a ResNet's residual blocks); a model with none is sharded as one unit.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from trainer.data.workers import checked_iter


def default_blocks(model: nn.Module) -> list[nn.Module]:
    """``model.fsdp_blocks()`` when it has one; else every instance of the repeated non-leaf module class that
    holds the most parameters (e.g. a GPT's blocks, a ResNet's BasicBlocks); else none."""
    named = getattr(model, "fsdp_blocks", None)
    if callable(named):
        return list(named())
    kinds = Counter(type(m) for m in model.modules() if m is not model and any(True for _ in m.children()))
    repeated = [k for k, n in kinds.items() if n >= 2 and k not in (nn.Sequential, nn.ModuleList, nn.ModuleDict)]

    def weight(kind: type) -> int:
        return sum(p.numel() for m in model.modules() if type(m) is kind for p in m.parameters())

    if not repeated:
        return []
    best = max(repeated, key=weight)
    outer = [m for m in model.modules() if type(m) is best]
    # Nested instances of the same class (a block inside a block) are sharded with their outer one.
    inner = {id(sub) for m in outer for sub in m.modules() if sub is not m}
    return [m for m in outer if id(m) not in inner]


def shard(model: nn.Module, precision: str, activation_checkpointing: bool) -> nn.Module:
    """Shard ``model`` in place over all ranks (FSDP2): each block, then the root; bf16 parameters with fp32
    gradient reduction when ``precision`` is bf16; blocks recompute their activations in the backward pass when
    ``activation_checkpointing``. Returns the same module (now an FSDPModule)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16"
              else MixedPrecisionPolicy())
    blocks = default_blocks(model)
    if activation_checkpointing and blocks:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        wanted = {id(b) for b in blocks}
        apply_activation_checkpointing(model, check_fn=lambda m: id(m) in wanted)
        # The wrappers replace the blocks in their parents: shard the wrappers.
        blocks = [m for m in model.modules() if id(getattr(m, "_checkpoint_wrapped_module", None)) in wanted]
    for block in blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` was sharded with FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def no_sync(model: nn.Module, skip: bool = True) -> Iterator[None]:
    """Gradient accumulation: with ``skip``, the micro-step's gradients are not all-reduced (DDP: the forward inside
    this block) or reduce-scattered (FSDP2: the setting holds until the next call, so a backward pass after the block
    is covered too); with ``skip`` False, they are."""
    if is_sharded(model):
        model.set_requires_gradient_sync(not skip)  # type: ignore[operator]
        yield
    elif skip and isinstance(model, nn.parallel.DistributedDataParallel):
        with model.no_sync():
            yield
    else:
        yield


def local_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state (its shards under FSDP2)."""

    def size(t: torch.Tensor) -> int:
        local = t.to_local() if hasattr(t, "to_local") else t
        return int(local.numel() * local.element_size())

    params = sum(size(p) for p in model.parameters())
    grads = sum(size(p.grad) for p in model.parameters() if p.grad is not None)
    state = 0
    if optimizer is not None:
        state = sum(size(v) for s in optimizer.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"params": params, "grads": grads, "optimizer": state, "total": params + grads + state}


def eval_batches(model: nn.Module | None, loader: Iterable[Any], device: torch.device) -> Iterator[tuple[Any, bool]]:
    """An evaluation loader's batches as ``(batch, counts)``. Sharded models gather parameters in every forward,
    so every rank must run as many: a rank whose shard ran out repeats its last batch with ``counts`` False."""
    batches = checked_iter(loader) if isinstance(loader, DataLoader) else iter(loader)
    if model is None or not is_sharded(model):
        for batch in batches:
            yield batch, True
        return
    last = None
    while True:
        batch = next(batches, None)
        more = torch.tensor([batch is not None], dtype=torch.int32, device=device)
        torch.distributed.all_reduce(more, op=torch.distributed.ReduceOp.MAX)
        if not more.item():
            return
        if batch is None and last is None:
            raise RuntimeError("this rank's evaluation shard is empty: use fewer processes or more evaluation data")
        last = batch if batch is not None else last
        yield last, batch is not None
