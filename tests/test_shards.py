"""Sharded data sets (trainer.data): every format reads the same rows, the order is a function of (seed, epoch), a
position continues exactly on any world size and worker count, and bad shards are clear errors."""

from __future__ import annotations

import gzip
import io
import json
import sys
import tarfile
from collections import Counter
from pathlib import Path

import pytest

from trainer.core.env import DistEnv
from trainer.data import ShardError, Shards, Tokens
from trainer.data.batches import plan
from trainer.data.loader import Loader
from trainer.data.workers import shutdown_workers

from .conftest import ROOT, ok, run_trainer
from .shard_files import add, ident, write

SIZES = [23, 0, 31, 7, 40, 3, 19]  # 123 samples, an empty shard, shards smaller than a global batch
N = sum(SIZES)


def env_of(rank: int, world: int) -> DistEnv:
    return DistEnv(rank, rank, world, world, 0, 1, "127.0.0.1", 29500, None, "torchrun")


@pytest.mark.parametrize("fmt", ["tar", "jsonl", "parquet", "arrow"])
def test_every_format_reads_the_same_rows_and_notes_the_empty_shard(tmp_path: Path, fmt: str) -> None:
    ds = Shards(write(tmp_path / fmt, fmt, SIZES), transform=ident)
    assert len(ds) == N and [ds[i] for i in range(N)] == list(range(N))  # by number: file order
    if fmt != "arrow":  # datasets saves an empty set without an Arrow file: nothing to skip
        assert len(ds.notes) == 1 and "holds no sample: skipped" in ds.notes[0]
    order = ds.order(seed=3, epoch=0)
    assert sorted(ds[order.locate(p)] for p in range(N)) == list(range(N))  # the stream: each sample once


