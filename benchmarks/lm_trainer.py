"""GPT-2 small through the built-in trainer against a bare loop: ``python -m trainer`` with the model, data and task
named by import path (``model.target``, ``data.target``, ``task.target``), on token shards read by ``Tokens``.

Each side runs in a process of its own, as a user runs it; the pairs interleave the sides (A B, B A, …). A process's
rate is the median of its windows of ``WINDOW`` steps after its warm-up: the trainer's from its log lines (the
meter's samples/s between two of them), the bare loop's (benchmarks/lm.py's ``Loop``) from its bursts. Compiled
processes keep their compile cache between a side's runs (the trainer's in its run folder, as a requeued attempt
finds it; the bare loop's in a folder of its own): a pair times training, not compilation.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from benchmarks.common import ROOT, pairs, spread
from benchmarks.lm import MODEL_KEYS, Loop, flops_per_token, gpt_of, peak, run_folder_cache_env, shape
from trainer.data import Shards, Tokens

WINDOW = 20
"""Steps per measured window (a log line of the trainer, a burst of the bare loop)."""
LINE = re.compile(r"^epoch \d+ step (\d+): loss \S+, (\d+) samples/s", re.M)
"""The trainer's log line without a terminal (trainer/builtin/train.py ``report``)."""


def _split(chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return chunk[:-1], chunk[1:]


def token_shards(root: str, block: int = 1024) -> tuple[Shards, None]:
    """data.target: the token files ``root``/train-*.bin (uint16, nanoGPT's layout) as (input, target) windows."""
    return Shards(f"{root}/train-*.bin", Tokens(block), _split), None


class ModelLoss:
    """task.target: the model computes its own loss from (input, target), as the GPT does."""

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return model(x, y)

    def eval_step(self, model: nn.Module, batch: Any) -> dict[str, tuple[torch.Tensor, int]]:
        x, y = batch
        return {"loss": (model(x, y) * y.numel(), y.numel())}


def write_shards(root: Path, vocab: int, windows: int, block: int, files: int = 2) -> None:
    """Random uint16 tokens, ``windows`` windows of ``block`` in all, in ``files`` shards."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        rng.integers(0, vocab, (windows // files + 1) * block + 1, dtype=np.uint16).tofile(root / f"train-{i}.bin")


def trainer_side(variant: str, tiny: bool, steps: int, warm: int, shards: Path, run_dir: Path) -> dict[str, Any]:
    """One ``python -m trainer`` run: its windows' tokens/s after ``warm`` of them, and its launch → first step."""
    s = shape(tiny)
    started = time.time()
    cmd = [sys.executable, "-m", "trainer", f"run.dir={run_dir}", "checkpoint.resume=never", "run.report=false",
           "tracking.mode=disabled", "model.target=benchmarks.lm:gpt", *[f"model.kwargs.{k}={s[k]}" for k in MODEL_KEYS],
           "data.target=benchmarks.lm_trainer:token_shards", f"data.kwargs.root={shards}",
           f"data.kwargs.block={s['block']}", f"data.batch_size={s['batch']}", "task.target=benchmarks.lm_trainer:ModelLoss",
           "optim.name=adamw", "optim.lr=3e-4", "optim.weight_decay=0.1", "optim.grad_clip=1.0",
           f"train.max_steps={steps}", f"train.log_every={WINDOW}", f"train.compile={variant == 'compiled'}",
           f"train.precision={'bf16' if torch.cuda.is_available() else 'fp32'}"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=run_folder_cache_env())
    if p.returncode:
        raise RuntimeError(f"the trainer exited {p.returncode}: {p.stdout[-1500:]}\n{p.stderr[-3000:]}")
    rates = [int(r) * s["block"] for _, r in LINE.findall(p.stdout)]
    result = json.loads((run_dir / "result.json").read_text())
    return {"tokens_per_s": statistics.median(rates[warm:]), "windows": rates,
            "launch_s": result["first_step_at"] - started}


def bare(variant: str, tiny: bool, windows: int) -> list[float]:
    """In this process: the bare loop's tokens/s in ``windows`` bursts of ``WINDOW`` steps, after its first step."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    s = shape(tiny)
    model: Any = gpt_of(s).to(device)
    loop = Loop(torch.compile(model) if variant == "compiled" else model, s, device)
    loop.burst(1)
    return [loop.burst(WINDOW) for _ in range(windows)]


def bare_side(variant: str, tiny: bool, steps: int, warm: int, cache: Path) -> dict[str, Any]:
    """The bare loop in a fresh interpreter, as many steps as the trainer's run; its rate after ``warm`` windows."""
    started = time.time()
    cmd = [sys.executable, "-m", "benchmarks.lm_trainer", "--bare", variant, "--windows", str(steps // WINDOW)]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    p = subprocess.run(cmd + (["--tiny"] if tiny else []), cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    if p.returncode:
        raise RuntimeError(f"the bare loop exited {p.returncode}: {p.stderr[-3000:]}")
    rates = json.loads(p.stdout.strip().splitlines()[-1])
    return {"tokens_per_s": statistics.median(rates[warm:]), "windows": rates, "wall_s": time.time() - started}


def lm_trainer_rows(n_pairs: int, smoke: bool, variants: tuple[str, ...] = ("eager", "compiled")) -> dict[str, Any]:
    """Each variant in ``n_pairs`` interleaved pairs (eager alone in a smoke run on the CPU)."""
    s = shape(smoke)
    windows, warm = (2, 1) if smoke else (8, 3)
    steps = windows * WINDOW
    res: dict[str, Any] = {"shape": s, "window_steps": WINDOW, "warm_windows": warm, "steps": steps, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        shards = Path(tmp) / "shards"
        write_shards(shards, s["vocab"], (steps + 1) * s["batch"], s["block"])  # one epoch: no epoch's end
        for variant in ("eager",) if smoke else variants:
            done = pairs(n_pairs, functools.partial(trainer_side, variant, smoke, steps, warm, shards,
                                                    Path(tmp) / f"run-{variant}"),
                         functools.partial(bare_side, variant, smoke, steps, warm, Path(tmp) / f"cache-{variant}"))
            row = {"variant": variant, "trainer": [t for t, _ in done], "bare": [b for _, b in done],
                   "trainer_vs_bare": spread([t["tokens_per_s"] / b["tokens_per_s"] for t, b in done])}
            res["rows"].append(row)
            print(summary(row), flush=True)
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    with torch.device("meta"):  # counted, not built: no 124 M weights allocated and drawn on the CPU for a number
        params = sum(p.numel() for p in gpt_of(s).parameters())
    res.update(device=name, peak_flops=peak(name), flops_per_token=flops_per_token(s, params - s["block"] * s["dim"]))
    return res


def summary(row: dict[str, Any]) -> str:
    med = statistics.median
    return (f"{row['variant']}: trainer {med(t['tokens_per_s'] for t in row['trainer']):,.0f} tok/s, bare "
            f"{med(b['tokens_per_s'] for b in row['bare']):,.0f} ({row['trainer_vs_bare']['median']:.3f}×, per pair "
            f"{', '.join(f'{x:.3f}' for x in row['trainer_vs_bare']['values'])})")


def lm_trainer_section(r: dict[str, Any]) -> list[str]:
    """The built-in trainer's LM rows of section 4 of docs/benchmarks.md."""
    if "skipped" in r:
        return [f"- GPT-2 small through the built-in trainer: skipped ({r['skipped']}).", ""]
    med = statistics.median
    out = [f"The same model through the built-in trainer (`python -m trainer model.target=… data.target=… task.target=…`, "
           f"benchmarks/lm_trainer.py), on two token shards read by `Tokens`, against the bare loop, each side a "
           f"process of its own, in interleaved pairs; a process's rate is the median of its {r['window_steps']}-step "
           f"windows after the first {r['warm_windows']} ({r['steps']} steps a run):", "",
           "| variant | trainer tokens/s | bare tokens/s | trainer / bare | per pair | MFU of the trainer (peak) | "
           "launch → first step (s): trainer |", "|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        ours = med(t["tokens_per_s"] for t in x["trainer"])
        mfu = f"{ours * r['flops_per_token'] / r['peak_flops']:.1%} ({r['peak_flops'] / 1e12:.0f} TFLOP/s)" \
            if r["peak_flops"] else "peak unknown"
        out.append(f"| {x['variant']} | {ours:,.0f} | {med(b['tokens_per_s'] for b in x['bare']):,.0f} | "
                   f"**{x['trainer_vs_bare']['median']:.3f}×** | "
                   f"{', '.join(f'{v:.3f}' for v in x['trainer_vs_bare']['values'])} | {mfu} | "
                   f"{', '.join(format(t['launch_s'], '.1f') for t in x['trainer'])} |")
    return out + [""]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bare", choices=["eager", "compiled"], help="run the bare loop's side in this process")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--variants", default="eager,compiled", help="comma-separated, of eager,compiled")
    p.add_argument("--tiny", action="store_true", help="a tiny model (the CPU's smoke run)")
    a = p.parse_args()
    if a.bare:
        print(json.dumps(bare(a.bare, a.tiny, a.windows)), flush=True)
        return 0
    print(json.dumps(lm_trainer_rows(a.pairs, a.tiny, tuple(a.variants.split(","))), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
