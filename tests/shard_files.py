"""Shard files of every format with the same rows ``{"id": i, "x": [4 floats]}``, for the sharded data tests."""

from __future__ import annotations

import io
import json
import random
import tarfile
from pathlib import Path
from typing import Any


def rows(sizes: list[int], seed: int = 0) -> list[list[dict[str, Any]]]:
    """Shards of rows with consecutive ids."""
    r, i, out = random.Random(seed), 0, []
    for n in sizes:
        out.append([{"id": i + k, "x": [round(r.gauss(0, 1), 4) for _ in range(4)]} for k in range(n)])
        i += n
    return out


def write(folder: Path, fmt: str, sizes: list[int]) -> Path:
    """``folder`` with one file per shard in ``fmt`` (tar, jsonl, parquet, arrow)."""
    folder.mkdir(parents=True, exist_ok=True)
    for k, shard in enumerate(rows(sizes)):
        path = folder / f"part-{k:03d}.{fmt}"
        if fmt == "jsonl":
            path.write_text("".join(json.dumps(r) + "\n" for r in shard))
        elif fmt == "tar":
            with tarfile.open(path, "w") as tar:
                for r in shard:
                    add(tar, f"s{r['id']:06d}.json", json.dumps(r).encode())
                    add(tar, f"s{r['id']:06d}.cls", str(r["id"] % 3).encode())
        elif fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(shard, schema=_schema()), path, row_group_size=7)
        elif fmt == "arrow":
            import datasets
            import pyarrow as pa

            datasets.disable_progress_bars()
            ds = datasets.Dataset(pa.Table.from_pylist(shard, schema=_schema()))
            ds.save_to_disk(str(folder / f"part-{k:03d}"))
    return folder


def _schema() -> Any:
    import pyarrow as pa

    return pa.schema([("id", pa.int64()), ("x", pa.list_(pa.float64()))])


def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def ident(sample: Any) -> int:
    """A sample's id, whatever its format (a tar sample's JSON member holds the row)."""
    return int(sample["json"]["id"] if "json" in sample else sample["id"])
