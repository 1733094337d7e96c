"""A job's life on the dev cluster: ten random faults (ranks SIGKILLed, ranks SIGSTOPped from outside, preemptions)
against the same job without faults; the result must be the same, and the goodput at least 90 % of the fault-free
run's. The job holds a spare node (``spare_nodes=1``, ``max_failures=12``) and takes memory snapshots; with
``--regroup`` (both jobs ``regroup=true``) a lost or stuck rank's survivors go on in place, a warm spare joining.

``python -m benchmarks.life [--regroup]`` (about 25 minutes on 2 cores) writes docs/benchmarks-life.json (or
benchmarks-life-regroup.json) and section 10 of docs/benchmarks.md, which shows both.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, dev_cluster_env, machine, publish
from benchmarks.procfs import STIME, UTIME, processes, stat
from benchmarks.recovery import events_of, wait_until
from trainer.runtime.records.attempts import attempts, figures, recoveries

ARGS = ["data.synthetic_train_size=8192", "data.synthetic_test_size=256", "data.num_workers=0", "train.epochs=8",
        "train.log_every=50", "tracking.mode=disabled", "checkpoint.every_steps=100", "checkpoint.poll_steps=1",
        "dist.heartbeat_timeout_s=6"]
FAULTS = "step_delay_s=0.25"
KINDS = ["kill"] * 5 + ["stop"] * 2 + ["preempt"] * 3


def _env() -> dict[str, str]:
    env = dev_cluster_env()
    if env is None:
        raise RuntimeError("the dev cluster is down (make dev-cluster)")
    return {**env, "TRAINER_CHECKSUM": "1", "TRAINER_FAULTS": FAULTS}


def _submit(run: Path, env: dict[str, str], regroup: bool) -> str:
    sets = ["spare_nodes=1", "max_failures=12", "time_min=120", *(["regroup=true"] if regroup else [])]
    out = subprocess.run([sys.executable, "-m", "cluster", "submit", "--cluster", "dev", "--launcher", "sbatch",
                          *(a for s in sets for a in ("--set", s)), "--", *ARGS, f"run.dir={run}"], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True)
    return out.stdout.split("submitted job ")[1].split()[0]


def _cpu_s(pid: int) -> float:
    fields = stat(pid)
    if fields is None:
        return -1.0
    return (int(fields[UTIME]) + int(fields[STIME])) / os.sysconf("SC_CLK_TCK")


def _training(job: str) -> list[tuple[int, str]]:
    """(pid, node) of each process training in the job now, by pid: a trainer process whose CPU time grows (a warm
    spare waits without using any, a stopped rank cannot), whatever rank it has become after regroups."""
    found = {pid: env.get("SLURMD_NODENAME", "?") for pid, env, argv in processes()
             if env.get("SLURM_JOB_ID") == job and "python" in Path(argv[0]).name and argv[1:3] == ["-m", "trainer"]}
    before = {pid: _cpu_s(pid) for pid in found}
    time.sleep(0.5)
    return [(pid, found[pid]) for pid in sorted(found) if _cpu_s(pid) > before[pid] >= 0]


def _progress(run: Path) -> tuple[int, int]:
    """(attempts so far, steps the newest one trained past its start)."""
    ev = events_of(run)
    starts = [e for e in ev if e["event"] == "attempt"]
    if not starts:
        return 0, 0
    last = starts[-1]
    done = max((e["step"] for e in ev if e["event"] == "progress" and e["t"] > last["t"]), default=0)
    return len(starts), max(0, done - int(last["resumed_step"]))


def faulted(run: Path, env: dict[str, str], seed: int, regroup: bool) -> list[dict[str, Any]]:
    """Submit the job and hit it with the ten faults, each after a random number of steps of the attempt before."""
    rng = random.Random(seed)
    kinds = rng.sample(KINDS, len(KINDS))
    job = _submit(run, env, regroup)
    done: list[dict[str, Any]] = []
    for kind in kinds:
        count = _progress(run)[0] or 1
        gap = rng.randint(20, 120)
        wait_until(lambda count=count, gap=gap: _progress(run)[0] >= count and _progress(run)[1] >= gap,  # type: ignore[misc]
              900, f"{gap} steps before fault {len(done) + 1}")
        pick = rng.randint(0, 1)
        deadline, ranks = time.monotonic() + 60, _training(job)
        while len(ranks) < 2 and time.monotonic() < deadline:  # between two attempts: the next one's processes
            ranks = _training(job)
        pid, node = ranks[pick % len(ranks)] if ranks else (None, None)
        if kind == "preempt":
            subprocess.run(["scancel", "--signal=USR2", job], env=env, check=True)
        elif pid is not None:
            os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        done.append({"kind": kind, "process": pick, "node": node, "t": time.time(), "steps_before": gap})
        wait_until(lambda count=count: _progress(run)[0] > count or (run / "result.json").exists(), 900,  # type: ignore[misc]
              f"recovery from fault {len(done)}")
    wait_until(lambda: (run / "result.json").exists(), 1800, "the faulted job to end")
    return done


def measure(seed: int, tmp: Path, regroup: bool = False) -> dict[str, Any]:
    env = _env()
    env["TRAINER_SUSPECTS"] = str(tmp / "suspects.json")
    clean, hit = tmp / "clean", tmp / "faulted"
    _submit(clean, env, regroup)
    wait_until(lambda: (clean / "result.json").exists(), 3600, "the fault-free job to end")
    faults = faulted(hit, env, seed, regroup)
    results = {name: json.loads((run / "result.json").read_text()) for name, run in (("clean", clean), ("faulted", hit))}
    goodput = {name: figures(attempts(run))["goodput"] for name, run in (("clean", clean), ("faulted", hit))}
    ends = [e for e in events_of(hit) if e["event"] == "attempt_end"]
    return {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "seed": seed, "faults": faults,
            "same_result": results["clean"].get("param_checksums") == results["faulted"].get("param_checksums"),
            "outcome": results["faulted"].get("outcome"), "goodput": goodput,
            "goodput_ratio": goodput["faulted"] / goodput["clean"],
            "decisions": [(e["class"], e["decision"]) for e in ends], "recoveries": recoveries(attempts(hit)),
            "regroup": regroup, "command": f"python -m benchmarks.life --seed {seed}" + (" --regroup" if regroup else "")}


def _lines(r: dict[str, Any]) -> list[str]:
    """One measured job's life: outcome, goodput, verdicts, recoveries."""
    paths: dict[str, int] = {}
    for _, decision in r["decisions"]:
        paths[decision] = paths.get(decision, 0) + 1
    rec = r["recoveries"]
    inside = [x for x in rec if x["decision"] == "in place"]
    out = [f"- Outcome: {r['outcome']}; parameters equal to the fault-free run's: **{r['same_result']}**.",
           f"- Goodput: {100 * r['goodput']['faulted']:.1f} % with faults, {100 * r['goodput']['clean']:.1f} % "
           f"without: **{100 * r['goodput_ratio']:.1f} %** of the fault-free run's (target ≥ 90 %).",
           f"- Verdicts: {', '.join(f'{n} × {d}' for d, n in sorted(paths.items()))}."]
    if rec:
        out.append(f"- Recoveries from failures: {len(rec)}" + (f", {len(inside)} of them in place" if inside else "")
                   + f"; median {sorted(x['total_s'] for x in rec)[len(rec) // 2]:.2f} s from the last step (in "
                   "place: from the loss) to the next first step.")
    else:
        out.append("- No recovery from a failure recorded.")
    return out


