"""What the audits cost, how soon a slow rank is found, and whether they cry wolf (trainer/runtime/health/, section
12 of docs/benchmarks.md). Four parts, each kept with its own date and command, so one can be measured again alone:

- overhead: the built-in trainer on 2 gloo processes with the audits at their defaults against both off, and the
  replay audit every 100 steps against it off, as interleaved pairs; the ratios of their training rates;
- detection: the built-in model at a batch of 512 a process (about 80 ms a step here: ``make train``'s 8 ms steps are
  below the detector's 10 ms floor at any ratio) with rank 1 slowed 1.3× from outside (SIGSTOP 30 ms of every 130 ms,
  benchmarks/outside.py) from its first step on, the detector at its defaults: the seconds until the straggler event
  and the rank it names;
- alarms: clean runs, the straggler events counted: ``make train`` as it is (2 processes on this machine), the
  detection workload without the slowdown (where the floor hides nothing and the ratio alone decides), and, when the
  dev cluster is up, ``make train``'s training as a 2-node job on it;

``python -m benchmarks.audit [--only overhead,detection,alarms]`` writes docs/benchmarks-audit.json and the section.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import recovery
from benchmarks.common import ROOT, clean_env, dev_cluster_env, machine, pairs, publish, show, spread
from benchmarks.outside import Throttle, pin
from benchmarks.procfs import processes

OFF = ["audit.straggler_steps=0", "audit.replicas_every_steps=-1"]
PARTS = ("overhead", "cost", "detection", "workload", "alarms")
SLOWDOWN = (0.03, 0.1)  # stopped 30 ms, running 100 ms: 1.3× slower
WORKLOAD = ["data.batch_size=512", "data.synthetic_train_size=262144", "train.epochs=1"]  # 256 steps


def events_of(folder: Path, kind: str) -> list[dict[str, Any]]:
    """The run's events of one kind (none yet while a line is half written: recovery.events_of)."""
    return [e for e in recovery.events_of(folder) if e["event"] == kind]


def train(args: list[str], tmp: Path, during: Callable[[subprocess.Popen[str], Path], Any] | None = None
          ) -> dict[str, Any]:
    """One 2-process run of the built-in trainer as ``make train`` starts it (``args`` on top of the defaults):
    its result, its straggler events and what ``during`` returned (called with the launcher's process and the run
    folder while it runs)."""
    folder = Path(tempfile.mkdtemp(dir=tmp))
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             "-m", "trainer", *args, f"run.dir={folder}"], cwd=ROOT, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = during(proc, folder) if during else None
    out = proc.communicate(timeout=1800)[0]
    if proc.returncode:
        raise RuntimeError(f"{' '.join(args)} failed:\n{out[-3000:]}")
    result: dict[str, Any] = json.loads((folder / "result.json").read_text())
    result["stragglers"], result["during"] = events_of(folder, "straggler"), seen
    shutil.rmtree(folder)
    return result


def overhead(n_pairs: int, size: int, tmp: Path) -> dict[str, Any]:
    base = [f"data.synthetic_train_size={size}", "checkpoint.every_steps=50", "tracking.mode=disabled",
            "checkpoint.resume=never", "data.num_workers=0", "train.epochs=1"]
    got = pairs(n_pairs, lambda: train(base, tmp, pinned), lambda: train([*base, *OFF], tmp, pinned))
    replayed = pairs(n_pairs, lambda: train([*base, "audit.replay_every_steps=100"], tmp, pinned),
                     lambda: train(base, tmp, pinned))
    return {"pairs": n_pairs, "size": size, "pinned": True,
            "on_vs_off": spread([on["train_samples_per_s"] / off["train_samples_per_s"] for on, off in got]),
            "replay_vs_not": spread([on["train_samples_per_s"] / off["train_samples_per_s"] for on, off in replayed]),
            "command": f"python -m benchmarks.audit --only overhead --pairs {n_pairs} --size {size}"}


