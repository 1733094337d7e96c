"""GPU-only rows: resnet18 precision and layout variants, the trainer against the bare loop on one GPU, checkpoint
cost of a GPU-resident state, and DataParallel vs DDP with per-GPU memory.

Each skips without a GPU (the smoke run exercises the precision code on the CPU at a tiny size). On a machine with a
GPU, `python -m benchmarks.gpu` measures this section alone: it writes docs/benchmarks-gpu.json and puts the section
into docs/benchmarks.md, where a later `make bench` on a machine without a GPU keeps showing it.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.checkpoints import checkpoint_cost
from benchmarks.common import ROOT, bare_run, each, machine, pairs, publish, show, spread, trainer_run
from benchmarks.lm import lm_rows, lm_section
from benchmarks.lm_trainer import lm_trainer_rows, lm_trainer_section

WARMUP = 10
"""Steps before the timed ones: 3 left a compiled model short of its steady state (section 4 of 2026-11-26)."""


VARIANTS = ("fp32", "bf16", "bf16+channels_last", "bf16+channels_last+compile", "bf16+channels_last+compile+short",
            "bf16+channels_last+compile:reduce-overhead")
"""A compiled variant's mode follows its colon (train.compile_mode): CUDA graphs for steps of many small kernels.
Compiled for static shapes, as train.compile does; ``+short``: torch's default instead, after one short batch (an
epoch's last), which compiles again for any batch size: what the built-in trainer ran after its first epoch before."""


