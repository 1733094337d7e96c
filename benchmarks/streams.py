"""Sharded data (trainer.data.Shards, section 13 of docs/benchmarks.md): how fast its loader reads WebDataset shards
against webdataset's own pipeline over the same shards and a plain DataLoader over the same samples held in memory,
as interleaved pairs with the same workers, decoding and batching; and the memory a reading process peaks at.

``python -m benchmarks.streams`` writes docs/benchmarks-streams.json and the section.
"""

from __future__ import annotations

import argparse
import functools
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from benchmarks.common import ROOT, machine, pairs, publish, show, spread

BATCH = 64


def ours(folder: Path, workers: int, window: int | None = 1000) -> Any:
    from trainer.builtin.data import labelled_image
    from trainer.core.env import DistEnv
    from trainer.data import Shards
    from trainer.data.loader import Loader

    env = DistEnv(0, 0, 1, 1, 0, 1, "127.0.0.1", 0, None, "torchrun")
    loader = Loader(Shards(folder, transform=labelled_image, shuffle_window=window), env, BATCH, 0, None,
                    num_workers=workers)
    return loader


def webdataset(folder: Path, workers: int, buffer: int = 1000) -> Any:
    import webdataset as wds
    from torch.utils.data import DataLoader

    from trainer.builtin.data import labelled_image

    urls = [str(p) for p in sorted(folder.glob("*.tar"))]
    pipe = (wds.WebDataset(urls, shardshuffle=len(urls), nodesplitter=None, empty_check=False).shuffle(buffer)
            .decode("torchrgb").map(labelled_image).batched(BATCH))
    return DataLoader(pipe, batch_size=None, num_workers=workers)