def meter_cost(rounds: int, block: int = 50) -> dict[str, Any]:
    """The straggler meter's own cost, in one process and free of the run-to-run noise of two: the default model's step
    (SmallCNN, batch 32, 28 px, AdamW) with the meter's hooks and without, in alternating blocks, the meter read at
    every 10th step as the poll reads it."""
    import torch
    import torch.nn.functional as F

    from trainer.builtin.models import SmallCNN
    from trainer.runtime.health.straggler import Meter

    torch.manual_seed(0)
    x, y = torch.randn(32, 3, 28, 28), torch.randint(0, 10, (32,))

    def setup(metered: bool) -> Callable[[], float]:
        model = SmallCNN(3, 10, 28)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        meter = Meter(model, [opt], own=True, device=torch.device("cpu")) if metered else None
        done = [0]

        def run() -> float:
            began = time.perf_counter()
            for _ in range(block):
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                done[0] += 1
                if meter is not None and done[0] % 10 == 0:
                    meter.take(done[0])
            return (time.perf_counter() - began) / block
        run()  # warm-up: the allocator, AdamW's state
        return run

    plain, metered = setup(False), setup(True)
    got = pairs(rounds, metered, plain)
    return {"rounds": rounds, "block": block, "step_ms": spread([1000 * p for _, p in got]),
            "meter_vs_plain": spread([m / p for m, p in got]), "extra_us": spread([1e6 * (m - p) for m, p in got]),
            "command": f"python -m benchmarks.audit --only cost --cost-rounds {rounds}"}


def rank_pid(folder: Path, rank: int) -> int:
    return next(p for p, env, argv in processes() if env.get("RANK") == str(rank) and env.get("TORCHELASTIC_RUN_ID")
                and "trainer" in argv and str(folder) in " ".join(argv))


def first_step(proc: subprocess.Popen[str], folder: Path) -> None:
    while not events_of(folder, "first_step"):
        if proc.poll() is not None:
            raise RuntimeError("the run ended before its first step")
        time.sleep(0.05)


def pinned(proc: subprocess.Popen[str], folder: Path) -> dict[str, Any]:
    """Once the first step is done, rank r (and its loader workers) on core r, as ranks on their own GPUs or nodes
    are: on two shared cores, clean ranks differ by up to 1.45×, as much as the slowdown measured."""
    first_step(proc, folder)
    return {"pinned": [pin(rank_pid(folder, r), {r % (os.cpu_count() or 1)}) for r in (0, 1)]}


def slowed(proc: subprocess.Popen[str], folder: Path) -> dict[str, Any]:
    """Ranks pinned (``pinned``), then rank 1's process slowed 1.3× from outside until the straggler event (or the
    run's end): when that began and when it was named."""
    pins = pinned(proc, folder)
    began = time.time()
    with Throttle(rank_pid(folder, 1), *SLOWDOWN):
        while proc.poll() is None and not events_of(folder, "straggler"):
            time.sleep(0.05)
    named = events_of(folder, "straggler")
    return {"after_s": round(named[0]["t"] - began, 1) if named else None,
            "rank": named[0]["rank"] if named else None, "lost_s": named[0]["lost_s"] if named else None, **pins}


def detection(runs: int, tmp: Path) -> dict[str, Any]:
    found = [train(WORKLOAD, tmp, slowed)["during"] for _ in range(runs)]
    return {"runs": found, "slowdown": round(sum(SLOWDOWN) / SLOWDOWN[1], 2), "pinned": True,
            "command": f"python -m benchmarks.audit --only detection --detection-runs {runs}"}


