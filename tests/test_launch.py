"""`python -m trainer.launch`: any command as one Slurm task (real processes, Slurm's variables set by hand)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import ROOT, clean_env, faults, free_port, held, outputs

PLAIN = ROOT / "tests" / "scripts" / "plain_ddp.py"
HOSTILE = ["a b", "x'; touch pwned; echo 'y", "$(touch pwned)", "--flag=1", "--"]


def slurm_task(rank: int, world: int, job_id: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """What srun gives one task of a one-node step."""
    return clean_env({"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NTASKS": str(world),
                      "SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "127.0.0.1",
                      "SLURM_STEP_ID": "0", "SLURM_JOB_ID": str(job_id), "SLURM_NTASKS_PER_NODE": str(world),
                      **(extra or {})})


def launch(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "trainer.launch", *args], env=env, cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def test_a_plain_ddp_script_gets_torchruns_variables_from_slurms(tmp_path: Path) -> None:
    job_id = free_port() - 15000  # the port trainer.core.env derives from the job id is then free
    assert job_id > 0
    # PATH without this venv: "python" must mean the job's interpreter, not the system's (which has no torch).
    procs = [launch(["--", "python", str(PLAIN), *HOSTILE],
                    slurm_task(r, 2, job_id, {"PATH": "/usr/bin:/bin", "OUT_DIR": str(tmp_path)}), tmp_path)
             for r in range(2)]
    outs = outputs(procs, timeout=120)
    assert [p.returncode for p in procs] == [0, 0], outs
    lines = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [x["rank"] for x in lines] == [0, 1] and {x["world_size"] for x in lines} == {2}
    assert [x["local_rank"] for x in lines] == [0, 1] and {x["local_world_size"] for x in lines} == {2}
    assert {x["sum"] for x in lines} == {3.0} and {x["master_addr"] for x in lines} == {"127.0.0.1"}
    assert lines[0]["grad"] == lines[1]["grad"]
    assert all(x["argv"] == HOSTILE for x in lines)
    assert not list(tmp_path.rglob("pwned"))


def _wait_for_child(proc: subprocess.Popen[str]) -> None:
    """Until the wrapper's command has started (it prints a line)."""
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "started"


SLEEPER = "import time, sys; print('started', flush=True); time.sleep(60); sys.exit(0)"


def test_a_command_that_ignores_the_warning_keeps_running(tmp_path: Path) -> None:
    proc = launch(["--", "python", "-c", SLEEPER], slurm_task(0, 1, 7, {"RUN_DIR": str(tmp_path)}), tmp_path)
    _wait_for_child(proc)
    os.killpg(proc.pid, signal.SIGUSR2)  # as Slurm signals every process of the step
    time.sleep(1.5)
    assert proc.poll() is None, proc.communicate()[0]  # neither the wrapper nor the command died of it
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "requeue.json").exists()


def test_requeue_after_stops_a_command_that_does_not_save_and_asks_for_a_requeue(tmp_path: Path) -> None:
    proc = launch(["--requeue-after", "1", "--", "python", "-c", SLEEPER],
                  slurm_task(0, 1, 7, {"RUN_DIR": str(tmp_path)}), tmp_path)
    _wait_for_child(proc)
    os.killpg(proc.pid, signal.SIGUSR2)
    out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 75, out
    assert "stopping it for a requeue" in out
    assert json.loads((tmp_path / "requeue.json").read_text())["by"] == "trainer.launch"


@pytest.mark.parametrize(("code", "expected"), [
    ("import sys; sys.exit(3)", 3),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 128 + 9),
    ("import sys; sys.exit(75)", 75),
])
def test_exit_codes_pass_through(tmp_path: Path, code: str, expected: int) -> None:
    proc = launch(["--", "python", "-c", code], slurm_task(0, 1, 7, {"RUN_DIR": str(tmp_path)}), tmp_path)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == expected, out
    assert (tmp_path / "requeue.json").exists() == (expected == 75)  # rank 0 leaves the marker for the batch shell


@pytest.mark.parametrize(("signum", "kind"), [(9, "infrastructure"), (6, "user_error")])
def test_a_shells_child_killed_by_a_signal_is_classed_as_that_signal(tmp_path: Path, signum: int, kind: str) -> None:
    """`CMD="bash train.sh"` whose python is OOM-killed: bash exits 128+9, which was "the command exited 137", the
    user's error, never retried; an abort() stays the program's own."""
    script = f"{sys.executable} -c 'import os; os.kill(os.getpid(), {signum})'; exit $?"
    proc = launch(["--", "bash", "-c", script], slurm_task(0, 1, 7, {"RUN_DIR": str(tmp_path)}), tmp_path)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 128 + signum, out
    (record,) = [json.loads(p.read_text()) for p in tmp_path.glob("exits/*/train-0.json")]
    assert (record["code"], record["class"]) == (128 + signum, kind), record
    assert f"(exit {128 + signum}: a shell's child)" in record["cause"], record


@pytest.mark.parametrize("options", [["-u"], []])
def test_under_torchruns_agent_interpreter_options_reach_the_interpreter(tmp_path: Path, options: list[str]) -> None:
    """`launch: torchrun` with `python -u …` or `python -c …`: torchrun took -u and -c for its own options (exit 2)."""
    code = "import sys; print('ran', sys.argv[1:])"
    proc = launch(["--torchrun", "1", "--", "python", *options, "-c", code, "x y"],
                  slurm_task(0, 1, 7, {"RUN_DIR": str(tmp_path), "MASTER_PORT": str(free_port())}), tmp_path)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0 and "ran ['x y']" in out, out


@pytest.mark.parametrize(("args", "field"), [([], "CMD"), (["--", "no-such-program-x"], "CMD"),
                                             (["--signal", "KILL", "--", "true"], "--signal")])
def test_bad_commands_are_clear(tmp_path: Path, args: list[str], field: str) -> None:
    proc = launch(args, slurm_task(0, 1, 7, {"RUN_DIR": str(tmp_path)}), tmp_path)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 2, out
    assert f"error: {field}" in out and "HINT:" in out and "Traceback" not in out
    # A command that cannot start is the user's error in its exit record too: a start record left alone reads as
    # killed by a signal (the node's fault: retried, and the node blamed).
    records = list(tmp_path.glob("exits/*/train-0.json"))
    assert len(records) == (args[-1:] == ["no-such-program-x"])  # the others stop before the command's start
    for record in records:
        info = json.loads(record.read_text())
        assert (info["code"], info["class"]) == (2, "user_error"), info


def test_the_session_api_saves_on_the_jobs_warning_signal_into_run_dir(tmp_path: Path) -> None:
    """USR1 is not one the session saves on by default (SIGUSR2, SIGTERM): TRAINER_SIGNAL tells it; RUN_DIR is its run
    folder."""
    run = tmp_path / "run"
    proc = launch(["--signal", "USR1", "--", "python", str(ROOT / "examples" / "char_lm" / "train.py"),
                   "--max-steps", "400", "--max-bytes", "40000", "--eval-every", "1000", "checkpoint.poll_steps=1"],
                  slurm_task(0, 1, 7, {"RUN_DIR": str(run), **faults(wait_at_step=3)}), tmp_path)
    held(run, [proc])  # some steps in
    os.killpg(proc.pid, signal.SIGUSR1)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 75, out
    assert (run / "requeue.json").exists() and (run / "checkpoints" / "latest").exists(), out
