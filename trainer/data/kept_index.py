"""Shard indexes made once and kept: a restart reads them instead of scanning every shard again, and the first scan
is shared out among the ranks.

One small file per shard in a folder (``Shards(index_dir=…)``; default: ``.shard-index`` beside the first shard, when
it can be written there), named by the shard's path, size and modification time and by the reader: a shard that
changes gets a new index. The files hold numbers and strings only (numpy's ``.npz`` without pickles, and JSON):
reading one runs no code. Readers whose index holds anything else are scanned at every start, as before.
"""

from __future__ import annotations

import contextlib
import json
import lzma
import os
import socket
import zipfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from trainer.data.readers import Index, Reader, TarTable

FOLDER = ".shard-index"
UNREADABLE = (OSError, ValueError, KeyError, TypeError, IndexError, EOFError, RuntimeError, NotImplementedError,
              MemoryError, zipfile.BadZipFile, zlib.error, lzma.LZMAError)
"""What reading a damaged index raises (a truncated copy, a node that died mid-write, a disk that filled): numpy's and
zipfile's readers have no common error (an encrypted or unknown compression flag, a size that cannot be allocated);
a description that does not fit its arrays. Such an index is scanned again."""


def rank_and_world() -> tuple[int, int]:
    """This process's place among the ranks, to share the first scan out (the group's when there is one)."""
    import torch.distributed as dist

    from trainer.core.env import discover
    from trainer.core.errors import UserError

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        env = discover()
    except UserError:
        return 0, 1  # the launch itself reports a broken environment; the data only shares less
    return env.rank, env.world_size


def _name(path: Path, reader: Reader) -> str:
    st = path.stat()
    settings = sorted((k, v) for k, v in vars(reader).items() if isinstance(v, (str, int, float, bool)))
    who = json.dumps([str(path.resolve()), st.st_size, st.st_mtime_ns, type(reader).__qualname__, settings])
    return f"{path.name[:60]}.{xxhash.xxh64_hexdigest(who.encode())}"


def _plain(value: Any) -> Any:
    """JSON's lists back to the tuples a schema was made of (it must stay hashable and compare equal)."""
    return tuple(_plain(v) for v in value) if isinstance(value, list) else value


def load(folder: Path, path: Path, reader: Reader) -> Index | None:
    """The kept index of ``path`` as ``reader`` reads it; None when there is none (or it cannot be read)."""
    try:
        base = folder / _name(path, reader)
        meta = json.loads(base.with_suffix(base.suffix + ".json").read_text())
        arrays = dict(np.load(base.with_suffix(base.suffix + ".npz"), allow_pickle=False)) if meta["arrays"] else {}
        return _index(path, meta, arrays)
    except UNREADABLE:
        return None


def _index(path: Path, meta: dict[str, Any], arrays: dict[str, Any]) -> Index:
    """The index a description and its arrays make; a ValueError (or KeyError) when they do not fit together."""
    kind, starts, count = meta["starts"], None, int(meta["count"])
    if kind == "tar":
        starts = TarTable(arrays["keys"], arrays["starts"], arrays["kinds"], arrays["offsets"], arrays["sizes"],
                          np.array(meta["exts"], dtype=object))
        sizes = {len(starts.keys) + 1, len(starts.starts)}, {len(starts.kinds), len(starts.offsets), len(starts.sizes)}
        if sizes[0] != {count + 1} or len(sizes[1]) != 1 or starts.exts.ndim != 1:
            raise ValueError("the arrays do not fit the description")
    elif kind == "array":
        starts = arrays["starts"]
        if len(starts) != count:
            raise ValueError("the arrays do not fit the description")
    return Index(str(path), count, _plain(meta["schema"]), starts)


def store(folder: Path, path: Path, reader: Reader, index: Index) -> None:
    """Keep ``index`` (best effort: a folder that cannot be written only costs the next start a scan)."""
    s = index.starts
    arrays: dict[str, Any] = {}
    meta: dict[str, Any] = {"count": index.count, "schema": index.schema, "starts": "none"}
    if isinstance(s, TarTable):
        arrays = {"keys": s.keys, "starts": s.starts, "kinds": s.kinds, "offsets": s.offsets, "sizes": s.sizes}
        meta.update(starts="tar", exts=[str(e) for e in s.exts])
    elif isinstance(s, np.ndarray) and s.dtype != object:
        arrays, meta["starts"] = {"starts": s}, "array"
    else:
        return  # nothing a scan learnt (token files, Arrow, Parquet's footer): reading it again is cheap
    meta["arrays"] = bool(arrays)
    base = folder / _name(path, reader)
    tmp = f".{socket.gethostname()}.{os.getpid()}.tmp"  # ranks on other nodes may write the same index at once
    npz, description = base.with_suffix(base.suffix + ".npz"), base.with_suffix(base.suffix + ".json")
    try:
        folder.mkdir(exist_ok=True)
        if arrays:
            with open(npz.with_name(npz.name + tmp), "wb") as f:
                np.savez(f, **arrays)
            os.replace(npz.with_name(npz.name + tmp), npz)
        # The .json last: an index counts once its description exists.
        description.with_name(description.name + tmp).write_text(json.dumps(meta))
        os.replace(description.with_name(description.name + tmp), description)
    except (OSError, TypeError, ValueError):
        for left in (npz, description):  # a full disk keeps no half-written copy (and the next start tries again)
            with contextlib.suppress(OSError):
                left.with_name(left.name + tmp).unlink(missing_ok=True)


def index_all(shards: Sequence[tuple[Reader, Path]], folder: Path | None, rank: int, world: int) -> list[Index]:
    """Every shard's index: kept ones read; the rest scanned and kept, rank r taking shards r, r + world, … first, then
    reading what the others kept meanwhile and scanning what is still missing. No collective: a rank that builds its
    data alone (or a folder the nodes do not share) only costs a scan, never a hang; a bad shard fails on every rank
    that scans it. Without a folder every rank scans every shard."""
    if folder is None:
        return [reader.index(path) for reader, path in shards]
    found: list[Index | None] = [None] * len(shards)
    mine = list(range(rank % world, len(shards), world))
    for i in mine + [i for i in range(len(shards)) if i % world != rank % world]:  # read once each, as late as can be
        reader, path = shards[i]
        ix = load(folder, path, reader)
        if ix is None:
            ix = reader.index(path)
            store(folder, path, reader, ix)
        found[i] = ix
    return [ix for ix in found if ix is not None]
