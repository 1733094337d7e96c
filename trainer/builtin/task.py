"""The Task interface: how a batch becomes a loss in training and metrics in evaluation.

A task is any object with these two methods (no base class needed)::

    class NextToken:
        def training_step(self, model, batch):            # batch already on the device, under autocast
            x, y = batch
            return F.cross_entropy(model(x).flatten(0, 1), y.flatten())   # the mean loss of this micro-batch

        def eval_step(self, model, batch):                 # under torch.no_grad, on the unwrapped model
            x, y = batch
            logits = model(x).flatten(0, 1)
            n = y.numel()
            return {"loss": (F.cross_entropy(logits, y.flatten(), reduction="sum"), n),
                    "accuracy": ((logits.argmax(1) == y.flatten()).sum(), n)}

``eval_step`` returns ``{name: (sum, count)}``: the runtime adds sums and counts over batches and ranks and
reports sum / count, so uneven shards stay exact. ``training_step`` may also return ``(loss, {name: value})``
to log more training metrics (averaged over the log interval). Name it with ``task.target=pkg.mod:NextToken``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

Sums = Mapping[str, tuple[torch.Tensor | float, torch.Tensor | float]]
"""What ``eval_step`` returns: per metric, the sum over this batch and the count it is an average over."""


@runtime_checkable
class Task(Protocol):
    """Loss for training, summed metrics for evaluation."""

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor | tuple[torch.Tensor, Mapping[str, Any]]:
        """The mean loss of this micro-batch (optionally with extra metrics to log)."""
        ...

    def eval_step(self, model: nn.Module, batch: Any) -> Sums:
        """Per metric, (sum over the batch, count): reduced exactly across batches and ranks."""
        ...


class Classification:
    """The built-in task: ``(inputs, labels)`` batches, cross-entropy loss, top-1 accuracy."""

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x).float(), y)

    def eval_step(self, model: nn.Module, batch: Any) -> Sums:
        x, y = batch
        out = model(x).float()
        return {"loss": (F.cross_entropy(out, y, reduction="sum"), y.numel()),
                "accuracy": ((out.argmax(1) == y).sum(), y.numel())}


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor moved to ``device``, whatever its nesting (tuples, lists, dicts, named tuples)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return type(batch)({k: to_device(v, device) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def batch_size(batch: Any) -> int:
    """Samples in a batch: the leading size of its first tensor (1 when it holds none)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else []
    for v in values:
        n = batch_size(v)
        if n:
            return n
    return 0


def split_output(out: Any) -> tuple[torch.Tensor, Mapping[str, Any]]:
    """``training_step``'s result as (loss, extra metrics); a clear error when it is neither form."""
    loss, extra = (out[0], out[1]) if isinstance(out, tuple) and len(out) == 2 else (out, {})
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not isinstance(extra, Mapping):
        raise TypeError(f"training_step must return a scalar loss tensor or (loss, {{name: value}}), "
                        f"got {type(out).__name__}")
    return loss, extra
