"""Recovery in place: a killed rank's survivors regroup without a new process, or a warm spare takes its place.

The session (``SESSION``): three ranks of ``tests/scripts/elastic_loop.py`` (an own loop on ``trainer.Session`` in the
documented ``except RuntimeError → sess.regroup`` pattern, a global batch, a checkpoint every 5 steps) on one
machine, rank 1 SIGKILLed from outside after step 12. Measured: the kill to the end of the first step after it, from
the run's events. The paths, interleaved run by run: in place on the two survivors, in place with a warm spare that
waited at the store (``TRAINER_SPARE``), and the restart every other path takes (the survivors fail, and three new
processes resume from the last checkpoint, as a restart in the allocation would: no Slurm here). Each under DDP and
under FSDP2 (``STRATEGIES``; a snapshot in node memory every 11 steps as well, which a sharded model goes back to).

The building block (``PATHS``): the store in a process of its own (``python -m trainer.store``), three ranks of
``tests/scripts/regroup_rank.py`` all-reducing in a loop on one machine, and one rank SIGKILLed from outside once
every rank has done 10 all-reduces; the survivors leave the failed group, join the next generation and go on
(``trainer/core/regroup.py``). Measured: the kill to each member's first all-reduce in the new group (wall clock), and
each survivor's own time from its failed collective to the new group. The paths, interleaved run by run:

- shrink: rank 0 (the store's usual host) is killed, the two others go on as a group of two;
- spare: rank 1 is killed, a spare process waiting at the store joins in its place (the group stays three).

``python -m benchmarks.regroup`` writes docs/benchmarks-regroup.json and section 14 of docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, clean_env, machine, show, spread, standalone
from trainer.store import start as start_store

SCRIPT = ROOT / "tests" / "scripts" / "regroup_rank.py"
LOOP = ROOT / "tests" / "scripts" / "elastic_loop.py"
SESSION = ("in place", "warm spare", "restart")
"""The session's paths (see the module docstring)."""
STRATEGIES = ("ddp", "fsdp")
"""The session's strategies: DDP (the survivors hold the state) and FSDP2 (the lost shard comes from a snapshot)."""
PATHS = {"shrink": (0, 0), "spare": (1, 1)}
"""Each path's (rank killed, spares waiting)."""


def one_run(path: str, folder: Path) -> dict[str, Any]:
    """One job of the path: the kill, then what every member that went on printed."""
    folder.mkdir(parents=True)
    lost, spares = PATHS[path]
    store, ports = start_store(folder / "port", env=clean_env(), cwd=ROOT)
    who = [*map(str, range(3)), *(f"spare:{3 + n}" for n in range(spares))]
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), "127.0.0.1", *map(str, ports), w, "3", str(folder)], cwd=ROOT,
                              env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for w in who]
    try:
        while len(list(folder.glob("ready.*"))) < 3 or len(list(folder.glob("spare.*"))) < spares:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a rank of the {path} run ended before the kill")
            time.sleep(0.02)
        os.killpg(procs[lost].pid, signal.SIGKILL)
        killed_at = time.time()
        members = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1])
                   for i, p in enumerate(procs) if i != lost]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        store.terminate()
        store.wait(timeout=60)
    return {"path": path, "world_after": members[0]["world"],
            "kill_to_first_collective_s": max(m["first_after"] for m in members) - killed_at,
            "regrouped_s": [m["regrouped_s"] for m in members if m["origin"] < 3]}


