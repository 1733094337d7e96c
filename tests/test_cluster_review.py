"""The cluster tools where a review found them wrong: an interpreter path in submitit's srun line, one job's line of
``scontrol show job``, node lists without scontrol, ``regroup`` under submitit, an empty ``RUN=``, Ctrl-C while
waiting, the verdict's safety cap in a sweep's worker, a RESUMEd sweep's re-attached trial. Slurm's commands are
stand-ins on PATH (printing what Slurm prints), the tools run as a user runs them."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import hostlist
import pytest

from cluster.__main__ import main as cluster_main
from cluster.job import ledger, nodes
from cluster.launch.command import Trainer
from cluster.launch.launchers import submitit_script
from cluster.profile import load_profile
from cluster.sweeps import study as studies
from cluster.sweeps import worker

from .conftest import ROOT, clean_env
from .test_sweep import local_sweep, squeue  # noqa: F401 (the fake squeue the sweep tests list workers with)

TPE = "method: tpe\ntrials: 4\nparameters: {optim.lr: {type: float, low: 0.001, high: 0.1, log: true}}"


def stand_ins(bin_dir: Path, scripts: dict[str, str]) -> str:
    """Slurm's commands as shell scripts in ``bin_dir``; the PATH that finds them first (and no other Slurm)."""
    bin_dir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return f"{bin_dir}:/usr/local/bin:/usr/bin:/bin"


# ---- submitit's srun line runs the profile's interpreter as one word ---------------------------------------------

@pytest.mark.parametrize(("overrides", "program"), [
    ({"python": "/opt/my venv/bin/python"}, ["/opt/my venv/bin/python"]),
    ({"python": "/opt/venv/bin/python"}, ["/opt/venv/bin/python"]),
    ({"container.runtime": "apptainer", "container.image": "img:1"}, ["--", "img:1", "python3"]),
    ({"container.runtime": "pyxis", "container.image": "img:1"}, ["--container-workdir=$PWD", "python3"]),
])
def test_submitits_tasks_start_the_profiles_interpreter(overrides: dict[str, object], program: list[str]) -> None:
    text = submitit_script(load_profile("dev", overrides), Trainer(()))
    (line,) = [x for x in text.splitlines() if "submitit.core._submit" in x]
    words = shlex.split(line)
    assert words[words.index("-u") - len(program):words.index("-u")] == program, line


# ---- scontrol: the asked job's line, and node lists it cannot expand ---------------------------------------------

ARRAY = ("JobId=101 ArrayJobId=100 ArrayTaskId=0 JobName=w Partition=a StdOut=/logs/w-100_0.out\n"
         "JobId=100 ArrayJobId=100 ArrayTaskId=1 JobName=w Partition=a StdOut=/logs/w-100_1.out\n"
         "JobId=102 ArrayJobId=100 ArrayTaskId=2-4%2 JobName=w Partition=a StdOut=/logs/w-100_[2-4].out\n")
HET = ("JobId=200 HetJobId=200 HetJobOffset=0 JobName=h Partition=cpu StdOut=/logs/h 0.out\n"
       "JobId=201 HetJobId=200 HetJobOffset=1 JobName=h Partition=gpu StdOut=/logs/h 1.out\n")


@pytest.mark.parametrize(("printed", "job", "log"), [
    (ARRAY, "100", "/logs/w-100_1.out"),  # the array's first id lists every task: its own line, not the last
    (ARRAY, "101", "/logs/w-100_0.out"),
    (ARRAY, "100_0", "/logs/w-100_0.out"),
    (ARRAY, "100_3", "/logs/w-100_[2-4].out"),  # a pending task shares its range's line
    (ARRAY, "100_9", None),  # no line of its own: nothing rather than another task's
    (HET, "200", "/logs/h 0.out"),
    (HET, "200+1", "/logs/h 1.out"),
    (HET.splitlines()[1], "201", "/logs/h 1.out"),
])
def test_the_fields_of_the_job_asked_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, printed: str, job: str,
                                         log: str | None) -> None:
    (tmp_path / "out").write_text(printed + "\n")
    monkeypatch.setenv("PATH", stand_ins(tmp_path / "bin", {"scontrol": f"cat {tmp_path / 'out'}"}))
    assert nodes.job_fields(job).get("StdOut") == log