def section(r: dict[str, Any] | None, regrouped: dict[str, Any] | None = None) -> list[str]:
    """Section 10 of docs/benchmarks.md: the job restarting its processes (``r``), and regrouping in place."""
    out = ["## 10. A job's life: ten random faults", ""]
    if r is None and regrouped is None:
        return out + ["Not measured yet: `python -m benchmarks.life [--regroup]` with the dev cluster up.", ""]
    first = r or regrouped
    assert first is not None
    kinds = {k: sum(f["kind"] == k for f in first["faults"]) for k in ("kill", "stop", "preempt")}
    out += ["The dev cluster: 2 training nodes and a spare (`spare_nodes=1`, `max_failures=12`), memory snapshots, "
            f"`{' '.join(ARGS)}`, `TRAINER_FAULTS={FAULTS}`; one job without faults, then the same job with "
            f"{len(first['faults'])} faults at random steps (the same seed, the same faults): {kinds['kill']} "
            f"processes SIGKILLed, {kinds['stop']} SIGSTOPped from outside, {kinds['preempt']} preemptions "
            "(`scancel --signal=USR2`).", ""]
    for name, got in (("Restarting every process", r), ("Regrouping in place (`regroup=true`: survivors go on, a "
                                                        "warm spare joins; a preemption still requeues)", regrouped)):
        if got is not None:
            out += [f"{name}: measured by `{got['command']}` on {got['date']} ({got['machine']['cpu']}, "
                    f"{got['machine']['cores']} cores).", "", *_lines(got), ""]
    if regrouped is not None:
        out += ["Where the regrouping job's time still goes: each preemption is a requeue (the job leaves its nodes: "
                "Slurm 22.05's queue wait and new processes, about 20 s each, section 11); a rank stopped from outside "
                "is given away only after the others' hang watchdog (`dist.heartbeat_timeout_s`), about 2 s more to "
                "see that its pulse in the store stood still, and its kill (`srun --overlap`). A kill whose victim "
                "was the last process of the attempt's own job step, while spares that had taken the other places "
                "trained on, no longer ends the attempt: the batch script waits while the store counts processes "
                "training.", ""]
    return out


def main() -> int:
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--regroup", action="store_true", help="both jobs regroup=true")
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    a = parser.parse_args()
    with tempfile.TemporaryDirectory() as t:
        results = measure(a.seed, Path(t), a.regroup)
    name = "life-regroup" if a.regroup else "life"
    other = a.out / f"benchmarks-{'life' if a.regroup else 'life-regroup'}.json"
    kept = json.loads(other.read_text()) if other.exists() else None
    publish(a.out, name, results, section(kept, results) if a.regroup else section(results, kept))
    return 0 if results["same_result"] and results["outcome"] == "finished" else 1


if __name__ == "__main__":
    sys.exit(main())