def _rank(run: Path, rank: int, port: int, extra: dict[str, str], strategy: str) -> subprocess.Popen[str]:
    """One process of the elastic loop, as srun starts one (``rank`` -1: a warm spare, in the lost rank 1's slot of
    the machine: a spare node would have its own)."""
    env = {**clean_env(), "RANK": str(max(rank, 0)), "LOCAL_RANK": str(rank if rank >= 0 else 1), "WORLD_SIZE": "3",
           "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "TRAINER_MEMORY_DIR": str(run.parent / "shm"), **extra}
    if rank < 0:
        env["TRAINER_SPARE"] = "0"
    # Snapshots every 11 steps: step 11's lies between the checkpoints of steps 10 and 15 (a step with a checkpoint
    # takes no snapshot), so the sharded regroup after step 12 has one newer than the checkpoint to go back to.
    sharded = ["dist.strategy=fsdp", "checkpoint.memory=on", "checkpoint.memory_every_steps=11"]
    args = ["tracking.mode=disabled", "run.report=false", "train.device=cpu", "checkpoint.every_steps=5",
            *(sharded if strategy == "fsdp" else []), f"run.dir={run}", "--pace", "0.05", "--stop", "40"]
    return subprocess.Popen([sys.executable, str(LOOP), *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def session_run(path: str, folder: Path, port: int, strategy: str = "ddp") -> dict[str, Any]:
    """One job of a session path: rank 1 killed after step 12; the kill to the end of the first step after it."""
    folder.mkdir(parents=True)
    run, store, extra = folder / "run", None, {}
    if path != "restart":
        store, (first, presence) = start_store(folder / "port", env=clean_env(), cwd=ROOT)
        extra = {"TRAINER_STORE": f"127.0.0.1:{first}:{presence}"}
    procs = [_rank(run, r, port, extra, strategy) for r in ([0, 1, 2, -1] if path == "warm spare" else [0, 1, 2])]
    try:
        spare = _client(extra) if path == "warm spare" else None  # killed only once the spare waits
        while not (run / "trace.jsonl").exists() or len((run / "trace.jsonl").read_text().splitlines()) < 12 or \
                (spare is not None and not int(spare.add("spares/count", 0))):
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a rank of the {path} run ended before the kill: {procs[0].communicate()[0]}")
            time.sleep(0.02)
        os.killpg(procs[1].pid, signal.SIGKILL)
        killed_at = time.time()
        rest = [p for i, p in enumerate(procs) if i != 1]
        for p in rest:
            p.communicate(timeout=300)
        if path == "restart":  # every process anew, from the last checkpoint
            again = [_rank(run, r, port + 1, {}, strategy) for r in range(3)]
            for p in again:
                p.communicate(timeout=300)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        if store:
            store.terminate()
            store.wait(timeout=60)
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    after = [e["t"] for e in events if e["event"] == "first_step" and e["t"] > killed_at]
    if not after:
        raise RuntimeError(f"the {path} run has no step after the kill: {[e['event'] for e in events]}")
    first_step = min(after)
    regroup = [e for e in events if e["event"] == "regroup"]
    resumed = [e for e in events if e["event"] == "attempt" and e["t"] > killed_at]
    return {"path": path, "strategy": strategy, "kill_to_first_step_s": first_step - killed_at,
            "regroup_s": regroup[0]["total_s"] if regroup else None,
            "again": regroup[0].get("again", 0) if regroup else (12 - resumed[0]["resumed_step"] if resumed else None),
            "finished": (run / "result.json").exists()}


def _paired(runs: list[dict[str, Any]], slow: str, fast: str, strategy: str = "ddp") -> list[float]:
    """``slow``'s time ÷ ``fast``'s within each repeat (the runs in measure's order: every path once per repeat)."""
    runs = [x for x in runs if x.get("strategy", "ddp") == strategy]
    per = len(SESSION)
    repeats = [runs[i:i + per] for i in range(0, len(runs) - per + 1, per)]
    times = [{x["path"]: x["kill_to_first_step_s"] for x in r} for r in repeats]
    return [t[slow] / t[fast] for t in times if slow in t and fast in t]


def _client(extra: dict[str, str]) -> Any:
    """A client of the store TRAINER_STORE names."""
    import torch.distributed as dist

    host, port, _ = extra["TRAINER_STORE"].split(":")
    return dist.TCPStore(host, int(port), is_master=False)  # type: ignore[attr-defined]


def measure(repeats: int, tmp: Path) -> dict[str, Any]:
    runs = [one_run(path, tmp / f"{path}-{i}") for i in range(repeats) for path in
            (PATHS if i % 2 == 0 else reversed(PATHS))]
    base = 20000 + os.getpid() % 5000
    session = [session_run(path, tmp / f"session-{i}-{k}-{j}", base + 10 * (6 * i + 3 * k + j), strategy)
               for i in range(repeats) for k, strategy in enumerate(STRATEGIES)
               for j, path in enumerate(SESSION if i % 2 == 0 else reversed(SESSION))]
    return {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "repeats": repeats, "runs": runs,
            "session": session, "command": f"python -m benchmarks.regroup --repeats {repeats}"}


def section(r: dict[str, Any]) -> list[str]:
    """Section 14 of docs/benchmarks.md."""
    m = r["machine"]
    out = ["## 14. Recovery in place: survivors regroup, a warm spare joins", "",
           f"Measured by `{r['command']}` on {r['date']} ({m['cpu']}, {m['cores']} cores, one machine): three gloo "
           "ranks all-reducing in a loop on a store in a process of its own (`python -m trainer.store`), one SIGKILLed "
           "from outside; the survivors regroup in place (`trainer/core/regroup.py`, the building block under "
           "`Session.regroup`). Milliseconds, median (min–max) over the runs, the paths interleaved.", "",
           "| path | rank killed | ranks after | kill → every member's first collective in the new group (ms) | "
           "a survivor's failed collective → its new group (ms) |", "|---|---|---|---|---|"]
    for path, (lost, _) in PATHS.items():
        rows = [x for x in r["runs"] if x["path"] == path]
        kill = spread([1000 * x["kill_to_first_collective_s"] for x in rows])
        own = spread([1000 * s for x in rows for s in x["regrouped_s"]])
        out.append(f"| {path} | {lost} | {rows[0]['world_after']} | {show(kill, '{:.0f}')} | {show(own, '{:.0f}')} |")
    out += ["", "A lost rank is known the moment its process ends: its presence connection to the store process closes "
            "(no timeout, no beat to miss; TCP keepalive for a node that vanishes, about 5 s).", ""]
    return out + session_section(r.get("session", []))


def session_section(runs: list[dict[str, Any]]) -> list[str]:
    """Section 14's table of the session's paths (none: nothing)."""
    if not runs:
        return []
    out = ["The session, end to end (`Session.regroup` in an own loop, tests/scripts/elastic_loop.py: a global "
            "batch, a checkpoint every 5 steps; under FSDP2 a snapshot in node memory every 11 steps too): three "
            "processes on one machine, rank 1 SIGKILLed from outside after step 12. Seconds from the kill to the end of "
            "the first step after it (its `first_step` event), median (min–max), the paths interleaved; the regroup's "
            "own time is its `regroup` event's `total_s` (DDP: the group left, the new one made, DDP made again, the "
            "step agreed, the state sent to a spare, the parts rebuilt; FSDP2: FSDP taken off the model, the new group, "
            "the model sharded on it, step 11's snapshot loaded from node memory). *Steps again*: steps trained before "
            "the kill that are trained again (each path goes back to the newest of step 10's checkpoint and, under FSDP2, "
            "step 11's snapshot; DDP in place to none).",
            "", "| strategy | path | processes after | kill → first step done (s) | the regroup itself (ms) | steps "
            "again | finished |", "|---|---|---|---|---|---|---|"]
    for strategy in STRATEGIES:
        for path in SESSION:
            rows = [x for x in runs if x["path"] == path and x.get("strategy", "ddp") == strategy]
            if not rows:
                continue
            kill = spread([x["kill_to_first_step_s"] for x in rows])
            took = show(spread([1000 * x["regroup_s"] for x in rows]), "{:.0f}") if rows[0]["regroup_s"] else "–"
            again = [x["again"] for x in rows if x.get("again") is not None]
            after = {"in place": 2, "warm spare": 3, "restart": 3}[path]
            out.append(f"| {strategy} | {path} | {after} | {show(kill, '{:.2f}')} | {took} | "
                       f"{show(spread(again), '{:.0f}') if again else '–'} | {sum(x['finished'] for x in rows)} of "
                       f"{len(rows)} |")
    for strategy in STRATEGIES:
        ratios = _paired(runs, "restart", "in place", strategy)
        if ratios:
            out += ["", f"{strategy}: restart ÷ in place, paired run by run (each repeat runs every path once): "
                        f"{show(spread(ratios), '{:.0f}')}×."]
    out += ["", "The restart here is the cheapest one there is (no Slurm, no queue, the processes on the same machine, "
            "the checkpoint on a local disk): its time is detection, new interpreters importing torch and the loop, "
            "a new group and the restore. On the dev cluster, the built-in trainer's jobs with `regroup: true` side by "
            "side with the restarts, torchrun's included: section 8 (and tests/test_healing*.py on Slurm 22.05, 24.11 "
            "and 26.05).", ""]
    return out


def main() -> int:
    return standalone("regroup", measure, section, __doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