def _variant(variant: str, res: int, batch: int, device: torch.device, warmup: int = WARMUP) -> Any:
    """One variant's step function, warmed up (compilation, autotuning, the allocator's first sizes)."""
    import torchvision

    if "compile" in variant:
        torch.compiler.reset()  # else a second resnet18 recompiles the same code with dynamic shapes (slower kernels)
    model: Any = torchvision.models.resnet18(num_classes=10).to(device)
    x = torch.randn(batch, 3, res, res, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    if "channels_last" in variant:
        model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    short = "+short" in variant
    if "compile" in variant:
        model = torch.compile(model, mode=variant.partition(":")[2] or "default", dynamic=None if short else False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(n: int = batch) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled="bf16" in variant):
            loss = torch.nn.functional.cross_entropy(model(x[:n]).float(), y[:n])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(warmup):
        step(max(1, batch // 4) if short and i == 1 else batch)
    return step


def precision_rows(repeats: int, smoke: bool) -> list[dict[str, Any]] | dict[str, str]:
    """GPU only: resnet18 forward+backward throughput, fp32 vs bf16 autocast vs channels_last (+ torch.compile): every
    variant warmed up first, then timed in rounds of one burst each, so that each round's ratios share the machine."""
    if not torch.cuda.is_available() and not smoke:
        return {"skipped": "no GPU on this machine"}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    # A smoke run on the CPU only checks the path: one warm-up step and one burst of one step per variant (the full
    # counts took 50 CPU-seconds of bf16 resnet18 steps, a third of the test suite's benchmark run).
    warmup, rounds, burst = (1, 1, 1) if smoke else (WARMUP, max(3, repeats * 2), 5)
    for res, batch in ((32, 256), (224, 64)) if not smoke else ((32, 4),):
        variants = [v for v in VARIANTS if not (smoke and "compile" in v)]
        steps = {v: _variant(v, res, batch, device, warmup) for v in variants}
        rates: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(rounds):
            for v in variants:
                _sync(device)
                t = time.perf_counter()
                for _ in range(burst):
                    steps[v]()
                _sync(device)
                rates[v].append(burst * batch / (time.perf_counter() - t))
        for v in variants:
            vs_fp32 = [a / b for a, b in zip(rates[v], rates["fp32"], strict=True)]
            rows.append({"resolution": res, "batch": batch, "variant": v, "device": device.type, "warmup": warmup,
                         "samples_per_s": statistics.median(rates[v]), "vs_fp32": spread(vs_fp32)})
        del steps
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


def trainer_vs_bare(repeats: int, size: int, tmp: Path) -> dict[str, Any]:
    """GPU only: the trainer against the tutorials' loop in one process on one GPU, as interleaved pairs."""
    if not torch.cuda.is_available():
        return {"skipped": "no GPU on this machine"}
    rows = []
    for batch in (32, 256):
        args = [f"data.synthetic_train_size={size}", "train.epochs=1", f"data.batch_size={batch}", "data.num_workers=0"]
        done = pairs(repeats, functools.partial(trainer_run, 1, args, tmp, "cuda"),
                     functools.partial(bare_run, 1, batch, size, "cuda"))
        rows.append({"batch": batch, "trainer_samples_per_s": spread([t["train_samples_per_s"] for t, _ in done]),
                     "bare_samples_per_s": spread([b["train_samples_per_s"] for _, b in done]),
                     "trainer_vs_bare": spread([t["train_samples_per_s"] / b["train_samples_per_s"] for t, b in done]),
                     "launch_s": spread([t["launch_to_first_step_s"] for t, _ in done]),
                     "bare_launch_s": spread([b["launch_to_first_step_s"] for _, b in done])})
    return {"rows": rows}


def checkpoints(repeats: int, tmp: Path) -> list[dict[str, Any]] | dict[str, str]:
    """GPU only: checkpoint cost (section 2's pairs) of a state that lives on the GPU."""
    if not torch.cuda.is_available():
        return {"skipped": "no GPU on this machine"}
    return [checkpoint_cost(max(5, repeats), tmp, m, "cuda") for m in ("resnet18", "linear8192")]


def section(r: dict[str, Any] | None) -> list[str]:
    """Section 4 of docs/benchmarks.md from ``python -m benchmarks.gpu``'s results (None: never measured). A part the
    last run did not measure is shown from the newest earlier run kept beside it that did (``earlier``: a list, or
    one run), named as such."""
    out = ["## 4. GPU only", ""]
    if r is None:
        return out + ["Not measured yet: run `python -m benchmarks.gpu` on a machine with a GPU.", ""]
    out += [f"Measured by `{r['command']}` on {r['date']}: {where(r)}. Figures from a GPU machine compare only with "
            "each other, not with the CPU sections." + (f" Note: {r['note']}." if r.get("note") else ""), ""]
    if r.get("tests"):  # the GPU tests' run on the same machine, kept beside the figures by hand
        out += [f"GPU tests on that machine: `{r['tests']['command']}`: {r['tests']['result']}.", ""]
    kept = r.get("earlier", [])
    earlier: list[dict[str, Any]] = [kept] if isinstance(kept, dict) else kept
    for key, render in RENDERERS.items():
        run = next((e for e in earlier if key in e), None)
        if key in r:
            out += render(r[key])
        elif run is not None:
            out += [f"*From the run of {run['date']} (`{run['command']}`, {where(run)}):*", ""]
            out += render(run[key])
        else:
            out += render({"skipped": "not run"})
    return out + [f"- {x}" for x in r.get("findings", [])] + ([""] if r.get("findings") else [])


def where(r: dict[str, Any]) -> str:
    m = r["machine"]
    return f"{', '.join(m['gpus']) or 'no GPU'}, {m['cpu']}, {m['cores']} cores; Python {m['python']}, torch {m['torch']}"


def bare_section(t: dict[str, Any]) -> list[str]:
    if "skipped" in t:
        return [f"- Trainer vs bare loop on one GPU: skipped ({t['skipped']}).", ""]
    out = ["Trainer vs the bare loop (section 1's model and data), one process on one GPU, interleaved pairs:", "",
           "| batch | trainer samples/s | bare samples/s | trainer / bare | per pair | launch → first step (s): trainer "
           "| bare |", "|---|---|---|---|---|---|---|"]
    out += [f"| {w['batch']} | {w['trainer_samples_per_s']['median']:.0f} | {w['bare_samples_per_s']['median']:.0f} | "
            f"**{show(w['trainer_vs_bare'])}** | {each(w['trainer_vs_bare'])} | {show(w['launch_s'], '{:.2f}')} | "
            f"{show(w['bare_launch_s'], '{:.2f}') if 'bare_launch_s' in w else '–'} |" for w in t["rows"]]
    return out + [""]


def checkpoint_section(c: list[dict[str, Any]] | dict[str, str]) -> list[str]:
    if isinstance(c, dict):
        return [f"- Checkpoints of a GPU-resident state: skipped ({c['skipped']}).", ""]
    out = ["Checkpoint cost of a state on the GPU (section 2's pairs; the asynchronous save first copies the state "
           "into pinned host buffers):", "", "| model | state (MiB) | raw (s) | ours (s) | speed vs raw | "
           "async stall (s) | stall vs sync | first async stall (s) |", "|---|---|---|---|---|---|---|---|"]
    out += [f"| {k['model']} | {k['state_mb']:.1f} | {k['raw_s']['median']:.3f} | {k['sync_s']['median']:.3f} | "
            f"**{show(k['speed_vs_raw'], '{:.0%}')}** | {k['async_stall_s']['median']:.3f} | "
            f"**{show(k['stall_vs_sync'], '{:.0%}')}** | {k['first_async_stall_s']:.3f} |" for k in c]
    return out + [""]


def precision_section(p: list[dict[str, Any]] | dict[str, str]) -> list[str]:
    if isinstance(p, dict):
        return [f"- resnet18 precision and layout: skipped ({p['skipped']}).", ""]
    out = [f"resnet18 forward + backward + SGD step after {p[0].get('warmup', 3)} warm-up steps (compilation included "
           "in the warm-up), every variant built first and then timed in rounds of one 5-step burst each: \"vs fp32\" "
           "is the median of each round's ratio, with its spread. Compiled for static shapes (train.compile's way); "
           "`+short`: torch's default shapes, given one short batch (an epoch's last) before the warm-up.", "",
           "| resolution | batch | variant | samples/s | vs fp32 |", "|---|---|---|---|---|"]
    base = {(x["resolution"], x["batch"]): x["samples_per_s"] for x in p if x["variant"] == "fp32"}

    def ratio(x: dict[str, Any]) -> str:  # a run from before the rounds: a ratio of medians
        return f"{x['samples_per_s'] / base[(x['resolution'], x['batch'])]:.2f}×"
    out += [f"| {x['resolution']} | {x['batch']} | {x['variant']} | {x['samples_per_s']:.0f} | "
            f"{show(x['vs_fp32']) if 'vs_fp32' in x else ratio(x)} |" for x in p]
    return out + [""]


def dp_section(d: list[dict[str, Any]] | dict[str, str]) -> list[str]:
    if isinstance(d, dict):
        return [f"- DataParallel vs DDP: skipped ({d['skipped']}).", ""]
    return ["DataParallel vs DDP:", ""] + [f"- {json.dumps(x)}" for x in d] + [""]


def stored(folder: Path) -> dict[str, Any] | None:
    """The last GPU measurement kept in ``folder``/benchmarks-gpu.json, if any."""
    path = folder / "benchmarks-gpu.json"
    return json.loads(path.read_text()) if path.exists() else None


RENDERERS: dict[str, Callable[[Any], list[str]]] = {
    "lm": lm_section, "lm_trainer": lm_trainer_section, "precision": precision_section, "trainer_vs_bare": bare_section,
    "checkpoint": checkpoint_section, "dp_vs_ddp": dp_section}
"""The section's parts in their order, each with what shows it."""
PARTS = tuple(RENDERERS)


def measure(repeats: int, size: int, tmp: Path | None, out: Path, only: tuple[str, ...] = PARTS) -> dict[str, Any]:
    """The GPU rows of the parts named in ``only``, each kept in ``out``/benchmarks-gpu.json as it ends (a run cut
    short keeps what it measured)."""
    command = f"python -m benchmarks.gpu --repeats {repeats}" + (f" --parts {','.join(only)}" if only != PARTS else "")
    results: dict[str, Any] = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "command": command}
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=tmp) as t:
        parts = (("lm", lambda: lm_rows(repeats + 2, False)),
                 ("lm_trainer", lambda: lm_trainer_rows(repeats, False)),
                 ("precision", lambda: precision_rows(repeats, False)),
                 ("trainer_vs_bare", lambda: trainer_vs_bare(repeats, size, Path(t))),
                 ("checkpoint", lambda: checkpoints(repeats, Path(t))),
                 ("dp_vs_ddp", lambda: dp_vs_ddp(repeats, size, Path(t))))
        for key, run in parts:
            if key not in only:
                continue
            started = time.perf_counter()
            results[key] = run()
            print(f"{key}: {time.perf_counter() - started:.0f} s", flush=True)
            (out / "benchmarks-gpu.json").write_text(json.dumps(results, indent=1))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description="Section 4 of docs/benchmarks.md, measured on this machine's GPU.")
    parser.add_argument("--repeats", type=int, default=3, help="pairs per comparison")
    parser.add_argument("--train-size", type=int, default=65536,
                        help="samples per run of trainer vs bare: 8192 made 32 steps at batch 256, a fraction of a second")
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {','.join(PARTS)}")
    a = parser.parse_args()
    only = tuple(x for x in a.parts.split(",") if x)
    if not only or set(only) - set(PARTS):
        print(f"error: --parts: {a.parts!r} names no part or an unknown one\nHINT: choose from {','.join(PARTS)}",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: GPU: torch sees no CUDA GPU on this machine\nHINT: run it where torch.cuda.is_available() is true",
              file=sys.stderr)
        return 2
    results = measure(a.repeats, a.train_size, None, a.out, only)
    publish(a.out, None, results, section(results))  # measure() kept benchmarks-gpu.json
    return 0


if __name__ == "__main__":
    sys.exit(main())