def in_memory(folder: Path, workers: int) -> Any:
    """The same raw samples read into a list first, decoded and batched the same way by a plain DataLoader."""
    import tarfile

    import webdataset.autodecode as wa
    from torch.utils.data import DataLoader

    samples: dict[str, dict[str, Any]] = {}
    for shard in sorted(folder.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for m in tar:
                key, ext = m.name.split(".", 1)
                samples.setdefault(key, {"__key__": key})[ext] = tar.extractfile(m).read()  # type: ignore[union-attr]
    return DataLoader(Decoded(list(samples.values()), wa.Decoder([wa.imagehandler("torchrgb"), wa.basichandlers])),
                      batch_size=BATCH, shuffle=True, num_workers=workers)


class Decoded(Dataset[Any]):
    """Raw samples in memory, decoded and transformed as they are fetched."""

    def __init__(self, raw: list[dict[str, Any]], decoder: Any) -> None:
        self.raw, self.decoder = raw, decoder

    def __len__(self) -> int:
        return len(self.raw)

    def __getitem__(self, i: int) -> Any:
        from trainer.builtin.data import labelled_image

        return labelled_image(self.decoder(self.raw[i]))


def rate(make: Any, folder: Path, workers: int) -> float:
    """Samples per second over one epoch, worker start-up included (every side starts its workers alike); making
    the data set (trainer.Shards: its index) is timed apart (``index_rate``)."""
    data, n = make(folder, workers), 0
    start = time.perf_counter()
    for x, _ in data:
        n += len(x)
    return n / (time.perf_counter() - start)


def index_rate(folder: Path, kept: bool) -> float:
    """Samples per second trainer.Shards indexes at start: a first start scans every shard (into a new folder), a
    restart reads the index the first one kept."""
    from trainer.data import Shards

    where = folder.parent / "kept-index" if kept else Path(tempfile.mkdtemp(dir=folder.parent))
    if kept and not where.exists():
        Shards(folder, index_dir=where)
    start = time.perf_counter()
    n = len(Shards(folder, index_dir=where))
    return n / (time.perf_counter() - start)


def million_startup(tmp: Path, n_pairs: int, samples: int = 1_000_000, shards: int = 16) -> dict[str, Any]:
    """Start-up over ``samples`` WebDataset samples (one small member each) in ``shards`` tar files, one process:
    seconds to a ready data set when it scans every shard (a first start) and when it reads the kept index (a
    restart), as interleaved pairs."""
    import io
    import tarfile

    folder = tmp / "million"
    folder.mkdir()
    per = samples // shards
    for k in range(shards):
        with tarfile.open(folder / f"part-{k:03d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(per):
                info = tarfile.TarInfo(f"{k:03d}{i:07d}.cls")
                info.size = 1
                tar.addfile(info, io.BytesIO(b"3"))

    def seconds(kept: bool) -> float:
        return per * shards / index_rate(folder, kept)

    got = pairs(n_pairs, functools.partial(seconds, False), functools.partial(seconds, True))
    return {"samples": per * shards, "shards": shards, "scan_s": spread([a for a, _ in got]),
            "kept_s": spread([b for _, b in got]), "ratio": spread([a / b for a, b in got])}


def peak_rss(kind: str, folder: Path) -> float:
    """MiB a fresh process's resident memory grows by, at its peak, while it reads an epoch with ``kind``
    (ours:<window> or webdataset:<buffer>), over what it held once the data set was made."""
    code = ("from pathlib import Path; from benchmarks import streams as s; "
            f"name, n = {kind!r}.split(':'); folder = Path({str(folder)!r}); "
            "it = s.ours(folder, 0, None if n == 'shard' else int(n)) if name == 'ours' else s.webdataset(folder, 0, int(n)); "
            "before = peak = s.rss()\n"
            "for _ in iter(it): peak = max(peak, s.rss())\n"
            "print(peak - before)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def rss() -> float:
    """This process's resident memory now, in MiB."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / 2**20


def measure(n_pairs: int, shards: int, per_shard: int, size: int, tmp: Path) -> dict[str, Any]:
    folder = tmp / "wds"
    subprocess.run([sys.executable, str(ROOT / "examples" / "shards" / "make_shards.py"), str(folder), "--train",
                    str(shards * per_shard), "--val", "0", "--per-shard", str(per_shard), "--size", str(size)],
                   check=True, capture_output=True)
    train = folder / "train"
    out: dict[str, Any] = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "pairs": n_pairs,
                           "shards": shards, "per_shard": per_shard, "image": size, "batch": BATCH, "by_workers": {}}
    for workers in (0, 2):
        mine = functools.partial(rate, ours, train, workers)
        vs_wds = pairs(n_pairs, mine, functools.partial(rate, webdataset, train, workers))
        vs_mem = pairs(n_pairs, mine, functools.partial(rate, in_memory, train, workers))
        out["by_workers"][workers] = {
            "ours_per_s": spread([a for a, _ in vs_wds + vs_mem]),
            "vs_webdataset": spread([a / b for a, b in vs_wds]), "vs_memory": spread([a / b for a, b in vs_mem])}
    starts = pairs(n_pairs, functools.partial(index_rate, train, False), functools.partial(index_rate, train, True))
    out["index_per_s"] = spread([a for a, _ in starts])
    out["kept_per_s"] = spread([b for _, b in starts])
    out["kept_vs_scan"] = spread([b / a for a, b in starts])
    out["million"] = million_startup(tmp, n_pairs)
    out["rss_mib"] = {k: peak_rss(k, train) for k in ("ours:1000", "ours:shard", "webdataset:1000", "webdataset:10000")}
    out["command"] = (f"python -m benchmarks.streams --pairs {n_pairs} --shards {shards} --per-shard {per_shard} "
                      f"--size {size}")
    return out


def section(r: dict[str, Any] | None) -> list[str]:
    out = ["## 13. Sharded data: read rate and memory", ""]
    if not r:
        return out + ["Not measured yet: `python -m benchmarks.streams`.", ""]
    rows = [f"| {w} | {show(v['ours_per_s'], '{:,.0f}')} | {show(v['vs_webdataset'], '{:.2f}×')} | "
            f"{show(v['vs_memory'], '{:.2f}×')} |" for w, v in r["by_workers"].items()]
    rss = r["rss_mib"]
    return out + [
        f"Measured by `{r['command']}` on {r['date']} ({r['machine']['cpu']}, {r['machine']['cores']} cores): "
        f"{r['shards']} WebDataset shards of {r['per_shard']} samples (a {r['image']} px PNG and a class each, written "
        f"by examples/shards/make_shards.py), one epoch per run in batches of {r['batch']}, the same decoding "
        "(webdataset's `torchrgb`) and the built-in trainer's transform on every side; "
        f"{r['pairs']} interleaved pairs per ratio.", "",
        "| loader workers | trainer.Shards, samples/s | ÷ webdataset's pipeline | ÷ a DataLoader over the samples in "
        "memory |", "|---|---|---|---|", *rows, "",
        f"Indexing at start (every rank, before training): a first start scans {show(r['index_per_s'], '{:,.0f}')} "
        "samples/s, shared out among the ranks; a restart reads the index kept in `.shard-index` at "
        f"{show(r['kept_per_s'], '{:,.0f}')} samples/s ({show(r['kept_vs_scan'], '{:.1f}×')} the scan). "
        f"For {r['million']['samples']:,} WebDataset samples in {r['million']['shards']} tar shards, one process: "
        f"{show(r['million']['scan_s'], '{:.1f} s')} to scan at a first start, "
        f"{show(r['million']['kept_s'], '{:.2f} s')} to read the kept index at a restart "
        f"({show(r['million']['ratio'], '{:.0f}×')} faster).", "",
        "| a process reading one epoch (0 workers) | resident memory at its peak, over the data set made |",
        "|---|---|",
        *(f"| {what} | +{rss[k]:.1f} MiB |" for k, what in (
            ("ours:1000", "trainer.Shards, shuffle window 1,000"), ("ours:shard", "trainer.Shards, whole-shard shuffle"),
            ("webdataset:1000", "webdataset, shuffle buffer 1,000"),
            ("webdataset:10000", "webdataset, shuffle buffer 10,000"))), "",
        "trainer.Shards holds no samples: a reader seeks to each of its own samples through the index made at start "
        "(a tar sample's key and its members' offsets and sizes in numpy arrays, about 72 bytes a sample in every "
        "process), so its memory does not grow with the shuffle, and a resume reads nothing it then discards. "
        "webdataset streams each shard whole through tarfile and a chain of generator stages, its shuffle buffer "
        "holding raw samples. The in-memory side reads no file at all: its ratio is what reading the files costs. "
        "With 0 workers the ratios include the noise of one process doing everything on a busy 2-core machine.", ""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--per-shard", type=int, default=500)
    parser.add_argument("--size", type=int, default=64, help="image side in pixels")
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    a = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        r = measure(a.pairs, a.shards, a.per_shard, a.size, Path(tmp))
    publish(a.out, "streams", r, section(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