def test_token_shards_give_windows_with_the_next_token(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(bytes(range(25)))
    ds = Shards(tmp_path / "a.bin", Tokens(block=8, dtype="uint8"))
    assert len(ds) == 3 and ds[1].tolist() == list(range(8, 17))


def test_the_order_depends_on_seed_and_epoch_only_and_keeps_windows_local(tmp_path: Path) -> None:
    ds = Shards(write(tmp_path, "jsonl", SIZES), transform=ident, shuffle_window=5)
    again = Shards(write(tmp_path / "b", "jsonl", SIZES), transform=ident, shuffle_window=5)
    take = lambda d, s, e: [d[i] for i in d.order(s, e).take(0, N)]  # noqa: E731
    assert take(ds, 1, 0) == take(again, 1, 0) and take(ds, 1, 0) != take(ds, 1, 1) != take(ds, 2, 1)
    order = ds.order(1, 0)
    starts = [0, *order.ends[:-1]]
    for p, (s, j) in enumerate(order.take(0, N)):  # a window of 5 consecutive positions is 5 neighbouring samples
        shard = list(order.shards).index(s)
        assert starts[shard] <= p < order.ends[shard] and j // 5 == (p - starts[shard]) // 5


def _consume(ds: Shards, splits: list[tuple[int, int, int]], global_batch: int | None,
             micro: int = 4) -> list[list[int]]:
    """Steps (ids, in rank order) of attempts (world, workers, steps), each resumed from the last one's state."""
    steps, state = [], None
    for world, workers, count in splits:
        planned = plan(global_batch, world, micro) if global_batch else None
        loaders = [Loader(ds, env_of(r, world), micro, 7, planned, num_workers=workers) for r in range(world)]
        for loader in loaders:
            if state:
                loader.load_state_dict(state)
        its = [loader.forever() for loader in loaders]
        for _ in range(count):
            steps.append([int(i) for it, lo in zip(its, loaders, strict=True) for _ in range(lo.accumulation) for i in next(it)])
        state = loaders[0].state_dict()
        for loader in loaders:
            del loader.loader
    return steps


def test_a_global_batch_takes_the_same_samples_at_every_step_on_any_world_size_and_workers(tmp_path: Path) -> None:
    ds = Shards(write(tmp_path, "jsonl", SIZES), transform=ident, shuffle_window=5)
    whole = _consume(ds, [(3, 0, 25)], 12)
    cut = _consume(ds, [(3, 2, 4), (2, 0, 5), (3, 0, 3), (1, 2, 6), (2, 0, 7)], 12)
    assert cut == whole
    for epoch in (whole[:10], whole[10:20]):  # 123 // 12 = 10 steps an epoch
        seen = Counter(i for step in epoch for i in step)
        assert len(seen) == 120 and max(seen.values()) == 1


def test_three_shards_on_four_processes_read_every_sample_once_an_epoch(tmp_path: Path) -> None:
    ds = Shards(write(tmp_path, "jsonl", [50, 9, 30]), transform=ident, shuffle_window=7)
    steps = _consume(ds, [(4, 2, 5), (3, 0, 7)], 12)  # 89 // 12 = 7 steps an epoch: 12 steps reach into epoch 1
    for epoch in (steps[:7], steps[7:]):
        seen = Counter(i for step in epoch for i in step)
        assert max(seen.values()) == 1 and len(seen) == 12 * len(epoch)


def test_without_a_global_batch_a_resume_on_another_world_size_continues_at_the_next_sample(tmp_path: Path) -> None:
    ds = Shards(write(tmp_path, "jsonl", SIZES), transform=ident)
    steps = _consume(ds, [(3, 0, 3), (2, 0, 3), (1, 0, 5)], None)  # 36 + 24 + 20: epoch 0's first 80 (36 = 4.5 steps of 8)
    seen = Counter(i for step in steps for i in step)
    assert sum(seen.values()) == 80 and max(seen.values()) == 1
    order = ds.order(7, 0)
    assert [i for step in steps for i in step] == [ds[order.locate(p)] for p in range(80)]


def test_an_epoch_has_as_many_steps_after_a_resume_on_another_world_size(tmp_path: Path) -> None:
    """The schedule's unit (steps in a whole epoch) does not shrink to the steps left when a resume on another
    world size starts a new split mid-epoch (the built-in trainer's total steps once ended a run 4 steps early)."""
    ds = Shards(write(tmp_path, "jsonl", SIZES), transform=ident)
    three = Loader(ds, env_of(0, 3), 4, 7, plan(12, 3, 4))
    it = iter(three)
    for _ in range(3):
        next(it)
    two = Loader(ds, env_of(0, 2), 4, 7, plan(12, 2, 4))
    fresh = two.epoch_steps
    two.load_state_dict(three.state_dict())
    assert fresh == three.epoch_steps == two.epoch_steps == N // 12 and len(two) < fresh * two.accumulation


@pytest.mark.parametrize(("make", "expected", "hint"), [
    (lambda d: d / "nope", "'.*nope' does not exist", "a file, a folder or a glob"),
    (lambda d: d / "*.tar", "matches no shard file", "check the path"),
    (lambda d: _file(d / "a.tar", gzip.compress(_tar_bytes(3))), "cannot read shard '.*a.tar' after byte 0",
     "plain \\(uncompressed\\) tar"),
    (lambda d: _file(d / "a.tar", _tar_bytes(3)[:1024] + b"x" * 700 + _tar_bytes(3)[1024:]),
     "cannot read shard '.*a.tar' after byte 1024", "rewrite or remove"),
    (lambda d: (_file(d / "a.jsonl", b'{"id": 1}\n'), _file(d / "b.jsonl", b'{"ids": 1}\n'))[0].parent,
     "shards '.*a.jsonl' and '.*b.jsonl' differ in schema", "one schema"),
    (lambda d: _file(d / "a.jsonl", b""), "no shard holds a sample", "all empty"),
    (lambda d: _file(d / "a.jsonl", b'{"id": 1\n'), "cannot read shard '.*a.jsonl' at line 1", "rewrite"),
    (lambda d: _file(d / "a.csv", b"id\n1\n"), "no reader for '.*a.csv'", "reader="),
])
def test_bad_shards_name_the_file_and_place(tmp_path: Path, make: object, expected: str, hint: str) -> None:
    with pytest.raises(ShardError, match=expected) as caught:
        Shards(make(tmp_path))  # type: ignore[operator]
    assert caught.value.field == "data.path"
    assert __import__("re").search(hint, caught.value.hint), caught.value.hint


def _file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _tar_bytes(n: int) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for i in range(n):
            add(tar, f"s{i}.json", json.dumps({"id": i}).encode())
    return out.getvalue()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shard_truncated_mid_run_is_a_shard_error_naming_it_even_from_a_worker(tmp_path: Path, workers: int) -> None:
    folder = write(tmp_path, "tar", [40, 40])
    ds = Shards(folder, transform=ident)
    for f in folder.glob("*.tar"):
        f.write_bytes(f.read_bytes()[:2048])
    loader = Loader(ds, env_of(0, 1), 4, 0, None, num_workers=workers, persistent_workers=workers > 0)
    with pytest.raises(ShardError, match=r"cannot read shard '.*part-00[01].tar' at sample 's0000\d\d'"):
        for _ in loader.forever():
            pass
    shutdown_workers(loader.loader)  # as the session does at its end


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sample_that_does_not_decode_names_its_shard_and_key(tmp_path: Path, workers: int) -> None:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for i in range(8):
            add(tar, f"s{i}.png", b"not an image" if i == 5 else _png())
            add(tar, f"s{i}.cls", b"1")
    ds = Shards(_file(tmp_path / "a.tar", out.getvalue()), transform=key)
    loader = Loader(ds, env_of(0, 1), 4, 0, None, num_workers=workers, persistent_workers=workers > 0)
    with pytest.raises(ShardError, match=r"cannot read shard '.*a.tar' at sample 's5', byte \d+: cannot decode it: "
                                         r"UnidentifiedImageError"):
        for _ in loader.forever():
            pass
    shutdown_workers(loader.loader)


def key(sample: dict[str, object]) -> object:
    return sample["__key__"]


def _png() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (2, 2)).save(out, format="PNG")
    return out.getvalue()


