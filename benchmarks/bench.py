"""`make bench`: measured claims only. Writes docs/benchmarks.md, docs/benchmarks.json and a scaling plot.

Every figure is the median of --repeats runs made in this one invocation on this one machine: compare
rows of the same run, never across runs (these machines are noisy).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.sharded import memory_rows, save_pairs
from trainer.env import without_placement

ROOT = Path(__file__).resolve().parent.parent


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor()
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "gpus": gpus, "platform": platform.platform()}


def clean_env() -> dict[str, str]:
    env = without_placement(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def torchrun(nproc: int, target: list[str], ok_if: str = "") -> tuple[subprocess.CompletedProcess[str], float]:
    launched = time.time()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           *target], env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if proc.returncode and not (ok_if and ok_if in proc.stdout):
        raise RuntimeError(f"{' '.join(target)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc, launched


def trainer_run(nproc: int, args: list[str], tmp: Path, device: str = "cpu") -> dict[str, Any]:
    run = Path(tempfile.mkdtemp(dir=tmp))
    # As with the bare loop: gloo's teardown occasionally aborts a rank after the run finished; result.json counts.
    _, launched = torchrun(nproc, ["-m", "trainer", *args, f"run.dir={run}", f"train.device={device}",
                                   "tracking.mode=disabled", "checkpoint.resume=never"], ok_if="\ndone: test accuracy")
    result = json.loads((run / "result.json").read_text())
    result["launch_to_first_step_s"] = result["first_step_at"] - launched
    shutil.rmtree(run)
    return result


def bare_run(nproc: int, batch: int, size: int) -> dict[str, Any]:
    # The bare loop's gloo teardown sometimes aborts after it has printed its figures: those still count.
    proc, launched = torchrun(nproc, [str(ROOT / "benchmarks" / "bare_ddp.py"), f"--batch-size={batch}",
                                      f"--train-size={size}"], ok_if='"train_samples_per_s"')
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["launch_to_first_step_s"] = result["first_step_at"] - launched
    return result


def med(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def scaling(repeats: int, size: int, tmp: Path) -> list[dict[str, Any]]:
    """The classic 1/2/4-GPU table: processes, global batch, batch per process, epoch time, samples/s, efficiency."""
    counts = [1, 2]
    device = "cpu"
    if torch.cuda.device_count() > 1:
        counts, device = [n for n in (1, 2, 4, 8) if n <= torch.cuda.device_count()], "cuda"
    rows = []
    for mode, per_proc in (("weak", lambda n: 32), ("strong", lambda n: 64 // n)):
        base = None
        for n in counts:
            args = [f"data.synthetic_train_size={size}", "train.epochs=1", f"data.batch_size={per_proc(n)}",
                    "data.num_workers=0"]
            runs = [trainer_run(n, args, tmp, device) for _ in range(repeats)]
            rate = med(runs, "train_samples_per_s")
            base = base or rate
            rows.append({"scaling": mode, "device": device, "processes": n, "global_batch": per_proc(n) * n,
                         "batch_per_process": per_proc(n), "epoch_time_s": med(runs, "train_time_s"),
                         "samples_per_s": rate, "efficiency": rate / (base * n)})
    return rows


def trainer_vs_bare(repeats: int, size: int, tmp: Path) -> dict[str, Any]:
    """Our trainer against the tutorials' loop: same model, data, batch; 2 processes. Ratio of samples/s."""
    ours, bare = [], []
    for _ in range(repeats):  # interleaved, so drift in machine load hits both alike
        ours.append(trainer_run(2, [f"data.synthetic_train_size={size}", "train.epochs=1", "data.batch_size=32"], tmp))
        bare.append(bare_run(2, 32, size))
    o, b = med(ours, "train_samples_per_s"), med(bare, "train_samples_per_s")
    return {"trainer_samples_per_s": o, "bare_samples_per_s": b, "ratio": o / b,
            "trainer_launch_to_first_step_s": med(ours, "launch_to_first_step_s"),
            "bare_launch_to_first_step_s": med(bare, "launch_to_first_step_s")}


def checkpoint_cost(repeats: int, tmp: Path, model_name: str) -> dict[str, Any]:
    """Synchronous save vs a raw torch.save of the same state; training stall of the asynchronous mode."""
    import torch.distributed as dist

    from trainer import checkpoint as ckpt
    from trainer.config import ModelConfig
    from trainer.models import build_model

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    model = build_model(ModelConfig(name=model_name), 3, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    opt.step()  # momentum buffers exist, as in a real checkpoint
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "progress": {"global_step": 1, "epoch": 0,
             "batches_in_epoch": 1}}
    size = len(_serialized(state))
    raw, sync, stall = [], [], []
    # One checkpointer for all async saves, as in a run: its first save allocates the host buffers that
    # every later one reuses (reported apart), the steady state is what a long run sees.
    a = ckpt.Checkpointer(tmp / "async", True, keep=2)
    t = time.perf_counter()
    a.save(state, 0, blocking=False)
    first_stall = time.perf_counter() - t
    a.wait()
    for i in range(repeats):
        path = tmp / f"raw{i}.pt"
        t = time.perf_counter()
        with open(path, "wb") as f:  # raw torch.save, made durable the same way for a fair comparison
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        raw.append(time.perf_counter() - t)
        c = ckpt.Checkpointer(tmp / f"ck{i}", True, keep=2)
        t = time.perf_counter()
        c.save(state, 1)
        sync.append(time.perf_counter() - t)
        t = time.perf_counter()
        a.save(state, i + 1, blocking=False)
        stall.append(time.perf_counter() - t)
        a.wait()
    r, s, st = statistics.median(raw), statistics.median(sync), statistics.median(stall)
    return {"model": model_name, "state_mb": size / 2**20, "raw_torch_save_s": r, "sync_save_s": s,
            "speed_vs_raw": r / s, "async_stall_s": st, "async_stall_vs_sync": st / s,
            "async_first_stall_s": first_stall}


