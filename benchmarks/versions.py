"""The requeue path on each Slurm version the dev cluster runs (this machine's 22.05; 24.11 and 26.05 from Debian
roots): a 2-node job, one rank SIGKILLed, the verdict requeues it without that node; seconds from the failed
attempt's end (srun returned) to the next attempt's first step, by phase (trainer/runtime/records/attempts.py). Where the
version offers it and the cluster enables it (26.05 here), the job asked for an expedited requeue.

``python -m benchmarks.versions`` writes docs/benchmarks-versions.json and section 11 of docs/benchmarks.md; a version
whose cluster is down is left out (`make dev-cluster SLURM=24.11` starts one).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import dev_cluster_env, machine, show, spread, standalone
from benchmarks.recovery import slurm_run

VERSIONS = ("", "24.11", "26.05")
"""This machine's own Slurm, then the Debian roots' (slurm/dev-cluster-root.sh)."""


def measure(repeats: int, tmp: Path) -> dict[str, Any]:
    rows = []
    for version in VERSIONS:
        env = dev_cluster_env(version)
        if env is None:
            continue
        name = subprocess.run(["sinfo", "--version"], env=env, capture_output=True, text=True).stdout.split()[-1]
        runs = [slurm_run("requeue", tmp, env) for _ in range(repeats)]
        rows.append({"slurm": name, "runs": runs, "requeue": "expedited" if all(x["expedited"] for x in runs)
                     else "plain"})
    return {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "repeats": repeats, "rows": rows,
            "command": f"python -m benchmarks.versions --repeats {repeats}"}


def section(r: dict[str, Any] | None) -> list[str]:
    out = ["## 11. The requeue path on each Slurm version", ""]
    if not r or not r.get("rows"):
        return out + ["Not measured yet: `python -m benchmarks.versions` with the dev clusters up.", ""]
    out += [f"Measured by `{r['command']}` on {r['date']} ({r['machine']['cpu']}, {r['machine']['cores']} cores): "
            "a 2-node job on each version's dev cluster, one rank SIGKILLed after a checkpoint, requeued by the "
            "verdict; seconds from the failed attempt's end (srun returned) to the next attempt's first step, median "
            "(min–max), and the median of each phase. The dev clusters shorten the credential's life to 10 s, which "
            "a plain requeue waits out before the job may start again (Slurm's default: 120 s).", "",
            "| Slurm | requeue | end → first step (s) | verdict | queue | startup | restore | first step |",
            "|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        rec = [x["recovery"] for x in row["runs"] if x.get("recovery")]
        if not rec:
            continue
        ends = spread([x["verdict"] + x["queue"] + x["startup"] + x["restore"] + x["first_step"] for x in rec])
        phases = " | ".join(f"{statistics.median(x[k] for x in rec):.2f}"
                            for k in ("verdict", "queue", "startup", "restore", "first_step"))
        out.append(f"| {row['slurm']} | {row['requeue']} | {show(ends, '{:.1f}')} | {phases} |")
    return out + [""]


def main() -> int:
    return standalone("versions", measure, section, __doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
