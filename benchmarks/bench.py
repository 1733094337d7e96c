"""`make bench`: measured claims only. Writes docs/benchmarks.md, docs/benchmarks.json and a scaling plot.

Every comparison runs as interleaved pairs (A B, B A, …) in this one invocation on this one machine; every pair's
ratio is printed with their median, min and max. Compare figures within one run only: these machines are noisy.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import audit, cadence, gpu, life, projection, recovery, streams, versions
from benchmarks.checkpoints import checkpoint_cost
from benchmarks.common import ROOT, bare_run, dev_cluster_env, each, machine, pairs, show, splice, spread, trainer_run
from benchmarks.lm import lm_rows
from benchmarks.lm_trainer import lm_trainer_rows
from benchmarks.sharded import memory_rows, save_pairs

BATCH = 32  # per process, as the trainer's default


def trainer_and_bare(rounds: int, size: int, tmp: Path, strong: bool = True) -> dict[str, Any]:
    """Our trainer and the tutorials' loop, same model, data and batch, at 1 and N processes (weak scaling: 32 per
    process) and (``strong``) at 1 process with N processes' global batch (strong scaling). Each round runs every
    setting as a trainer/bare pair, so a round also gives both loops' scaling efficiency from runs minutes apart at
    most."""
    counts, device = [1, 2], "cpu"
    if torch.cuda.device_count() > 1:
        counts, device = [n for n in (1, 2, 4, 8) if n <= torch.cuda.device_count()], "cuda"
    top = counts[-1]
    settings = [(n, BATCH) for n in counts] + ([(1, BATCH * top)] if strong else [])
    runs: dict[tuple[int, int], list[tuple[dict[str, Any], dict[str, Any]]]] = {s: [] for s in settings}
    for r in range(rounds):
        for n, batch in settings:
            args = [f"data.synthetic_train_size={size}", "train.epochs=1", f"data.batch_size={batch}",
                    "data.num_workers=0"]
            runs[(n, batch)] += pairs(1, functools.partial(trainer_run, n, args, tmp, device),
                                      functools.partial(bare_run, n, batch, size, device), start=r)
    rate = {s: ([t["train_samples_per_s"] for t, _ in r], [b["train_samples_per_s"] for _, b in r])
            for s, r in runs.items()}
    rows = [{"processes": n, "batch_per_process": batch, "global_batch": n * batch,
             "trainer_samples_per_s": spread(rate[(n, batch)][0]), "bare_samples_per_s": spread(rate[(n, batch)][1]),
             "trainer_vs_bare": spread([t / b for t, b in zip(*rate[(n, batch)], strict=True)])} for n, batch in settings]

    def efficiency(base: tuple[int, int], side: int) -> dict[str, Any]:  # side 0: trainer, 1: bare
        return spread([many / (top * one) for many, one in zip(rate[(top, BATCH)][side], rate[base][side], strict=True)])

    launch = [(t["launch_to_first_step_s"], b["launch_to_first_step_s"]) for r in runs.values() for t, b in r]
    return {"device": device, "rounds": rounds, "top": top, "rows": rows,
            "weak": {"trainer": efficiency((1, BATCH), 0), "bare": efficiency((1, BATCH), 1)},
            "strong": {"trainer": efficiency((1, BATCH * top), 0), "bare": efficiency((1, BATCH * top), 1)} if strong
            else None,
            "launch_s": {"trainer": spread([t for t, _ in launch]), "bare": spread([b for _, b in launch])}}


def cluster_overhead(n_pairs: int) -> dict[str, Any]:
    """`make submit NODES=2 WAIT=1` against a minimal hand-written sbatch+srun job, when the dev cluster is up."""
    env = dev_cluster_env()
    if env is None:
        return {"skipped": "the dev cluster is down (make dev-cluster)"}
    args = "data.synthetic_train_size=1024 train.epochs=1 data.num_workers=0 tracking.mode=disabled"

    phases: list[dict[str, float]] = []

    def timed(cmd: list[str]) -> float:
        start, wall = time.time(), time.perf_counter()
        out = subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True).stdout
        took = time.perf_counter() - wall
        job = re.search(r"submitted job (\d+)", out)
        seen = submit_phases(ROOT / "runs" / job.group(1), start, start + took) if job else {}
        if seen:
            phases.append(seen)
        return took

    wrap = f"srun {sys.executable} -m trainer {args} checkpoint.resume=never run.dir=/tmp/bench-bare-$SLURM_JOB_ID"
    done = pairs(n_pairs, lambda: timed(["make", "-s", "submit", "NODES=2", "WAIT=1", f"ARGS={args}"]),
                 lambda: timed(["sbatch", "--wait", "-N2", "--ntasks-per-node=1", "-o", "/dev/null", f"--wrap={wrap}"]))
    return {"make_submit_s": spread([o for o, _ in done]), "sbatch_srun_s": spread([b for _, b in done]),
            "ratio": spread([o / b for o, b in done]),
            "phases": {k: spread([p[k] for p in phases]) for k in PHASES} if phases else {}}


PHASES = {"submit": "make, the CLI's checks (the model built on the meta device: a torch import), sbatch, the "
                    "job starting",
          "start-up": "each task: Python, torch, the process group, model and data, to the first step",
          "training": "first step to the last, the evaluation and the final save",
          "wind-down": "the run report, processes exiting, the job step ending",
          "result": "the job's end to `make` returning (submitit's poll for the result files)"}


def submit_phases(run: Path, start: float, end: float) -> dict[str, float]:
    """Where one `make submit WAIT=1`'s seconds went, from its run folder's events (wall clock, one machine)."""
    t: dict[str, float] = {}
    for line in (run / "events.jsonl").read_text().splitlines():
        event = json.loads(line)
        t.setdefault(event["event"], float(event["t"]))
    if not {"job_start", "first_step", "exit", "job_end"} <= t.keys():
        return {}
    return {"submit": t["job_start"] - start, "start-up": t["first_step"] - t["job_start"],
            "training": t["exit"] - t["first_step"], "wind-down": t["job_end"] - t["exit"], "result": end - t["job_end"]}


def render(results: dict[str, Any]) -> str:
    """docs/benchmarks.md from the results."""
    m = results["machine"]
    out = ["# Benchmarks", "", f"Measured by `make bench` on {results['date']}: {m['cpu']}, {m['cores']} cores, "
           f"GPUs: {', '.join(m['gpus']) or 'none'}; Python {m['python']}, torch {m['torch']}. Every comparison ran "
           "as interleaved pairs in this one invocation, each pair's order alternating (A B, B A, …); a ratio is "
           "shown as median (min–max) over its pairs, with every pair's value beside it. Compare figures within this "
           "page only.", ""]
    out += scaling_section(results["trainer_and_bare"]) + checkpoint_section(results["checkpoint"])
    out += launch_section(results["trainer_and_bare"], results["cluster"])
    out += [""] + gpu.section(results["gpu"])
    out += sharded_section(results["sharded"])
    if "cadence" in results:
        out += cadence.section(results["cadence"])
    return "\n".join(out) + "\n"


def scaling_section(t: dict[str, Any]) -> list[str]:
    out = ["## 1. Trainer vs the tutorials' bare loop, and scaling", "",
           f"Same model, data and batch on {t['device']} (`benchmarks/bare_ddp.py`: DDP, DataLoader, SGD, nothing "
           f"else); the training loop only. {t['rounds']} rounds, each running every setting as a trainer, bare pair.",
           "", "| processes | batch/process | global batch | trainer samples/s | bare samples/s | trainer / bare | "
           "per pair |", "|---|---|---|---|---|---|---|"]
    for r in t["rows"]:
        out.append(f"| {r['processes']} | {r['batch_per_process']} | {r['global_batch']} | "
                   f"{r['trainer_samples_per_s']['median']:.0f} | {r['bare_samples_per_s']['median']:.0f} | "
                   f"**{show(r['trainer_vs_bare'])}** | {each(r['trainer_vs_bare'])} |")
    n = t["top"]
    out += ["", f"Scaling efficiency from 1 to {n} processes, samples/s at {n} ÷ ({n} × samples/s at 1), per round:",
            "", "| | trainer | per round | bare loop | per round |", "|---|---|---|---|---|"]
    for key, label in (("weak", f"weak (batch {BATCH} per process)"), ("strong", f"strong (global batch {BATCH * n})")):
        e = t[key]
        if e is None:  # a smoke run measures no strong scaling
            continue
        out.append(f"| {label} | {show(e['trainer'], '{:.2f}')} | {each(e['trainer'])} | {show(e['bare'], '{:.2f}')} "
                   f"| {each(e['bare'])} |")
    return out + ["", "![scaling](benchmarks-scaling.png)", "", "Targets: trainer / bare ≥ 1.0×; the trainer's scaling "
                  "efficiency no lower than the bare loop's.", ""]


def checkpoint_section(rows: list[dict[str, Any]]) -> list[str]:
    out = ["## 2. Checkpoint cost", "",
            "One process; every save starts after an `os.sync()`. Speed: pairs of (raw `torch.save` + fsync, our "
            "synchronous save: hash, fsync, rename, manifest), raw time ÷ ours. Stall: pairs of (synchronous save, "
            "asynchronous save's training stall).", "",
            "| model | state (MiB) | raw (s) | ours (s) | speed vs raw | per pair | async stall (s) | stall vs sync | "
            "per pair | first async stall (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in rows:
        out.append(f"| {c['model']} | {c['state_mb']:.1f} | {c['raw_s']['median']:.3f} | {c['sync_s']['median']:.3f} | "
                   f"**{show(c['speed_vs_raw'], '{:.0%}')}** | {each(c['speed_vs_raw'])} | "
                   f"{c['async_stall_s']['median']:.3f} | **{show(c['stall_vs_sync'], '{:.0%}')}** | "
                   f"{each(c['stall_vs_sync'])} | {c['first_async_stall_s']:.3f} |")
    out += ["", "Targets: sync save ≥ 90 % of raw speed from resnet18's size up (the smallest state is fixed costs: "
            "fsyncs, manifest); async stall ≤ 10 % of a sync save. The stall is the steady state (later saves copy "
            "into host buffers the first one allocated); the first save's stall is shown apart. Both sides "
            "of a speed pair write the same bytes through the same `torch.save`: a row's spread is the disk's (on a "
            "VM's disk, fsyncs of hundreds of MiB vary by tens of percent from one save to the next).", ""]
    return out


def launch_section(t: dict[str, Any], c: dict[str, Any]) -> list[str]:
    out = ["## 3. Launch overhead", "",
            f"Local torchrun, launch → first optimizer step: trainer {show(t['launch_s']['trainer'], '{:.2f}')} s, "
            f"bare loop {show(t['launch_s']['bare'], '{:.2f}')} s (every run of section 1).", ""]
    if "skipped" in c:
        out.append(f"Dev cluster row skipped: {c['skipped']}.")
    else:
        out.append(f"Dev cluster, 2 nodes, pairs of (`make submit NODES=2 WAIT=1`, a minimal `sbatch --wait` + `srun` "
                   f"job): {c['make_submit_s']['median']:.1f} s vs {c['sbatch_srun_s']['median']:.1f} s, "
                   f"**{show(c['ratio'])}** (pairs: {each(c['ratio'])}; target ≤ 1.2×). `sbatch --wait` polls the "
                   "job's state every few seconds, so the hand-written side's figure is rounded up to its poll.")
        if c.get("phases"):
            out += ["", "Where `make submit`'s seconds go (median (min–max) over its runs, from the run folder's events):",
                    "", "| phase | seconds | what |", "|---|---|---|"]
            out += [f"| {k} | {show(v, '{:.2f}')} | {PHASES[k]} |" for k, v in c["phases"].items()]
    return out


def sharded_section(r: dict[str, Any]) -> list[str]:
    """Section 5: per-rank memory with ddp and fsdp, single-file vs sharded saves."""
    out = ["", "## 5. Sharded models (FSDP2) and sharded checkpoints", "",
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
    out += ["", f"dcp / file save time: **{show(s['sync_ratio'])}**."]
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = results["trainer_and_bare"]
    weak = [r for r in t["rows"] if r["batch_per_process"] == BATCH]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for key, label in (("trainer_samples_per_s", "trainer"), ("bare_samples_per_s", "bare loop")):
        ax.errorbar([r["processes"] for r in weak], [r[key]["median"] for r in weak], marker="o", capsize=3,
                    yerr=[[r[key]["median"] - r[key]["min"] for r in weak], [r[key]["max"] - r[key]["median"]
                                                                             for r in weak]], label=label)
    ax.set_xlabel("processes")
    ax.set_ylabel("samples/s (median, min–max)")
    ax.set_title(f"Weak scaling on {t['device']}, batch {BATCH} per process")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3, help="pairs (rounds) per comparison")
    parser.add_argument("--train-size", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one pair each: checks that the script works")
    a = parser.parse_args()
    repeats, size = (1, 512) if a.smoke else (a.repeats, a.train_size)
    a.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        results: dict[str, Any] = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "repeats": repeats}
        results["trainer_and_bare"] = trainer_and_bare(repeats, size, tmp, strong=not a.smoke)
        models = (("cnn", 1),) if a.smoke else (("cnn", 5), ("resnet18", 7), ("linear8192", 9))
        results["checkpoint"] = [checkpoint_cost(max(k, repeats), tmp, m) for m, k in models]
        results["cluster"] = {"skipped": "smoke run"} if a.smoke else cluster_overhead(repeats)
        # Without a GPU, section 4 shows the last GPU machine's figures (python -m benchmarks.gpu), kept in a.out.
        results["gpu"] = gpu.measure(repeats, size, tmp, a.out) if torch.cuda.is_available() and not a.smoke else \
            gpu.stored(a.out)
        results["precision_smoke"] = gpu.precision_rows(repeats, smoke=True) if a.smoke else None
        results["lm_smoke"] = lm_rows(1, True) if a.smoke else None  # the LM benchmark's path, tiny and eager
        results["lm_trainer_smoke"] = lm_trainer_rows(1, True) if a.smoke else None  # the built-in trainer's LM path
        dim, layers = (64, 2) if a.smoke else (256, 4)
        # The smoke run checks that every section runs, with as few new interpreters as that takes.
        results["sharded"] = {"memory": memory_rows(dim, layers, (2,) if a.smoke else (1, 2)),
                              "saves": save_pairs(repeats, dim, layers)}
        results["cadence"] = cadence.simulate()
        if not a.smoke:  # the dev cluster's recovery paths, when it is up (section 8)
            measured = recovery.measure(repeats, tmp)
            if "skipped" not in measured:
                (a.out / "benchmarks-recovery.json").write_text(json.dumps(measured, indent=1))
    results["took_s"] = time.perf_counter() - started
    (a.out / "benchmarks.json").write_text(json.dumps(results, indent=1))
    page = a.out / "benchmarks.md"
    kept = hand_written(page)
    page.write_text(render(results))
    for lines in [kept, recovery.section(stored(a.out, "recovery")), projection.section(a.out),
                  life.section(stored(a.out, "life"), stored(a.out, "life-regroup")), versions.section(stored(a.out, "versions")),
                  audit.section(stored(a.out, "audit")), streams.section(stored(a.out, "streams"))]:
        if lines:
            splice(page, lines)
    plot(results, a.out / "benchmarks-scaling.png")
    print(page.read_text())
    print(f"took {results['took_s']:.0f} s")
    return 0


def stored(folder: Path, name: str) -> dict[str, Any] | None:
    """The last measurement kept in ``folder``/benchmarks-<name>.json (sections measured on their own)."""
    path = folder / f"benchmarks-{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def hand_written(page: Path) -> list[str]:
    """Section 7 of an existing page (the test suite's wall time, timed by hand), to keep across runs."""
    text = page.read_text() if page.exists() else ""
    start = text.find("## 7. ")
    if start < 0:
        return []
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)].rstrip("\n").splitlines()


if __name__ == "__main__":
    sys.exit(main())
