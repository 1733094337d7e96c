"""Checkpoints that only count once committed: rank 0 writes, every rank waits.

Commit protocol for ``step_<N>``: temp file → flush + fsync → ``os.replace`` → manifest ``step_<N>.json`` (size,
XXH3 hash, step) → flush + fsync → ``os.replace`` → fsync folder (both renames) → ``latest`` pointer → prune.
A ``.pt`` file without its manifest is an unfinished save and is never loaded.
"""

from __future__ import annotations

import io
import json
import os
import random
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from trainer.dist import from_main, gather
from trainer.files import fsync_dir, tmp_path, write_json

PREFIX = "step_"
FORMAT_VERSION = 2


def rng_state() -> dict[str, Any]:
    """This process's random generators, in a form ``torch.load(weights_only=True)`` accepts."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),  # type: ignore[index]
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


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
        if self.delay_s:  # test hook: sleep with the file half-written; a kill now must leave older checkpoints intact
            self.f.flush()
            time.sleep(self.delay_s)
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
    with open(tmp, "wb") as f:
        sink = _Sink(f, delay_s, on_write)
        torch.save(obj, sink)  # type: ignore[arg-type]  # any object with write() will do
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync_dir:
        fsync_dir(path.parent)
    return sink.size, sink.hash.hexdigest()


class _Staging:
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


class Checkpointer:
    """Saves and finds checkpoints in ``<run>/checkpoints``; only the main rank touches the folder."""

    def __init__(self, folder: Path, is_main: bool, keep: int, save_delay_s: float = 0.0,
                 on_write: Callable[[], None] | None = None) -> None:
        self.folder = folder
        self.is_main = is_main
        self.keep = keep
        self.save_delay_s = save_delay_s
        self.on_write = on_write
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._staging = _Staging()
        self.last_path: Path | None = None

    # ---- saving -------------------------------------------------------------------------
    def save(self, state: dict[str, Any], step: int, blocking: bool = True) -> Path:
        """Collective: every rank calls it. Rank 0 writes and commits; the others wait at a barrier.

        With ``blocking=False`` rank 0 only copies the state into its host buffers before the barrier
        and writes it in a background thread (one at a time).
        """
        state = dict(state, rng=gather(rng_state()))
        path = self.folder / f"{PREFIX}{step:08d}.pt"
        status: list[Any] = [None]
        if self.is_main:
            try:
                self.wait()
                self.folder.mkdir(parents=True, exist_ok=True)
                if blocking:
                    self._commit(state, path, step)
                else:
                    staged = self._staging.stage(state)
                    self._thread = threading.Thread(target=self._commit_bg, args=(staged, path, step), daemon=False)
                    self._thread.start()
            except Exception as exc:  # e.g. a full disk: every rank must hear of it, not wait at a barrier
                status[0] = f"{type(exc).__name__}: {exc}"
                from_main(status)
                raise
        from_main(status)  # also the barrier: nobody runs ahead of the commit
        if status[0] is not None:
            raise RuntimeError(f"checkpoint save failed on rank 0: {status[0]}")
        self.last_path = path
        return path

    def wait(self) -> None:
        """Block until a background save has committed; re-raise its error here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"background checkpoint save failed: {err}") from err

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
        size, digest = save_atomic(path, state, self.save_delay_s, self.on_write, sync_dir=False)
        manifest = {
            "file": path.name,
            "size": size,
            "xxh3_64": digest,
            "global_step": step,
            "time": time.time(),
            "version": FORMAT_VERSION,
        }
        write_json(path.with_suffix(".json"), manifest)
        # A pointer for people and tools; resuming trusts the manifests, so it needs no fsync of its own.
        latest = self.folder / ".latest.tmp"
        latest.write_text(path.name)
        os.replace(latest, self.folder / "latest")
        self._prune()

    def _prune(self) -> None:
        for manifest in committed(self.folder)[self.keep:]:
            manifest.unlink(missing_ok=True)  # the marker goes first: a half-pruned checkpoint never counts
            manifest.with_suffix(".pt").unlink(missing_ok=True)
        marked = {m.with_suffix(".pt") for m in committed(self.folder)}
        for orphan in self.folder.glob(f"{PREFIX}*.pt"):
            if orphan not in marked and marked and orphan.stat().st_mtime < min(p.stat().st_mtime for p in marked):
                orphan.unlink(missing_ok=True)


def committed(folder: Path) -> list[Path]:
    """Manifests of committed checkpoints, newest first."""
    return sorted(folder.glob(f"{PREFIX}*.json"), key=lambda p: p.name, reverse=True)


def verify(manifest: Path) -> bytes:
    """The checkpoint's bytes if they match its manifest; raise ValueError otherwise."""
    meta = json.loads(manifest.read_text())
    data = (manifest.parent / meta["file"]).read_bytes()
    if len(data) != meta["size"]:
        raise ValueError(f"size {len(data)} != {meta['size']} recorded (truncated)")
    if xxhash.xxh3_64_hexdigest(data) != meta["xxh3_64"]:
        raise ValueError("checksum mismatch (corrupted)")
    return data


def find_resumable(target: Path) -> tuple[Path, dict[str, Any]] | None:
    """Newest complete checkpoint under a run folder or checkpoint folder, or the given file or step folder.

    A sharded checkpoint (a ``step_<N>/`` folder) comes back as the folder and its ``extra.pt`` state; its
    models and optimizers are loaded by every rank with :func:`trainer.sharded.load_sharded`."""
    if target.is_file() or (target.is_dir() and target.name.startswith(PREFIX)):
        manifest = target.with_suffix(".json")
        candidates = [manifest] if manifest.exists() else []
        if not candidates and target.is_file():
            return target, torch.load(target, map_location="cpu", weights_only=True)
    else:
        folder = target / "checkpoints" if (target / "checkpoints").is_dir() else target
        candidates = committed(folder)
    for manifest in candidates:
        meta = json.loads(manifest.read_text())
        if meta.get("format") == "dcp":
            from trainer.sharded import EXTRA, verify_files

            step_dir = manifest.parent / meta["dir"]
            try:
                verify_files(meta, step_dir)
            except ValueError as exc:
                warnings.warn(f"skipping checkpoint {step_dir}: {exc}; trying an older one", stacklevel=2)
                continue
            return step_dir, torch.load(step_dir / EXTRA, map_location="cpu", weights_only=True)
        try:
            data = verify(manifest)
        except Exception as exc:
            bad = manifest.with_suffix(".pt")
            warnings.warn(f"skipping checkpoint {bad}: {exc}; trying an older one", stacklevel=2)
            continue
        # Intact bytes that do not load are no corruption: skipping them would restart the run from scratch.
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        return manifest.with_suffix(".pt"), state
    return None
