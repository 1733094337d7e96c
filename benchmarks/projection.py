"""Effective training time at 1,024 and 16,384 GPUs, projected per recovery path from the measured recovery phases
(docs/benchmarks-recovery.json, the dev cluster) and stated, sourced assumptions for what this machine cannot show.

Effective training time (ETTR) = 1 − durable-save overhead − snapshot overhead − (R + W) / M: M the job's mean time
to failure, R a recovery's downtime (detection to the next first step), W the work recomputed (half the interval
of what the restart restores from), each interval Young/Daly's √(2·stall·M) as the runtime's own cadences choose
it. ``python -m benchmarks.projection`` writes section 9 of docs/benchmarks.md; `make bench` runs it too.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, splice

MEAN_TIME_TO_FAILURE_H = {1024: 7.9, 16384: 1.8}
"""Kokolis et al., "Revisiting Reliability in Large-Scale Machine Learning Research Clusters", HPCA 2025 (Meta's
RSC clusters): a job's mean time to failure at 1,024 and 16,384 GPUs."""


@dataclass(frozen=True)
class Assumption:
    value: float
    unit: str
    what: str
    source: str


AT_SCALE = {
    "state_gb_per_gpu": Assumption(1.0, "GB", "model + optimizer state per GPU (sharded)",
                                   "e.g. a 405B-parameter model with Adam (16 B/parameter) over 6,500 GPUs"),
    "d2h_gb_s": Assumption(20.0, "GB/s", "device → pinned host copy per GPU",
                           "H100 on PCIe Gen5 (64 GB/s peak), a third of it; §4 measures ours on an H200"),
    "node_net_gb_s": Assumption(25.0, "GB/s", "node → node for a partner copy or a spare's fetch (gloo over TCP)",
                                "one 200 Gb/s NIC's worth"),
    "gpus_per_node": Assumption(8, "", "GPUs per node", "HGX H100"),
    "in_memory": Assumption(0.9, "", "share of failures one node's loss explains (its partner keeps a copy)",
                            "assumed; the rest (two neighbours, the allocation, the file system) restore from disk"),
    "in_place": Assumption(0.9, "", "share of failures the survivors recover in place (one node's loss, as above)",
                           "assumed as in_memory; the rest restart in the allocation from the durable checkpoint"),
    "nccl_init_s": Assumption(15.0, "s", "a new NCCL communicator over every GPU (the regrouped survivors)",
                              "startup_s less the imports assumed there"),
    "detection_s": Assumption(30.0, "s", "a failure noticed: a lost peer within seconds, a dead node at the hang "
                              "watchdog (dist.heartbeat_timeout_s=60 for 5 s steps)", "assumed half and half"),
    "startup_s": Assumption(45.0, "s", "interpreters, torch and NCCL communicators at this size",
                            "NVIDIA/nccl#1789: NCCL's init reaches tens of seconds only near 100K GPUs; imports from a "
                            "shared file system on every node: 30 s assumed"),
    "step_s": Assumption(5.0, "s", "one training step (the first step after a restart)", "assumed"),
    "durable_stall_s": Assumption(1.0, "s", "an asynchronous durable save's stall (the copy to host buffers)",
                                  "§2: an async save stalls ≤ 10 % of a synchronous one; 1 GB/GPU to a file system at "
                                  "the rate below"),
    "pfs_read_gb_s": Assumption(500.0, "GB/s", "aggregate parallel file system read for a durable restore",
                                "a large Lustre/GPFS installation"),
    "queue_s": Assumption(120.0, "s", "a requeued job pending before it starts again, on idle nodes",
                          "Slurm's default munge credential life (120 s), seen in this project's issue 38"),
}
TARGETS = "Llama 3 (Dubey et al., 2024): more than 90 % on 16,384 GPUs; ByteRobust (ByteDance, 2025): 97 % on 9,600 GPUs"


def measured_phases(folder: Path) -> dict[str, float]:
    """Medians from section 8's runs on the dev cluster, which this model does not grow with the job's size: the
    in-allocation restarts' teardown + verdict (5 s when not measured), and a recovery in place's abort + rendezvous +
    transfer on gloo (1 s when not measured; a communicator at scale is ``nccl_init_s`` apart)."""
    try:
        runs = json.loads((folder / "benchmarks-recovery.json").read_text())["runs"]
    except (OSError, ValueError, KeyError):
        runs = []

    def median(paths: tuple[str, ...], keys: tuple[str, ...], default: float) -> float:
        rec = [r["recovery"] for r in runs if r.get("path") in paths and r.get("recovery")]
        return statistics.median(sum(x[k] for k in keys) for x in rec) if rec else default

    return {"teardown_verdict_s": median(("spare", "shrink"), ("teardown", "verdict"), 5.0),
            "regroup_s": median(("in place", "warm spare"), ("abort", "rendezvous", "transfer"), 1.0)}


