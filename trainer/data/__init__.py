"""Data the runtime knows how to resume: sharded files read in an order that depends on (seed, epoch) alone, the
loaders and samplers that hand each rank its share, and the global batch's split (``batches``, no torch: the
cluster tools check it at submit time)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Arrow", "Jsonl", "Parquet", "Reader", "ShardError", "Shards", "Tar", "Tokens", "Windows"]

if TYPE_CHECKING:
    from trainer.data.readers import Arrow, Jsonl, Parquet, Reader, ShardError, Tar, Tokens
    from trainer.data.shards import Shards
    from trainer.data.windows import Windows

# Imported on first use: `trainer.data.batches` (no torch) must not load the readers' numpy and torch.
_EXPORTS = {**dict.fromkeys(["Arrow", "Jsonl", "Parquet", "Reader", "ShardError", "Tar", "Tokens"], "trainer.data.readers"),
            "Shards": "trainer.data.shards", "Windows": "trainer.data.windows"}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trainer.data' has no attribute {name!r}")
