"""Next-token prediction as a Task: the loss for training, summed metrics for exact evaluation across ranks."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class NextToken:
    """Cross-entropy on every position; evaluation reports loss, bits per byte and top-1 accuracy."""

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())

    def eval_step(self, model: nn.Module, batch: Any) -> dict[str, tuple[torch.Tensor, int]]:
        x, y = batch
        logits, y = model(x).flatten(0, 1).float(), y.flatten()
        nll = F.cross_entropy(logits, y, reduction="sum")
        return {"loss": (nll, y.numel()), "bits_per_byte": (nll / math.log(2), y.numel()),
                "accuracy": ((logits.argmax(1) == y).sum(), y.numel())}
