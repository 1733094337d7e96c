"""The benchmark script still runs (tiny sizes, one repeat); its numbers are not judged here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .conftest import ROOT, clean_env


def test_bench_smoke(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench", "--smoke", "--out", str(tmp_path)], cwd=ROOT,
                          env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "benchmarks.json").read_text())
    assert [r["processes"] for r in results["scaling"]] == [1, 2, 1, 2]
    assert results["trainer_vs_bare"]["ratio"] > 0 and results["checkpoint"][0]["sync_save_s"] > 0
    assert (tmp_path / "benchmarks-scaling.png").stat().st_size > 1000
    assert "## 2. Trainer vs the tutorials' bare loop" in (tmp_path / "benchmarks.md").read_text()
    memory = {(m["strategy"], m["processes"]): m["total"] for m in results["sharded"]["memory"]}
    assert memory[("fsdp", 2)] < 0.6 * memory[("ddp", 2)]  # each rank keeps about half (the split is exact, not timed)
    assert results["sharded"]["saves"]["pairs"][0]["dcp_sync_s"] > 0
