"""Text that is on every machine: the source files of Python's standard library, read as bytes (no download)."""

from __future__ import annotations

import importlib

import torch

from trainer.data import Windows


def stdlib_text(modules: list[str], max_bytes: int) -> bytes:
    """The source of some standard-library modules, concatenated (at most ``max_bytes``)."""
    text = b""
    for name in modules:
        path = importlib.import_module(name).__file__
        assert path is not None
        with open(path, "rb") as f:
            text += f.read()
    return text[:max_bytes]


def build(block: int = 64, max_bytes: int = 400_000,
          modules: tuple[str, ...] = ("argparse", "dataclasses", "json.decoder")) -> tuple[Windows, Windows]:
    """Train on the first 90 % of the text, evaluate on the last 10 %."""
    raw = torch.frombuffer(bytearray(stdlib_text(list(modules), max_bytes)), dtype=torch.uint8)
    cut = int(0.9 * len(raw))
    return Windows(raw[:cut], block), Windows(raw[cut:], block)
