"""Data sets the runtime knows how to resume: sharded files read in an order that depends on (seed, epoch) alone."""

from trainer.data.readers import Arrow, Jsonl, Parquet, Reader, ShardError, Tar, Tokens
from trainer.data.shards import Shards
from trainer.data.windows import Windows

__all__ = ["Arrow", "Jsonl", "Parquet", "Reader", "ShardError", "Shards", "Tar", "Tokens", "Windows"]
