"""Sweeps: spec validation, trial planning, status ranking, the array script, and one real array on the dev cluster."""

from __future__ import annotations

import json
import re
import shlex
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from cluster import sweep, sweep_spec, sweep_status
from cluster.__main__ import main as cluster_main
from cluster.sweep_spec import SweepSpec, plan
from cluster.sweep_status import status
from trainer.core.config import load as load_train_config
from trainer.core.files import write_json

from .conftest import ROOT, SMALL, faults
from .test_slurm import sh, slurm_env, wait_for
from .wandb_records import records

__all__ = ["slurm_env"]  # the fixture, imported for the dev-cluster test below

GRID = "parameters: {optim.lr: [0.05, 0.1], data.batch_size: [32, 64]}"


def write(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text + "\n")
    return path


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = cluster_main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


# (spec YAML, the field the error names, a piece of its message)
BAD_SPECS = [
    ("name: 'a b'\n" + GRID, "sweep.name", "characters"),
    ("method: bayes\n" + GRID, "sweep.method", "grid or random"),
    ("methd: grid\n" + GRID, "sweep.methd", "not in"),
    ("parameters: {}", "sweep.parameters", "empty"),
    ("parameters: [optim.lr]", "sweep.parameters", "mapping"),
    ("parameters: {optim.lr: []}", "sweep.parameters.optim.lr", "no values"),
    ("parameters: {optim.lr: [0.1, 0.1]}", "sweep.parameters.optim.lr", "twice"),
    ("parameters: {optim.lr: {distribution: uniform, min: 0.01, max: 0.1}}", "sweep.parameters.optim.lr", "method: random"),
    ("method: random\ntrials: 2\nparameters: {optim.lr: {distribution: uniform, min: 0.1, max: 0.1}}",
     "sweep.parameters.optim.lr", "below max"),
    ("method: random\ntrials: 2\nparameters: {optim.lr: {distribution: log_uniform, min: 0, max: 0.1}}",
     "sweep.parameters.optim.lr.min", "min > 0"),
    ("method: random\ntrials: 2\nparameters: {optim.lr: {distribution: normal, min: 0.01, max: 0.1}}",
     "sweep.parameters.optim.lr.distribution", "uniform"),
    ("method: random\ntrials: 2\nparameters: {data.batch_size: {distribution: int_uniform, min: 8.5, max: 64}}",
     "sweep.parameters.data.batch_size.min", "whole number"),
    ("method: random\ntrials: 2\nparameters: {optim.lr: {distribution: uniform, max: 0.1}}",
     "sweep.parameters.optim.lr.min", "required"),
    ("method: random\n" + GRID, "sweep.trials", "trials >= 1"),
    ("method: random\ntrials: 1001\n" + GRID, "sweep.trials", "at most 1000"),
    ("trials: 4\n" + GRID, "sweep.trials", "random only"),
    ("parameters: {optim.lr: [" + ", ".join(str(i / 1000 + 0.001) for i in range(1001)) + "]}",
     "sweep.parameters", "1001 trials"),
    ("max_parallel: 0\n" + GRID, "sweep.max_parallel", ">= 1"),
    ("max_parallel: two\n" + GRID, "sweep.max_parallel", "Integer"),
    ("metric: accuracy\n" + GRID, "sweep.metric", "not a metric"),
    ("mode: best\n" + GRID, "sweep.mode", "max or min"),
    ("args: [optim.momentum]\n" + GRID, "sweep.args", "key=value"),
    ("args: [optim.momentun=0.5]\n" + GRID, "sweep.args", "unknown key"),
    ("args: [optim.lr=0.3]\n" + GRID, "sweep.args", "also a swept parameter"),
    ("args: [run.dir=/tmp/x]\n" + GRID, "sweep.args", "per trial"),
    ("parameters: {tracking.group: [a, b]}", "sweep.parameters.tracking.group", "per trial"),
    ("parameters: {optim.lrr: [0.1]}", "sweep.parameters.optim.lrr", "unknown key"),
    ("parameters: {optim.lr: [0.1, -1]}", "sweep.parameters.optim.lr", "must be > 0"),
    ("parameters: {data.name: [synthetic, mnist]}", "sweep.trials.1", "data.root"),
    ("profile: {nodes: 2}\nparameters: {data.global_batch_size: [64, 63]}", "sweep.parameters.data.global_batch_size",
     "63 samples per step do not split equally across 2 processes"),
    ("profile: {nodez: 1}\n" + GRID, "sweep.profile.nodez", "not in"),
    ("cluster: nowhere\n" + GRID, "sweep.cluster", "no profile"),
    ("profile: {launch: torchrun}\n" + GRID, "sweep.profile.launch", "submitit"),
    ("parameters: {optim.lr: [0.1\n", "SWEEP", "not valid YAML"),
    ("parameters: {optim.lr: [1, 1.0]}", "sweep.parameters.optim.lr", "twice"),
    ("parameters: {optim: {lr: [0.1, 0.2]}}", "sweep.parameters.optim", "group of keys"),
    ("args: [{train.epochs: 1}]\n" + GRID, "sweep.args", "key=value strings"),
    ("args: [checkpoint.signal=SIGTERM]\n" + GRID, "sweep.args", "no longer a key"),
    ("method: random\ntrials: 5\nparameters: {optim.name: [sgd, adamw], data.batch_size: [32, 64]}",
     "sweep.trials", "only 4"),
    ("method: random\ntrials: 4\nparameters: {data.batch_size: {distribution: int_uniform, min: 16, max: 18}}",
     "sweep.trials", "only 3"),
]


