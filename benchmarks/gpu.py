"""GPU-only rows: resnet18 precision and layout variants, and DataParallel vs DDP with per-GPU memory.

Both skip without a GPU (the smoke run exercises the precision code on the CPU at a tiny size).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import trainer_run


def precision_rows(repeats: int, smoke: bool) -> list[dict[str, Any]] | dict[str, str]:
    """GPU only: resnet18 forward+backward throughput, fp32 vs bf16 autocast vs channels_last (+ torch.compile)."""
    if not torch.cuda.is_available() and not smoke:
        return {"skipped": "no GPU on this machine"}
    import torchvision

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for res, batch in ((32, 256), (224, 64)) if not smoke else ((32, 4),):
        for variant in ("fp32", "bf16", "bf16+channels_last", "bf16+channels_last+compile"):
            if smoke and "compile" in variant:
                continue
            model: Any = torchvision.models.resnet18(num_classes=10).to(device)
            x = torch.randn(batch, 3, res, res, device=device)
            y = torch.randint(0, 10, (batch,), device=device)
            if "channels_last" in variant:
                model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
            if "compile" in variant:
                model = torch.compile(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            times = []
            for i in range(3 + repeats * 5):
                _sync(device)
                t = time.perf_counter()
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled="bf16" in variant):
                    loss = torch.nn.functional.cross_entropy(model(x).float(), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                _sync(device)
                if i >= 3:  # warm-up (and compilation) excluded
                    times.append(time.perf_counter() - t)
            rows.append({"resolution": res, "batch": batch, "variant": variant, "device": device.type,
                         "samples_per_s": batch / statistics.median(times)})
    return rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def dp_vs_ddp(repeats: int, size: int, tmp: Path) -> list[dict[str, Any]] | dict[str, str]:
    """GPU only: nn.DataParallel (one process) vs DDP (one process per GPU): samples/s and per-GPU peak memory."""
    n = torch.cuda.device_count()
    if n < 2:
        return {"skipped": f"needs 2 or more GPUs ({n} here)"}
    rows = []
    model = torch.nn.DataParallel(torchvision_resnet().cuda())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64 * n, 3, 32, 32, device="cuda")
    y = torch.randint(0, 10, (64 * n,), device="cuda")
    for i in range(n):
        torch.cuda.reset_peak_memory_stats(i)
    times = []
    for i in range(3 + repeats * 10):
        torch.cuda.synchronize()
        t = time.perf_counter()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t)
    rows.append({"method": "DataParallel", "gpus": n, "samples_per_s": 64 * n / statistics.median(times),
                 "peak_memory_gb_per_gpu": [torch.cuda.max_memory_allocated(i) / 2**30 for i in range(n)]})
    runs = [trainer_run(n, ["model.name=resnet18", "data.image_size=32", f"data.synthetic_train_size={size}",
                            "train.epochs=1", "data.batch_size=64"], tmp, "cuda") for _ in range(repeats)]
    rows.append({"method": "DDP (trainer)", "gpus": n, "samples_per_s": statistics.median(r["train_samples_per_s"] for r in runs),
                 "peak_memory_gb_per_gpu": "see W&B gpu/max_memory_gb (per process)"})
    return rows


def torchvision_resnet() -> torch.nn.Module:
    import torchvision

    return torchvision.models.resnet18(num_classes=10)
