"""What the audits cost and whether they cry wolf (trainer/runtime/health/audit.py, section 12 of docs/benchmarks.md).

Overhead: the built-in trainer on 2 gloo processes with the audits at their defaults (compute times at every poll,
the replicas compared before every save, here every 50 steps) against the same run with both off, and with the
replay audit every 100 steps against it off, as interleaved pairs; the ratios of their training rates.
False alarms: clean runs of a tiny model (a few milliseconds a step, where
this 2-core machine's noise weighs most) with the detector at its defaults, the straggler events counted.

``python -m benchmarks.audit`` writes docs/benchmarks-audit.json and the section.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, machine, pairs, publish, show, spread, torchrun

OFF = ["audit.straggler_steps=0", "audit.replicas_every_steps=-1"]
TINY = ["data.image_size=8", "data.batch_size=8", "train.eval_every=0", "data.synthetic_test_size=64"]


def run(args: list[str], tmp: Path, fault: str = "") -> dict[str, Any]:
    """One 2-process run (``fault``: TRAINER_FAULTS): its result and the straggler events it wrote."""
    folder = Path(tempfile.mkdtemp(dir=tmp))
    torchrun(2, ["-m", "trainer", *args, f"run.dir={folder}", "tracking.mode=disabled", "checkpoint.resume=never",
                 "data.num_workers=0", "train.epochs=1"], ok_if="\ndone: test accuracy", extra={"TRAINER_FAULTS": fault})
    result: dict[str, Any] = json.loads((folder / "result.json").read_text())
    events = [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()]
    result["stragglers"] = [e for e in events if e["event"] == "straggler"]
    shutil.rmtree(folder)
    return result


def measure(n_pairs: int, size: int, clean_steps: int, tmp: Path) -> dict[str, Any]:
    base = [f"data.synthetic_train_size={size}", "checkpoint.every_steps=50"]
    got = pairs(n_pairs, lambda: run(base, tmp), lambda: run([*base, *OFF], tmp))
    ratio = spread([on["train_samples_per_s"] / off["train_samples_per_s"] for on, off in got])
    replayed = pairs(n_pairs, lambda: run([*base, "audit.replay_every_steps=100"], tmp), lambda: run(base, tmp))
    replay = spread([on["train_samples_per_s"] / off["train_samples_per_s"] for on, off in replayed])
    # False alarms: clean runs with the detector on (and in the overhead pairs' audited runs too).
    clean = [run([*TINY, f"data.synthetic_train_size={16 * clean_steps}"], tmp)]
    steps = sum(r["global_step"] for r in clean) + sum(on["global_step"] for on, _ in got)
    named = slowed_named(base, tmp)
    alarms = sum(len(r["stragglers"]) for r in clean) + sum(len(on["stragglers"]) for on, _ in got)
    return {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "pairs": n_pairs, "size": size,
            "on_vs_off": ratio, "replay_vs_not": replay, "clean_steps": steps, "slowed_named": named, "false_alarms": alarms,
            "tiny_step_ms": 1000 / clean[0]["train_samples_per_s"] * 16,
            "command": f"python -m benchmarks.audit --pairs {n_pairs} --size {size} --clean-steps {clean_steps}"}


def slowed_named(base: list[str], tmp: Path) -> list[list[tuple[int, int]]]:
    """The issue's goal: a rank slowed 1.5× from step 100, at the defaults, named within 50 steps (3 runs)."""
    slowed = [run(base, tmp, "slow_rank=1 slow_from_step=100 slow_factor=1.5")["stragglers"] for _ in range(3)]
    return [[(e["rank"], e["step"] - 100) for e in found] for found in slowed]


def section(r: dict[str, Any] | None) -> list[str]:
    out = ["## 12. Audits: slow ranks and silent corruption", ""]
    if not r:
        return out + ["Not measured yet: `python -m benchmarks.audit`.", ""]
    return out + [
        f"Measured by `{r['command']}` on {r['date']} ({r['machine']['cpu']}, {r['machine']['cores']} cores), the built-in "
        "trainer on 2 gloo processes.", "",
        "| what | figure |", "|---|---|",
        f"| training rate, audits at their defaults ÷ both off ({r['pairs']} interleaved pairs, {r['size']} samples, a "
        f"save every 50 steps) | {show(r['on_vs_off'], '{:.3f}×')} |",
        f"| training rate, replay audit every 100 steps ÷ without it (the same pairs' setting) | "
        f"{show(r['replay_vs_not'], '{:.3f}×')} |",
        f"| a rank slowed 1.5× from step 100 (3 runs, defaults): (rank named, steps after the slowdown) | "
        f"{'; '.join(', '.join(f'rank {k} after {n}' for k, n in found) or 'not named' for found in r['slowed_named'])} |",
        f"| straggler events in {r['clean_steps']:,} clean steps (the pairs' audited runs and a tiny model at "
        f"{r['tiny_step_ms']:.1f} ms a step) | {r['false_alarms']} |", "",
        "The rate ratio's spread is this machine's run-to-run noise as much as the audits' cost: each pair's two runs "
        "differ only in `audit.straggler_steps=0 audit.replicas_every_steps=-1` (or `audit.replay_every_steps=100`). "
        "What the audits add per step is a clock read around each training forward and optimizer step, one float per "
        "rank in the poll's all-reduce, and at each save one pass over the parameters and one small gather; a replay "
        "adds one forward and backward on every rank, its inputs sent to the next rank, every 100 steps.", ""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--size", type=int, default=16384)
    parser.add_argument("--clean-steps", type=int, default=10000)
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    parser.add_argument("--slowed-only", action="store_true", help="measure the slowed rank again, keep the rest")
    a = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if a.slowed_only:
            r = json.loads((a.out / "benchmarks-audit.json").read_text())
            r["slowed_named"] = slowed_named([f"data.synthetic_train_size={r['size']}", "checkpoint.every_steps=50"],
                                             Path(tmp))
        else:
            r = measure(a.pairs, a.size, a.clean_steps, Path(tmp))
    publish(a.out, "audit", r, section(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
