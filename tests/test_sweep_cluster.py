"""Sweeps on the dev cluster, with real Optuna studies: a TPE sweep with ASHA pruning whose worker is preempted mid-trial
(journal file), and a random sweep in the dev cluster's MariaDB whose worker is cancelled (an RDB URL)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.sweeps import study as studies
from cluster.sweeps.worker import record_of

from .conftest import SMALL, faults, go
from .test_slurm import sh, slurm_env, wait_for
from .wandb_records import records

__all__ = ["slurm_env"]  # the fixture, imported for the tests below

ARGS = [a for a in SMALL if not a.startswith(("train.epochs", "data.synthetic_train_size"))]


def submit(spec: dict[str, object], env: dict[str, str], cwd: Path) -> tuple[Path, str]:
    """Submit the sweep (JSON is YAML); its folder and the workers' array id."""
    path = cwd / "spec.yaml"
    path.write_text(json.dumps(spec))
    proc = sh([sys.executable, "-m", "cluster", "sweep", str(path)], env, cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (folder,) = (cwd / "sweeps").iterdir()
    return folder, str(json.loads((folder / "sweep.json").read_text())["arrays"][0])


def assigned(folder: Path, w: int) -> dict[str, object]:
    """What worker ``w`` of the sweep's one array runs (workers/<array>_<w>.json)."""
    try:
        (path,) = (folder / "workers").glob(f"*_{w}.json")
        data: dict[str, object] = json.loads(path.read_text())
        return data
    except (OSError, ValueError):  # not there yet (a ValueError too: no file to unpack)
        return {}


def workers_gone(array: str, env: dict[str, str]) -> bool:
    return not sh(["squeue", "-h", "-r", "-j", array], env).stdout.strip()


def release(folder: Path, keep: str | None = None) -> None:
    """Let every trial held at its ``wait_at_step`` go on, but ``keep`` (a trial's run folder)."""
    for waiting in folder.glob("trials/*/faults/waiting.*"):
        run = waiting.parent.parent
        if str(run) != keep:
            go(run, waiting.name.split(".")[1])


def holds(folder: Path, w: int) -> str | None:
    """The run folder of worker ``w``'s trial when it is held at its ``wait_at_step`` (else None)."""
    run = assigned(folder, w).get("run_dir")
    return str(run) if isinstance(run, str) and any((Path(run) / "faults").glob("waiting.*")) else None


def test_a_tpe_sweep_prunes_concentrates_and_survives_a_preempted_worker(slurm_env: dict[str, str],
                                                                        tmp_path: Path) -> None:
    spec = {"name": "tpe", "profile": {"nodes": 1}, "max_parallel": 2, "method": "tpe", "trials": 10, "seed": 1,
            "sampler_args": {"n_startup_trials": 4}, "pruner": "asha",
            "pruner_args": {"min_resource": 16, "reduction_factor": 2}, "metric": "test_accuracy", "mode": "max",
            "args": [*ARGS, "data.synthetic_train_size=512", "train.epochs=4", "checkpoint.poll_steps=1"],
            "parameters": {"optim.lr": {"type": "float", "low": 0.0001, "high": 0.5, "log": True}}}
    # Every trial of a worker's first attempt is held after step 21 of 64 (a test fault), past its first report: worker
    # 0's first trial is preempted there, through Slurm; the others are let go.
    env = {**slurm_env, **faults(at={"0": {"wait_at_step": 20}})}
    folder, array = submit(spec, env, tmp_path)
    wait_for(lambda: release(folder, holds(folder, 0)) or holds(folder, 0) is not None, timeout=240,
             what="worker 0's first trial to be held after its first report")
    preempted = int(assigned(folder, 0)["trial"])  # type: ignore[call-overload]
    assert (folder / "trials" / str(preempted) / "reports.jsonl").exists()
    assert sh(["scancel", "--signal=USR2", f"{array}_0"], env).returncode == 0
    wait_for(lambda: release(folder) or workers_gone(array, env), timeout=400, what=f"the workers of {array} to end")

    status = sh([sys.executable, "-m", "cluster", "sweep-status", str(folder)], env, cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    study = studies.open_study(record_of(folder), folder)
    trials = study.trials
    assert len(trials) == 10 and {t.state.name for t in trials} <= {"COMPLETE", "PRUNED"}, status.stdout

    # The preempted trial: requeued with its worker, resumed from its checkpoint under the same number, finished.
    run = folder / "trials" / str(preempted)
    result = json.loads((run / "result.json").read_text())
    assert result["resumed_from"] and "/checkpoints/step_" in result["resumed_from"], result
    history = [h["trial"] for h in json.loads((folder / "workers" / f"{array}_0.json").read_text())["history"]]
    assert history.count(preempted) == 1
    starts = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if '"job_start"' in line]
    assert [e["restart"] for e in starts] == [0, 1]
    assert "re-attached to trial" in (folder / "logs" / f"worker-{array}_0.out").read_text()
    for t in trials:  # every reported step is in the study exactly once, wherever the trial was replayed
        reported = [json.loads(line)["step"] for line in (folder / "trials" / str(t.number) / "reports.jsonl")
                    .read_text().splitlines()]
        assert sorted(t.intermediate_values) == sorted(set(reported)), (t.number, reported)

    # ASHA stopped trials early: their result says pruned, not failed, and at least one stopped before the 64th step
    # (a trial judged at the last rung, step 64, is pruned with nothing left to save).
    pruned = [t for t in trials if t.state.name == "PRUNED"]
    results = [json.loads((folder / "trials" / str(t.number) / "result.json").read_text()) for t in pruned]
    assert pruned and all(r["outcome"] == "pruned" and r["global_step"] <= 64 for r in results), status.stdout
    early = [t for t, r in zip(pruned, results, strict=True) if r["global_step"] < 64]
    assert early and all(max(t.intermediate_values) < 64 for t in early), [r["global_step"] for r in results]

    # TPE's concentration on a noisy 10-trial study depends on which trials end first: it is proven in-process
    # (tests/test_sweep.py); here every trial after the start-up ones was asked of the spec's sampler.
    assert len({t.params["optim.lr"] for t in trials}) == 10
    page = (folder / "sweep.html").read_text()
    assert "intermediate values (pruned trials end early)" in page and "<tr class='pruned'>" in page


@pytest.fixture
def mariadb_url(slurm_env: dict[str, str]) -> str:
    """A fresh database and user in the dev cluster's MariaDB, as an SQLAlchemy URL over TCP."""
    state = Path(slurm_env.get("DEV_CLUSTER_DIR") or os.environ.get("DEV_CLUSTER_DIR")
                 or Path(os.environ.get("TMPDIR", "/tmp")) / "slurm-ddp-dev-cluster")
    ports = dict(line.split("=", 1) for line in (state / "ports").read_text().split())
    name, password = f"optuna_{secrets.token_hex(4)}", secrets.token_hex(8)
    sql = (f"CREATE DATABASE {name}; CREATE USER '{name}'@'127.0.0.1' IDENTIFIED BY '{password}'; "
           f"GRANT ALL ON {name}.* TO '{name}'@'127.0.0.1';")
    subprocess.run(["mariadb", "--no-defaults", f"--socket={state / 'mariadb' / 'mariadb.sock'}", "-u", "root",
                    "-e", sql], check=True, capture_output=True, text=True)
    return f"mysql+pymysql://{name}:{password}@127.0.0.1:{ports['mariadb']}/{name}"


def test_a_sweep_in_mariadb_fails_and_reruns_the_trial_of_a_cancelled_worker(
        slurm_env: dict[str, str], mariadb_url: str, tmp_path: Path) -> None:
    spec = {"name": "rdb", "profile": {"nodes": 1}, "max_parallel": 2, "method": "random", "trials": 3, "seed": 5,
            "storage": mariadb_url, "metric": "test_loss", "mode": "min",
            "args": [*[a for a in ARGS if not a.startswith("tracking.")], "data.synthetic_train_size=512",
                     "train.epochs=2", "tracking.mode=offline"],
            "parameters": {"optim.lr": {"type": "float", "low": 0.001, "high": 0.3, "log": True}}}
    env = {**slurm_env, **faults(at={"0": {"wait_at_step": 5}})}  # every trial held after step 6 until let go
    folder, array = submit(spec, env, tmp_path)
    assert not (folder / studies.JOURNAL).exists()  # the study lives in the database
    wait_for(lambda: all(holds(folder, w) for w in (0, 1)), timeout=240, what="both workers' trials to be held")
    lost = int(assigned(folder, 1)["trial"])  # type: ignore[call-overload]
    assert sh(["scancel", f"{array}_1"], env).returncode == 0  # cancelled: never requeued, its trial stays RUNNING
    wait_for(lambda: release(folder) or workers_gone(array, env), timeout=300, what=f"the workers of {array} to end")

    study = studies.open_study(record_of(folder), folder)
    states = {t.number: t.state.name for t in study.trials}
    assert states[lost] == "FAIL" and "no longer pending or running" in study.trials[lost].user_attrs["lost"]
    (retry,) = [t for t in study.trials if t.user_attrs.get("retry_of") == lost]
    assert retry.params == study.trials[lost].params and retry.state.name == "COMPLETE"
    assert sorted(states.values()) == ["COMPLETE", "COMPLETE", "COMPLETE", "FAIL"]
    out = sh([sys.executable, "-m", "cluster", "sweep-status", str(folder)], env, cwd=tmp_path).stdout
    assert f"{len(study.trials)} of 3 trials" in out and "failed" in out

    # The password is in one file only this user reads; nothing else in the sweep's folder or the ledger holds it.
    password = mariadb_url.split(":")[2].split("@")[0]
    leaks = [p for p in [*folder.rglob("*"), *Path(env["TRAINER_LEDGER"]).rglob("*")]
             if p.is_file() and p.name != "storage-url" and password.encode() in p.read_bytes()]
    assert not leaks and (folder / "storage-url").stat().st_mode & 0o777 == 0o600, leaks
    assert ":***@" in record_of(folder).spec["storage"]

    # One W&B run per trial, grouped by the sweep, named after the trial.
    t = retry.number
    (wandb_file,) = (folder / "trials" / str(t)).glob("wandb/offline-run-*/run-*.wandb")
    (run,) = [r.run for r in records(wandb_file) if r.WhichOneof("record_type") == "run"]
    assert (run.run_group, run.display_name) == (folder.name, f"{folder.name}-{t}")
