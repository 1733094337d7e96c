"""Any command on the dev cluster: a plain DDP script, the char LM example preempted twice, a failing script,
a sweep over a command's argument (`make submit CMD=…`, `python -m cluster submit -- …`, `python -m cluster sweep`)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from trainer.core.env import expand_nodelist
from trainer.runtime.records.attempts import attempts, figures

from .conftest import ROOT, faults, held, ok, result_of, run_trainer
from .test_session import CHAR_LM, last_weights, same
from .test_slurm import cluster_cmd, job_id_of, job_runs, job_state, sh, slurm_env, wait_for

__all__ = ["slurm_env"]  # the fixture, used by name

PLAIN = ROOT / "tests" / "scripts" / "plain_ddp.py"
ODD = ["a b", "x'; touch pwned; echo 'y", "$(touch pwned)"]


@pytest.mark.parametrize(("launcher", "launch"), [("sbatch", "srun"), ("submitit", "srun"), ("sbatch", "torchrun")])
def test_a_plain_ddp_script_runs_on_two_nodes(slurm_env: dict[str, str], tmp_path: Path, launcher: str,
                                              launch: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    run = tmp_path / "run"
    proc = cluster_cmd(["--launcher", launcher, "--wait", "--set", f"launch={launch}", "--set", "doctor=true",
                        "--", "python", str(PLAIN), *ODD], {**slurm_env, "OUT_DIR": str(out), "RUN_DIR": str(run)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [x["rank"] for x in lines] == [0, 1] and {x["world_size"] for x in lines} == {2}
    assert {x["sum"] for x in lines} == {3.0} and lines[0]["grad"] == lines[1]["grad"]
    assert len({x["node"] for x in lines}) == 2  # one task on each node
    if launch == "srun":  # torchrun's agent names the rendezvous host itself (here both nodes are one machine)
        assert {x["master_addr"] for x in lines} == {expand_nodelist(lines[0]["nodelist"])[0]}
    assert all(x["argv"] == ODD for x in lines) and not list(ROOT.glob("pwned")) and not list(tmp_path.rglob("pwned"))
    if launcher == "sbatch":  # the preflight doctor ran first, launched like the command
        log = ROOT / re.search(r"log:\s+(\S+)", proc.stdout).group(1)  # type: ignore[union-attr]
        assert "doctor: all checks passed" in log.read_text()
    # A command without the session API: its report holds what the batch script saw (one attempt, exit 0).
    # (submitit's client returns on the task's result; the batch shell's teardown may still be writing it)
    wait_for(lambda: (run / "report.html").exists(), timeout=60, what="the report")
    (only,) = attempts(run)
    assert only.exit_code == 0 and only.info["nodes"] == 2


LM = ["--max-steps", "40", "--eval-every", "1000", "--max-bytes", "40000", "--batch-size", "8", "--sample", "0",
      "tracking.mode=disabled", "checkpoint.poll_steps=1"]


def _log_count(log: Path, text: str) -> int:
    return log.read_text().count(text) if log.exists() else 0


def test_the_char_lm_submitted_as_a_command_survives_two_preemptions_bit_identically(
        slurm_env: dict[str, str], tmp_path: Path) -> None:
    """Each of the first two attempts is held after a few steps (a test fault) and warned through Slurm."""
    run = tmp_path / "run"
    cmd = " ".join(["python", str(CHAR_LM), *LM])
    env = {**slurm_env, "RUN_DIR": str(run), **faults(at={"0": {"wait_at_step": 5}, "1": {"wait_at_step": 7}})}
    proc = sh(["make", "submit", "CLUSTER=dev", "NODES=2", "LAUNCHER=sbatch", f"CMD={cmd}"], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = job_id_of(proc.stdout)
    log = ROOT / "runs" / "slurm" / f"train-{job}.out"
    for attempt in range(2):  # warn, wait for the requeued attempt to be held, warn again
        held(run, ranks=2, attempt=str(attempt))
        assert sh(["scancel", "--signal=USR2", job], slurm_env).returncode == 0
        wait_for(lambda a=attempt: _log_count(log, "-> preempted: requeue") == a + 1, timeout=120,
                 what=f"requeue {attempt + 1}")
    wait_for(lambda: (run / "result.json").exists(), timeout=240, what="the third attempt to finish")
    wait_for(lambda: job_state(job, slurm_env) == "COMPLETED", timeout=60, what="COMPLETED")
    states = job_runs(job, slurm_env)
    assert len(states) == 3, states  # two requeues: three attempts
    assert _log_count(log, "resumed from") == 2
    # The run report: 3 attempts in order; a signal's save keeps every step (no lost work); goodput below 1 and as
    # the event log's own arithmetic gives it.
    runs = attempts(run)
    f = figures(runs)
    assert [r["exit"] for r in f["attempts"]] == [75, 75, 0] and [r["restart"] for r in f["attempts"]] == [0, 1, 2]
    for i, a in enumerate(runs[:-1]):
        saved = max(e["step"] for e in a.times("checkpoint"))
        signalled = a.times("signal")[0]["step"]
        assert f["attempts"][i]["lost_steps"] == a.last_step - saved == 0 and saved == signalled
        assert runs[i + 1].info["resumed_step"] == saved
    alloc = sum(a.end - a.start for a in runs) * 2  # two nodes
    assert 0 < f["goodput"] < 1 and f["allocated_node_s"] == pytest.approx(alloc)
    assert (run / "report.html").exists() and (run / "report-timeline.png").stat().st_size > 5000
    ref = tmp_path / "ref"
    ok(run_trainer([*LM, f"run.dir={ref}"], tmp_path, nproc=2, script=CHAR_LM))
    assert result_of(run)["global_step"] == result_of(ref)["global_step"] == 40
    assert same(last_weights(run), last_weights(ref)), "weights differ from the uninterrupted run"


FAIL = "import sys; print('about to fail: marker-31'); sys.exit(1)"


@pytest.mark.parametrize("launcher", ["sbatch", "submitit"])
def test_a_failing_command_fails_the_job_without_a_requeue_and_shows_its_log(
        slurm_env: dict[str, str], launcher: str) -> None:
    proc = cluster_cmd(["--launcher", launcher, "--nodes", "1", "--wait", "--", "python", "-c", FAIL], slurm_env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "marker-31" in proc.stdout + proc.stderr  # the log's last lines, shown by --wait
    job = job_id_of(proc.stdout)
    wait_for(lambda: job_state(job, slurm_env) == "FAILED", timeout=60, what="FAILED")
    states = job_runs(job, slurm_env)
    assert states == ["FAILED"], states


TRIAL = """import json, os, sys
args = sys.argv[1:]
value = float(args[args.index("--lr") + 1])
json.dump({"test_value": value, "argv": args}, open(os.path.join(os.environ["RUN_DIR"], "result.json"), "w"))
"""


def test_a_sweep_over_a_commands_argument(slurm_env: dict[str, str], tmp_path: Path) -> None:
    script = tmp_path / "trial.py"
    script.write_text(TRIAL)
    spec = {"name": "cmd", "cluster": "dev", "profile": {"nodes": 1}, "max_parallel": 2, "metric": "test_value",
            "command": f"python {script} --tag {{tag}}-x", "parameters": {"tag": ["a b", "c"], "lr": [0.5]}}
    (tmp_path / "cmd.yaml").write_text(json.dumps(spec))
    proc = sh([sys.executable, "-m", "cluster", "sweep", str(tmp_path / "cmd.yaml"), "--wait"], slurm_env,
              timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (folder,) = (tmp_path / "sweeps").iterdir()
    for i, tag in enumerate(["a b", "c"]):
        result = json.loads((folder / "trials" / str(i) / "result.json").read_text())
        assert result["argv"] == ["--tag", f"{tag}-x", "--lr", "0.5"], result
    assert re.search(r"best: trial \d \(test_value 0.5", proc.stdout), proc.stdout


NAIVE = """import os, sys, time
restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
print(f"attempt {restart + 1}: started", flush=True)
if restart:
    sys.exit(0)
