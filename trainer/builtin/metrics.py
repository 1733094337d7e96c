"""Training metrics since the last report, kept on the device and read only at log time (no per-step sync)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from trainer.core.env import DistEnv


class Meter:
    """Loss (and a task's extra metrics) and throughput since the last report, rank 0's view."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.reset()

    def reset(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.n, self.steps, self.samples, self.t0 = 0, 0, 0, self.clock()

    def add(self, loss: torch.Tensor, extra: Mapping[str, Any], samples: int) -> None:
        """One micro-step: its mean loss and extra metrics (tensors stay on the device)."""
        for name, value in {"loss": loss, **extra}.items():
            v = value.detach().float() if isinstance(value, torch.Tensor) else torch.tensor(float(value))
            self.sums[name] = self.sums[name] + v if name in self.sums else v
        self.n += 1
        self.samples += samples

    def metrics(self, lr: float) -> dict[str, float]:
        """Averages since the last reset (this reads the device: call at log time only)."""
        # Read first: the read waits for the device to finish the steps the host only queued. Timed before it, a
        # window measured the host's queueing (6 % fast on GPT-2 small on a GPU: docs/benchmarks.md section 4).
        out = {f"train/{k}": float(v) / max(1, self.n) for k, v in self.sums.items()}
        elapsed = max(1e-9, self.clock() - self.t0)
        out.update({"train/lr": lr, "train/samples_per_s": self.samples / elapsed,
                    "train/step_time_s": elapsed / max(1, self.steps)})
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["gpu/max_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
        return out


def reduce_sums(sums: dict[str, list[float]]) -> dict[str, float]:
    """Per metric, (sum of sums) / (sum of counts) over every rank: exact whatever each rank's share."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, sums)  # one collective per evaluation; ranks without batches send {}
    total: dict[str, list[float]] = {}
    for rank_sums in out:
        for name, (s, n) in rank_sums.items():
            acc = total.setdefault(name, [0.0, 0.0])
            acc[0], acc[1] = acc[0] + s, acc[1] + n
    return {name: s / n for name, (s, n) in sorted(total.items()) if n}


def progress_bar(env: DistEnv, total: int, initial: int) -> Any:
    """A tqdm bar on rank 0 when stderr is a terminal; batch logs get plain lines instead."""
    if not env.is_main or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