def project(gpus: int, measured: dict[str, float]) -> list[dict[str, Any]]:
    """ETTR of each recovery path at ``gpus`` GPUs. In place, the failures the survivors cover (``in_place``) cost a
    new group, a spare's fetch and the step in flight, with no process started (the state replicated: DDP, or HSDP's
    replica groups); a sharded model (FSDP2) in place loads its newest snapshot instead, since no survivor holds the
    lost shard; with snapshots, the failures they cover (``in_memory``) restore from memory; either way the durable
    interval is chosen for the rest only (a two-level cadence), which restore from the durable checkpoint."""
    a = {k: v.value for k, v in AT_SCALE.items()}
    m, f = MEAN_TIME_TO_FAILURE_H[gpus] * 3600, a["in_memory"]
    node_gb = a["state_gb_per_gpu"] * a["gpus_per_node"]
    snap_stall = a["state_gb_per_gpu"] / a["d2h_gb_s"] + node_gb / a["node_net_gb_s"]  # the copy, the partner swap
    snap_every = math.sqrt(2 * snap_stall * m / f)
    restore_memory = node_gb / a["node_net_gb_s"] + 2 * node_gb / 10.0  # a spare's fetch, then /dev/shm at 10 GB/s
    restore_disk = a["state_gb_per_gpu"] * gpus / a["pfs_read_gb_s"]
    common = a["detection_s"] + measured["teardown_verdict_s"] + a["startup_s"] + a["step_s"]
    down = {"memory": common + restore_memory, "disk": common + restore_disk,
            "queue": common + a["queue_s"] + restore_disk,
            "in place": a["detection_s"] + measured["regroup_s"] + a["nccl_init_s"] + node_gb / a["node_net_gb_s"]
            + a["step_s"],
            "sharded": a["detection_s"] + measured["regroup_s"] + a["nccl_init_s"] + restore_memory + a["step_s"]}
    out = []
    for name, first, share in (("in place, from the survivors' memory", "in place", a["in_place"]),
                               ("in place, sharded (FSDP2): from a snapshot in node memory", "sharded", a["in_place"]),
                               ("in the allocation, from node memory", "memory", f),
                               ("in the allocation, from the durable checkpoint", "disk", 0.0),
                               ("requeued, from the durable checkpoint", "queue", 0.0)):
        durable_every = math.sqrt(2 * a["durable_stall_s"] * m / (1 - share))
        rest = "queue" if first == "queue" else "disk"
        snapshots = first in ("memory", "sharded")
        overhead = a["durable_stall_s"] / durable_every + (snap_stall / snap_every if snapshots else 0.0)
        redo = {"memory": snap_every / 2, "sharded": snap_every / 2, "in place": a["step_s"] / 2}.get(
            first, durable_every / 2)
        lost = share * (down[first] + redo) + (1 - share) * (down[rest] + durable_every / 2)
        out.append({"gpus": gpus, "path": name, "mttf_h": m / 3600, "downtime_s": down[first],
                    "recomputed_s": redo, "overhead": overhead, "ettr": 1 - overhead - lost / m})
    return out


def section(folder: Path) -> list[str]:
    """Section 9 of docs/benchmarks.md."""
    measured = measured_phases(folder)
    rows = [r for gpus in MEAN_TIME_TO_FAILURE_H for r in project(gpus, measured)]
    out = ["## 9. Effective training time at 1,024 and 16,384 GPUs (projected)", "",
           "Computed by `python -m benchmarks.projection` (no measurement of its own): effective training time = 1 − "
           "durable-save overhead − snapshot overhead − (downtime + recomputed work) / mean time to failure, each "
           "interval Young/Daly's √(2 · stall · MTTF) as the runtime chooses it; with snapshots, the failures "
           "they cannot cover restore from the durable checkpoint, whose interval is chosen for those alone. Downtime "
           "and recomputed work are per failure the path handles. Teardown and verdict: "
           f"{measured['teardown_verdict_s']:.1f} s, the median of the in-allocation restarts in section 8; a "
           f"regroup's abort, rendezvous and transfer: {measured['regroup_s']:.2f} s, the median of section 8's "
           "recoveries in place (gloo, a few ranks: at scale the new communicator is `nccl_init_s` and the spare's "
           "fetch of a node's state is added); everything else is an assumption, listed below with its source. "
           "Targets: " + TARGETS + "; this project's for recovery in place: 98.5 % at 16,384 GPUs.", "",
           "| GPUs | MTTF (h) | path | downtime (s) | recomputed (s) | save + snapshot overhead | effective training time |",
           "|---|---|---|---|---|---|---|"]
    out += [f"| {r['gpus']:,} | {r['mttf_h']:.1f} | {r['path']} | {r['downtime_s']:.0f} | {r['recomputed_s']:.0f} | "
            f"{100 * r['overhead']:.2f} % | **{100 * r['ettr']:.1f} %** |" for r in rows]
    out += ["", "| assumption | value | what | source |", "|---|---|---|---|",
            "| mean time to failure | 7.9 h (1,024 GPUs), 1.8 h (16,384) | a job's, all causes | Kokolis et al., HPCA "
            "2025 (Meta) |"]
    out += [f"| {k} | {v.value:g} {v.unit} | {v.what} | {v.source} |" for k, v in AT_SCALE.items()]
    out += ["", "A sharded model recovered in place is spared the start-up (`startup_s`), not the work since its "
            "newest snapshot: no survivor holds the lost shard. Replicating shards across nodes (HSDP) would let it "
            "recover from the survivors' memory as DDP does; the runtime does not offer HSDP yet.",
            "", "What the model leaves out: failures during a recovery, a second node lost before the first is "
            "replaced (the partner's copy is then gone too: the durable path), the queue wait of a busy partition (an "
            "hour at a site is ordinary: the requeued path only gets worse), and stragglers.", ""]
    return out


def main() -> int:
    folder = ROOT / "docs"
    lines = section(folder)
    if (folder / "benchmarks.md").exists():
        splice(folder / "benchmarks.md", lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
