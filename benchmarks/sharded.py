"""ddp vs fsdp: per-rank memory of parameters + gradients + optimizer state, and single-file vs sharded saves.

Run by `make bench` (:func:`memory_rows`, :func:`save_pairs`); each measurement is its own torchrun job of

    python -m torch.distributed.run --nproc-per-node=N benchmarks/sharded.py --strategy fsdp --format dcp --saves 3

which trains one step of the char LM example's GPT (AdamW) and prints one JSON line on rank 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def measure(ns: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "examples" / "char_lm"))
    from model import GPT, GPTConfig

    import trainer
    from trainer.runtime.fsdp import local_bytes

    with tempfile.TemporaryDirectory() as run, trainer.Session(
            [f"dist.strategy={ns.strategy}", f"checkpoint.format={ns.format}", f"run.dir={run}",
             "tracking.mode=disabled", "checkpoint.resume=never", "checkpoint.keep=2"]) as sess:
        model = sess.wrap(GPT(GPTConfig(block=64, layers=ns.layers, dim=ns.dim)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sess.restore(model=model, optimizer=opt)
        x = torch.randint(0, 256, (4, 64))
        model(x, x).backward()
        opt.step()  # the optimizer state exists from here on
        sizes: list[Any] = [None] * sess.env.world_size
        dist.all_gather_object(sizes, local_bytes(model, opt))
        sync, stall = [], []
        for i in range(ns.saves):
            start = time.perf_counter()
            sess.save(2 * i + 1, blocking=True)
            sync.append(time.perf_counter() - start)
            start = time.perf_counter()
            sess.save(2 * i + 2, blocking=False)
            stall.append(time.perf_counter() - start)
            sess.checkpointer.wait()
        folder = Path(run) / "checkpoints"
        state_bytes = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / max(1, len(list(
            folder.glob("step_*.json")))) if ns.saves else 0
        sess.print(json.dumps({"strategy": ns.strategy, "format": ns.format, "processes": sess.env.world_size,
                               "per_rank": sizes, "sync_s": statistics.median(sync) if sync else None,
                               "stall_s": statistics.median(stall[1:] or stall) if stall else None,
                               "checkpoint_bytes": state_bytes}))


def _job(nproc: int, args: list[str]) -> dict[str, Any]:
    from benchmarks.common import ranks

    out = ranks(nproc, [str(Path(__file__)), *args])
    return json.loads(next(line for line in reversed(out.splitlines()) if line.startswith("{")))


def memory_rows(dim: int, layers: int, counts: tuple[int, ...] = (1, 2)) -> list[dict[str, Any]]:
    """Per-rank bytes with ddp and fsdp, on each of ``counts`` processes (one job each: the sizes are exact, not
    timed)."""
    rows = []
    for strategy in ("ddp", "fsdp"):
        for nproc in counts:
            r = _job(nproc, ["--strategy", strategy, "--format", "auto", "--saves", "0", "--dim", str(dim),
                             "--layers", str(layers)])
            worst = max(r["per_rank"], key=lambda s: s["total"])
            rows.append({"strategy": strategy, "processes": nproc, **{k: v / 2**20 for k, v in worst.items()}})
    return rows


def save_pairs(repeats: int, dim: int, layers: int) -> dict[str, Any]:
    """2 processes, ddp: rank 0 writing one file vs every rank writing its share (dcp), as interleaved pairs."""
    from benchmarks.common import pairs, spread

    def job(fmt: str) -> dict[str, Any]:
        return _job(2, ["--strategy", "ddp", "--format", fmt, "--saves", "3", "--dim", str(dim), "--layers", str(layers)])

    done = [{"file_sync_s": file["sync_s"], "dcp_sync_s": dcp["sync_s"], "file_stall_s": file["stall_s"],
             "dcp_stall_s": dcp["stall_s"], "sync_ratio": dcp["sync_s"] / file["sync_s"],
             "state_mb": file["checkpoint_bytes"] / 2**20} for file, dcp in pairs(repeats, lambda: job("file"),
                                                                                    lambda: job("dcp"))]
    return {"pairs": done, "sync_ratio": spread([p["sync_ratio"] for p in done])}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--format", default="auto")
    parser.add_argument("--saves", type=int, default=0)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    measure(parser.parse_args())
