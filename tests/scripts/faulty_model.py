"""A user's model with a bug that shows at one step on one rank: the dev-cluster tests' user error."""

from __future__ import annotations

import os

import torch
from torch import nn


class Faulty(nn.Module):
    """A small classifier whose ``fail_at``-th training forward raises on rank ``rank`` (as a shape bug would)."""

    def __init__(self, channels: int = 1, classes: int = 10, fail_at: int = 5, rank: int = 1) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(channels * 16, classes))
        self.calls, self.fail_at, self.rank = 0, fail_at, rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += self.training
        if self.calls == self.fail_at and int(os.environ.get("SLURM_PROCID", "0")) == self.rank:
            raise ValueError(f"tensor shape mismatch in forward call {self.calls}")
        return self.net(x)
