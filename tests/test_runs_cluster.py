"""The run tools on the dev cluster: two jobs, a sweep and a hand-run batch script in one ledger; `runs` while they
run and after; a preempted job's 2 attempts; one rank's lines of one attempt; `cancel`, then `resubmit`, which resumes
from the checkpoint and finishes."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from cluster.job import ledger

from .conftest import ROOT, SMALL, faults, held
from .test_slurm import sh, slurm_env, wait_for

__all__ = ["slurm_env"]  # the fixture, imported for the tests below

LOOP = '''\
import os, sys
import torch
import trainer


def main() -> int:
    with trainer.Session(sys.argv[1:]) as sess:
        model = sess.wrap(torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        start = sess.restore(model=model, optimizer=opt)
        for step in sess.steps(start, 60):
            loss = model(torch.ones(2, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            print(f"rank {sess.env.rank} attempt {os.environ.get('SLURM_RESTART_COUNT', '0')} step {step}", flush=True)
            sess.log({"loss": float(loss)}, step)
            if sess.should_save(step):
                sess.save(step)
                if sess.preempted:
                    break
        return sess.finish({})


trainer.main(main)
'''


def tool(args: list[str], env: dict[str, str], cwd: Path) -> str:
    proc = sh([sys.executable, "-m", "cluster", *args], env, cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def table(env: dict[str, str], cwd: Path) -> dict[str, dict[str, Any]]:
    return {r["job"]: r for r in json.loads(tool(["runs", "--json"], env, cwd))}


def submitted(out: str) -> str:
    return out.split("submitted job ")[1].split()[0]


def start_all(env: dict[str, str], cwd: Path) -> tuple[str, str, str]:
    """Jobs A (2 nodes) and B (1 node) of the loop above, held in their first attempt after steps 3 and 6 (a test
    fault), a 2-trial sweep, and C, the loop by hand from a rendered template; their job ids (A, B, C)."""
    (cwd / "loop.py").write_text(LOOP)
    cmd = ["--", "python", "loop.py", "checkpoint.every_steps=5", "checkpoint.poll_steps=1", "tracking.mode=disabled"]
    a = submitted(tool(["submit", "--nodes", "2", "--launcher", "sbatch", *cmd],
                       {**env, **faults(at={"0": {"wait_at_step": 2}})}, cwd))
    b = submitted(tool(["submit", "--nodes", "1", "--launcher", "sbatch", *cmd],
                       {**env, **faults(at={"0": {"wait_at_step": 5}})}, cwd))
    spec = {"name": "s", "profile": {"nodes": 1}, "max_parallel": 1, "method": "grid", "metric": "test_accuracy",
            "mode": "max", "args": SMALL, "parameters": {"optim.lr": [0.05, 0.1]}}  # small: only its rows count
    (cwd / "spec.yaml").write_text(json.dumps(spec))
    tool(["sweep", "spec.yaml"], env, cwd)
    (cwd / "run.sbatch").write_text(tool(["render", "--cluster", "dev", "--command"], env, cwd))
    venv = {**env, "PATH": f"{Path(sys.executable).parent}:{env['PATH']}"}  # the template runs `python`
    hand = sh(["sbatch", "--parsable", "run.sbatch", "python", "loop.py", "tracking.mode=disabled"], venv, cwd=cwd)
    assert hand.returncode == 0, hand.stderr
    return a, b, hand.stdout.strip().split(";")[0]


@pytest.mark.slurm_compat
def test_runs_status_logs_cancel_and_resubmit_on_real_jobs(slurm_env: dict[str, str], tmp_path: Path) -> None:
    env = {**slurm_env, ledger.LEDGER_ENV: str(tmp_path / "ledger")}
    a, b, c = start_all(env, tmp_path)
    runs_a, runs_b = tmp_path / "runs" / a, tmp_path / "runs" / b
    held(runs_a, ranks=2)
    assert table(env, tmp_path)[a]["state"] == "running"
    assert table(env, tmp_path)[b]["state"] in ("pending", "running")
    assert sh(["scancel", "--signal=USR2", a], env).returncode == 0  # a preemption: saved, requeued
    held(runs_b, ranks=1)  # after step 6, step 5 saved
    assert "cancelled" in tool(["cancel", b], env, tmp_path)
    wait_for(lambda: table(env, tmp_path)[a]["state"] in ("requeued", "running")
             and table(env, tmp_path)[a]["attempts"] == 2, 120, "job A's requeue")
    wait_for(lambda: table(env, tmp_path)[b]["state"] == "cancelled", 60, "job B to be cancelled")
    b2 = submitted(tool(["resubmit", b], env, ROOT))  # from another folder: it goes back to where B was submitted
    wait_for(lambda: all(table(env, tmp_path).get(j, {}).get("state") in ("finished", "cancelled")
                         for j in (a, b, b2, c)), 400, "every job to end")
    wait_for(lambda: next(r for r in table(env, tmp_path).values() if r["kind"] == "sweep")["state"] == "finished",
             400, "the sweep to end")

    rows = table(env, tmp_path)
    assert (rows[a]["state"], rows[a]["attempts"], rows[a]["progress"]) == ("finished", 2, "60/60"), rows[a]
    assert (rows[b]["state"], rows[b2]["state"], rows[c]["state"]) == ("cancelled", "finished", "finished"), rows
    assert rows[b2]["run_dir"] == rows[b]["run_dir"] == str(runs_b.resolve())  # the same folder: resumed
    starts = [e for e in map(json.loads, (runs_b / "events.jsonl").read_text().splitlines()) if e["event"] == "attempt"]
    assert starts[-1]["job_id"] == b2 and starts[-1]["resumed_step"] >= 5, starts[-1]
    sweep = next(r for r in rows.values() if r["kind"] == "sweep")
    assert sweep["progress"] == "2/2 trials" and sweep["name"].startswith("s-")
    hand_record = json.loads((tmp_path / "ledger" / f"{c}.json").read_text())
    assert hand_record["by_hand"] and hand_record["args"] == ["python", "loop.py", "tracking.mode=disabled"]
    check_logs_and_status(env, tmp_path, a)


def check_logs_and_status(env: dict[str, str], cwd: Path, a: str) -> None:
    """One rank's lines of one attempt: rank 1's before the preemption, nothing of rank 0 or of attempt 1."""
    lines = tool(["logs", a, "--rank", "1", "--attempt", "0"], env, cwd).splitlines()
    steps = [line for line in lines if line.startswith("rank ")]
    assert steps and all(line.startswith("rank 1 attempt 0 step ") for line in steps), lines
    later = tool(["logs", a, "--rank", "0", "--attempt", "1"], env, cwd).splitlines()
    assert any(line.startswith("rank 0 attempt 1 step 60") for line in later), later
    status = tool(["status", a], env, cwd)
    assert "attempts (2):" in status and "preempted" in status and "progress: step 60/60" in status, status
    listing = tool(["runs", "--width", "100"], env, cwd)
    assert listing.splitlines()[0].split() == ["NAME", "JOB", "STATE", "ATTEMPTS", "NODES", "PROGRESS", "METRIC", "AGE"]
