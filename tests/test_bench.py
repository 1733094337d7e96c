"""The benchmark script still runs (tiny sizes, one repeat); its numbers are not judged here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT, clean_env


@pytest.mark.timeout(900)  # 1 min alone (89 CPU seconds), 6 min beside the rest of CI on 2 cores
@pytest.mark.skipif(os.environ.get("CI") != "true" and os.environ.get("TRAINER_TEST_BENCH") != "1",
                    reason="the benchmark script's smoke run (89 CPU seconds alone, 1 min): CI runs it; "
                           "here TRAINER_TEST_BENCH=1 make test")
def test_bench_smoke(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench", "--smoke", "--out", str(tmp_path)], cwd=ROOT,
                          env=clean_env(), capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "benchmarks.json").read_text())
    t = results["trainer_and_bare"]
    assert [(r["processes"], r["batch_per_process"]) for r in t["rows"]] == [(1, 32), (2, 32)]  # no strong scaling
    assert all(r["trainer_vs_bare"]["values"][0] > 0 for r in t["rows"])
    assert t["weak"]["bare"]["median"] > 0 and t["weak"]["trainer"]["median"] > 0 and t["strong"] is None
    ck = results["checkpoint"][0]
    assert ck["sync_s"]["median"] > 0 and len(ck["speed_vs_raw"]["values"]) == 1
    assert (tmp_path / "benchmarks-scaling.png").stat().st_size > 1000
    page = (tmp_path / "benchmarks.md").read_text()
    assert "## 1. Trainer vs the tutorials' bare loop, and scaling" in page and "per pair" in page
    memory = {(m["strategy"], m["processes"]): m["total"] for m in results["sharded"]["memory"]}
    assert memory[("fsdp", 2)] < 0.6 * memory[("ddp", 2)]  # each rank keeps about half (the split is exact, not timed)
    assert results["sharded"]["saves"]["pairs"][0]["dcp_sync_s"] > 0
    first = results["cadence"][0]  # the simulated policy: Young/Daly's interval loses less than far-off fixed ones
    assert first["vs_auto"]["1 min"]["median"] > 1 and first["vs_auto"]["60 min"]["median"] > 1
    assert "## 6. Checkpoint cadence under simulated interruptions" in page
    assert "## 4. GPU only" in page and results["precision_smoke"][0]["samples_per_s"] > 0
    lm = results["lm_smoke"]["rows"][0]  # the LM's bare loop and Session's, interleaved
    assert lm["variant"] == "eager" and len(lm["trainer_vs_bare"]) == 1 and lm["launch_s"] > lm["first_step_s"]
    built_in = results["lm_trainer_smoke"]["rows"][0]  # GPT through `python -m trainer`'s targets, on token shards
    assert built_in["trainer"][0]["tokens_per_s"] > 0 and len(built_in["trainer"][0]["windows"]) == 2


def test_gpu_section_shows_the_last_gpu_measurement_on_machines_without_one(tmp_path: Path) -> None:
    """docs/benchmarks-gpu.json (from `python -m benchmarks.gpu` on a GPU machine) renders as section 4, and replaces
    just that section of an existing page."""
    from benchmarks import gpu
    from benchmarks.common import splice

    stored = gpu.stored(ROOT / "docs")
    assert stored is not None and stored["machine"]["gpus"]
    lines = gpu.section(stored)
    assert lines[0] == "## 4. GPU only" and any(stored["machine"]["gpus"][0] in line for line in lines)
    assert sum(line.startswith("| 32 | ") for line in lines) >= 1  # the one-GPU trainer vs bare row at batch 32
    assert any(line.startswith("| compiled | ") for line in lines)  # GPT-2 small, compiled
    page = tmp_path / "benchmarks.md"
    page.write_text("# B\n\n## 3. x\n\nthree\n## 4. GPU only\n\nSTALE-SECTION\n\n## 5. y\n\nfive\n")
    splice(page, lines)
    text = page.read_text()
    assert "STALE-SECTION" not in text and "three" in text and text.endswith("## 5. y\n\nfive\n") and lines[2] in text
    splice(page, ["## 8. new", "", "eight"])  # a section not there yet: after the ones numbered lower
    splice(page, ["## 6. mid", "", "six"])
    heads = [line for line in page.read_text().splitlines() if line.startswith("## ")]
    assert heads == ["## 3. x", "## 4. GPU only", "## 5. y", "## 6. mid", "## 8. new"], heads
    assert gpu.section(None)[2].startswith("Not measured yet")
    assert any(line.startswith("| compiled | ") for line in gpu.lm_trainer_section(stored["lm_trainer"]))


def test_a_gpu_part_not_measured_again_is_shown_from_the_newest_run_that_did() -> None:
    from benchmarks import gpu

    m = {"gpus": ["G"], "cpu": "c", "cores": 1, "python": "3", "torch": "t"}
    runs = [{"machine": m, "date": "2026-11-27", "command": "two", "checkpoint": {"skipped": "in two"}},
            {"machine": m, "date": "2026-11-26", "command": "one", "checkpoint": {"skipped": "in one"},
             "dp_vs_ddp": {"skipped": "in one"}}]
    text = "\n".join(gpu.section({"machine": m, "date": "2026-11-29", "command": "three", "earlier": runs}))
    assert "run of 2026-11-27 (`two`" in text and "skipped (in two)" in text and "skipped (in one)" in text
    assert text.count("*From the run of") == 2 and "lm_trainer" not in text
    assert "run of 2026-11-26 (`one`" in "\n".join(gpu.section({"machine": m, "date": "x", "command": "c",
                                                                "earlier": runs[1]}))  # one run, as kept before


def test_the_audit_section_shows_the_overhead_the_detection_and_the_false_alarms() -> None:
    from benchmarks import audit
    from benchmarks.common import spread

    r = {"machine": {"cpu": "cpu", "cores": 2},
         "overhead": {"pairs": 2, "size": 8, "on_vs_off": spread([0.99, 1.004]), "replay_vs_not": spread([0.98, 0.99]),
                      "command": "python -m benchmarks.audit --only overhead", "date": "2026-11-26"},
         "detection": {"runs": [{"after_s": 4.2, "rank": 1, "lost_s": 0.9}, {"after_s": None, "rank": None,
                                                                            "lost_s": None}],
                       "slowdown": 1.3, "command": "c", "date": "2026-11-27"},
         "alarms": {"local": {"runs": 20, "steps": 7680, "events": [], "step_ms": spread([60.0, 70.0])},
                    "workload": {"runs": 5, "steps": 1280, "events": [{"rank": 0, "ratio": 1.4}], "step_ms": spread([80.0])},
                    "cluster": None, "command": "a", "date": "2026-11-27"}}
    text = "\n".join(audit.section(r))
    assert "| 0.997× (0.990×–1.004×) | `python -m benchmarks.audit --only overhead`, 2026-11-26 |" in text
    assert "2 runs, the detector's defaults): named | rank 1 after 4.2 s; not named |" in text
    assert "| straggler events in 5 clean runs of the detection workload (1,280 steps, 80 ms (80 ms–80 ms) a step) | 1 |" \
        in text
    assert "| straggler events in 20 clean `make train` runs (7,680 steps, 65 ms (60 ms–70 ms) a step) | 0 |" in text
    assert "the dev cluster was down" in text
    assert audit.section(None)[2].startswith("Not measured yet")


def test_the_streams_section_shows_the_ratios_and_memory() -> None:
    from benchmarks import streams

    r = json.loads((ROOT / "docs" / "benchmarks-streams.json").read_text())
    text = "\n".join(streams.section(r))
    assert "## 13. Sharded data" in text and "÷ webdataset's pipeline" in text and "shuffle buffer 10,000" in text
    assert streams.section(None)[2].startswith("Not measured yet")


def test_the_regroup_section_shows_each_paths_times_in_milliseconds() -> None:
    from benchmarks import regroup

    runs = [{"path": "shrink", "world_after": 2, "kill_to_first_collective_s": k, "regrouped_s": [0.012, 0.03]}
            for k in (0.07, 0.075)] + [{"path": "spare", "world_after": 3, "kill_to_first_collective_s": 0.1,
                                        "regrouped_s": [0.05, 0.06]}]
    text = "\n".join(regroup.section({"machine": {"cpu": "cpu", "cores": 2}, "date": "2026-11-27", "runs": runs,
                                      "command": "python -m benchmarks.regroup --repeats 2"}))
    assert "| shrink | 0 | 2 | 72 (70–75) | 21 (12–30) |" in text
    assert "| spare | 1 | 3 | 100 (100–100) | 55 (50–60) |" in text
    assert "| path | processes after |" not in text  # no session runs: no table for them
    session = [{"path": "in place", "kill_to_first_step_s": 0.12, "regroup_s": 0.02, "finished": True},  # before fsdp
               {"path": "restart", "kill_to_first_step_s": 4.5, "regroup_s": None, "finished": True},
               {"path": "restart", "kill_to_first_step_s": 5.5, "regroup_s": None, "finished": False},
               {"path": "in place", "strategy": "fsdp", "kill_to_first_step_s": 0.3, "regroup_s": 0.15, "again": 2,
                "finished": True}]
    text = "\n".join(regroup.section({"machine": {"cpu": "cpu", "cores": 2}, "date": "2026-11-27", "runs": runs,
                                      "session": session, "command": "python -m benchmarks.regroup --repeats 2"}))
    assert "| ddp | in place | 2 | 0.12 (0.12–0.12) | 20 (20–20) | – | 1 of 1 |" in text
    assert "| ddp | restart | 3 | 5.00 (4.50–5.50) | – | – | 1 of 2 |" in text and "| warm spare |" not in text
    assert "| fsdp | in place | 2 | 0.30 (0.30–0.30) | 150 (150–150) | 2 (2–2) | 1 of 1 |" in text


def _rec(decision: str, total: float, **phases: float) -> dict[str, object]:
    return {"decision": decision, "total_s": total, "restored_from": None if decision == "in place" else "memory",
            "recomputed_steps": 1, **phases}


def test_the_recovery_section_puts_in_place_paths_beside_the_restarts_and_the_projection_uses_them(
        tmp_path: Path) -> None:
    from benchmarks import projection, recovery

    inplace = {"detection": 0.02, "abort": 0.01, "rendezvous": 0.005, "transfer": 0.015, "first_step": 0.05}
    restart = {"detection": 0.0, "teardown": 0.3, "verdict": 0.2, "queue": 0.0, "startup": 6.0, "restore": 0.0,
               "first_step": 0.3}
    runs = [{"path": "in place", "kill_to_first_step_s": 0.1, "recovery": _rec("in place", 0.1, **inplace)},
            {"path": "warm spare", "kill_to_first_step_s": 0.2, "recovery": _rec("in place", 0.2, **inplace)},
            {"path": "spare", "kill_to_first_step_s": 6.8, "recovery": _rec("restart_here", 6.8, **restart)},
            {"path": "torchrun", "kill_to_first_step_s": 7.0, "recovery": _rec("restart_here", 7.0, **restart)}]
    r = {"machine": {"cpu": "cpu", "cores": 2}, "date": "2026-11-28", "runs": runs,
         "command": "python -m benchmarks.recovery --repeats 1",
         "torchrun_vs_in_place": {"median": 70.0, "min": 70.0, "max": 70.0, "values": [70.0]}}
    text = "\n".join(recovery.section(r))
    assert "| in place | the survivors' memory | 0.10 (0.10–0.10) | 0.02 | 0.01 | 0.01 | 0.01 | 0.05 | 1 |" in text
    assert "| spare | memory | 6.80 (6.80–6.80) | 0.00 | 0.30 | 0.20 | 0.00 | 6.00 | 0.00 | 0.30 | 1 |" in text
    assert "torchrun's restart ÷ in place: **70.00× (70.00×–70.00×)**" in text and "| shrink |" not in text
    (tmp_path / "benchmarks-recovery.json").write_text(json.dumps(r))
    measured = projection.measured_phases(tmp_path)
    assert measured == pytest.approx({"teardown_verdict_s": 0.5, "regroup_s": 0.03})
    for gpus in (1024, 16384):
        rows = projection.project(gpus, measured)
        assert [x["ettr"] for x in rows] == sorted((x["ettr"] for x in rows), reverse=True), rows  # in place first
        a = {k: v.value for k, v in projection.AT_SCALE.items()}
        assert rows[0]["downtime_s"] == pytest.approx(a["detection_s"] + 0.03 + a["nccl_init_s"] + a["step_s"]
                                                      + a["state_gb_per_gpu"] * a["gpus_per_node"] / a["node_net_gb_s"])
    assert projection.measured_phases(tmp_path / "none") == {"teardown_verdict_s": 5.0, "regroup_s": 1.0}


def test_the_life_section_shows_the_restarting_and_the_regrouping_job() -> None:
    from benchmarks import life

    def got(regroup: bool, ratio: float) -> dict[str, object]:
        rec = [_rec("in place" if regroup else "restart_here", 0.2 if regroup else 7.0)]
        return {"machine": {"cpu": "cpu", "cores": 2}, "date": "2026-11-28", "faults": [{"kind": "kill"}],
                "same_result": True, "outcome": "finished", "goodput": {"faulted": 0.9 * ratio, "clean": 0.9},
                "goodput_ratio": ratio, "decisions": [("finished", "done")], "recoveries": rec, "regroup": regroup,
                "command": "python -m benchmarks.life --seed 1" + (" --regroup" if regroup else "")}

    text = "\n".join(life.section(got(False, 0.734), got(True, 0.95)))
    assert text.count("- Outcome: finished") == 2 and "**73.4 %** of the fault-free run's" in text
    assert "**95.0 %** of the fault-free run's" in text and "1 of them in place; median 0.20 s" in text
    assert "`python -m benchmarks.life --seed 1 --regroup`" in text
    assert "Regrouping in place" not in "\n".join(life.section(got(False, 0.8)))