def _serialized(state: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def cluster_overhead(repeats: int) -> dict[str, Any]:
    """`make submit NODES=2 WAIT=1` against a minimal hand-written sbatch+srun job, when the dev cluster is up."""
    status = subprocess.run(["bash", str(ROOT / "slurm" / "dev-cluster.sh"), "status"], capture_output=True)
    if status.returncode:
        return {"skipped": "the dev cluster is down (make dev-cluster)"}
    env_lines = subprocess.run(["bash", str(ROOT / "slurm" / "dev-cluster.sh"), "env"], capture_output=True,
                               text=True).stdout
    env = clean_env()
    for line in env_lines.splitlines():
        if line.startswith("export "):
            k, v = line[len("export "):].split("=", 1)
            env[k] = v.strip("'\"")
    args = "data.synthetic_train_size=1024 train.epochs=1 data.num_workers=0 tracking.mode=disabled"
    ours, bare = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        subprocess.run(["make", "-s", "submit", "NODES=2", "WAIT=1", f"ARGS={args}"], cwd=ROOT, env=env, check=True,
                       capture_output=True)
        ours.append(time.perf_counter() - t)
        t = time.perf_counter()
        wrap = f"srun {sys.executable} -m trainer {args} checkpoint.resume=never run.dir=/tmp/bench-bare-$SLURM_JOB_ID"
        subprocess.run(["sbatch", "--wait", "-N2", "--ntasks-per-node=1", "-o", "/dev/null", f"--wrap={wrap}"],
                       cwd=ROOT, env=env, check=True, capture_output=True)
        bare.append(time.perf_counter() - t)
    o, b = statistics.median(ours), statistics.median(bare)
    return {"make_submit_s": o, "sbatch_srun_s": b, "ratio": o / b}


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
    rows.append({"method": "DDP (trainer)", "gpus": n, "samples_per_s": med(runs, "train_samples_per_s"),
                 "peak_memory_gb_per_gpu": "see W&B gpu/max_memory_gb (per process)"})
    return rows


def torchvision_resnet() -> torch.nn.Module:
    import torchvision

    return torchvision.models.resnet18(num_classes=10)


def render(results: dict[str, Any]) -> str:
    """docs/benchmarks.md from the results."""
    m = results["machine"]
    out = ["# Benchmarks", "", f"Measured by `make bench` on {results['date']}: {m['cpu']}, {m['cores']} cores, "
           f"GPUs: {', '.join(m['gpus']) or 'none'}; Python {m['python']}, torch {m['torch']}. Each figure is the "
           f"median of {results['repeats']} runs of this one invocation; compare rows within this page only.", ""]
    out += ["## 1. Scaling", "", "| scaling | device | processes | global batch | batch/process | epoch time (s) | "
            "samples/s | efficiency |", "|---|---|---|---|---|---|---|---|"]
    for r in results["scaling"]:
        out.append(f"| {r['scaling']} | {r['device']} | {r['processes']} | {r['global_batch']} | {r['batch_per_process']} "
                   f"| {r['epoch_time_s']:.2f} | {r['samples_per_s']:.0f} | {100 * r['efficiency']:.0f} % |")
    t = results["trainer_vs_bare"]
    out += ["", "![scaling](benchmarks-scaling.png)", "", "## 2. Trainer vs the tutorials' bare loop", "",
            "2 processes, same model, data and batch (`benchmarks/bare_ddp.py`). Training loop only.", "",
            "| | samples/s | launch → first step (s) |", "|---|---|---|",
            f"| trainer | {t['trainer_samples_per_s']:.0f} | {t['trainer_launch_to_first_step_s']:.2f} |",
            f"| bare loop | {t['bare_samples_per_s']:.0f} | {t['bare_launch_to_first_step_s']:.2f} |",
            "", f"Ratio trainer / bare: **{t['ratio']:.2f}×** (target ≥ 1.05×)."]
    out += ["", "## 3. Checkpoint cost", "", "| model | state (MB) | raw torch.save+fsync (s) | our sync save (s) | "
            "speed vs raw | async stall (s) | stall vs sync | first async stall (s) |", "|---|---|---|---|---|---|---|---|"]
    for c in results["checkpoint"]:
        out.append(f"| {c['model']} | {c['state_mb']:.1f} | {c['raw_torch_save_s']:.3f} | {c['sync_save_s']:.3f} | "
                   f"{100 * c['speed_vs_raw']:.0f} % | {c['async_stall_s']:.3f} | {100 * c['async_stall_vs_sync']:.0f} % | "
                   f"{c['async_first_stall_s']:.3f} |")
    out += ["", "Targets: sync save ≥ 90 % of raw speed; async stall ≤ 10 % of a sync save. The async stall is the "
            "steady state (later saves copy into host buffers the first one allocated); the first save's stall is "
            "shown apart.", "",
            "## 4. Launch overhead", "",
            f"Local torchrun, launch → first optimizer step: trainer {t['trainer_launch_to_first_step_s']:.2f} s, "
            f"bare loop {t['bare_launch_to_first_step_s']:.2f} s.", ""]
    c = results["cluster"]
    if "skipped" in c:
        out.append(f"Dev cluster row skipped: {c['skipped']}.")
    else:
        out.append(f"Dev cluster, 2 nodes: `make submit NODES=2 WAIT=1` {c['make_submit_s']:.1f} s vs a minimal "
                   f"`sbatch --wait` + `srun` job {c['sbatch_srun_s']:.1f} s: **{c['ratio']:.2f}×** (target ≤ 1.2×).")
    out += ["", "## 5. GPU only", ""]
    for key, title in (("dp_vs_ddp", "DataParallel vs DDP"), ("precision", "resnet18 precision and layout")):
        rows = results[key]
        if isinstance(rows, dict):
            out.append(f"- {title}: skipped ({rows['skipped']}).")
        else:
            out.append(f"- {title}:")
            out += [f"  - {json.dumps(r)}" for r in rows]
    out += sharded_section(results["sharded"])
    return "\n".join(out) + "\n"


def sharded_section(r: dict[str, Any]) -> list[str]:
    """Rows of section 6: per-rank memory with ddp and fsdp, single-file vs sharded saves."""
    out = ["", "## 6. Sharded models (FSDP2) and sharded checkpoints", "",
           "The char LM example's GPT (`benchmarks/sharded.py`), AdamW, after one step; per-rank MiB of what the "
           "optimizer keeps (exact sizes, not timings; the largest rank):", "",
           "| strategy | processes | parameters | gradients | optimizer state | total |", "|---|---|---|---|---|---|"]
    for m in r["memory"]:
        out.append(f"| {m['strategy']} | {m['processes']} | {m['params']:.1f} | {m['grads']:.1f} | "
                   f"{m['optimizer']:.1f} | {m['total']:.1f} |")
    s = r["saves"]
    out += ["", f"Saving the same state (ddp, 2 processes, {s['pairs'][0]['state_mb']:.1f} MiB): rank 0 writing one "
            "file (`checkpoint.format=file`) vs every rank writing its share (`dcp`), as interleaved pairs, medians of 3 "
            "saves each:", "", "| pair | file sync (s) | dcp sync (s) | dcp / file | file async stall (s) | "
            "dcp async stall (s) |", "|---|---|---|---|---|---|"]
    for i, p in enumerate(s["pairs"]):
        out.append(f"| {i + 1} | {p['file_sync_s']:.3f} | {p['dcp_sync_s']:.3f} | {p['sync_ratio']:.2f}× | "
                   f"{p['file_stall_s']:.3f} | {p['dcp_stall_s']:.3f} |")
    out += ["", f"dcp / file save time: median **{s['median_sync_ratio']:.2f}×** (min {s['min_sync_ratio']:.2f}, max "
            f"{s['max_sync_ratio']:.2f})."]
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    for mode in ("weak", "strong"):
        rows = [r for r in results["scaling"] if r["scaling"] == mode]
        ax.plot([r["processes"] for r in rows], [r["samples_per_s"] for r in rows], marker="o", label=f"{mode} scaling")
    ax.set_xlabel("processes")
    ax.set_ylabel("samples/s")
    ax.set_title(f"Scaling on {results['scaling'][0]['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train-size", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat: checks that the script works")
    a = parser.parse_args()
    repeats, size = (1, 512) if a.smoke else (a.repeats, a.train_size)
    a.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        results: dict[str, Any] = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "repeats": repeats}
        results["scaling"] = scaling(repeats, size, tmp)
        results["trainer_vs_bare"] = trainer_vs_bare(repeats, size, tmp)
        results["checkpoint"] = [checkpoint_cost(max(3, repeats), tmp, m) for m in (("cnn",) if a.smoke else ("cnn", "resnet18"))]
        results["cluster"] = {"skipped": "smoke run"} if a.smoke else cluster_overhead(repeats)
        results["dp_vs_ddp"] = dp_vs_ddp(repeats, size, tmp)
        results["precision"] = precision_rows(repeats, a.smoke)
        dim, layers = (64, 2) if a.smoke else (256, 4)
        results["sharded"] = {"memory": memory_rows(dim, layers), "saves": save_pairs(repeats, dim, layers)}
    (a.out / "benchmarks.json").write_text(json.dumps(results, indent=1))
    (a.out / "benchmarks.md").write_text(render(results))
    plot(results, a.out / "benchmarks-scaling.png")
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
