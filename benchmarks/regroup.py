"""Recovery in place: a killed rank's survivors regroup without a new process, or a warm spare takes its place.

Each run: the store in a process of its own (``python -m trainer.store``), three ranks of
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


def measure(repeats: int, tmp: Path) -> dict[str, Any]:
    runs = [one_run(path, tmp / f"{path}-{i}") for i in range(repeats) for path in
            (PATHS if i % 2 == 0 else reversed(PATHS))]
    return {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "repeats": repeats, "runs": runs,
            "command": f"python -m benchmarks.regroup --repeats {repeats}"}


def section(r: dict[str, Any]) -> list[str]:
    """Section 14 of docs/benchmarks.md."""
    m = r["machine"]
    out = ["## 14. Recovery in place: survivors regroup, a warm spare joins", "",
           f"Measured by `{r['command']}` on {r['date']} ({m['cpu']}, {m['cores']} cores, one machine): three gloo "
           "ranks all-reducing in a loop on a store in a process of its own (`python -m trainer.store`), one SIGKILLed "
           "from outside; the survivors regroup in place (`trainer/core/regroup.py`, a building block the session "
           "does not use yet). Milliseconds, median (min–max) over the runs, the paths interleaved.", "",
           "| path | rank killed | ranks after | kill → every member's first collective in the new group (ms) | "
           "a survivor's failed collective → its new group (ms) |", "|---|---|---|---|---|"]
    for path, (lost, _) in PATHS.items():
        rows = [x for x in r["runs"] if x["path"] == path]
        kill = spread([1000 * x["kill_to_first_collective_s"] for x in rows])
        own = spread([1000 * s for x in rows for s in x["regrouped_s"]])
        out.append(f"| {path} | {lost} | {rows[0]['world_after']} | {show(kill, '{:.0f}')} | {show(own, '{:.0f}')} |")
    out += ["", "A lost rank is known the moment its process ends: its presence connection to the store process closes "
            "(no timeout, no beat to miss; TCP keepalive for a node that vanishes, about 5 s). Not paid here: the "
            "5.5-6.3 s of start-up in every path of section 8. Not in these figures: moving a real model's state to "
            "the spare (a broadcast of parameters and optimizer state), and the session's own part (DDP's group, the "
            "loader's global batch, rank 0's duties, the last complete step), which is issue 49's next step.", ""]
    return out


def main() -> int:
    return standalone("regroup", measure, section, __doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
