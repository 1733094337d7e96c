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

from trainer.checkpoint.base import Checkpointer
from trainer.checkpoint.file import save_atomic
from trainer.checkpoint.layout import EXTRA, PREFIX, publish
from trainer.checkpoint.rng import rng_state
from trainer.core import hooks
from trainer.core.dist import gather
from trainer.core.files import fsync_dir


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


class ShardedCheckpointer(Checkpointer):
    """Saves ``step_<N>/`` folders in ``<run>/checkpoints``: every rank writes its shards, rank 0 commits.
    Asynchronous saves run DCP's own background save on a separate gloo group, one in flight at most; rank 0
    commits it from a thread once the save has finished on every rank."""

    every_rank_writes = True

    def __init__(self, folder: Path, is_main: bool, keep: int, model: nn.Module | None = None) -> None:
        super().__init__(folder, is_main, keep)
        self.model = model
        self.group: Any = None
        """A gloo group of its own for background saves, so they never share a communicator with training."""
        self._future: Future[Any] | None = None
        self._commit_thread: threading.Thread | None = None

    def save(self, state: dict[str, Any], step: int, blocking: bool = True,
             sharded: dict[str, Any] | None = None) -> Path:
        """Collective: every rank writes its shards of ``sharded`` (models and optimizers); rank 0 writes ``state``
        as ``extra.pt`` and commits."""
        from torch.distributed.checkpoint.state_dict_saver import async_save, save

        self.wait_all()
        shards = sharded_state(sharded or {}, self.model)
        extra = dict(state, rng=gather(rng_state()))
        final = self.folder / f"{PREFIX}{step:08d}"
        tmp = self.folder / f".{final.name}.tmp"

        def prepare() -> None:
            self.folder.mkdir(parents=True, exist_ok=True)
            for stale in self.folder.glob(f".{PREFIX}*.tmp"):  # saves killed half-way
                if stale.is_dir():
                    shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
            save_atomic(tmp / EXTRA, extra, sync_dir=False)  # the commit fsyncs this folder

        try:
            self._on_main(prepare, "save")  # the folder exists before any rank writes into it
            pause = hooks.current().write_pause(step)
            if pause and self.is_main:  # test hook: a kill now leaves a half-written folder
                time.sleep(pause)
            if blocking:
                save(shards, checkpoint_id=str(tmp))
                self._on_main(lambda: self._commit(tmp, final, step), "commit")  # nobody runs ahead of the commit
        except BaseException:
            if self.is_main:  # every rank is done with the folder: DCP raises only once it heard from each
                shutil.rmtree(tmp, ignore_errors=True)  # half a checkpoint only holds the room a full disk lacks
            raise
        if not blocking:
            if self.group is None:  # collective: every rank makes it in the same (first asynchronous) save
                self.group = dist.new_group(backend="gloo")
            self._future = async_save(shards, checkpoint_id=str(tmp), process_group=self.group)  # type: ignore[assignment]
            if self.is_main:
                self._commit_thread = threading.Thread(target=self._commit_when_written,
                                                       args=(self._future, tmp, final, step))
                self._commit_thread.start()
        self.last_path = final
        return final

    def _commit_when_written(self, future: Future[Any], tmp: Path, final: Path, step: int) -> None:
        try:
            future.result()  # on rank 0 this returns after DCP's metadata: every rank has written
            self._commit(tmp, final, step)
        except BaseException as exc:  # surfaced by wait()
            shutil.rmtree(tmp, ignore_errors=True)  # DCP's future fails once every rank is done, as its save does
            self._error = exc

    def _commit(self, tmp: Path, final: Path, step: int) -> None:
        fsync_dir(tmp)  # DCP fsyncs its own files; extra.pt was written with fsync
        if final.exists():  # an uncommitted folder of the same step (a crash after the rename): replaced
            shutil.rmtree(final)
        os.replace(tmp, final)  # made durable by the manifest's folder fsync; a manifest without it fails verification
        files = {f.name: f.stat().st_size for f in sorted(final.iterdir()) if f.is_file()}
        publish(self.folder, final, step, self.keep, format="dcp", dir=final.name, files=files)

    def _join(self) -> None:
        if self._future is not None:
            future, self._future = self._future, None
            if self._commit_thread is not None:
                self._commit_thread.join()
                self._commit_thread = None
            else:
                future.result()