time.sleep(300)  # never saves, ignores the warning
"""


@pytest.mark.parametrize("launcher", ["sbatch", "submitit"])
def test_requeue_on_signal_requeues_a_command_that_ignores_the_warning(
        slurm_env: dict[str, str], tmp_path: Path, launcher: str) -> None:
    script = tmp_path / "naive.py"
    script.write_text(NAIVE)
    run = tmp_path / "run"
    proc = cluster_cmd(["--launcher", launcher, "--nodes", "1", "--set", "requeue_on_signal=true",
                        "--set", "signal_grace_s=24", "--", "python", str(script)], {**slurm_env, "RUN_DIR": str(run)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = job_id_of(proc.stdout)
    logs = [ROOT / p for p in re.findall(r"logs?:\s+(\S+)", proc.stdout)]
    logs += [p.with_suffix(".err") for p in logs]  # submitit keeps a task's stderr apart

    def said(text: str) -> bool:
        return any(text in p.read_text(errors="replace") for p in logs if p.exists())

    wait_for(lambda: said("attempt 1: started"), what="the command to start under its wrapper")
    assert sh(["scancel", "--signal=USR2", job], slurm_env).returncode == 0
    wait_for(lambda: job_state(job, slurm_env) == "COMPLETED", timeout=180, what="the requeued attempt to finish")
    # The warning alone stopped nothing: the wrapper did, once the grace (24 s less 20 for the exit) had passed.
    assert said("trainer.launch: still running 4 s after SIGUSR2: stopping it for a requeue"), logs
    states = job_runs(job, slurm_env)
    assert len(states) == 2 and said("attempt 2: started"), states