def test_a_missing_shard_folder_exits_2_before_training(tmp_path: Path) -> None:
    proc = run_trainer(["data.name=shards", f"data.root={tmp_path / 'none'}", "tracking.mode=disabled"], tmp_path)
    ok(proc, 2)
    assert "error: data.path: shard" in proc.stderr and "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_the_shards_example_trains_the_built_in_trainer_on_its_webdataset_folder(tmp_path: Path) -> None:
    made = __import__("subprocess").run([sys.executable, str(ROOT / "examples" / "shards" / "make_shards.py"),
                                         str(tmp_path / "wds")], capture_output=True, text=True, check=True)
    assert "train" in made.stdout
    run = tmp_path / "run"
    proc = ok(run_trainer(["data.name=shards", f"data.root={tmp_path / 'wds'}", "train.epochs=1", f"run.dir={run}",
                           "tracking.mode=disabled", "data.num_workers=0", "train.log_every=5"], tmp_path))
    assert "8 shard(s), 1,024 samples" in proc.stdout, proc.stdout
    result = json.loads((run / "result.json").read_text())
    assert result["test_accuracy"] > 0.5, result


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_tar_shards_of_every_header_format_and_long_keys_index_alike(tmp_path: Path, fmt: int) -> None:
    keys = ["short", "d" * 90 + "/" + "k" * 60, "é" * 30]  # a ustar prefix, a long name, non-ASCII (pax)
    with tarfile.open(tmp_path / "a.tar", "w", format=fmt) as tar:
        for i, key in enumerate(keys):
            if fmt == tarfile.USTAR_FORMAT and not key.isascii():
                continue
            add(tar, f"{key}.json", json.dumps({"id": i}).encode())
            add(tar, f"{key}.cls", b"1")
    ds = Shards(tmp_path / "a.tar")
    got = [(ds[i]["__key__"], ds[i]["json"]["id"], ds[i]["cls"]) for i in range(len(ds))]
    assert got == [(k, i, 1) for i, k in enumerate(keys) if fmt != tarfile.USTAR_FORMAT or k.isascii()]


def test_a_resume_reads_only_the_samples_it_trains_on(tmp_path: Path) -> None:
    from trainer.data import Jsonl

    class Counting(Jsonl):
        reads: list[int] = []

        def read(self, index, j, cache):  # type: ignore[no-untyped-def]
            got = super().read(index, j, cache)
            self.reads.append(got["id"])
            return got

    reader = Counting()
    ds = Shards(write(tmp_path, "jsonl", [200, 200]), reader, transform=ident, shuffle_window=50)
    loader = Loader(ds, env_of(0, 2), 4, 0, None)
    loader.load_state_dict({"epoch": 0, "position": 0, "batch_size": 4, "world_size": 3, "samples": 156})
    batch = next(iter(loader))  # mid-shard, mid-window, on another world size
    order = ds.order(0, 0)
    read = list(reader.reads)
    assert read == batch.tolist() == [ds[order.locate(p)] for p in range(156, 160)]