def on_cluster(env: dict[str, str], tmp: Path) -> dict[str, Any]:
    """One clean 2-node job of the defaults on the dev cluster: its steps and straggler events."""
    folder = Path(tempfile.mkdtemp(dir=tmp)) / "run"
    out = subprocess.run([sys.executable, "-m", "cluster", "submit", "--cluster", "dev", "--launcher", "sbatch",
                          "--nodes", "2", "--", f"run.dir={folder}"], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True).stdout
    job = out.split("submitted job ")[1].split()[0]
    recovery.wait_until(lambda: (folder / "result.json").exists() and not subprocess.run(
        ["squeue", "-h", "-j", job], env=env, capture_output=True, text=True).stdout.strip(), 1800, f"job {job} to end")
    result = json.loads((folder / "result.json").read_text())
    return {"steps": result["global_step"], "stragglers": events_of(folder, "straggler")}


def clean(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"runs": len(runs), "steps": sum(r["global_step"] for r in runs),
            "events": [e for r in runs for e in r["stragglers"]],
            "step_ms": spread([1000 * r["train_time_s"] / r["global_step"] for r in runs])}


def workload(runs: int, tmp: Path) -> dict[str, Any]:
    """Clean runs of the detection workload, pinned as the detection runs are: what the rule sees without a fault."""
    return {**clean([train(WORKLOAD, tmp, pinned) for _ in range(runs)]), "pinned": True,
            "command": f"python -m benchmarks.audit --only workload --workload-runs {runs}"}


def alarms(runs: int, cluster_runs: int, tmp: Path) -> dict[str, Any]:
    local = clean([train([], tmp) for _ in range(runs)])
    env = dev_cluster_env()
    cluster = [on_cluster(env, tmp) for _ in range(cluster_runs)] if env else []
    return {"local": local,
            "cluster": {"runs": len(cluster), "steps": sum(r["steps"] for r in cluster),
                        "events": [e for r in cluster for e in r["stragglers"]]} if env else None,
            "command": f"python -m benchmarks.audit --only alarms --alarm-runs {runs} --cluster-runs {cluster_runs}"}


