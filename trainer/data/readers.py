"""Readers of shard files, one per format: each indexes a file once (sample count, schema, where samples start) and
reads a sample by its number. The order in which samples are read is not theirs to decide (trainer/data/shards.py).

The formats are read through the libraries that own them (tarfile and webdataset's decoders, pyarrow, datasets);
an index is plain data, so it travels to DataLoader workers, which open files lazily.
"""

from __future__ import annotations

import bisect
import json
import os
import tarfile
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from trainer.core.errors import UserError

_HINT = "rewrite or remove that file (the shard list is data.path / Shards(paths))"


class ShardError(UserError):
    """A shard that cannot be read, naming the file and where in it. Built from one message, so a DataLoader
    worker's error reaches the training process as itself (DataLoader re-raises ``type(message)``)."""

    def __init__(self, message: str, hint: str = _HINT) -> None:
        if message.startswith("Caught "):  # re-raised from a worker: keep the original's own line
            message = message.rstrip().rsplit("\n", 1)[-1].split("data.path: ", 1)[-1]
        super().__init__("data.path", message, hint)


@dataclass(frozen=True)
class Index:
    """What a reader learnt from one pass over a shard: its samples and their schema."""

    path: str
    count: int
    schema: Hashable
    starts: Any = field(default=None, compare=False)
    """Where each sample starts, as the format needs it (tar members, JSONL line offsets, Parquet row groups)."""


class Reader(Protocol):
    """One shard format."""

    def index(self, path: Path) -> Index:
        """Count the samples of ``path`` and say where they start; a ShardError naming the file and place if not."""
        ...

    def read(self, index: Index, j: int, cache: dict[str, Any]) -> Any:
        """Sample ``j`` of the shard (``cache``: this process's, for its open files; ``opened(cache)`` keeps the most
        recent few)."""
        ...


OPEN_SHARDS = 64
"""Shards a process keeps open (a descriptor or a memory map each) for its next samples: the most recently read. A
set may hold more files than a process may open (``ulimit -n``); each process reads shards mostly one after another."""


class Opened:
    """This process's most recently read shards, opened; the least recent is closed as another opens. A DataLoader
    reads a map-style set from one thread per process, so a shard closed here is never one a read is using."""

    def __init__(self, limit: int = OPEN_SHARDS) -> None:
        self.limit = limit
        self._open: OrderedDict[str, tuple[Any, Callable[[Any], None] | None]] = OrderedDict()

    def get(self, path: str, open_: Callable[[str], Any], close: Callable[[Any], None] | None = None) -> Any:
        """``path`` opened (``open_``, once while it stays among the recent); ``close`` ends it when it leaves them
        (None: dropped, as a memory map is)."""
        if path in self._open:
            self._open.move_to_end(path)
            return self._open[path][0]
        while len(self._open) >= self.limit:
            _, (old, end) = self._open.popitem(last=False)
            if end is not None:
                end(old)
        value = open_(path)
        self._open[path] = (value, close)
        return value

    def __del__(self) -> None:  # a data set dropped (an evaluation's): its files with it
        for value, end in self._open.values():
            if end is not None:
                end(value)


def opened(cache: dict[str, Any]) -> Opened:
    """The open shards kept in a reader's ``cache``."""
    found = cache.get("opened")
    if not isinstance(found, Opened):
        found = cache["opened"] = Opened()
    return found


COMPRESSED = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ", b"\x28\xb5\x2f\xfd")
"""The first bytes of gzip, bzip2, xz and zstd files."""