def test_the_char_lm_on_byte_shards_resumes_on_another_world_size(tmp_path: Path) -> None:
    """examples/char_lm on the byte shards its make_shards.py writes: preempted on 2 processes, finished on 1."""
    import subprocess

    shards = tmp_path / "bytes"
    subprocess.run([sys.executable, str(ROOT / "examples" / "char_lm" / "make_shards.py"), str(shards), "--shards", "3",
                    "--shard-bytes", "20000"], check=True, capture_output=True)
    script, run = ROOT / "examples" / "char_lm" / "train.py", tmp_path / "run"
    args = ["--shards", str(shards), "--max-steps", "12", "--eval-every", "12", "--global-batch", "8", "--batch-size", "4",
            "--block", "32", "--sample", "0", f"run.dir={run}", "checkpoint.poll_steps=1", "tracking.mode=disabled"]
    first = run_trainer(args, tmp_path, nproc=2, env={"TRAINER_FAULTS": "preempt_at_step=4"}, script=script)
    ok(first, 75)
    assert "3 shard(s), 1,872 samples" in first.stdout, first.stdout
    second = ok(run_trainer(args, tmp_path, nproc=1, script=script))
    assert "global batch 8 = 1 process(es)" in second.stdout
    assert json.loads((run / "result.json").read_text())["global_step"] == 12


def test_a_resume_on_another_split_with_less_than_a_step_left_goes_on_in_the_next_epoch(tmp_path: Path) -> None:
    """108 samples on 3 processes, 4 more on 1, then 3 processes again: the 11 left of epoch 0 make no step of 12, so
    the resumed loader starts epoch 1 (it must not find the epoch empty)."""
    ds = Shards(write(tmp_path, "jsonl", SIZES), transform=ident)
    steps = _consume(ds, [(3, 0, 9), (1, 0, 1), (3, 0, 2)], None)
    order = ds.order(7, 1)
    assert steps[-2:] == [[ds[order.locate(p)] for p in range(s, s + 12)] for s in (0, 12)]


@pytest.mark.parametrize("fmt", ["tar", "jsonl"])
def test_loader_workers_forked_after_the_parent_read_a_shard_read_their_own_samples(tmp_path: Path, fmt: str) -> None:
    """A resume or a first evaluation reads samples in the training process before DataLoader forks its workers: the
    workers must not share the parent's open file (one offset for all: a worker's seek moves the other's read)."""
    from torch.utils.data import DataLoader

    ds = Shards(write(tmp_path / "s", fmt, [400, 400]))
    expected = [ds[i] for i in range(len(ds))]  # the parent opened both files
    for _ in range(3):
        loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
        assert [row for row in loader] == expected


@pytest.mark.parametrize("fmt", ["tar", "jsonl"])
def test_a_second_start_reads_the_kept_index_instead_of_scanning(tmp_path: Path, fmt: str) -> None:
    from trainer.data import Jsonl, Tar

    scans: list[str] = []

    class Counting(Tar if fmt == "tar" else Jsonl):  # type: ignore[misc]
        def index(self, path):  # type: ignore[no-untyped-def]
            scans.append(path.name)
            return super().index(path)

    files = sorted(write(tmp_path / "data", fmt, [23, 31, 7]).glob(f"*.{fmt}"))
    first = Shards(files, Counting(), transform=ident)
    assert len(scans) == 3
    again = Shards(files, Counting(), transform=ident)
    assert len(scans) == 3, "the second start scanned again"
    assert [again[i] for i in range(len(again))] == [first[i] for i in range(len(first))]
    # A shard that changes is scanned again (its size and time name its index); the others stay kept.
    files[1].write_bytes((write(tmp_path / "more", fmt, [23, 36, 7]) / files[1].name).read_bytes())
    changed = Shards(files, Counting(), transform=ident)
    assert len(scans) == 4 and len(changed) == 23 + 36 + 7


def test_the_first_scan_is_shared_out_among_the_ranks_and_an_unwritable_folder_only_costs_a_scan(
        tmp_path: Path) -> None:
    from trainer.data import Jsonl
    from trainer.data.kept_index import index_all

    scans: list[str] = []

    class Counting(Jsonl):
        def index(self, path):  # type: ignore[no-untyped-def]
            scans.append(path.name)
            return super().index(path)

    files = sorted(write(tmp_path / "data", "jsonl", [5, 6, 7, 8]).glob("*.jsonl"))
    shards = [(Counting(), f) for f in files]
    got = index_all(shards, tmp_path / "kept", rank=1, world=2)  # its own shards first, then the rest
    assert scans == [files[1].name, files[3].name, files[0].name, files[2].name]
    assert [ix.count for ix in got] == [5, 6, 7, 8]
    scans.clear()
    assert [ix.count for ix in index_all(shards, tmp_path / "kept", rank=0, world=2)] == [5, 6, 7, 8]
    assert scans == []  # rank 1 kept every shard it scanned
    blocked = tmp_path / "a file, not a folder"
    blocked.write_text("")
    Shards(files, Counting(), index_dir=blocked)
    Shards(files, Counting(), index_dir=blocked)
    assert len(scans) == 8
