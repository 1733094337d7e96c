"""Text that is on every machine: the source files of Python's standard library, read as bytes (no download)."""

from __future__ import annotations

import importlib

import torch
from torch.utils.data import Dataset


def stdlib_text(modules: list[str], max_bytes: int) -> bytes:
    """The source of some standard-library modules, concatenated (at most ``max_bytes``)."""
    text = b""
    for name in modules:
        path = importlib.import_module(name).__file__
        assert path is not None
        with open(path, "rb") as f:
            text += f.read()
    return text[:max_bytes]


class Windows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Every ``block``-byte window of a byte string, with the next byte of each position as its target."""

    def __init__(self, data: torch.Tensor, block: int) -> None:
        self.data, self.block = data, block

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.block: (i + 1) * self.block + 1].long()
        return chunk[:-1], chunk[1:]


def build(block: int = 64, max_bytes: int = 400_000,
          modules: tuple[str, ...] = ("argparse", "dataclasses", "json.decoder")) -> tuple[Windows, Windows]:
    """Train on the first 90 % of the text, evaluate on the last 10 %."""
    raw = torch.frombuffer(bytearray(stdlib_text(list(modules), max_bytes)), dtype=torch.uint8)
    cut = int(0.9 * len(raw))
    return Windows(raw[:cut], block), Windows(raw[cut:], block)
