"""A job's life on the dev cluster: ten random faults (ranks SIGKILLed, ranks SIGSTOPped from outside, preemptions)
against the same job without faults; the result must be the same, and the goodput at least 90 % of the fault-free
run's. The job holds a spare node (``spare_nodes=1``, ``max_failures=12``) and takes memory snapshots.

``python -m benchmarks.life`` (about 25 minutes on 2 cores) writes docs/benchmarks-life.json and section 10 of
docs/benchmarks.md.
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

from benchmarks.common import ROOT, dev_cluster_env, machine, processes, standalone
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


def _submit(run: Path, env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-m", "cluster", "submit", "--cluster", "dev", "--launcher", "sbatch",
                          "--set", "spare_nodes=1", "--set", "max_failures=12", "--set", "time_min=120", "--",
                          *ARGS, f"run.dir={run}"], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return out.stdout.split("submitted job ")[1].split()[0]


def _trainer(job: str, rank: int) -> int | None:
    """The pid of ``rank``'s trainer process in the job's live attempt."""
    for pid, env, argv in processes():
        if env.get("SLURM_JOB_ID") == job and env.get("SLURM_PROCID") == str(rank) and "python" in Path(argv[0]).name \
                and argv[1:3] == ["-m", "trainer"]:
            return pid
    return None


def _progress(run: Path) -> tuple[int, int]:
    """(attempts so far, steps the newest one trained past its start)."""
    ev = events_of(run)
    starts = [e for e in ev if e["event"] == "attempt"]
    if not starts:
        return 0, 0
    last = starts[-1]
    done = max((e["step"] for e in ev if e["event"] == "progress" and e["t"] > last["t"]), default=0)
    return len(starts), max(0, done - int(last["resumed_step"]))


def faulted(run: Path, env: dict[str, str], seed: int) -> list[dict[str, Any]]:
    """Submit the job and hit it with the ten faults, each after a random number of steps of the attempt before."""
    rng = random.Random(seed)
    kinds = rng.sample(KINDS, len(KINDS))
    job = _submit(run, env)
    done: list[dict[str, Any]] = []
    for kind in kinds:
        count = _progress(run)[0] or 1
        gap = rng.randint(20, 120)
        wait_until(lambda count=count, gap=gap: _progress(run)[0] >= count and _progress(run)[1] >= gap,  # type: ignore[misc]
              900, f"{gap} steps before fault {len(done) + 1}")
        rank = rng.randint(0, 1)
        deadline, pid = time.monotonic() + 60, _trainer(job, rank)
        while pid is None and time.monotonic() < deadline:  # between two attempts: the next one's process
            time.sleep(0.1)
            pid = _trainer(job, rank)
        if kind == "preempt":
            subprocess.run(["scancel", "--signal=USR2", job], env=env, check=True)
        elif pid is not None:
            os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        done.append({"kind": kind, "rank": rank, "t": time.time(), "steps_before": gap})
        wait_until(lambda count=count: _progress(run)[0] > count or (run / "result.json").exists(), 900,  # type: ignore[misc]
              f"recovery from fault {len(done)}")
    wait_until(lambda: (run / "result.json").exists(), 1800, "the faulted job to end")
    return done


def measure(seed: int, tmp: Path) -> dict[str, Any]:
    env = _env()
    env["TRAINER_SUSPECTS"] = str(tmp / "suspects.json")
    clean, hit = tmp / "clean", tmp / "faulted"
    _submit(clean, env)
    wait_until(lambda: (clean / "result.json").exists(), 3600, "the fault-free job to end")
    faults = faulted(hit, env, seed)
    results = {name: json.loads((run / "result.json").read_text()) for name, run in (("clean", clean), ("faulted", hit))}
    goodput = {name: figures(attempts(run))["goodput"] for name, run in (("clean", clean), ("faulted", hit))}
    ends = [e for e in events_of(hit) if e["event"] == "attempt_end"]
    return {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "seed": seed, "faults": faults,
            "same_result": results["clean"].get("param_checksums") == results["faulted"].get("param_checksums"),
            "outcome": results["faulted"].get("outcome"), "goodput": goodput,
            "goodput_ratio": goodput["faulted"] / goodput["clean"],
            "decisions": [(e["class"], e["decision"]) for e in ends], "recoveries": recoveries(attempts(hit)),
            "command": f"python -m benchmarks.life --seed {seed}"}


def section(r: dict[str, Any] | None) -> list[str]:
    out = ["## 10. A job's life: ten random faults", ""]
    if r is None:
        return out + ["Not measured yet: `python -m benchmarks.life` with the dev cluster up.", ""]
    kinds = {k: sum(f["kind"] == k for f in r["faults"]) for k in ("kill", "stop", "preempt")}
    paths: dict[str, int] = {}
    for _, decision in r["decisions"]:
        paths[decision] = paths.get(decision, 0) + 1
    out += [f"Measured by `{r['command']}` on {r['date']} ({r['machine']['cpu']}, {r['machine']['cores']} cores), "
            "the dev cluster: 2 training nodes and a spare (`spare_nodes=1`, `max_failures=12`), memory snapshots, "
            f"`{' '.join(ARGS)}`, `TRAINER_FAULTS={FAULTS}`; one job without faults, then the same job with "
            f"{len(r['faults'])} faults at random steps: {kinds['kill']} ranks SIGKILLed, {kinds['stop']} SIGSTOPped "
            f"from outside, {kinds['preempt']} preemptions (`scancel --signal=USR2`).", "",
            f"- Outcome: {r['outcome']}; parameters equal to the fault-free run's: **{r['same_result']}**.",
            f"- Goodput: {100 * r['goodput']['faulted']:.1f} % with faults, {100 * r['goodput']['clean']:.1f} % "
            f"without: **{100 * r['goodput_ratio']:.1f} %** of the fault-free run's (target ≥ 90 %).",
            f"- Verdicts: {', '.join(f'{n} × {d}' for d, n in sorted(paths.items()))}.",
            f"- Recoveries from failures: {len(r['recoveries'])}, median "
            f"{sorted(x['total_s'] for x in r['recoveries'])[len(r['recoveries']) // 2]:.1f} s from the last step to "
            "the next first step." if r["recoveries"] else "- No recovery from a failure recorded.", ""]
    return out


def main() -> int:
    return standalone("life", measure, section, __doc__ or "", option="seed", default=1)


if __name__ == "__main__":
    sys.exit(main())
