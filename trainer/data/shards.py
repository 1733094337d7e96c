"""Sharded files as one data set whose order is a function of (seed, epoch) and whose position is a count of samples.

An epoch reads the shards in a seeded order, and each shard in seeded windows of ``shuffle_window`` consecutive
samples shuffled among themselves (the locality of a shuffle buffer, without holding samples in memory). Stream
position p of an epoch is one sample of one shard; the loader hands position ranges to ranks and workers
(trainer/data/samplers.py: StreamSampler), so how many processes read the stream changes who reads a sample,
never which sample comes next. Each process reads only its own samples, by index.
"""

from __future__ import annotations

import bisect
import glob
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from trainer.data import kept_index
from trainer.data.readers import BY_SUFFIX, Index, Reader, ShardError


def shard_files(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    """Files named by ``paths``: files, globs, and folders (their shard files; a ``save_to_disk`` folder's Arrow
    files), in the order given (each glob and folder sorted). A ShardError names what matched nothing."""
    out: list[Path] = []
    for item in [paths] if isinstance(paths, (str, Path)) else paths:
        text = str(item)
        if any(c in text for c in "*?["):
            found = [Path(p) for p in sorted(glob.glob(text))]
        elif Path(text).is_dir():
            found = sorted(p for p in Path(text).rglob("*") if p.suffix in BY_SUFFIX or p.suffix == ".bin")
        else:
            if not Path(text).is_file():
                raise ShardError(f"shard {text!r} does not exist", "check the path (a file, a folder or a glob)")
            found = [Path(text)]
        if not found:
            raise ShardError(f"{text!r} matches no shard file (.tar, .jsonl, .parquet, .arrow, .bin)",
                             "check the path, or name the files (a list or a glob)")
        out += found
    return out


class Order:
    """One epoch's stream: position p → (shard number, sample number in that shard)."""

    def __init__(self, counts: np.ndarray, seed: int, epoch: int, window: int | None) -> None:
        self.seed, self.epoch = seed, epoch
        self.shards = np.random.default_rng([seed, epoch]).permutation(len(counts))
        self.counts = counts[self.shards]
        self.ends = np.cumsum(self.counts).tolist()
        self.window = window
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def locate(self, p: int) -> tuple[int, int]:
        """The shard and sample number at stream position ``p``."""
        s = bisect.bisect_right(self.ends, p)
        offset = p - (self.ends[s - 1] if s else 0)
        count = int(self.counts[s])
        size = min(self.window or count, count)
        w, within = divmod(offset, size)
        perm = self._perms.get((s, w))
        if perm is None:
            if len(self._perms) > 64:  # a reader moves through windows in order: forget the oldest
                self._perms.pop(next(iter(self._perms)))
            n = min(size, count - w * size)
            perm = self._perms[(s, w)] = np.random.default_rng([self.seed, self.epoch, int(self.shards[s]), w]).permutation(n)
        return int(self.shards[s]), w * size + int(perm[within])

    def take(self, start: int, n: int) -> list[tuple[int, int]]:
        """Positions ``start … start + n - 1``."""
        return [self.locate(p) for p in range(start, start + n)]


class Shards(Dataset[Any]):
    """Shard files (WebDataset tar, JSONL, Parquet, Arrow from ``save_to_disk``, token files) as one data set that
    resumes exactly on any world size and any number of loader workers (``Session.loader``, ``data.name=shards``).

    ``reader`` reads every file (default: by suffix); ``transform`` turns a decoded sample into what the model takes;
    ``shuffle_window``: samples shuffled together within a shard (None: the whole shard); ``index_dir``: where each
    shard's scan is kept for the next start (default ``.shard-index`` beside the first shard; scanned at every start
    when it cannot be written). Indexing with a number reads
    the set in file order (evaluation); the training loader reads it in the epoch's shuffled order.
    """

    def __init__(self, paths: str | Path | Sequence[str | Path], reader: Reader | None = None,
                 transform: Callable[[Any], Any] | None = None, shuffle_window: int | None = 10_000,
                 index_dir: str | Path | None = None) -> None:
        self.reader, self.transform, self.window = reader, transform, shuffle_window
        self.notes: list[str] = []
        read = [(self._reader(f), f) for f in shard_files(paths)]
        folder = Path(index_dir) if index_dir is not None else read[0][1].parent / kept_index.FOLDER if read else None
        indexes = list(zip((r for r, _ in read), kept_index.index_all(read, folder, *kept_index.rank_and_world()),
                           strict=True))
        for _, ix in indexes:
            if not ix.count:
                self.notes.append(f"shard {ix.path!r} holds no sample: skipped")
        self.readers = [r for r, ix in indexes if ix.count]
        self.indexes = [ix for _, ix in indexes if ix.count]
        if not self.indexes:
            raise ShardError("no shard holds a sample", "check the files (they are all empty)")
        first = self.indexes[0]
        for ix in self.indexes[1:]:
            if ix.schema != first.schema:
                raise ShardError(f"shards {first.path!r} and {ix.path!r} differ in schema: {first.schema} vs "
                                 f"{ix.schema}", "train on shards of one schema (or convert them)")
        self.counts = np.array([ix.count for ix in self.indexes], dtype=np.int64)
        self.ends = np.cumsum(self.counts).tolist()
        self._cache: dict[str, Any] = {}

    def _reader(self, path: Path) -> Reader:
        if self.reader is not None:
            return self.reader
        make = BY_SUFFIX.get(path.suffix)
        if make is None:
            raise ShardError(f"no reader for {str(path)!r} (suffix {path.suffix!r})",
                             "pass one: Shards(paths, reader=Tokens(block=…)) for token files, or a Reader of your own")
        return make()

    def __len__(self) -> int:
        return int(self.ends[-1])

    def order(self, seed: int, epoch: int) -> Order:
        """The stream of ``epoch``: a function of (seed, epoch) alone."""
        return Order(self.counts, seed, epoch, self.window)

    def describe(self) -> str:
        """One line: files, samples, the shuffle."""
        window = "whole shards" if self.window is None else f"windows of {self.window:,} samples"
        return (f"{len(self.indexes)} shard(s), {len(self):,} samples, shuffled by shard and within {window}; each "
                "process reads only its own samples")

    def __getitem__(self, item: int | tuple[int, int]) -> Any:
        if isinstance(item, tuple):
            s, j = item
        else:
            s = bisect.bisect_right(self.ends, item)
            j = item - (self.ends[s - 1] if s else 0)
        ix: Index = self.indexes[s]
        sample = self.readers[s].read(ix, j, self._cache)
        return self.transform(sample) if self.transform is not None else sample

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": {}}  # open files stay in the process that opened them
