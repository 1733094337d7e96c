"""Sharded checkpoints (``torch.distributed.checkpoint``) with the same commit protocol as single files.

Every rank writes its shards of the model and optimizer into ``.step_<N>.tmp/``; rank 0 adds ``extra.pt`` (the
rest: step, loader and scheduler state, random generators) and, once every rank has finished, renames the folder
to ``step_<N>/``, then writes the manifest ``step_<N>.json`` (each file's size) and the ``latest`` pointer. Only a
folder with a manifest counts, so a kill in the middle leaves the previous step loadable. Loading reshards onto
any number of processes.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.checkpoint import FORMAT_VERSION, PREFIX, committed, rng_state, save_atomic
from trainer.dist import from_main, gather
from trainer.files import fsync_dir, write_json

EXTRA = "extra.pt"


def sharded_state(objects: dict[str, Any], model: nn.Module | None) -> dict[str, Any]:
    """Models' and optimizers' state as DCP saves it: keys by parameter name, each rank holding its shards."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out: dict[str, Any] = {}
    for name, obj in objects.items():
        if isinstance(obj, nn.Module):
            out[name] = get_model_state_dict(obj)
        else:
            out[name] = get_optimizer_state_dict(_model_for(model), obj)
    return out


def _model_for(model: nn.Module | None) -> nn.Module:
    if model is None:
        raise ValueError("a sharded checkpoint of an optimizer needs its model: pass the model to Session.wrap first")
    return model


def load_sharded(folder: Path, objects: dict[str, Any], model: nn.Module | None) -> None:
    """Collective: load the models and optimizers among ``objects`` from a committed step folder (resharded)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    state = sharded_state(objects, model)
    dcp_load(state, checkpoint_id=str(folder))
    for name, obj in objects.items():
        if isinstance(obj, nn.Module):
            set_model_state_dict(obj, state[name])
        elif isinstance(obj, torch.optim.Optimizer):
            set_optimizer_state_dict(_model_for(model), obj, state[name])


def verify_files(manifest: dict[str, Any], folder: Path) -> None:
    """Raise ValueError when a file of a committed step folder is missing or has another size (truncated)."""
    for name, size in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            raise ValueError(f"{name} is missing")
        if path.stat().st_size != size:
            raise ValueError(f"{name} has {path.stat().st_size} bytes, {size} recorded (truncated)")


class ShardedCheckpointer:
    """Saves ``step_<N>/`` folders in ``<run>/checkpoints``: every rank writes its shards, rank 0 commits.

    Asynchronous saves run DCP's own background save on a separate gloo group, one in flight at most; rank 0
    commits it from a thread once the save has finished on every rank."""

    def __init__(self, folder: Path, is_main: bool, keep: int, save_delay_s: float = 0.0) -> None:
        self.folder, self.is_main, self.keep, self.save_delay_s = folder, is_main, keep, save_delay_s
        self.group: Any = None
        """A gloo group of its own for background saves, so they never share a communicator with training."""
        self._future: Future[Any] | None = None
        self._commit_thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_path: Path | None = None
        self.stall_s = 0.0
        """How long the last save kept training waiting (an asynchronous save: its staging copy)."""

    def save(self, sharded: dict[str, Any], extra: dict[str, Any], step: int, blocking: bool = True) -> Path:
        """Collective: every rank writes its shards of ``sharded``; rank 0 writes ``extra`` and commits."""
        from torch.distributed.checkpoint.state_dict_saver import async_save, save

        start = time.perf_counter()
        self.wait()
        extra = dict(extra, rng=gather(rng_state()))
        final = self.folder / f"{PREFIX}{step:08d}"
        tmp = self.folder / f".{final.name}.tmp"
        status: list[Any] = [None]
        if self.is_main:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                for stale in self.folder.glob(f".{PREFIX}*.tmp"):  # saves killed half-way
                    if stale.is_dir():
                        shutil.rmtree(stale, ignore_errors=True)
                tmp.mkdir()
                save_atomic(tmp / EXTRA, extra, sync_dir=False)  # the commit fsyncs this folder
            except Exception as exc:
                status[0] = f"{type(exc).__name__}: {exc}"
        from_main(status)  # the folder exists before any rank writes into it
        if status[0] is not None:
            raise RuntimeError(f"checkpoint save failed on rank 0: {status[0]}")
        if self.save_delay_s and self.is_main:  # test hook: a kill now leaves a half-written folder
            time.sleep(self.save_delay_s)
        if blocking:
            save(sharded, checkpoint_id=str(tmp))
            self._commit_main(tmp, final, step)
        else:
            if self.group is None:  # collective: every rank makes it in the same (first asynchronous) save
                self.group = dist.new_group(backend="gloo")
            self._future = async_save(sharded, checkpoint_id=str(tmp), process_group=self.group)  # type: ignore[assignment]
            if self.is_main:
                self._commit_thread = threading.Thread(target=self._commit_when_written,
                                                       args=(self._future, tmp, final, step))
                self._commit_thread.start()
        self.stall_s = time.perf_counter() - start
        self.last_path = final
        return final

    def _commit_main(self, tmp: Path, final: Path, step: int) -> None:
        status: list[Any] = [None]
        if self.is_main:
            try:
                self._commit(tmp, final, step)
            except Exception as exc:
                status[0] = f"{type(exc).__name__}: {exc}"
        from_main(status)  # nobody runs ahead of the commit
        if status[0] is not None:
            raise RuntimeError(f"checkpoint commit failed on rank 0: {status[0]}")

    def _commit_when_written(self, future: Future[Any], tmp: Path, final: Path, step: int) -> None:
        try:
            future.result()  # on rank 0 this returns after DCP's metadata: every rank has written
            self._commit(tmp, final, step)
        except BaseException as exc:  # surfaced by wait()
            self._error = exc

    def _commit(self, tmp: Path, final: Path, step: int) -> None:
        fsync_dir(tmp)  # DCP fsyncs its own files; extra.pt was written with fsync
        if final.exists():  # an uncommitted folder of the same step (a crash after the rename): replaced
            shutil.rmtree(final)
        os.replace(tmp, final)  # made durable by the manifest's folder fsync; a manifest without it fails verification
        files = {f.name: f.stat().st_size for f in sorted(final.iterdir()) if f.is_file()}
        write_json(final.with_suffix(".json"), {"format": "dcp", "dir": final.name, "files": files,
                                                "global_step": step, "time": time.time(), "version": FORMAT_VERSION})
        latest = self.folder / ".latest.tmp"
        latest.write_text(final.name)
        os.replace(latest, self.folder / "latest")
        self._prune()

    def _prune(self) -> None:
        for manifest in committed(self.folder)[self.keep:]:
            manifest.unlink(missing_ok=True)  # the marker goes first: a half-pruned checkpoint never counts
            target = manifest.with_suffix("")
            if target.is_dir():
                shutil.rmtree(target, ignore_errors=True)
            manifest.with_suffix(".pt").unlink(missing_ok=True)  # a single-file checkpoint of an earlier run

    def wait(self) -> None:
        """Block until an asynchronous save has finished (and, on rank 0, committed); re-raise its error here."""
        if self._future is not None:
            future, self._future = self._future, None
            if self._commit_thread is not None:
                self._commit_thread.join()
                self._commit_thread = None
            else:
                future.result()
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"background checkpoint save failed: {err}") from err
