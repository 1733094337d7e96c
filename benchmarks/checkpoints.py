"""Checkpoint cost: our synchronous save against a raw ``torch.save`` + fsync of the same state, and how long an
asynchronous save stalls training against a synchronous one; interleaved pairs, one process."""

from __future__ import annotations

import itertools
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import pairs, spread


def _state(model_name: str, device: str = "cpu") -> dict[str, Any]:
    """A model's and its SGD momentum's state after one step on ``device``, as a run checkpoints it."""
    from trainer.builtin.models import build_model
    from trainer.core.schema import ModelConfig

    if model_name == "linear8192":  # one 8192×8192 layer: 537 MB of weights and momentum
        model: torch.nn.Module = torch.nn.Linear(8192, 8192)
        x = torch.randn(2, 8192)
    else:
        model, x = build_model(ModelConfig(name=model_name), 3, 32), torch.randn(2, 3, 32, 32)
    model, x = model.to(device), x.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(x).sum().backward()
    opt.step()  # momentum buffers exist, as in a real checkpoint
    return {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "progress": {"global_step": 1, "epoch": 0, "batches_in_epoch": 1}}


def checkpoint_cost(n_pairs: int, tmp: Path, model_name: str, device: str = "cpu") -> dict[str, Any]:
    """Pairs of (raw torch.save + fsync, our synchronous save), then pairs of (synchronous save, asynchronous stall);
    the state lives on ``device`` (on a GPU the asynchronous save stages it into pinned host memory first)."""
    from trainer.checkpoint import file as ckpt

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    state = _state(model_name, device)
    counter = itertools.count()

    def raw() -> float:
        path = tmp / f"raw{next(counter)}.pt"
        os.sync()  # each save starts with no writeback of an earlier one (or of its deletion) still queued
        start = time.perf_counter()
        with open(path, "wb") as f:  # made durable the same way, for a fair comparison
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        took = time.perf_counter() - start
        path.unlink()
        return took

    def sync() -> float:
        folder = tmp / f"ck{next(counter)}"
        saver = ckpt.FileCheckpointer(folder, True, keep=2)
        os.sync()
        start = time.perf_counter()
        saver.save(state, 1)
        took = time.perf_counter() - start
        shutil.rmtree(folder)
        return took

    # One checkpointer for every async save, as in a run: the first save allocates the host buffers that every
    # later one copies into (reported apart); the steady state is what a long run sees.
    background = ckpt.FileCheckpointer(tmp / "async", True, keep=2)
    steps = itertools.count(1)

    def stall() -> float:
        os.sync()
        start = time.perf_counter()
        background.save(state, next(steps), blocking=False)
        took = time.perf_counter() - start
        background.wait()  # the write itself overlaps training; the next pair starts after it
        return took

    first_stall = stall()
    assert background.last_path is not None
    size = background.last_path.stat().st_size  # what every save of this state writes
    speed = pairs(n_pairs, raw, sync)
    stalls = pairs(n_pairs, sync, stall)
    shutil.rmtree(tmp / "async")
    return {"model": model_name, "device": device, "state_mb": size / 2**20, "pairs": n_pairs,
            "raw_s": spread([r for r, _ in speed]), "sync_s": spread([s for _, s in speed]),
            "speed_vs_raw": spread([r / s for r, s in speed]),
            "async_stall_s": spread([st for _, st in stalls]),
            "stall_vs_sync": spread([st / s for s, st in stalls]), "first_async_stall_s": first_stall}
