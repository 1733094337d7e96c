"""Shard readers over time (trainer/data/readers.py, trainer/data/kept_index.py): a set of more shards than the process
may open files is read in a real process under a real limit, and a kept index that cannot be read is scanned again."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trainer.data import Shards
from trainer.data.kept_index import FOLDER

from .conftest import ROOT
from .shard_files import ident, write

SHARDS = 240
"""More shards than the open-file limit the reading process gets (the files its start left open + 100)."""

READ_ALL = """
import os, resource, sys
from pathlib import Path
from trainer.data import Shards, Tokens
from tests.shard_files import ident

folder, fmt = Path(sys.argv[1]), sys.argv[2]
reader = Tokens(block=4, dtype="uint8") if fmt == "bin" else None
ds = Shards(sorted(folder.glob(f"*.{fmt}")), reader, index_dir=folder / "kept")
first = ds[(0, 0)]  # the format's libraries are imported: what they keep open counts in the limit's room
room = len(os.listdir("/proc/self/fd")) + 100
resource.setrlimit(resource.RLIMIT_NOFILE, (room, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
seen = []
for _ in range(2):  # twice: a shard read again after others took its place is opened again
    for s in range(len(ds.indexes)):
        sample = ds[(s, 1)]
        seen.append(int(sample[0]) if fmt == "bin" else ident(sample))
print(len(ds.indexes), sorted(set(seen)) == sorted(seen[: len(ds.indexes)]), flush=True)
"""


def shard_folder(folder: Path, fmt: str) -> Path:
    if fmt == "bin":
        folder.mkdir(parents=True)
        for k in range(SHARDS):
            (folder / f"part-{k:03d}.bin").write_bytes(bytes((k + i) % 256 for i in range(13)))
        return folder
    return write(folder, fmt, [2] * SHARDS)


@pytest.mark.parametrize("fmt", ["jsonl", "tar", "bin"])
def test_more_shards_than_the_open_file_limit_are_read_one_after_another(tmp_path: Path, fmt: str) -> None:
    """Each shard read keeps its file (or memory map: numpy's holds a descriptor) open for the next sample, but only
    for the most recent shards: an epoch over more shards than ``ulimit -n`` must not die with EMFILE half-way. (Arrow
    files hold a memory map without a descriptor: no limit to test them against.)"""
    folder = shard_folder(tmp_path / fmt, fmt)
    done = subprocess.run([sys.executable, "-c", READ_ALL, str(folder), fmt], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [str(SHARDS), "True"]


def kept_files(tmp_path: Path, fmt: str) -> tuple[list[Path], Path, list[int]]:
    """Shard files, the folder of their kept indexes (made by a first start) and the samples read at that start."""
    files = sorted(write(tmp_path / "data", fmt, [5, 9, 4]).glob(f"*.{fmt}"))
    first = Shards(files, transform=ident)
    return files, files[0].parent / FOLDER, [first[i] for i in range(len(first))]


def damaged(good: bytes, how: str, r: random.Random) -> bytes:
    if how == "empty":
        return b""
    if how == "truncated":
        return good[: r.randrange(len(good))]
    if how == "garbage":
        return bytes(r.randrange(256) for _ in range(r.randrange(1, 600)))
    if how == "numpy's magic":
        return b"\x93NUMPY" + bytes(r.randrange(256) for _ in range(200))
    data = bytearray(good)  # a few bytes overwritten, mostly in the zip's headers (front and back)
    for _ in range(r.randint(1, 3)):
        at = r.choice([r.randrange(120), r.randrange(max(0, len(data) - 200), len(data)), r.randrange(len(data))])
        data[at] = r.randrange(256)
    return bytes(data)


@pytest.mark.parametrize("fmt", ["tar", "jsonl"])
def test_a_kept_index_that_cannot_be_read_is_scanned_again(tmp_path: Path, fmt: str) -> None:
    """A node that died while another rank wrote the index, a full disk, a bad copy: every start must go on (a scan),
    never end in a traceback out of numpy's or zipfile's reader."""
    files, kept, expected = kept_files(tmp_path, fmt)
    arrays = sorted(kept.glob("*.npz"))
    assert len(arrays) == 3
    good = {p: p.read_bytes() for p in arrays}
    r = random.Random(0)
    for trial in range(300):
        how = ["empty", "truncated", "garbage", "numpy's magic", "overwritten"][trial % 5]
        for path, data in good.items():
            path.write_bytes(damaged(data, how, r))
        again = Shards(files, transform=ident)
        assert [again[i] for i in range(len(again))] == expected, f"trial {trial} ({how})"


def test_a_kept_index_whose_description_does_not_fit_its_arrays_is_scanned_again(tmp_path: Path) -> None:
    """Not a list of numbers where a description is, a description without its count, arrays of another kind."""
    files, kept, expected = kept_files(tmp_path, "tar")
    descriptions = sorted(kept.glob("*.json"))
    descriptions[0].write_text("[]")
    meta = json.loads(descriptions[1].read_text())
    descriptions[1].write_text(json.dumps({k: v for k, v in meta.items() if k != "count"}))
    with open(descriptions[2].with_suffix(".npz"), "wb") as f:  # a JSONL shard's arrays under a tar description
        np.savez(f, starts=np.arange(4))
    again = Shards(files, transform=ident)
    assert [again[i] for i in range(len(again))] == expected


def test_an_index_that_cannot_be_kept_leaves_no_temporary_file(tmp_path: Path) -> None:
    files, kept, expected = kept_files(tmp_path, "jsonl")
    for path in list(kept.iterdir()):  # each index's arrays cannot take their place: a folder holds their name
        path.unlink()
        if path.suffix == ".npz":
            path.mkdir()
    again = Shards(files, transform=ident)
    assert [again[i] for i in range(len(again))] == expected
    assert sorted(p.name for p in kept.iterdir() if ".tmp" in p.name) == []