@pytest.mark.parametrize("nodelist", ["n[01-03,07]", "n1,n2", "gpu-[1-2]-ib[3-4]", "a[08-10],b7,c[1,3]", "n[9-11]",
                                      "node1", "rack1-n[1-2],rack2-n[1-2]"])
@pytest.mark.parametrize("scontrol", ["exit 1", None])  # failing, or not installed
def test_a_node_list_is_expanded_when_scontrol_cannot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nodelist: str,
                                                      scontrol: str | None) -> None:
    monkeypatch.setenv("PATH", stand_ins(tmp_path / "bin", {"scontrol": scontrol} if scontrol else {})
                       .replace(":/usr/local/bin:/usr/bin:/bin", ""))
    assert nodes.hostnames(nodelist) == hostlist.expand_hostlist(nodelist)
    assert nodes.excluded({"ExcNodeList": nodelist}) == hostlist.expand_hostlist(nodelist)


# ---- submitit refuses regroup, as it refuses spare nodes and node ranges -----------------------------------------

@pytest.mark.parametrize(("launcher", "code"), [("submitit", 2), ("sbatch", 0)])
def test_regroup_needs_the_sbatch_launcher(capsys: pytest.CaptureFixture[str], launcher: str, code: int) -> None:
    assert cluster_main(["submit", "--launcher", launcher, "--dry-run", "--set", "regroup=true",
                         "--", "python", "-c", "pass"]) == code
    out, err = capsys.readouterr()
    if code:
        assert err.startswith("error: profile.regroup: ") and "HINT: LAUNCHER=sbatch" in err, err
    else:
        assert "--kill-on-bad-exit=0" in out and "trainer.store" in out


# ---- the run tools without RUN= ----------------------------------------------------------------------------------