def section(r: dict[str, Any] | None) -> list[str]:
    out = ["## 12. Audits: slow ranks and silent corruption", ""]
    if not r or "overhead" not in r:
        return out + ["Not measured yet: `python -m benchmarks.audit`.", ""]
    o, d, a = r["overhead"], r.get("detection"), r.get("alarms")
    out += [f"Measured on {r['machine']['cpu']} ({r['machine']['cores']} cores), the built-in trainer on 2 gloo "
            "processes; each part's command and date below.", "", "| what | figure | measured by |", "|---|---|---|",
            f"| training rate, audits at their defaults ÷ both off ({o['pairs']} interleaved pairs, {o['size']} "
            f"samples, a save every 50 steps{', ranks pinned' if o.get('pinned') else ''}) | "
            f"{show(o['on_vs_off'], '{:.3f}×')} | `{o['command']}`, {o['date']} |",
            f"| training rate, replay audit every 100 steps ÷ without it (the same setting) | "
            f"{show(o['replay_vs_not'], '{:.3f}×')} | the same |"]
    if r.get("cost"):
        c = r["cost"]
        step = show(c["step_ms"], "{:.2f} ms")
        out.append(f"| the straggler meter's own cost per step, one process (the default model's {step} step, "
                   f"{c['rounds']} interleaved pairs of {c['block']}-step blocks) | {show(c['meter_vs_plain'], '{:.3f}×')}, "
                   f"{show(c['extra_us'], '{:+.0f} µs')} | `{c['command']}`, {c['date']} |")
    if d:
        each = "; ".join(f"rank {x['rank']} after {x['after_s']} s" if x["after_s"] is not None else "not named"
                         for x in d["runs"])
        pins = ", each rank on a core of its own" if d.get("pinned") else ""
        out.append(f"| rank 1 slowed {d['slowdown']}× from outside from its first step (`{' '.join(WORKLOAD)}`, "
                   f"{len(d['runs'])} runs, the detector's defaults{pins}): named | {each} | `{d['command']}`, {d['date']} |")
    if a:
        loc, cl = a["local"], a["cluster"]
        heavy = r.get("workload") or a["workload"]  # its own part since the ranks are pinned for it
        out.append(f"| straggler events in {loc['runs']} clean `make train` runs ({loc['steps']:,} steps, "
                   f"{show(loc['step_ms'], '{:.0f} ms')} a step) | {len(loc['events'])} | `{a['command']}`, {a['date']} |")
        pins = ", pinned as those" if heavy.get("pinned") else ""
        out.append(f"| straggler events in {heavy['runs']} clean runs of the detection workload ({heavy['steps']:,} "
                   f"steps, {show(heavy['step_ms'], '{:.0f} ms')} a step{pins}) | {len(heavy['events'])} | "
                   + (f"`{heavy['command']}`, {heavy['date']} |" if "command" in heavy else "the same |"))
        out.append(f"| straggler events in {cl['runs']} clean 2-node runs of the defaults on the dev cluster "
                   f"({cl['steps']:,} steps) | {len(cl['events'])} | the same |" if cl else
                   "| clean 2-node runs on the dev cluster | not measured: the dev cluster was down | |")
        if heavy["events"]:
            named = ", ".join(f"rank {e['rank']} at {e['ratio']}×" for e in heavy["events"])
            pinned_too = (", each on a core of its own (the two virtual CPUs themselves differ: which rank is slower "
                          "changes from run to run)") if heavy.get("pinned") else ""
            out += ["", f"The clean runs of the detection workload named {named} (one node: no node blamed, reported "
                    f"only): two ranks of one clean run on this shared 2-vCPU machine differ by that much for 50 steps "
                    f"and more{pinned_too}, so here a 1.3× slowdown is inside the noise and is named only when it "
                    "stands out of it. A machine whose clean ranks agree within 1.1× is needed to show the 60 s goal."]
    return out + [
        "", "The rate ratio's spread is this machine's run-to-run noise as much as the audits' cost: each pair's two "
        "runs differ only in `audit.straggler_steps=0 audit.replicas_every_steps=-1` (or `audit.replay_every_steps="
        "100`). What the straggler audit adds per step is a clock read at each gradient hook that arrives last, at "
        "the optimizer step and around the poll, one float per rank in the poll's all-reduce; the replica audit one "
        "pass over the parameters and one small gather at each save; a replay one forward and backward on every rank "
        "every 100 steps. The slowdown is put on from outside (a stopped process loses time wherever it is), so the "
        "detection figure is the whole path: the measure, the poll, the rule (`audit.straggler_steps=50` steps above "
        "`audit.straggler_ratio=1.2` and `audit.straggler_floor_ms=10`).", ""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(PARTS), help="parts to measure again (the rest are kept)")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--size", type=int, default=16384)
    parser.add_argument("--detection-runs", type=int, default=3)
    parser.add_argument("--cost-rounds", type=int, default=40)
    parser.add_argument("--alarm-runs", type=int, default=20)
    parser.add_argument("--workload-runs", type=int, default=5)
    parser.add_argument("--cluster-runs", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    a = parser.parse_args()
    stored = a.out / "benchmarks-audit.json"
    r = json.loads(stored.read_text()) if stored.exists() else {}
    r = r if "overhead" in r else {}  # a file of the former layout: measured again whole
    only = set(a.only.split(",")) if r else set(PARTS)
    if only - set(PARTS):
        parser.error(f"--only: unknown part(s) {sorted(only - set(PARTS))}; HINT: choose from {','.join(PARTS)}")
    with tempfile.TemporaryDirectory() as tmp:
        for part, measure in (("overhead", lambda: overhead(a.pairs, a.size, Path(tmp))),
                              ("cost", lambda: meter_cost(a.cost_rounds)),
                              ("detection", lambda: detection(a.detection_runs, Path(tmp))),
                              ("workload", lambda: workload(a.workload_runs, Path(tmp))),
                              ("alarms", lambda: alarms(a.alarm_runs, a.cluster_runs, Path(tmp)))):
            if part in only:
                r[part] = {**measure(), "date": time.strftime("%Y-%m-%d")}
    r["machine"] = machine()
    publish(a.out, "audit", r, section(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
