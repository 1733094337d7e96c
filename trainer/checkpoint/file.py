"""Checkpoints that only count once committed: rank 0 writes, every rank waits.

Commit protocol for ``step_<N>``: temp file → flush + fsync → ``os.replace`` → manifest ``step_<N>.json`` (size,
XXH3 hash, step) → flush + fsync → ``os.replace`` → fsync folder (both renames) → ``latest`` pointer → prune.
A ``.pt`` file without its manifest is an unfinished save and is never loaded.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import xxhash

from trainer.checkpoint.base import Checkpointer
from trainer.checkpoint.layout import PREFIX, publish
from trainer.checkpoint.rng import rng_state
from trainer.core import hooks
from trainer.core.dist import gather
from trainer.core.exits import storage_error
from trainer.core.files import fsync_dir, tmp_path


class _Sink:
    """A file object for torch.save that counts bytes and hashes them on the way to disk: no copy in memory.

    XXH3 rather than CRC-32: a few times faster, which keeps a synchronous save close to a raw torch.save.
    """

    def __init__(self, f: Any, delay_s: float, on_write: Callable[[], None] | None) -> None:
        self.f, self.delay_s, self.size, self.hash = f, delay_s, 0, xxhash.xxh3_64()
        self.on_write = on_write

    def write(self, data: bytes) -> int:
        if self.on_write:
            self.on_write()
        self.hash.update(data)
        self.size += len(data)
        n: int = self.f.write(data)
        if self.delay_s:  # test hook: a slow file system with the file half-written (a kill now must leave older
            self.f.flush()  # checkpoints intact), still writing: a sign of life every half second
            end = time.monotonic() + self.delay_s
            while (left := end - time.monotonic()) > 0:
                time.sleep(min(0.5, left))
                if self.on_write:
                    self.on_write()
            self.delay_s = 0.0
        return n

    def flush(self) -> None:
        self.f.flush()


def save_atomic(path: Path, obj: Any, delay_s: float = 0.0,
                on_write: Callable[[], None] | None = None, sync_dir: bool = True) -> tuple[int, str]:
    """torch.save ``obj`` to ``path`` atomically (temp file, fsync, rename, fsync folder); return (size, XXH3-64).

    ``on_write`` is called before each chunk: a sign of life for the hang watchdog. ``sync_dir=False`` leaves the
    folder's fsync to the caller, when a later write in the same folder (a manifest) fsyncs it anyway."""
    tmp = tmp_path(path)
    try:
        with open(tmp, "wb") as f:
            sink = _Sink(f, delay_s, on_write)
            torch.save(obj, sink)  # type: ignore[arg-type]  # any object with write() will do
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception as exc:
        tmp.unlink(missing_ok=True)  # half a checkpoint only holds the room a full disk lacks
        disk = storage_error(exc)
        if disk is not None and (disk is not exc or not disk.filename):  # the file and the errno, not torch's empty
            raise OSError(disk.errno, disk.strerror, str(path)) from exc  # RuntimeError, nor close()'s nameless error
        raise
    if sync_dir:
        fsync_dir(path.parent)
    return sink.size, sink.hash.hexdigest()


class Staging:
    """Host copies of the state for background writes, kept from one asynchronous save to the next.

    Copying into memory that is already allocated (pinned, for GPU tensors) is many times faster than
    allocating it afresh each save (page faults and zeroing): this copy is the whole training stall of an
    asynchronous save. The price is one host copy of the state held for the run. Safe to reuse because
    saves are one at a time: the next copy starts only after the previous write has committed.
    """

    def __init__(self) -> None:
        self._bufs: dict[tuple[Any, ...], torch.Tensor] = {}

    def stage(self, obj: Any, key: tuple[Any, ...] = ()) -> Any:
        """A copy of ``obj`` whose tensors live in this object's host buffers."""
        if isinstance(obj, torch.Tensor):
            src = obj.detach()
            buf = self._bufs.get(key)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = self._bufs[key] = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
            buf.copy_(src)
            return buf
        if isinstance(obj, dict):
            return {k: self.stage(v, (*key, k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.stage(v, (*key, i)) for i, v in enumerate(obj))
        return obj


class FileCheckpointer(Checkpointer):
    """One ``step_<N>.pt`` file per checkpoint: rank 0 writes it (the other ranks' state gathered to it)."""

    def __init__(self, folder: Path, is_main: bool, keep: int, on_write: Callable[[], None] | None = None) -> None:
        super().__init__(folder, is_main, keep)
        self.on_write = on_write
        self._thread: threading.Thread | None = None
        self._staging = Staging()

    def save(self, state: dict[str, Any], step: int, blocking: bool = True,
             sharded: dict[str, Any] | None = None) -> Path:
        """Collective: every rank calls it. Rank 0 writes and commits; the others wait at a barrier.
        With ``blocking=False`` rank 0 only copies the state into its host buffers before the barrier
        and writes it in a background thread (one at a time).
        """
        state = dict(state, **(sharded or {}), rng=gather(rng_state()))
        path = self.folder / f"{PREFIX}{step:08d}.pt"

        def write() -> None:
            self.wait()
            self.folder.mkdir(parents=True, exist_ok=True)
            if blocking:
                self._commit(state, path, step)
            else:
                staged = self._staging.stage(state)
                self._thread = threading.Thread(target=self._commit_bg, args=(staged, path, step), daemon=False)
                self._thread.start()

        self._on_main(write, "save")
        self.last_path = path
        return path

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _commit_bg(self, state: dict[str, Any], path: Path, step: int) -> None:
        try:
            self._commit(state, path, step)
        except BaseException as exc:  # surfaced by wait()
            self._error = exc

    def _commit(self, state: dict[str, Any], path: Path, step: int) -> None:
        for stale in self.folder.glob(".*.tmp"):  # leftovers of a save killed half-way
            stale.unlink(missing_ok=True)
        # The manifest's own folder fsync makes both renames durable: one fsync of the folder, not two. Should a
        # crash keep the manifest but not the renamed file, the manifest fails verification and an older one is used.
        size, digest = save_atomic(path, state, hooks.current().write_pause(step), self.on_write, sync_dir=False)
        publish(self.folder, path, step, self.keep, file=path.name, size=size, xxh3_64=digest)
