"""Checkpoint cadence under simulated interruptions: the time lost (recomputed work + saving) by the auto cadence
(`trainer/runtime/saving/cadence.py`, Young/Daly) against fixed intervals, on the same interruption sequences.

A simulation, not a timing: a job needs ``WORK_H`` hours of training; interruptions arrive as a Poisson process of
mean ``mtbf``; every interval of training ends with a save that stalls ``stall`` seconds (an interruption during it
loses it too); an interruption loses the work since the last completed save. Each seed is one pair (the same
interruptions for every policy).

    python -m benchmarks.cadence
"""

from __future__ import annotations

import random
import statistics
from typing import Any

from trainer.runtime.saving.cadence import interval_s

WORK_H = 100.0
SCENARIOS = ((2.0, 4.0), (30.0, 4.0), (2.0, 48.0))
"""(save stall in seconds, mean time between interruptions in hours)."""
FIXED_MIN = (1.0, 10.0, 60.0)


def lost_s(interval: float, stall: float, mtbf: float, seed: int) -> float:
    """Wall time beyond the work itself: saves plus work recomputed after interruptions."""
    rng = random.Random(seed)
    work, done, wall = WORK_H * 3600, 0.0, 0.0
    next_cut = rng.expovariate(1 / mtbf)
    while done < work:
        segment = min(interval, work - done) + stall  # train, then save
        if wall + segment <= next_cut:
            wall, done = wall + segment, done + segment - stall
        else:  # interrupted: the segment (and its save) is lost
            wall = next_cut
            next_cut = wall + rng.expovariate(1 / mtbf)
    return wall - work


def scenario(stall: float, mtbf_h: float, seeds: int) -> dict[str, Any]:
    mtbf = mtbf_h * 3600
    auto = interval_s(stall, mtbf)
    runs = {"auto": [lost_s(auto, stall, mtbf, s) for s in range(seeds)]}
    for minutes in FIXED_MIN:
        runs[f"{minutes:g} min"] = [lost_s(60 * minutes, stall, mtbf, s) for s in range(seeds)]
    ratios = {k: [v / a for v, a in zip(vals, runs["auto"], strict=True)] for k, vals in runs.items() if k != "auto"}
    return {"stall_s": stall, "mtbf_h": mtbf_h, "auto_interval_s": auto,
            "lost_h": {k: statistics.median(v) / 3600 for k, v in runs.items()},
            "vs_auto": {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in ratios.items()}}


def simulate(seeds: int = 20) -> list[dict[str, Any]]:
    return [scenario(stall, mtbf, seeds) for stall, mtbf in SCENARIOS]


def section(rows: list[dict[str, Any]], seeds: int = 20) -> list[str]:
    """Section 6 of docs/benchmarks.md."""
    out = ["", "## 6. Checkpoint cadence under simulated interruptions", "",
           f"`benchmarks/cadence.py`: a job of {WORK_H:g} h of training, interruptions as a Poisson process, "
           f"{seeds} seeds (each a pair: the same interruptions for every policy); time lost = saves + recomputed work, "
           "median hours, and each fixed interval's loss over the auto cadence's, median (min–max) over the seeds "
           "(a simulation of the policy's arithmetic, not a timing).", "",
           "| save stall | interruptions every | auto interval | auto lost | "
           + " | ".join(f"every {m:g} min lost (× auto)" for m in FIXED_MIN) + " |",
           "|---|---|---|---|" + "---|" * len(FIXED_MIN)]
    for r in rows:
        cells = [f"{r['lost_h'][k]:.2f} h ({r['vs_auto'][k]['median']:.2f}×, {r['vs_auto'][k]['min']:.2f}–"
                 f"{r['vs_auto'][k]['max']:.2f})" for k in (f"{m:g} min" for m in FIXED_MIN)]
        out.append(f"| {r['stall_s']:g} s | {r['mtbf_h']:g} h | {r['auto_interval_s'] / 60:.1f} min | "
                   f"{r['lost_h']['auto']:.2f} h | " + " | ".join(cells) + " |")
    return out


if __name__ == "__main__":
    print("\n".join(section(simulate())))