@pytest.mark.parametrize("tool", ["status", "logs", "cancel", "resubmit"])
@pytest.mark.parametrize("ref", ["", "  "])
def test_a_run_tool_without_a_run_says_how_to_name_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str], tool: str, ref: str) -> None:
    monkeypatch.setenv(ledger.LEDGER_ENV, str(tmp_path / "ledger"))
    monkeypatch.chdir(tmp_path)  # a folder holding runs: '' must not name it
    ledger.write(ledger.Record(kind="job", name="t", job_id="5", run_dir=str(tmp_path), log=""))
    assert cluster_main([tool, ref]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: RUN: no run given") and "HINT: RUN=<folder, job id or name>" in err, err


# ---- Ctrl-C while waiting: one line, exit 130, the job runs on ---------------------------------------------------

def interrupted(argv: list[str], cwd: Path, path: str, ready: str) -> tuple[int, str]:
    """Run ``python -m cluster ARGV`` as a user does, press Ctrl-C (SIGINT to its process group, as a terminal sends
    it) once its output says ``ready``; its exit code and stderr."""
    env = clean_env({"PATH": path, "PYTHONPATH": str(ROOT), "TRAINER_LEDGER": str(cwd / "ledger"),
                     "TRAINER_SUSPECTS": str(cwd / "suspects.json")})
    proc = subprocess.Popen([sys.executable, "-m", "cluster", *argv], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None
    try:
        seen: list[str] = []
        while not any(ready in line for line in seen):
            line = proc.stdout.readline()
            assert line, f"ended before {ready!r}: {''.join(seen)}{proc.communicate()[1]}"
            seen.append(line)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # it never ended: nothing of it outlives the test
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, err


SBATCH = 'case "$1" in --help) exit 0;; esac\ncat >/dev/null\necho 990003\ncase "$*" in *--wait*) exec sleep 600;; esac'
SUBMITIT_SBATCH = 'case "$1" in --help) exit 0;; esac\necho "Submitted batch job 990004"'


@pytest.mark.parametrize(("launcher", "job", "sbatch"), [("sbatch", "990003", SBATCH),
                                                         ("submitit", "990004", SUBMITIT_SBATCH)],
                         ids=["sbatch", "submitit"])
def test_ctrl_c_while_waiting_for_a_job_stops_the_waiting_only(tmp_path: Path, launcher: str, job: str,
                                                               sbatch: str) -> None:
    path = stand_ins(tmp_path / "bin", {
        "sbatch": sbatch, "srun": "exit 0", "sinfo": "exit 1", "scontrol": "exit 1", "squeue": "echo RUNNING",
        "sacct": f"echo 'JobID|State|NodeList'; echo '{job}|RUNNING|n1'"})
    rc, err = interrupted(["submit", "--launcher", launcher, "--wait", "--", sys.executable, "-c", "pass"], tmp_path,
                          path, f"submitted job {job}")
    assert rc == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith(f"stopped waiting; job {job} runs on"), err


def test_ctrl_c_while_following_a_log_stops_the_following_only(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "t-5.out"
    log.write_text("attempt 0 of job 5 starts on n1\nstep 1\n")
    monkeypatch.setenv(ledger.LEDGER_ENV, str(tmp_path / "ledger"))  # the one the command reads (interrupted)
    ledger.write(ledger.Record(kind="job", name="t", job_id="5", run_dir=str(tmp_path), log=str(log),
                               launcher="sbatch"))
    path = stand_ins(tmp_path / "bin", {"squeue": "echo RUNNING", "sacct": "exit 0"})
    rc, err = interrupted(["logs", "5", "--follow"], tmp_path, path, "step 1")
    assert rc == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("stopped following; job 5 runs on"), err


# ---- the verdict's cap counts a sweep trial's own requeues ------------------------------------------------------

def start(job: str, restart: int) -> dict[str, object]:
    return {"t": 1.0, "event": "job_start", "job_id": job, "restart": restart, "nodes": 1}


@pytest.mark.parametrize(("events", "restarts", "trial", "decision"), [
    # a sweep worker's 8th attempt, this trial's 2nd: the trials before spent the job's restart count, not this one's
    ([start("7", 6)], 7, True, "requeue"),
    ([start("7", 0)], 7, True, "fail"),  # a trial requeued 7 times: the cap holds
    ([start("8", 0)], 7, True, "requeue"),  # another job's attempts (the array before a RESUME) are not this job's
    # a job whose folder forgot its earlier attempts (and their verdicts): Slurm's count still stops the loop
    ([start("7", 6)], 7, False, "fail"),
    ([], 7, False, "fail"),
    ([start("7", 0)], 2, False, "requeue"),
])
def test_the_verdicts_cap_counts_a_trials_own_requeues(tmp_path: Path, events: list[dict[str, object]],
                                                       restarts: int, trial: bool, decision: str) -> None:
    run = tmp_path / "run"
    (run / "exits" / f"7.{restarts}").mkdir(parents=True)
    (run / "exits" / f"7.{restarts}" / "train-0.json").write_text(json.dumps(
        {"rank": 0, "node": "n1", "code": 75, "class": "preempted", "cause": "saved for a requeue", "t": 1.0}))
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in [*events, start("7", restarts)]))
    path = stand_ins(tmp_path / "bin", {"scontrol": "exit 0", "sinfo": "exit 1", "srun": "exit 0"})
    env = clean_env({"PATH": path, "PYTHONPATH": str(ROOT), "SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": str(restarts),
                     **({"TRAINER_TRIAL": "s-1-3"} if trial else {})})  # as the worker's assignment exports it
    proc = subprocess.run([sys.executable, "-m", "cluster.job.verdict", "--run-dir", str(run), "--rc", "75",
                           "--suspects", str(tmp_path / "suspects.json")], env=env, capture_output=True, text=True,
                          timeout=60)
    (end,) = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()
              if json.loads(line)["event"] == "attempt_end"]
    assert end["decision"] == decision and proc.returncode == (0 if decision == "requeue" else 75), proc.stderr


# ---- a RESUMEd sweep: the new array's worker owns the trial it re-attached to ------------------------------------

def be(monkeypatch: pytest.MonkeyPatch, array: str, w: int) -> None:
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", array)
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", str(w))
    monkeypatch.setenv("SLURM_JOB_ID", f"{array}{w}")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")


