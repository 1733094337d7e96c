"""W&B in offline mode, checked through the files it writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .conftest import ROOT, SMALL, clean_env, faults, ok, outputs, result_of, run_trainer, spawn_ranks
from .wandb_records import summary

OFFLINE = [a for a in SMALL if not a.startswith("tracking.")] + ["tracking.mode=offline", "train.log_every=4"]


def run_files(run: Path) -> list[Path]:
    return sorted(run.glob("wandb/offline-run-*/run-*.wandb"))


def test_two_processes_make_one_offline_run_with_config_metrics_and_summary(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = ok(run_trainer([*OFFLINE, f"run.dir={run}"], tmp_path, nproc=2))
    files = run_files(run)
    assert len(files) == 1 and len(list(run.glob("wandb/offline-run-*"))) == 1
    rec = summary(files[0])
    assert rec["run_id"] == json.loads((run / "tracking.json").read_text())["run_id"] == result_of(run)["tracking_run_id"]
    assert rec["config"]["optim"]["lr"] == 0.05 and rec["config"]["data"]["name"] == "synthetic"
    steps = sorted(rec["history"])
    assert steps[0] == 4 and steps[-1] == 16
    assert {"train/loss", "train/lr", "train/samples_per_s", "train/step_time_s"} <= set(rec["history"][4])
    assert "eval/accuracy" in rec["history"][16]
    assert (rec["history"][4]["world/processes"], rec["history"][4]["world/nodes"]) == (2, 1)  # the attempt's size
    assert "world/processes" not in rec["history"][8]  # once per attempt
    assert rec["summary"]["test/accuracy"] == result_of(run)["test_accuracy"]
    assert proc.stdout.count("tracking: W&B offline run") == 1  # rank 0 only


def test_auto_without_a_key_is_offline(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = [a for a in OFFLINE if a != "tracking.mode=offline"]
    proc = ok(run_trainer([*args, f"run.dir={run}"], tmp_path, env={"WANDB_API_KEY": "", "HOME": str(tmp_path)}))
    assert "W&B offline run" in proc.stdout and len(run_files(run)) == 1


def test_restarts_continue_one_run_with_increasing_steps(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = [*OFFLINE, "train.epochs=2", f"run.dir={run}"]
    for preempt_at in (6, 9):  # two preemptions, then the run finishes: three processes in all
        ranks = spawn_ranks(args, tmp_path, env=faults(preempt_at_step=preempt_at))
        outs = outputs(ranks, timeout=180)
        assert [p.returncode for p in ranks] == [75, 75], outs
    ranks = spawn_ranks(args, tmp_path)
    outs = outputs(ranks, timeout=180)
    assert [p.returncode for p in ranks] == [0, 0], outs
    files = run_files(run)
    assert len(files) == 3  # offline W&B opens a folder per process start; `wandb sync` merges them
    runs = [summary(f) for f in files]
    assert len({r["run_id"] for r in runs}) == 1
    steps = [s for r in runs for s in sorted(r["history"])]
    assert steps == sorted(steps) and len(steps) == len(set(steps)), steps
    assert steps[-1] == 32


def test_a_run_started_afresh_in_a_used_folder_is_a_new_wandb_run_from_its_first_step(tmp_path: Path) -> None:
    """checkpoint.resume=never in a folder where a run finished: not appended to that W&B run (whose logged steps
    would hide the new run's first 16)."""
    run = tmp_path / "run"
    ok(run_trainer([*OFFLINE, f"run.dir={run}"], tmp_path))
    first = json.loads((run / "tracking.json").read_text())["run_id"]
    afresh = ok(run_trainer([*OFFLINE, f"run.dir={run}", "checkpoint.resume=never", "train.max_steps=8"], tmp_path))
    (again,) = [summary(f) for f in run_files(run) if summary(f)["run_id"] != first]
    assert sorted(again["history"])[0] == 4, again["history"]
    assert json.loads((run / "tracking.json").read_text())["run_id"] == again["run_id"]
    # The first run's checkpoints went aside (kept): a later resume continues the new run, not the older one whose
    # newest step (32) outnumbered the new run's (8).
    (aside,) = run.glob("checkpoints.before-*")
    assert f"checkpoints are set aside in {aside}" in afresh.stdout and list(aside.glob("step_*.json"))
    later = ok(run_trainer([*OFFLINE, f"run.dir={run}", "train.max_steps=8"], tmp_path))
    assert "step_00000008.pt at step 8" in later.stdout, later.stdout
    old = max(aside.glob("step_*.pt"))  # asked for by path, in a folder with checkpoints of its own: said, not silent
    pointed = ok(run_trainer([*OFFLINE, f"run.dir={run}", "train.max_steps=8", f"checkpoint.resume={old}"], tmp_path))
    assert f"checkpoint.resume={old} is where this run started; it continues from its own step_00000008.pt" in \
        pointed.stdout, pointed.stdout
    # never is the job's first start only: its later attempt (here a restart in place) continues, nothing set aside.
    never = [*OFFLINE, f"run.dir={run}", "checkpoint.resume=never", "train.max_steps=16", "checkpoint.poll_steps=1"]
    ok(run_trainer(never, tmp_path, env=faults(preempt_at_step=5)), code=75)
    assert len(list(run.glob("checkpoints.before-*"))) == 2
    later = ok(run_trainer(never, tmp_path, env={"TRAINER_ATTEMPT": "0.1"}))
    assert "at step 6" in later.stdout and len(list(run.glob("checkpoints.before-*"))) == 2, later.stdout


def test_disabled_writes_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ok(run_trainer([*SMALL, f"run.dir={run}"], tmp_path))
    assert not (run / "wandb").exists() and not (run / "tracking.json").exists()
    assert not (tmp_path / "wandb").exists()


def test_broken_wandb_warns_and_training_goes_on(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    run = tmp_path / "run"
    proc = ok(run_trainer([*OFFLINE, f"run.dir={run}", f"tracking.dir={blocker}/wandb"], tmp_path))
    assert "W&B tracking disabled after an error" in proc.stderr
    assert result_of(run)["global_step"] == 32  # trained to the end


def test_a_finished_offline_run_leaves_nothing_in_the_temporary_folder(tmp_path: Path) -> None:
    """wandb makes two folders in TMPDIR at import, removed by finalizers a rank never runs (it ends with os._exit,
    errors.exit_now): every rank 0 with W&B on used to leave both in the node's /tmp."""
    temp, run = tmp_path / "tmp", tmp_path / "run"
    temp.mkdir()
    proc = subprocess.run([sys.executable, "-m", "trainer", *OFFLINE, f"run.dir={run}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=clean_env({"TMPDIR": str(temp), "WANDB_DIR": str(tmp_path)}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert run_files(run), "no offline W&B run was written"
    assert [p.name for p in temp.iterdir() if "wandb" in p.name] == []  # (torch's shared cache folder may stay)


def test_the_wandb_folders_removed_at_exit_are_where_the_adapter_looks() -> None:
    """The private names trainer/runtime/records/wandb_folders.py uses, in the installed wandb."""
    import wandb  # noqa: F401  (imports the modules that make them)

    from trainer.runtime.records.wandb_folders import folders

    found = folders()
    assert len(found) == 2 and all(Path(f.name).is_dir() for f in found), found