@dataclass(frozen=True)
class TarTable:
    """A tar shard's samples in numpy arrays (about 40 bytes a sample, plus its key): every process holds the index
    of every shard, so it must stay small for millions of samples."""

    keys: Any
    """Each sample's key (fixed-width bytes)."""
    starts: Any
    """Sample i's members are rows ``starts[i] … starts[i + 1] - 1`` of the member arrays."""
    kinds: Any
    """Each member's extension, as an index into ``exts``."""
    offsets: Any
    sizes: Any
    exts: Any

    @staticmethod
    def of(members: list[tuple[str, int, int]]) -> TarTable:
        """From (name, data offset, size) in file order: consecutive members ``<key>.<ext>`` with one key are one
        sample (the WebDataset convention: the key is the name up to the first dot of its last part)."""
        import numpy as np

        keys, starts, kinds, exts = [], [], [], {}  # type: ignore[var-annotated]
        for i, (name, _, _) in enumerate(members):
            base = name.rsplit("/", 1)[-1]
            stem, _, ext = base.partition(".")
            key = name[: len(name) - len(base)] + stem
            if not keys or keys[-1] != key:
                keys.append(key)
                starts.append(i)
            kinds.append(exts.setdefault(ext, len(exts)))
        return TarTable(np.array([k.encode() for k in keys], dtype=bytes), np.array([*starts, len(members)], np.int64),
                        np.array(kinds, np.int32), np.array([m[1] for m in members], np.int64),
                        np.array([m[2] for m in members], np.int64), np.array(list(exts), dtype=object))

    def sample(self, j: int) -> tuple[str, list[tuple[str, int, int]]]:
        """Sample ``j``'s key and (extension, data offset, size) of each member."""
        rows = range(int(self.starts[j]), int(self.starts[j + 1]))
        return self.keys[j].decode(), [(self.exts[self.kinds[r]], int(self.offsets[r]), int(self.sizes[r])) for r in rows]


class _BadTar(Exception):
    def __init__(self, place: int, reason: str) -> None:
        self.place, self.reason = place, reason


