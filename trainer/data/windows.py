"""Next-token windows over a token sequence held in memory (the shard reader for token files is readers.Tokens)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class Windows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Consecutive ``block``-token windows of ``data`` (a 1-D tensor), each with the following token of every position
    as its target: ``(x, y)`` of int64."""

    def __init__(self, data: torch.Tensor, block: int) -> None:
        self.data, self.block = data, block

    def __len__(self) -> int:
        return max(0, (len(self.data) - 1) // self.block)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.block: (i + 1) * self.block + 1].long()
        return chunk[:-1], chunk[1:]
