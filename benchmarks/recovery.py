"""Recovery from a killed rank on the dev cluster, by path, and the floor any restart pays.

Each run: the built-in trainer on 2 nodes (durable saves every 10 steps, memory snapshots every 2), one rank
SIGKILLed from outside once a snapshot newer than the last save exists; measured from the run's events: the kill to
the first step of the next attempt, and that recovery's phases (trainer/runtime/records/attempts.py ``recoveries``).

- requeue: a plain 2-node job (no snapshots: the next allocation restores from the durable checkpoint);
- spare: ``spare_nodes=1``, the next attempt starts at once on the spare, restoring from node memory;
- shrink: ``NODES=2-3`` started on 3 nodes goes on with 2, restoring from node memory;
- in place: ``regroup=true`` on 3 nodes: the two survivors go on in their own processes (no process started);
- warm spare: ``regroup=true`` with ``spare_nodes=1``: a process waiting on the spare node takes the lost one's place;
- torchrun: its own restart of its workers (``--max-restarts=1``, one machine, the same trainer restoring from
  memory) after the same kill: new processes, a rendezvous, a restore, and nothing else.

Each round runs every path once, in an order that turns from round to round; the ratios pair the paths of a round.

``python -m benchmarks.recovery`` writes docs/benchmarks-recovery.json and section 8 of docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, clean_env, dev_cluster_env, each, machine, show, spread, standalone
from benchmarks.procfs import processes
from trainer.runtime.records.attempts import IN_PLACE, PHASES, attempts, recoveries

ARGS = ["data.synthetic_train_size=1024", "data.synthetic_test_size=256", "data.num_workers=0", "train.epochs=2",
        "train.log_every=8", "tracking.mode=disabled", "checkpoint.every_steps=10", "checkpoint.memory_every_steps=2",
        "checkpoint.poll_steps=1"]
FAULTS = "step_delay_s=0.3"
PATHS = {"spare": ["--set", "spare_nodes=1"], "shrink": ["--nodes", "2-3"], "requeue": [],
         "in place": ["--nodes", "3", "--set", "regroup=true"],
         "warm spare": ["--set", "spare_nodes=1", "--set", "regroup=true"]}
"""The dev cluster's paths: the command line of each job's ``cluster submit``."""
RESTARTS = ("spare", "shrink", "requeue", "torchrun")
IN_PLACE_PATHS = ("in place", "warm spare")


def events_of(run: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def ready(run: Path, memory: bool) -> bool:
    """The first attempt has a snapshot newer than its last durable save (without snapshots: a save and 2 steps)."""
    ev = events_of(run)
    saved = max((e["step"] for e in ev if e["event"] == "checkpoint"), default=0)
    if not saved:
        return False
    if memory:
        return any(e["event"] == "snapshot" and e["step"] > saved for e in ev)
    return any(e["event"] == "progress" and e["step"] >= saved + 2 for e in ev)


def kill(match: Callable[[dict[str, str]], bool]) -> float:
    """SIGKILL the one trainer process whose environment matches (never a waiting warm spare); the time of the kill."""
    for pid, env, argv in processes():
        module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else None  # torchrun's workers run python -u -m
        if "python" in Path(argv[0]).name and module == "trainer" and "TRAINER_SPARE" not in env and match(env):
            os.kill(pid, signal.SIGKILL)
            return time.time()
    raise RuntimeError("no trainer process to kill")


def measured(run: Path, killed_at: float) -> dict[str, Any]:
    """Kill → the next attempt's first step, and the recovery's phases."""
    first = min(e["t"] for e in events_of(run) if e["event"] == "first_step" and e["t"] > killed_at)
    found = recoveries(attempts(run))
    return {"kill_to_first_step_s": first - killed_at, "recovery": found[-1] if found else None}


def slurm_run(path: str, tmp: Path, env: dict[str, str]) -> dict[str, Any]:
    """One job on the dev cluster along ``path``; its kill → first step and phases."""
    run = Path(tempfile.mkdtemp(dir=tmp)) / "run"
    sets = PATHS[path]
    memory = path != "requeue"
    args = [*ARGS, f"run.dir={run}", f"checkpoint.memory={'on' if memory else 'off'}"]
    # Every node idle first: a node still completing the last job would start NODES=2-3 on 2 nodes (no shrink).
    wait_until(lambda: set(subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True,
                                          text=True).stdout.split()) == {"idle"}, 60, "idle nodes")
    # Its own suspects list: the runs kill the same rank again and again, which would make its node suspect.
    own = {**env, "TRAINER_FAULTS": FAULTS, "TRAINER_SUSPECTS": str(run.parent / "suspects.json")}
    out = subprocess.run([sys.executable, "-m", "cluster", "submit", "--cluster", "dev", "--launcher", "sbatch", *sets,
                          "--", *args], cwd=ROOT, env=own, capture_output=True, text=True, check=True).stdout
    job = out.split("submitted job ")[1].split()[0]
    shown = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True).stdout
    wait_until(lambda: ready(run, memory), 240, f"job {job}'s first snapshot")
    killed_at = kill(lambda e: e.get("SLURM_JOB_ID") == job and e.get("SLURM_PROCID") == "1")
    wait_until(lambda: (run / "result.json").exists(), 300, f"job {job} to finish")
    got = measured(run, killed_at)
    want = {"shrink": "restart_here", "in place": "in place", "warm spare": "in place"}.get(path)
    if want and (got["recovery"] or {}).get("decision") != want:
        raise RuntimeError(f"job {job} took another path than {path}: {got['recovery']}")
    return {"path": path, "job": job, "expedited": "ExpeditedRequeue=Yes" in shown, **got}


def torchrun_run(tmp: Path) -> dict[str, Any]:
    """The same training under a local torchrun that restarts its workers after the kill."""
    run = Path(tempfile.mkdtemp(dir=tmp)) / "run"
    env = {**clean_env(), "TRAINER_FAULTS": FAULTS, "TRAINER_MEMORY_DIR": str(run.parent / "shm")}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             "--max-restarts=1", "-m", "trainer", *ARGS, f"run.dir={run}", "checkpoint.memory=on"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: ready(run, True), 240, "torchrun's first snapshot")
        killed_at = kill(lambda e: e.get("RANK") == "1" and "TORCHELASTIC_RUN_ID" in e)
        if proc.wait(timeout=300):
            raise RuntimeError(f"torchrun ended with {proc.returncode}")
    finally:
        proc.kill()
    return {"path": "torchrun", **measured(run, killed_at)}


def wait_until(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def measure(repeats: int, tmp: Path) -> dict[str, Any]:
    """``repeats`` rounds of every path, the order turning by one each round; ratios within each round."""
    env = dev_cluster_env()
    if env is None:
        return {"skipped": "the dev cluster is down (make dev-cluster)"}
    order = ["spare", "torchrun", "in place", "shrink", "warm spare", "requeue"]
    rounds: list[dict[str, dict[str, Any]]] = []
    for i in range(repeats):
        turned = order[i % len(order):] + order[:i % len(order)]
        rounds.append({p: torchrun_run(tmp) if p == "torchrun" else slurm_run(p, tmp, env) for p in turned})

    def ratio(a: str, b: str) -> dict[str, Any]:
        return spread([r[a]["kill_to_first_step_s"] / r[b]["kill_to_first_step_s"] for r in rounds])

    return {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "repeats": repeats,
            "runs": [{**run, "round": i} for i, r in enumerate(rounds) for run in r.values()],
            "spare_vs_torchrun": ratio("spare", "torchrun"), "torchrun_vs_in_place": ratio("torchrun", "in place"),
            "torchrun_vs_warm_spare": ratio("torchrun", "warm spare"),
            "command": f"python -m benchmarks.recovery --repeats {repeats}"}


def _rows(r: dict[str, Any], paths: tuple[str, ...], phases: tuple[str, ...]) -> list[str]:
    """One table row per path: kill → first step, the median of each phase, where from, steps recomputed."""
    out = []
    for path in paths:
        rows = [x for x in r["runs"] if x["path"] == path]
        if not rows:
            continue
        rec = [x["recovery"] for x in rows if x["recovery"]]
        cells = " | ".join(f"{statistics.median(x[k] for x in rec):.2f}" if rec else "-" for k in phases)
        where = (rec[0]["restored_from"] or "the survivors' memory") if rec else "-"
        steps = statistics.median(x["recomputed_steps"] for x in rec) if rec else "-"
        out.append(f"| {path} | {where} | {show(spread([x['kill_to_first_step_s'] for x in rows]), '{:.2f}')} | "
                   f"{cells} | {steps} |")
    return out


def _ratio(r: dict[str, Any], key: str, what: str) -> str:
    ratio = r.get(key)
    return f"- {what}: **{show(ratio)}** (rounds: {each(ratio)})" if ratio else ""


def section(r: dict[str, Any] | None) -> list[str]:
    """Section 8 of docs/benchmarks.md."""
    out = ["## 8. Recovery from a killed rank", ""]
    if r is None or "skipped" in r:
        return out + [f"Not measured: {r['skipped'] if r else 'run python -m benchmarks.recovery'}.", ""]
    m = r["machine"]
    head = "| path | restored from | kill → first step (s) | "
    out += [f"Measured by `{r['command']}` on {r['date']} ({m['cpu']}, {m['cores']} cores): the dev cluster's jobs "
            "(every node a slurmd on this one machine), one rank SIGKILLed from outside after a memory snapshot "
            "newer than the last durable save; seconds from the kill to the first step after it, median (min–max) "
            "over the runs, and the median of each phase (trainer/runtime/records/attempts.py). Each round runs "
            "every path once, the order turning by one from round to round.", "",
            "Recovery in place (`regroup: true`; no process started, no file read). *in place*: 3 nodes, the two "
            "survivors go on; *warm spare*: 2 nodes and a spare node whose waiting process takes the lost one's "
            "place (the world size kept). Goals: ≤ 1.0 s in place, ≤ 1.5 s with a warm spare, at least 4× faster "
            "than torchrun's restart, at most 1 step recomputed.", "",
            head + " | ".join(IN_PLACE) + " | steps recomputed |", "|---|---|---|" + "---|" * len(IN_PLACE) + "---|",
            *_rows(r, IN_PLACE_PATHS, IN_PLACE), "",
            "Restarts (every process started again): *spare* (`spare_nodes=1`), *shrink* (`NODES=2-3` started on 3), "
            "*requeue* (a plain 2-node job, no snapshots), *torchrun* (`--max-restarts=1`, one machine).", "",
            head + " | ".join(PHASES) + " | steps recomputed |", "|---|---|---|" + "---|" * len(PHASES) + "---|",
            *_rows(r, RESTARTS, PHASES), ""]
    lines = [_ratio(r, "torchrun_vs_in_place", "torchrun's restart ÷ in place"),
             _ratio(r, "torchrun_vs_warm_spare", "torchrun's restart ÷ warm spare"),
             _ratio(r, "spare_vs_torchrun", "spare node's restart ÷ torchrun's restart")]
    out += [x for x in lines if x] + [
        "", "torchrun's restart is the floor any restart pays (new processes, a rendezvous, a restore); a spare "
        "node's restart adds srun's own teardown of the step, the verdict, and a new job step. In place, the "
        "survivors keep their processes, their model and optimizer in memory, and their loaders' position.", ""]
    return out


def main() -> int:
    return standalone("recovery", measure, section, __doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
