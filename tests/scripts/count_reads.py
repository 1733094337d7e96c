"""The built-in trainer, counting every read of a tensor's value by the host (``.item()``, ``float(t)``, ``bool(t)``:
aten's ``_local_scalar_dense``, which on a GPU waits for all queued work) inside its optimizer steps.

    python tests/scripts/count_reads.py KEY=VALUE...   (or under torchrun / spawn_ranks)

Rank 0 prints one JSON line: {"reads": N, "windows": M}. Logging and signal polls run between steps and the data
loader's own work (its seed draw from a CPU generator, as in any loop) is not the step's: neither is counted.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.builtin import train
from trainer.core.config import load

READ = torch.ops.aten._local_scalar_dense.default
counts = {"reads": 0, "windows": 0}
loading = False


class Reads(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is READ and not loading:
            counts["reads"] += 1
        return func(*args, **(kwargs or {}))


step_window = train.Trainer.train_window


def fetched(batches: Iterator[Any]) -> Iterator[Any]:
    global loading
    while True:
        loading = True
        batch = next(batches)
        loading = False
        yield batch


def counted(self: train.Trainer, batches: Iterator[Any], window: int) -> None:
    counts["windows"] += 1
    with Reads():
        step_window(self, fetched(batches), window)


train.Trainer.train_window = counted  # type: ignore[method-assign]
summary = train.fit(load(sys.argv[1:]))
if summary.get("rank") == 0:
    print(json.dumps(counts), flush=True)