def _plain_members(f: Any) -> list[tuple[str, int, int]] | None:
    """(name, data offset, size) of every regular file of a tar made of plain ustar/GNU headers, read header by
    header (about 20 times faster than tarfile, which checks and keeps far more); None at a pax or long-name header."""
    out, place = [], 0
    while True:
        f.seek(place)
        block = f.read(512)
        if len(block) < 512 or not block.strip(b"\0"):
            break
        if sum(block[:148]) + 256 + sum(block[156:]) != _octal(block[148:156], place):
            raise _BadTar(place, "not a tar header (its checksum fails: a corrupt or overwritten file)")
        kind = block[156:157]
        if kind in (b"x", b"g", b"L", b"K"):
            return None
        size = _octal(block[124:136], place)
        if kind in (b"0", b"\0", b"7"):
            name = block[:100].split(b"\0", 1)[0]
            if block[257:262] == b"ustar" and block[345] != 0:
                name = block[345:500].split(b"\0", 1)[0] + b"/" + name
            out.append((name.decode("utf-8", "replace"), place + 512, size))
        place += 512 + -(-size // 512) * 512
    _rest_is_zeros(f, place)
    return out


def _octal(field: bytes, place: int) -> int:
    if field[0] & 0x80:  # GNU base-256 for large sizes
        return int.from_bytes(field[1:], "big")
    try:
        return int(field.strip(b"\0 ") or b"0", 8)
    except ValueError:
        raise _BadTar(place, "not a tar header (a corrupt or overwritten file)") from None


def _rest_is_zeros(f: Any, place: int) -> None:
    f.seek(place)
    if f.read().strip(b"\0"):  # a tar ends in zero blocks: anything else is a damaged header
        raise _BadTar(place, "not a tar header (a corrupt or overwritten file)")


def _tarfile_members(f: Any) -> list[tuple[str, int, int]]:
    f.seek(0)
    out, place = [], 0
    try:
        with tarfile.open(fileobj=f, mode="r:") as tar:
            for member in tar:
                place = member.offset
                if member.isfile():
                    out.append((member.name, member.offset_data, member.size))
            place = tar.offset
    except tarfile.TarError as exc:
        raise _BadTar(place, str(exc)) from None
    _rest_is_zeros(f, place)  # tarfile ends quietly at a bad header after the first: say where
    return out


def _fail(path: str, where: str, exc: BaseException | str) -> ShardError:
    return ShardError(f"cannot read shard {path!r} {where}: {exc}")


class Tar:
    """WebDataset shards: plain tar files whose consecutive members ``<key>.<ext>`` make one sample, a dict
    ``{"__key__": key, ext: value}`` decoded by webdataset's decoders (``image`` as in ``webdataset.imagehandler``)."""

    def __init__(self, image: str = "torchrgb", decode: Callable[[dict[str, Any]], Any] | None = None) -> None:
        self.image, self.decode = image, decode

    def index(self, path: Path) -> Index:
        try:
            with open(path, "rb") as f:
                if f.read(6).startswith(COMPRESSED):
                    raise ShardError(f"cannot read shard {str(path)!r} after byte 0: it is compressed",
                                     "shards must be plain (uncompressed) tar files: samples are read by offset")
                members = _plain_members(f)
                if members is None:  # pax or GNU long-name headers: tarfile reads every kind
                    members = _tarfile_members(f)
        except _BadTar as exc:
            raise ShardError(f"cannot read shard {str(path)!r} after byte {exc.place}: {exc.reason}") from None
        except OSError as exc:
            raise ShardError(f"cannot read shard {str(path)!r}: {exc}") from None
        table = TarTable.of(members)
        first = table.exts[table.kinds[: table.starts[1]]] if len(table.keys) else []
        return Index(str(path), len(table.keys), ("tar", tuple(sorted(first))), table)

    def read(self, index: Index, j: int, cache: dict[str, Any]) -> Any:
        table: TarTable = index.starts
        key, members = table.sample(j)
        sample: dict[str, Any] = {"__key__": key}
        try:
            fd = _fd(cache, index.path)
            for ext, offset, size in members:
                sample[ext] = os.pread(fd, size, offset)  # no shared file offset to move under another reader
                if len(sample[ext]) != size:
                    raise OSError(f"{size - len(sample[ext])} bytes missing (truncated file)")
        except OSError as exc:
            raise _fail(index.path, f"at sample {key!r}, byte {members[0][1]}", exc) from None
        if self.decode is not None:
            return self.decode(sample)
        if "decoder" not in cache:
            import webdataset.autodecode as wds

            cache["decoder"] = wds.Decoder([wds.imagehandler(self.image), wds.basichandlers])
        try:
            return cache["decoder"](sample)
        except Exception as exc:  # noqa: BLE001 - webdataset wraps every decoder's error; name the sample instead
            cause = exc.__cause__ or exc
            raise _fail(index.path, f"at sample {key!r}, byte {members[0][1]}",
                        f"cannot decode it: {type(cause).__name__}: {cause}") from None


class Jsonl:
    """JSON Lines: one JSON object per line (blank lines skipped); the schema is the first object's keys."""

    def index(self, path: Path) -> Index:
        offsets: list[int] = []
        try:
            with open(path, "rb") as f:
                place = 0
                for line in f:
                    if line.strip():
                        offsets.append(place)
                    place += len(line)
                first = json.loads(_line_at(f.fileno(), offsets[0])) if offsets else {}
        except (OSError, ValueError) as exc:
            raise _fail(str(path), "at line 1" if offsets else "", exc) from None
        import numpy as np

        schema = tuple(sorted(first)) if isinstance(first, dict) else type(first).__name__
        return Index(str(path), len(offsets), ("jsonl", schema), np.array(offsets, np.int64))  # 8 bytes a row

    def read(self, index: Index, j: int, cache: dict[str, Any]) -> Any:
        try:
            return json.loads(_line_at(_fd(cache, index.path), int(index.starts[j])))
        except (OSError, ValueError) as exc:
            raise _fail(index.path, f"at row {j} (byte {index.starts[j]})", exc) from None


def _fd(cache: dict[str, Any], path: str) -> int:
    """This process's descriptor of ``path``, read with pread only (DataLoader workers may inherit it by fork)."""
    return int(opened(cache).get(path, lambda p: os.open(p, os.O_RDONLY), os.close))


def _line_at(fd: int, offset: int, chunk: int = 4096) -> bytes:
    """The line that starts at ``offset``."""
    parts: list[bytes] = []
    while True:
        part = os.pread(fd, chunk, offset)
        end = part.find(b"\n")
        if end >= 0 or not part:
            return b"".join([*parts, part[: end + 1] if end >= 0 else part])
        parts.append(part)
        offset += len(part)
        chunk *= 2


class Parquet:
    """Parquet files through pyarrow: a sample is a row as a dict; row groups are read whole and the last two kept."""

    def index(self, path: Path) -> Index:
        import pyarrow.parquet as pq

        try:
            meta = pq.ParquetFile(path)
            sizes = [meta.metadata.row_group(i).num_rows for i in range(meta.num_row_groups)]
            schema = str(meta.schema_arrow)
        except Exception as exc:  # noqa: BLE001 - pyarrow's errors have no common base but name the problem
            raise _fail(str(path), "(its footer)", exc) from None
        ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
        return Index(str(path), sum(sizes), ("parquet", schema), ends)

    def read(self, index: Index, j: int, cache: dict[str, Any]) -> Any:
        import pyarrow.parquet as pq

        group = bisect.bisect_right(index.starts, j)
        start = index.starts[group - 1] if group else 0
        groups: dict[tuple[str, int], list[dict[str, Any]]] = cache.setdefault("parquet", {})
        rows = groups.get((index.path, group))
        if rows is None:
            try:
                rows = pq.ParquetFile(index.path).read_row_group(group).to_pylist()
            except Exception as exc:  # noqa: BLE001
                raise _fail(index.path, f"at row {j} (row group {group})", exc) from None
            if len(groups) >= 2:
                groups.pop(next(iter(groups)))
            groups[(index.path, group)] = rows
        return rows[j - start]


class Arrow:
    """Arrow files of a Hugging Face data set saved with ``save_to_disk``, memory-mapped through ``datasets``."""

    def index(self, path: Path) -> Index:
        try:
            ds = _arrow(str(path))
            return Index(str(path), len(ds), ("arrow", str(ds.features)))
        except ShardError:
            raise
        except Exception as exc:  # noqa: BLE001 - datasets/pyarrow errors name the problem
            raise _fail(str(path), "", exc) from None

    def read(self, index: Index, j: int, cache: dict[str, Any]) -> Any:
        return opened(cache).get(index.path, _arrow)[j]


def _arrow(path: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise ShardError(f"{path!r} is an Arrow shard, read through Hugging Face datasets, which is not installed",
                         "pip install 'slurm-ddp-trainer[hf]' (or datasets)") from None

    return datasets.Dataset.from_file(path)


class Tokens:
    """Flat token files (``.bin``, as nanoGPT writes them): sample j is tokens ``j*block … (j+1)*block`` plus the next
    one, as an int64 tensor of ``block + 1`` (input and shifted target)."""

    def __init__(self, block: int, dtype: str = "uint16") -> None:
        self.block, self.dtype = block, dtype

    def index(self, path: Path) -> Index:
        import numpy as np

        try:
            tokens = path.stat().st_size // np.dtype(self.dtype).itemsize
        except OSError as exc:
            raise _fail(str(path), "", exc) from None
        return Index(str(path), max(0, (tokens - 1) // self.block), ("tokens", self.dtype, self.block))

    def read(self, index: Index, j: int, cache: dict[str, Any]) -> Any:
        import numpy as np
        import torch

        data = opened(cache).get(index.path, lambda p: np.memmap(p, dtype=self.dtype, mode="r"))
        return torch.from_numpy(data[j * self.block: (j + 1) * self.block + 1].astype(np.int64))


BY_SUFFIX: dict[str, Callable[[], Reader]] = {".tar": Tar, ".jsonl": Jsonl, ".parquet": Parquet, ".arrow": Arrow}
"""The reader a file's suffix picks when none is given (token files need their block length: ``Tokens(block)``)."""
