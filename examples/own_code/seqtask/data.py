"""Text that is on every machine: the source files of Python's standard library, read as bytes (no download); or
byte shards on disk (examples/char_lm/make_shards.py), read as large data would be."""

from __future__ import annotations

import importlib

import torch

from trainer.data import Shards, Tokens, Windows


def stdlib_text(modules: list[str], max_bytes: int) -> bytes:
    """The source of some standard-library modules, concatenated (at most ``max_bytes``)."""
    text = b""
    for name in modules:
        path = importlib.import_module(name).__file__
        assert path is not None
        with open(path, "rb") as f:
            text += f.read()
    return text[:max_bytes]


def shifted(chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A window of block + 1 bytes as (input, target) token ids."""
    chunk = chunk.long()
    return chunk[:-1], chunk[1:]


def build(block: int = 64, max_bytes: int = 400_000, modules: tuple[str, ...] = ("argparse", "dataclasses", "json.decoder"),
          shards: str = "") -> tuple[Windows | Shards, Windows | Shards]:
    """Train on the first 90 % of the text, evaluate on the last 10 %; with ``shards`` (a folder), on its
    train-*.bin files, evaluated on its val-*.bin (data.kwargs.shards=DIR)."""
    if shards:
        read = Tokens(block, dtype="uint8")
        return Shards(f"{shards}/train-*.bin", read, shifted), Shards(f"{shards}/val-*.bin", read, shifted)
    raw = torch.frombuffer(bytearray(stdlib_text(list(modules), max_bytes)), dtype=torch.uint8)
    cut = int(0.9 * len(raw))
    return Windows(raw[:cut], block), Windows(raw[cut:], block)