def test_a_trial_re_attached_by_a_resumed_sweeps_worker_is_not_lost(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, squeue: Path) -> None:  # noqa: F811 (the fixture)
    folder = local_sweep(tmp_path, TPE)
    be(monkeypatch, "900", 1)
    assert worker.next_trial(folder, 1) == 0
    number = json.loads((folder / "workers" / "900_1.json").read_text())["trial"]
    squeue.write_text("901_0|RUNNING\n901_1|RUNNING\n")  # `make cancel`, then `make sweep RESUME=…`: array 901
    be(monkeypatch, "901", 1)
    assert worker.next_trial(folder, 1) == 0  # re-attached: it trains the trial now
    be(monkeypatch, "901", 0)
    assert worker.next_trial(folder, 0) == 0  # asks, and judges the others' trials
    trials = studies.open_study(worker.record_of(folder), folder).trials
    assert trials[number].state.name == "RUNNING", trials[number].user_attrs
    assert {k: trials[number].user_attrs[k] for k in ("array", "job", "worker")} == {"array": "901", "job": "9011",
                                                                                     "worker": 1}
    assert not [t.number for t in trials if t.user_attrs.get("retry_of") == number]  # no second copy of it


def test_a_sweep_resumed_while_its_array_runs_never_gives_one_trial_to_two_jobs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, squeue: Path) -> None:  # noqa: F811 (the fixture)
    """`make sweep RESUME=…` while array 900 still trains: task 901_0 reused 900_0's files (workers/0.json) and
    re-attached to the trial 900_0 trains, both jobs in one RUN_DIR. Each array's task has its own files, and a trial
    is taken over only from a worker Slurm no longer lists."""
    squeue.write_text("900_0|RUNNING\n")
    folder = local_sweep(tmp_path, TPE)
    be(monkeypatch, "900", 0)
    assert worker.next_trial(folder, 0) == 0
    old = json.loads((folder / "workers" / "900_0.json").read_text())["trial"]
    squeue.write_text("900_0|RUNNING\n901_0|RUNNING\n")
    be(monkeypatch, "901", 0)
    assert worker.next_trial(folder, 0) == 0
    new = json.loads((folder / "workers" / "901_0.json").read_text())["trial"]
    assert new != old and json.loads((folder / "workers" / "900_0.json").read_text())["trial"] == old
    trials = studies.open_study(worker.record_of(folder), folder).trials
    assert trials[old].state.name == "RUNNING" and trials[old].user_attrs["array"] == "900"
    assert "/trials/" + str(new) in (folder / "workers" / "901_0.sh").read_text()


def test_a_resumed_sweeps_worker_does_not_inherit_the_failures_of_the_cancelled_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, squeue: Path) -> None:  # noqa: F811 (the fixture)
    """A broken environment failed worker 900_0's trials until it stopped; fixed, the sweep is RESUMEd: 901_0 starts
    with no failures of its own (it stopped at once, "its last 3 trials failed", when it read 900_0's file)."""
    squeue.write_text("900_0|RUNNING\n")
    folder = local_sweep(tmp_path, TPE.replace("trials: 4", "trials: 9"))
    be(monkeypatch, "900", 0)
    for _ in range(worker.FAILURES_IN_A_ROW):
        assert worker.next_trial(folder, 0) == 0
        assert worker.end(folder, 0, 1) == 0  # no result.json: failed
    assert worker.next_trial(folder, 0) == worker.EXIT_STOP
    squeue.write_text("901_0|RUNNING\n")
    be(monkeypatch, "901", 0)
    assert worker.next_trial(folder, 0) == 0


@pytest.mark.parametrize("target", ["status", "logs", "cancel"])
def test_make_passes_a_hostile_value_as_one_word(tmp_path: Path, target: str) -> None:
    """`make status RUN="a'b; touch …"`: the value reaches the tool whole (a ' closed the Makefile's quotes before,
    a shell syntax error at best, the rest run at worst)."""
    marker = tmp_path / "ran"
    value = f"a'b; touch {marker}"
    proc = subprocess.run(["make", "-s", target, f"RUN={value}"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "TRAINER_LEDGER": str(tmp_path / "ledger")})
    assert proc.returncode == 2, proc.stderr
    assert f'no run named "{value}"' in proc.stderr and not marker.exists(), proc.stderr