@pytest.mark.parametrize(("text", "field", "message"), BAD_SPECS, ids=[c[1] + ":" + c[2] for c in BAD_SPECS])
def test_bad_spec_is_a_user_error_naming_the_field(text: str, field: str, message: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    spec = write(tmp_path, text)
    rc, out, err = cli(["sweep", str(spec), "--dry-run"], capsys)
    assert rc == 2 and not out
    first, hint = err.splitlines()
    assert first.startswith(f"error: {field}: ") and message in first, err
    assert hint.startswith("HINT: ") and len(hint) > 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]  # nothing written


def test_a_bad_trainer_key_keeps_the_trainers_hint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = cli(["sweep", str(write(tmp_path, "parameters: {optim.lrr: [0.1]}")), "--dry-run"], capsys)
    assert rc == 2 and "HINT: valid keys under 'optim': " in err and "lr," in err and "Traceback" not in err


@pytest.mark.parametrize(("argv", "field"), [
    (["sweep", "missing.yaml"], "SWEEP"),
    (["sweep", "SPEC", "--set", "nodes"], "--set"),
    (["sweep-status"], "SWEEP_DIR"),
    (["sweep-status", "."], "SWEEP_DIR"),
])
def test_cli_input_errors(argv: list[str], field: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    argv = [str(write(tmp_path, GRID)) if a == "SPEC" else a for a in argv]
    rc, _, err = cli(argv, capsys)
    assert rc == 2 and err.startswith(f"error: {field}: ") and "\nHINT: " in err, err


def spec_of(tmp_path: Path, text: str) -> SweepSpec:
    return sweep_spec.load_spec(write(tmp_path, text))


def test_grid_is_the_cartesian_product_in_a_stable_order(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, "args: [train.epochs=1]\nparameters: {optim.lr: [0.01, 0.05, 0.2], data.batch_size: [32, 64]}")
    trials = plan(spec)
    assert [(t.index, t.overrides["optim.lr"], t.overrides["data.batch_size"]) for t in trials] == [
        (0, 0.01, 32), (1, 0.01, 64), (2, 0.05, 32), (3, 0.05, 64), (4, 0.2, 32), (5, 0.2, 64)]
    assert trials[3].args == ["train.epochs=1", "optim.lr=0.05", "data.batch_size=64"]
    assert plan(spec) == trials
    folder = tmp_path / "sweeps" / "s-20250101-000000"
    assert trials[3].task_args(folder) == [*trials[3].args, "tracking.group=s-20250101-000000",
                                           "run.name=s-20250101-000000-3"]  # the run folder comes as RUN_DIR


def test_grid_values_render_as_the_trainer_reads_them(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, "parameters: {train.deterministic: [true, false], optim.lr: [1e-4], model.name: [cnn]}")
    assert [t.args for t in plan(spec)] == [["train.deterministic=true", "optim.lr=0.0001", "model.name=cnn"],
                                            ["train.deterministic=false", "optim.lr=0.0001", "model.name=cnn"]]


def test_string_values_reach_the_trainer_as_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # YAML would read these back as something else: a bool, an int, a comment, a quoted word, null.
    values = ["exp #1", "yes", "0x10", '"q"', "null", "a: b", "plain"]
    spec = spec_of(tmp_path, "parameters: {tracking.project: " + json.dumps(values) + "}")
    for t in plan(spec):
        assert load_train_config(t.task_args(tmp_path)).tracking.project == values[t.index]
    rc, out, _ = cli(["sweep", str(write(tmp_path, "parameters: {tracking.project: " + json.dumps(values) + "}")),
                      "--dry-run"], capsys)
    assert rc == 0 and [line.split(None, 1)[1] for line in out.split("\n\n")[0].splitlines()[2:]] == values


def test_random_trials_are_distinct(tmp_path: Path) -> None:
    text = "method: random\ntrials: {n}\nparameters: {{optim.name: [sgd, adamw], data.batch_size: [32, 64]}}"
    trials = plan(spec_of(tmp_path, text.format(n=4)))
    assert sorted(tuple(t.overrides.values()) for t in trials) == [("adamw", 32), ("adamw", 64), ("sgd", 32), ("sgd", 64)]
    assert plan(spec_of(tmp_path, text.format(n=3))) == trials[:3]


RANDOM = """method: random
trials: {trials}
seed: {seed}
parameters:
  optim.lr: {{distribution: log_uniform, min: 0.0001, max: 1}}
  optim.momentum: {{distribution: uniform, min: 0.8, max: 0.99}}
  data.batch_size: {{distribution: int_uniform, min: 16, max: 20}}
  optim.name: [sgd, adamw]
"""


def test_random_sampling_is_seeded_and_inside_the_bounds(tmp_path: Path) -> None:
    trials = plan(spec_of(tmp_path, RANDOM.format(trials=400, seed=7)))
    assert len(trials) == 400 and [t.index for t in trials] == list(range(400))
    assert plan(spec_of(tmp_path, RANDOM.format(trials=400, seed=7))) == trials
    assert plan(spec_of(tmp_path, RANDOM.format(trials=400, seed=8))) != trials
    assert plan(spec_of(tmp_path, RANDOM.format(trials=5, seed=7))) == trials[:5]  # more trials extend, not reshuffle
    lrs = [t.overrides["optim.lr"] for t in trials]
    assert all(0.0001 <= v <= 1 for v in lrs)
    assert all(0.8 <= t.overrides["optim.momentum"] <= 0.99 for t in trials)
    sizes = [t.overrides["data.batch_size"] for t in trials]
    assert all(isinstance(v, int) for v in sizes) and set(sizes) == {16, 17, 18, 19, 20}  # both ends included
    assert {t.overrides["optim.name"] for t in trials} == {"sgd", "adamw"}
    # log_uniform: each of the four decades gets about a quarter (uniform would put ~90% in the top one).
    decades = [sum(1 for v in lrs if 10 ** (k - 4) <= v < 10 ** (k - 3)) for k in range(4)]
    assert all(60 <= n <= 140 for n in decades), decades
    assert trials[0].args[0].startswith("optim.lr=") and float(trials[0].args[0].split("=")[1]) == lrs[0]


def test_random_trials_are_validated_by_the_trainer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = "method: random\ntrials: 8\nparameters: {data.batch_size: {distribution: int_uniform, min: -3, max: 4}}"
    rc, _, err = cli(["sweep", str(write(tmp_path, text)), "--dry-run"], capsys)
    assert rc == 2 and err.startswith("error: sweep.parameters.data.batch_size: must be > 0"), err


@pytest.mark.parametrize(("job", "n", "indexes"), [
    ("123_4", 8, [4]), ("123_[0-3%2]", 8, [0, 1, 2, 3]), ("123_[5,7-8]", 9, [5, 7, 8]), ("123_[6]", 9, [6]),
    ("1234_1", 8, []), ("123", 1, [0]), ("123", 2, []), ("123.batch", 2, []),
])
def test_array_job_ids(job: str, n: int, indexes: list[int]) -> None:
    assert sweep_status._job_indexes(job, "123", n) == indexes


def fake_sweep(tmp_path: Path, mode: str, metrics: dict[int, float]) -> Path:
    """A sweep folder as `make sweep` leaves it, with result.json written for the trials in ``metrics``."""
    folder = tmp_path / "sweeps" / "fake-20250101-000000"
    spec = {"metric": "test_loss", "mode": mode, "parameters": {"optim.lr": [0.1, 0.2, 0.3, 0.4, 0.5]}}
    trials = [{"index": i, "overrides": {"optim.lr": lr}, "run_dir": str(folder / "trials" / str(i))}
              for i, lr in enumerate([0.1, 0.2, 0.3, 0.4, 0.5])]
    for i in range(5):
        (folder / "trials" / str(i)).mkdir(parents=True)
    for i, value in metrics.items():
        (folder / "trials" / str(i) / "result.json").write_text(json.dumps({"test_loss": value, "test_accuracy": 0.5}))
    (folder / "trials" / "3" / "requeue.json").write_text("{}")
    write_json(folder / "sweep.json", {"sweep_id": folder.name, "spec": spec, "array_job_id": "999",
                                             "trials": trials})
    return folder


@pytest.mark.parametrize(("mode", "order"), [("min", [2, 0, 1, 3, 4]), ("max", [1, 0, 2, 3, 4])])
def test_status_ranks_by_the_metric_and_reads_states(mode: str, order: list[int], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    folder = fake_sweep(tmp_path, mode, {0: 0.5, 1: 0.9, 2: 0.25})
    monkeypatch.setattr(sweep_status, "slurm_states", lambda job, n: {0: "completed", 1: "running", 3: "pending"})
    rows = status(folder)
    assert [r.index for r in rows] == order
    by = {r.index: r for r in rows}
    assert [by[i].state for i in range(5)] == ["done", "done", "done", "requeued", "unknown"]
    assert by[2].value == 0.25 and by[3].value is None
    text = sweep_status.format_status(folder, rows).splitlines()
    assert text[1].split() == ["trial", "optim.lr", "state", "test_loss"]
    assert [line.split()[0] for line in text[2:7]] == [str(i) for i in order]
    assert text[2 + order.index(4)].split() == ["4", "0.5", "unknown", "-"]
    best = order[0]
    assert text[-1].startswith(f"best: trial {best} ") and text[-1].endswith(str(folder / "trials" / str(best)))
    # columns line up: every row's state starts where the header's does
    col = text[1].index("state")
    assert all(line[col - 2:col] == "  " and line[col] != " " for line in text[2:7])


def test_requeue_marker_of_a_trial_slurm_ended_for_good_shows_slurms_state(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    folder = fake_sweep(tmp_path, "min", {})
    monkeypatch.setattr(sweep_status, "slurm_states", lambda job, n: {3: "failed"})
    assert {r.index: r.state for r in status(folder)}[3] == "failed"
    assert sweep_status.format_status(folder, status(folder)).splitlines()[-1].startswith("best: none yet")


def test_status_without_slurm_says_unknown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = fake_sweep(tmp_path, "min", {1: 0.3})
    monkeypatch.setenv("PATH", str(tmp_path))  # neither sacct nor squeue
    assert {r.index: r.state for r in status(folder)} == {0: "unknown", 1: "done", 2: "unknown", 3: "requeued",
                                                         4: "unknown"}


def test_wait_reports_failed_trials_and_exits_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    folder = fake_sweep(tmp_path, "min", {0: 0.5, 1: 0.9, 2: 0.25})
    polls = iter([{0: "completed", 1: "running", 3: "pending", 4: "pending"},  # 0 ended, 2 (no Slurm record) is done
                  {0: "completed", 1: "completed", 2: "completed", 3: "failed", 4: "cancelled"}])
    monkeypatch.setattr(sweep_status, "slurm_states", lambda job, n: next(polls))
    assert sweep_status.finish(folder, poll_s=0) == 1
    out, err = capsys.readouterr()
    assert "2/5 trials ended" in out and "5/5 trials ended" in out and "best: trial 2 " in out
    assert err.splitlines() == [f"trial {i} ended {state} without a result; log: {folder}/logs/999_{i}/999_{i}_0_log.err"
                                for i, state in ((3, "failed"), (4, "cancelled"))]


def test_wait_ends_when_slurm_forgets_the_trials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # No accounting: squeue lists a task while it runs, then forgets it. Trial 4 was never listed at all.
    folder = fake_sweep(tmp_path, "min", {0: 0.5})
    polls = iter([{1: "running", 2: "pending", 3: "pending"}, {2: "running", 3: "pending"}, {}])
    monkeypatch.setattr(sweep_status, "slurm_states", lambda job, n: next(polls, {}))
    clock = iter([0.0, 1.0, 2.0, 3.0, sweep_status.FORGOTTEN_S + 10])
    monkeypatch.setattr(sweep_status.time, "monotonic", lambda: next(clock))
    rows = sweep_status.wait_for(folder, poll_s=0)
    assert {r.index: r.state for r in rows} == {0: "done", 1: "unknown", 2: "unknown", 3: "requeued", 4: "unknown"}
    out = capsys.readouterr().out
    assert out.splitlines() == ["1/5 trials ended", "2/5 trials ended", "4/5 trials ended", "5/5 trials ended"]


def test_sweep_folders_of_one_name_started_together_differ(tmp_path: Path) -> None:
    first = sweep._new_sweep_dir(tmp_path, "s", create=True)
    second = sweep._new_sweep_dir(tmp_path, "s", create=True)
    assert first != second and first.is_dir() and second.is_dir() and second.name == first.name + "-2"


def test_dry_runs_work_where_slurm_is_not_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))  # no srun, no sbatch: a laptop
    rc, out, err = cli(["sweep", str(write(tmp_path, GRID)), "--dry-run"], capsys)
    assert rc == 0 and "#SBATCH --array=0-3%4\n" in out, err
    rc, out, err = cli(["submit", "--cluster", "dev", "--dry-run"], capsys)
    assert rc == 0 and out.startswith("#!/bin/bash") and "srun" in out, err
    rc, _, err = cli(["sweep", str(write(tmp_path, GRID)), "--wait"], capsys)
    assert rc == 2 and err.startswith("error: LAUNCHER: sbatch is not on PATH")


def test_an_unwritable_sweeps_folder_is_a_user_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sweeps").write_text("")  # a file where the folder should be: fails even for root
    (tmp_path / "sbatch").write_text("#!/bin/sh\nexit 1\n")  # never reached: the folder fails first
    (tmp_path / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    rc, _, err = cli(["sweep", str(write(tmp_path, GRID))], capsys)
    assert rc == 2 and err.startswith("error: SWEEP_DIR: cannot create ") and "\nHINT: " in err, err


def test_sweep_status_defaults_to_the_newest_sweep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    folder = fake_sweep(tmp_path, "min", {1: 0.3})
    monkeypatch.setattr(sweep_status, "slurm_states", lambda job, n: {})
    monkeypatch.chdir(tmp_path)
    rc, out, _ = cli(["sweep-status"], capsys)
    assert rc == 0 and out.startswith(f"sweep {folder.name}: array 999") and "best: trial 1 " in out


def test_dry_run_prints_the_trials_and_submitits_array_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    hostile = "a'; touch pwned; echo 'x"
    spec = write(tmp_path, f"name: grid\nmax_parallel: 2\nargs: [\"tracking.project={hostile}\"]\n{GRID}")
    rc, out, _ = cli(["sweep", str(spec), "--dry-run", "--set", "nodes=1"], capsys)
    assert rc == 0
    assert "#SBATCH --array=0-3%2\n" in out and "#SBATCH --job-name=grid\n" in out and "#SBATCH --nodes=1\n" in out
    assert re.search(r"#SBATCH --output=.*/sweeps/grid-\d{8}-\d{6}/logs/%A_%a/%A_%a_0_log\.out\n", out)
    table = out.split("\n\n")[0].splitlines()[1:]
    assert [line.split() for line in table] == [["trial", "optim.lr", "data.batch_size"], ["0", "0.05", "32"],
                                                ["1", "0.05", "64"], ["2", "0.1", "32"], ["3", "0.1", "64"]]
    runs = [line for line in out.splitlines() if line.startswith("# trial ")]
    assert len(runs) == 4
    argv = shlex.split(runs[2].split(" runs: ", 1)[1])  # the quoting holds: the value comes back whole
    assert argv[:3] == ["python", "-m", "trainer"] and not any(a.startswith(("checkpoint.signal=", "run.dir=")) for a in argv)
    assert f"tracking.project={hostile}" in argv and "optim.lr=0.1" in argv and "data.batch_size=32" in argv
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]  # nothing written, nothing submitted


def test_dry_run_throttle_and_single_trial(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    _, out, _ = cli(["sweep", str(write(tmp_path, "max_parallel: 8\n" + GRID)), "--dry-run"], capsys)
    assert "#SBATCH --array=0-3%4\n" in out  # submitit caps the throttle at the array size
    _, out, _ = cli(["sweep", str(write(tmp_path, "parameters: {optim.lr: [0.1]}")), "--dry-run"], capsys)
    assert "--array" not in out and "#SBATCH --output=" in out  # submitit submits one trial as a plain job


def test_container_trials_point_the_requeue_rule_at_their_own_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    spec = write(tmp_path, "profile: {container: {runtime: apptainer, image: t.sif}}\n" + GRID)
    rc, out, _ = cli(["sweep", str(spec), "--dry-run"], capsys)
    assert rc == 0
    lines = out.splitlines()
    mine = next(i for i, line in enumerate(lines) if line.startswith("export RUN_DIR=") and "SLURM_ARRAY_TASK_ID" in line)
    assert re.fullmatch(r'export RUN_DIR=\S+/sweeps/spec-\d{8}-\d{6}/trials/"\$\{SLURM_ARRAY_TASK_ID:-0\}"', lines[mine])
    assert lines[mine + 1].startswith("export RUN_DIR=${RUN_DIR:-")  # the profile's default does not replace it


def test_the_example_spec_is_valid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    rc, out, err = cli(["sweep", str(ROOT / "cluster" / "sweeps" / "example.yaml"), "--dry-run"], capsys)
    assert rc == 0, err
    assert "#SBATCH --array=0-5%2\n" in out and "#SBATCH --nodes=1\n" in out


def test_the_command_example_spec_is_valid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    rc, out, err = cli(["sweep", str(ROOT / "cluster" / "sweeps" / "char_lm.yaml"), "--dry-run"], capsys)
    assert rc == 0, err
    assert "#SBATCH --array=0-3%2\n" in out
    assert ("# trial 3 runs: python -m trainer.launch --signal USR2 -- python examples/char_lm/train.py --max-steps 100 "
            "--eval-every 50 --layers 2 tracking.mode=auto --lr 0.003") in out


def test_command_trials_fill_placeholders_and_append_the_rest() -> None:
    spec = SweepSpec(name="c", command="python t.py --name 'run {tag}' {n}", parameters={"tag": ["a b"], "n": [3],
                                                                                          "lr": [0.1]})
    (trial,) = plan(spec)
    assert trial.args == ["python", "t.py", "--name", "run a b", "3", "--lr", "0.1"] and trial.command


@pytest.mark.parametrize(("extra", "field"), [
    ({"command": "python t.py 'unclosed"}, "sweep.command"),
    ({"command": " "}, "sweep.command"),
    ({"command": "python t.py {nope}"}, "sweep.command"),
    ({"command": "python t.py", "args": ["optim.lr=1"]}, "sweep.args"),
    ({"command": "python t.py", "parameters": {"a b": [1]}}, "sweep.parameters.a b"),
])
def test_bad_command_specs_name_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          extra: dict[str, object], field: str) -> None:
    spec = {"parameters": {"lr": [0.1]}, **extra}
    rc, _, err = cli(["sweep", str(write(tmp_path, json.dumps(spec))), "--dry-run"], capsys)
    assert rc == 2 and err.startswith(f"error: {field}") and "HINT:" in err, err


def max_overlap(spans: list[tuple[str, str]]) -> int:
    """Most tasks running at once; a task starting in the second another ended does not overlap it."""
    events = sorted([(end, -1) for _, end in spans] + [(start, 1) for start, _ in spans])  # ends before starts
    running = most = 0
    for _, step in events:
        running += step
        most = max(most, running)
    return most


def test_grid_sweep_runs_as_one_throttled_array_on_the_dev_cluster(slurm_env: dict[str, str], tmp_path: Path) -> None:
    args = [a for a in SMALL if not a.startswith("tracking.")] + ["tracking.mode=offline"]
    spec = {"name": "grid", "cluster": "dev", "profile": {"nodes": 1}, "max_parallel": 2, "args": args,
            "parameters": {"optim.lr": [0.05, 0.1], "data.batch_size": [32, 64]}}
    path = write(tmp_path, json.dumps(spec), "grid.yaml")  # JSON is YAML
    proc = sh([sys.executable, "-m", "cluster", "sweep", str(path), "--wait"], slurm_env, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (folder,) = (tmp_path / "sweeps").iterdir()
    record = json.loads((folder / "sweep.json").read_text())
    array = record["array_job_id"]
    assert f"Slurm array {array}" in proc.stdout and "4/4 trials ended" in proc.stdout

    expected = [(0.05, 32), (0.05, 64), (0.1, 32), (0.1, 64)]
    results = {}
    for i, (lr, batch) in enumerate(expected):
        run = folder / "trials" / str(i)
        results[i] = json.loads((run / "result.json").read_text())["test_accuracy"]
        cfg = OmegaConf.load(run / "config.yaml")
        assert (cfg.optim.lr, cfg.data.batch_size) == (lr, batch)
        # The trial's folder came as RUN_DIR (its config.yaml is here), not as a key the sweep injected.
        assert (cfg.run.dir, cfg.tracking.group, cfg.run.name) == (None, folder.name, f"{folder.name}-{i}")
        (wandb_file,) = run.glob("wandb/offline-run-*/run-*.wandb")
        (run_record,) = [r.run for r in records(wandb_file) if r.WhichOneof("record_type") == "run"]
        assert (run_record.run_group, run_record.display_name) == (folder.name, f"{folder.name}-{i}")

    def tasks() -> list[list[str]]:
        out = sh(["sacct", "-j", array, "-n", "-P", "-X", "--format=JobID,State,Start,End"], slurm_env).stdout
        return [line.split("|") for line in out.splitlines()]

    wait_for(lambda: sorted((t[0], t[1]) for t in tasks()) == [(f"{array}_{i}", "COMPLETED") for i in range(4)],
             timeout=60, what=f"sacct to show 4 COMPLETED tasks of {array}: {tasks()}")
    assert max_overlap([(t[2], t[3]) for t in tasks()]) <= 2  # the %2 throttle held
    assert "#SBATCH --array=0-3%2\n" in (folder / "logs" / array / f"{array}_submission.sh").read_text()

    status_out = sh([sys.executable, "-m", "cluster", "sweep-status"], slurm_env, cwd=tmp_path).stdout
    lines = status_out.splitlines()
    assert lines[1].split() == ["trial", "optim.lr", "data.batch_size", "state", "test_accuracy"]
    rows = [line.split() for line in lines[2:6]]
    assert {r[3] for r in rows} == {"done"}
    ranked = sorted(range(4), key=lambda i: (-results[i], i))
    assert [int(r[0]) for r in rows] == ranked
    assert [float(r[4]) for r in rows] == [round(results[i], 4) for i in ranked]
    assert [(float(r[1]), int(r[2])) for r in rows] == [expected[i] for i in ranked]
    assert lines[-2].endswith(str(folder / "trials" / str(ranked[0])))  # best: …
    assert lines[-1] == f"report: {folder / 'sweep.html'}" and (folder / "sweep.png").stat().st_size > 5000
    page = (folder / "sweep.html").read_text()
    assert all(f'href="trials/{i}/report.html"' in page for i in range(4))  # every trial's own run report


def test_a_preempted_trial_requeues_and_resumes_on_its_own(slurm_env: dict[str, str], tmp_path: Path) -> None:
    args = [a for a in SMALL if not a.startswith("train.epochs")] + ["train.epochs=2"]
    path = write(tmp_path, f"""
name: rq
profile: {{nodes: 1}}
max_parallel: 2
args: {json.dumps(args)}
parameters:
  optim.lr: [0.05, 0.1]
""")
    proc = sh([sys.executable, "-m", "cluster", "sweep", str(path)], {**slurm_env, **faults(step_delay_s=0.3)},
              cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    folder = next((tmp_path / "sweeps").iterdir())
    array = json.loads((folder / "sweep.json").read_text())["array_job_id"]
    wait_for(lambda: (folder / "trials" / "0" / "config.yaml").exists(), what="trial 0 to start")
    time.sleep(6)  # a few steps in
    assert sh(["scancel", "--signal=USR2", f"{array}_0"], slurm_env).returncode == 0
    wait_for(lambda: all((folder / "trials" / str(i) / "result.json").exists() for i in (0, 1)), timeout=240,
             what="both trials to finish")
    first, second = (json.loads((folder / "trials" / str(i) / "result.json").read_text()) for i in (0, 1))
    assert first["resumed_from"] and "trials/0/checkpoints/step_" in first["resumed_from"]
    assert second["resumed_from"] is None and first["global_step"] == second["global_step"]


def test_sweep_status_writes_a_page_with_the_metric_by_parameter_and_links_to_trial_reports(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import matplotlib.image

    folder = fake_sweep(tmp_path, "min", {0: 0.5, 1: 0.9, 2: 0.25})
    (folder / "trials" / "1" / "report.html").write_text("<html></html>")
    monkeypatch.setattr(sweep_status, "slurm_states", lambda job, n: {})
    assert cluster_main(["sweep-status", str(folder)]) == 0
    assert f"report: {folder / 'sweep.html'}" in capsys.readouterr().out
    page = (folder / "sweep.html").read_text()
    assert page.count('href="trials/1/report.html"') == 1 and page.count(">report<") == 1
    assert "data:image/png;base64," in page and "http" not in page
    pixels = matplotlib.image.imread(folder / "sweep.png")
    assert pixels.shape[1] > 200 and pixels.std() > 0.01
