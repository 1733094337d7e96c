"""Sweeps without Slurm: spec validation, Optuna's plans, the workers' protocol against a real journal study, status,
the sweep page, the dashboard in a real browser. The dev-cluster sweeps are in tests/test_sweep_cluster.py."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.procfs import alive
from cluster.__main__ import main as cluster_main
from cluster.launch.command import Trainer
from cluster.profile import load_profile
from cluster.sweeps import lost, worker
from cluster.sweeps import spec as sweep_spec
from cluster.sweeps import status as sweep_status
from cluster.sweeps import study as studies
from cluster.sweeps import submit as sweep
from cluster.sweeps.folder import SweepFile
from cluster.sweeps.spec import SweepSpec, trial_args
from trainer.core.config import load as load_train_config
from trainer.core.files import write_json

from .conftest import ROOT, clean_env, free_port

GRID = "parameters: {optim.lr: [0.05, 0.1], data.batch_size: [32, 64]}"
TPE = "method: tpe\ntrials: 4\nparameters: {optim.lr: {type: float, low: 0.001, high: 0.1, log: true}}"


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
    ("method: bayes\n" + GRID, "sweep.method", "tpe, random, grid, cmaes"),
    ("methd: grid\n" + GRID, "sweep.methd", "not in"),
    ("parameters: {}", "sweep.parameters", "empty"),
    ("parameters: [optim.lr]", "sweep.parameters", "mapping"),
    ("parameters: {optim.lr: []}", "sweep.parameters.optim.lr", "no values"),
    ("parameters: {optim.lr: [0.1, 0.1]}", "sweep.parameters.optim.lr", "twice"),
    ("parameters: {optim.lr: {type: float, low: 0.01, high: 0.1}}", "sweep.parameters.optim.lr", "a grid lists"),
    ("method: tpe\ntrials: 2\nparameters: {optim.lr: {type: float, low: 0.1, high: 0.1}}",
     "sweep.parameters.optim.lr", "empty range"),
    ("method: tpe\ntrials: 2\nparameters: {optim.lr: {type: float, low: 0, high: 0.1, log: true}}",
     "sweep.parameters.optim.lr.low", "low > 0"),
    ("method: tpe\ntrials: 2\nparameters: {optim.lr: {type: normal, low: 0.01, high: 0.1}}",
     "sweep.parameters.optim.lr.type", "float, int, categorical"),
    ("method: random\ntrials: 2\nparameters: {optim.lr: {distribution: normal, min: 0.01, max: 0.1}}",
     "sweep.parameters.optim.lr.distribution", "uniform"),
    ("method: tpe\ntrials: 2\nparameters: {data.batch_size: {type: int, low: 8.5, high: 64}}",
     "sweep.parameters.data.batch_size.low", "whole number"),
    ("method: tpe\ntrials: 2\nparameters: {optim.lr: {type: float, high: 0.1}}", "sweep.parameters.optim.lr.low",
     "required"),
    ("method: tpe\ntrials: 2\nparameters: {optim.lr: {type: float, low: 0.01, high: 0.1, lo: 1}}",
     "sweep.parameters.optim.lr.lo", "unknown key"),
    ("method: tpe\ntrials: 2\nparameters: {optim.lr: {type: float, low: 0.01, high: 0.1, log: true, step: 0.01}}",
     "sweep.parameters.optim.lr.step", "without log"),
    ("method: random\n" + GRID, "sweep.trials", "needs trials"),
    ("method: tpe\ntrials: 1001\n" + GRID, "sweep.trials", "1-1000"),
    ("parameters: {optim.lr: [" + ", ".join(str(i / 1000 + 0.001) for i in range(1001)) + "]}",
     "sweep.parameters", "1001 trials"),
    ("max_parallel: 0\n" + GRID, "sweep.max_parallel", ">= 1"),
    ("max_parallel: two\n" + GRID, "sweep.max_parallel", "Integer"),
    ("metric: accuracy\n" + GRID, "sweep.metric", "not a metric"),
    ("metric: 'val loss'\ncommand: 'python train.py'\n" + GRID, "sweep.metric", "cannot be a key"),
    ("mode: best\n" + GRID, "sweep.mode", "max or min"),
    ("pruner: early\n" + GRID, "sweep.pruner", "median, asha"),
    ("pruner: asha\nmetric: train_samples_per_s\n" + GRID, "sweep.pruner", "intermediate values"),
    ("pruner: median\nargs: [train.epochs=1]\n" + GRID, "sweep.pruner", "evaluates once"),
    ("pruner_args: {min_resource: 2}\n" + GRID, "sweep.pruner_args", "pruner is none"),
    ("pruner: asha\npruner_args: {reduction: 2}\nargs: [train.epochs=2]\n" + GRID, "sweep.pruner_args",
     "SuccessiveHalvingPruner refused"),
    ("sampler_args: {n_startup: 2}\n" + TPE, "sweep.sampler_args", "TPESampler refused"),
    ("sampler_args: {seed: 2}\n" + TPE, "sweep.sampler_args.seed", "sweep's seed"),
    ("storage: 'nowhere://x'\n" + GRID, "sweep.storage", "driver"),
    ("storage: 'not a url'\n" + GRID, "sweep.storage", "neither journal"),
    ("storage: 'mysql+nosuchdriver://u@h/db'\n" + GRID, "sweep.storage", "driver"),
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
    ("profile: {spare_nodes: 1}\n" + GRID, "sweep.profile.spare_nodes", "fixed number of nodes"),
    ("cluster: nowhere\n" + GRID, "sweep.cluster", "no profile"),
    ("parameters: {optim.lr: [0.1\n", "SWEEP", "not valid YAML"),
    ("parameters: {optim.lr: [1, 1.0]}", "sweep.parameters.optim.lr", "twice"),
    ("parameters: {optim: {lr: [0.1, 0.2]}}", "sweep.parameters.optim", "group of keys"),
    ("args: [{train.epochs: 1}]\n" + GRID, "sweep.args", "key=value strings"),
    ("args: [checkpoint.signal=SIGTERM]\n" + GRID, "sweep.args", "no longer a key"),
    ("method: random\ntrials: 5\nparameters: {optim.name: [sgd, adamw], data.batch_size: [32, 64]}",
     "sweep.trials", "only 4"),
    ("method: random\ntrials: 4\nparameters: {data.batch_size: {type: int, low: 16, high: 18}}", "sweep.trials", "only 3"),
    ("method: tpe\ntrials: 8\nparameters: {data.batch_size: {type: int, low: -3, high: 4}}",
     "sweep.parameters.data.batch_size", "must be > 0"),
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


def test_sqlite_on_a_network_file_system_is_refused_with_the_reason(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(studies, "filesystem", lambda path: "nfs4")
    with pytest.raises(Exception, match="SQLite on nfs4") as err:
        studies.check_storage(f"sqlite:///{tmp_path}/s.db", tmp_path)
    assert "journal" in str(getattr(err.value, "hint", ""))
    monkeypatch.setattr(studies, "filesystem", lambda path: "ext4")
    studies.check_storage(f"sqlite:///{tmp_path}/s.db", tmp_path)  # a local disk: allowed


def test_a_bad_trainer_key_keeps_the_trainers_hint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = cli(["sweep", str(write(tmp_path, "parameters: {optim.lrr: [0.1]}")), "--dry-run"], capsys)
    assert rc == 2 and "HINT: valid keys under 'optim': " in err and "lr," in err and "Traceback" not in err


@pytest.mark.parametrize(("argv", "field"), [
    (["sweep", "missing.yaml"], "SWEEP"),
    (["sweep", "SPEC", "--set", "nodes"], "--set"),
    (["sweep", "SPEC", "--resume", "."], "SWEEP_DIR"),
    (["sweep-status"], "SWEEP_DIR"),
    (["sweep-status", "."], "SWEEP_DIR"),
    (["sweep-dashboard", "."], "SWEEP_DIR"),
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
    trials = studies.plan(spec, [], None)
    assert [(t["optim.lr"], t["data.batch_size"]) for t in trials] == [
        (0.01, 32), (0.01, 64), (0.05, 32), (0.05, 64), (0.2, 32), (0.2, 64)]
    assert studies.plan(spec, trials[:2], None) == trials[2:]  # a RESUME runs what is left
    assert studies.plan(spec, [], 2) == trials[:2]
    assert trial_args(spec, trials[3], "s-20250101-000000", 7) == [
        "train.epochs=1", "optim.lr=0.05", "data.batch_size=64", "tracking.group=s-20250101-000000",
        "run.name=s-20250101-000000-7"]  # the run folder comes as RUN_DIR


def test_grid_values_render_as_the_trainer_reads_them(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, "parameters: {train.deterministic: [true, false], optim.lr: [1e-4], model.name: [cnn]}")
    assert [trial_args(spec, t, "s", 0)[:3] for t in studies.plan(spec, [], None)] == [
        ["train.deterministic=true", "optim.lr=0.0001", "model.name=cnn"],
        ["train.deterministic=false", "optim.lr=0.0001", "model.name=cnn"]]


def test_string_values_reach_the_trainer_as_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # YAML would read these back as something else: a bool, an int, a comment, a quoted word, null.
    values = ["exp #1", "yes", "0x10", '"q"', "null", "a: b", "plain"]
    spec = spec_of(tmp_path, "parameters: {tracking.project: " + json.dumps(values) + "}")
    for i, t in enumerate(studies.plan(spec, [], None)):
        assert load_train_config(trial_args(spec, t, "s", i)).tracking.project == values[i]


def test_random_trials_are_distinct(tmp_path: Path) -> None:
    text = "method: random\ntrials: {n}\nparameters: {{optim.name: [sgd, adamw], data.batch_size: [32, 64]}}"
    trials = studies.plan(spec_of(tmp_path, text.format(n=4)), [], 4)
    assert sorted(tuple(t.values()) for t in trials) == [("adamw", 32), ("adamw", 64), ("sgd", 32), ("sgd", 64)]
    assert studies.plan(spec_of(tmp_path, text.format(n=3)), [], 3) == trials[:3]


RANDOM = """method: random
trials: {trials}
seed: {seed}
parameters:
  optim.lr: {{type: float, low: 0.0001, high: 1, log: true}}
  optim.momentum: {{distribution: uniform, min: 0.8, max: 0.99}}
  data.batch_size: {{type: int, low: 16, high: 20}}
  optim.name: [sgd, adamw]
"""


def test_random_sampling_is_seeded_and_inside_the_bounds(tmp_path: Path) -> None:
    def draw(n: int, seed: int, taken: list[dict[str, object]] | None = None) -> list[dict[str, object]]:
        return studies.plan(spec_of(tmp_path, RANDOM.format(trials=n, seed=seed)), taken or [], n)

    trials = draw(400, 7)
    assert len(trials) == 400 and draw(400, 7) == trials and draw(400, 8) != trials
    assert draw(5, 7) == trials[:5]  # more trials extend, not reshuffle
    assert draw(5, 7, trials[:5]) == trials[5:10]  # a RESUME continues the same sequence
    lrs = [float(t["optim.lr"]) for t in trials]  # type: ignore[arg-type]
    assert all(0.0001 <= v <= 1 for v in lrs)
    assert all(0.8 <= t["optim.momentum"] <= 0.99 for t in trials)  # type: ignore[operator]
    sizes = [t["data.batch_size"] for t in trials]
    assert all(isinstance(v, int) for v in sizes) and set(sizes) == {16, 17, 18, 19, 20}  # both ends included
    assert {t["optim.name"] for t in trials} == {"sgd", "adamw"}
    # log: each of the four decades gets about a quarter (uniform would put ~90% in the top one).
    decades = [sum(1 for v in lrs if 10 ** (k - 4) <= v < 10 ** (k - 3)) for k in range(4)]
    assert all(60 <= n <= 140 for n in decades), decades


@pytest.mark.parametrize(("job", "indexes"), [
    ("123_4", [4]), ("123_[0-3%2]", [0, 1, 2, 3]), ("123_[5,7-8]", [5, 7, 8]), ("123_[6]", [6]),
    ("1234_1", []), ("123", []), ("123.batch", []),
])
def test_array_job_ids(job: str, indexes: list[int]) -> None:
    assert lost.job_indexes(job, "123") == indexes


def test_sweep_folders_of_one_name_started_together_differ(tmp_path: Path) -> None:
    first = sweep._new_sweep_dir(tmp_path, "s", create=True)
    second = sweep._new_sweep_dir(tmp_path, "s", create=True)
    assert first != second and first.is_dir() and second.is_dir() and second.name == first.name + "-2"


def test_dry_runs_work_where_slurm_is_not_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))  # no srun, no sbatch: a laptop
    rc, out, err = cli(["sweep", str(write(tmp_path, GRID)), "--dry-run"], capsys)
    assert rc == 0 and "#SBATCH --array=0-3\n" in out, err
    rc, _, err = cli(["sweep", str(write(tmp_path, GRID)), "--wait"], capsys)
    assert rc == 2 and err.startswith("error: LAUNCHER: sbatch is not on PATH")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]


def test_an_unwritable_sweeps_folder_is_a_user_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sweeps").write_text("")  # a file where the folder should be: fails even for root
    (tmp_path / "sbatch").write_text("#!/bin/sh\nexit 1\n")  # never reached: the folder fails first
    (tmp_path / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    rc, _, err = cli(["sweep", str(write(tmp_path, GRID))], capsys)
    assert rc == 2 and err.startswith("error: SWEEP_DIR: cannot create ") and "\nHINT: " in err, err


def test_dry_run_prints_the_trials_and_the_workers_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    hostile = "a'; touch pwned; echo 'x"
    spec = write(tmp_path, f"name: grid\nmax_parallel: 3\nargs: [\"tracking.project={hostile}\"]\n{GRID}")
    rc, out, _ = cli(["sweep", str(spec), "--dry-run", "--set", "nodes=1"], capsys)
    assert rc == 0
    assert "#SBATCH --array=0-2\n" in out and "#SBATCH --job-name=grid\n" in out and "#SBATCH --nodes=1\n" in out
    assert re.search(r"#SBATCH --output=.*/sweeps/grid-\d{8}-\d{6}/logs/worker-%A_%a\.out\n", out)
    table = out.split("\n# a trial")[0].splitlines()[1:]
    assert [line.split() for line in table] == [["trial", "optim.lr", "data.batch_size"], ["0", "0.05", "32"],
                                                ["1", "0.05", "64"], ["2", "0.1", "32"], ["3", "0.1", "64"]]
    (run,) = [line for line in out.splitlines() if line.startswith("# a trial runs: ")]
    argv = shlex.split(run.split(" runs: ", 1)[1])  # the quoting holds: the value comes back whole
    assert argv[:3] == ["python", "-m", "trainer"] and f"tracking.project={hostile}" in argv
    script = out[out.index("#!/bin/bash"):]
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]  # nothing written, nothing submitted


def test_an_adaptive_dry_run_shows_the_search_space(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    rc, out, err = cli(["sweep", str(write(tmp_path, TPE)), "--dry-run"], capsys)
    assert rc == 0, err
    assert "# 4 trials, sampled as results come in from:" in out and "'log': True" in out


@pytest.mark.parametrize("name", ["example.yaml", "char_lm.yaml", "tpe.yaml"])
def test_the_example_specs_are_valid(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    rc, out, err = cli(["sweep", str(ROOT / "cluster" / "sweeps" / name), "--dry-run"], capsys)
    assert rc == 0, err
    assert "#SBATCH --array=0-1\n" in out and "#SBATCH --nodes=1\n" in out


def test_command_trials_fill_placeholders_and_append_the_rest() -> None:
    spec = SweepSpec(name="c", command="python t.py --name 'run {tag}' {n}", parameters={"tag": ["a b"], "n": [3],
                                                                                          "lr": [0.1]})
    assert trial_args(spec, {"tag": "a b", "n": 3, "lr": 0.1}, "s", 0) == [
        "python", "t.py", "--name", "run a b", "3", "--lr", "0.1"]


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


# ---- the workers' protocol against a real journal study (no Slurm: fake array ids, a fake squeue) ----------------

def local_sweep(tmp_path: Path, text: str) -> Path:
    """A sweep folder and its study as `python -m cluster sweep` prepares them before submitting array 900."""
    spec_path = write(tmp_path, text)
    folder = tmp_path / "sweeps" / "s-1"
    folder.mkdir(parents=True)
    sweep.prepare(str(spec_path), sweep_spec.load_spec(spec_path), "dev", folder,
                  SweepFile(sweep_id="s-1", study="s-1", arrays=("900",)))
    return folder


@pytest.fixture
def squeue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake squeue on PATH printing the ``JobID|State`` lines written to the returned file (the workers Slurm
    lists)."""
    listed = tmp_path / "squeue.out"
    listed.write_text("900_0|RUNNING\n900_1|RUNNING\n")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "squeue").write_text(f"#!/bin/sh\ncat {shlex.quote(str(listed))}\n")
    (tmp_path / "bin" / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    return listed


def be(monkeypatch: pytest.MonkeyPatch, w: int, attempt: int = 0) -> None:
    """Act as array task 900_<w> (its own job id 1000 + w)."""
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "900")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", str(w))
    monkeypatch.setenv("SLURM_JOB_ID", str(1000 + w))
    monkeypatch.setenv("SLURM_RESTART_COUNT", str(attempt))


def assignment(folder: Path, w: int) -> tuple[int, Path, list[str]]:
    """The trial worker ``w`` runs, its RUN_DIR and arguments, as the batch script reads them from
    workers/<array>_<w>.sh (array 900, or the array ``be`` set)."""
    task = f"{os.environ.get('SLURM_ARRAY_JOB_ID', '900')}_{w}"
    mine = json.loads((folder / "workers" / f"{task}.json").read_text())
    out = subprocess.run(["bash", "-c", f'source {shlex.quote(str(folder / "workers" / f"{task}.sh"))}; '
                          'printf "%s\\n" "$RUN_DIR" "$TRAINER_TRIAL" "$@"'], capture_output=True, text=True).stdout
    run_dir, name, *args = out.splitlines()
    assert name == f"s-1-{mine['trial']}" and Path(run_dir) == folder / "trials" / str(mine["trial"])
    return mine["trial"], Path(run_dir), args


def finished(run_dir: Path, **result: object) -> None:
    write_json(run_dir / "result.json", {"outcome": "finished", "exit_code": 0, **result})


def test_workers_take_the_planned_trials_once_each_and_end_with_the_study(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, squeue: Path) -> None:
    folder = local_sweep(tmp_path, "method: random\ntrials: 5\nseed: 3\nargs: [train.epochs=1]\n"
                                   "parameters: {optim.lr: {type: float, low: 0.001, high: 0.1, log: true}}")
    planned = studies.plan(sweep_spec.load_spec(tmp_path / "spec.yaml"), [], 5)
    ran = []
    for turn in range(5):  # two workers, taking turns
        w = turn % 2
        be(monkeypatch, w)
        assert worker.next_trial(folder, w) == 0
        number, run_dir, args = assignment(folder, w)
        finished(run_dir, test_accuracy=0.1 * turn)
        assert worker.end(folder, w, 0) == 0
        ran.append(float(next(a for a in args if a.startswith("optim.lr=")).split("=")[1]))
    assert [worker.next_trial(folder, w) for w in (0, 1)] == [worker.EXIT_DONE] * 2
    assert ran == [p["optim.lr"] for p in planned]  # the seeded plan, each trial once, whichever worker asked
    study = studies.open_study(worker.record_of(folder), folder)
    assert [(t.state.name, t.value) for t in study.trials] == [("COMPLETE", pytest.approx(0.1 * i)) for i in range(5)]
    assert {t.user_attrs["worker"] for t in study.trials} == {0, 1}


def test_a_requeued_worker_re_attaches_and_the_study_holds_each_step_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, squeue: Path) -> None:
    import optuna

    folder = local_sweep(tmp_path, TPE + "\npruner: median\npruner_args: {n_startup_trials: 1}\nmetric: test_accuracy\n"
                                         "args: [train.eval_every=10]")
    study = studies.open_study(worker.record_of(folder), folder)
    study.add_trial(optuna.trial.create_trial(  # a good earlier trial: the median to beat
        params={"optim.lr": 0.01}, distributions=studies.space(sweep_spec.load_spec(tmp_path / "spec.yaml")),
        value=0.9, intermediate_values={10: 0.8, 20: 0.9}))
    be(monkeypatch, 0)
    assert worker.next_trial(folder, 0) == 0
    number, run_dir, _ = assignment(folder, 0)
    with open(run_dir / "reports.jsonl", "a") as f:
        f.write('{"step": 10, "values": {"test_accuracy": 0.85, "test_loss": 1.0}}\n{"step": 20, "val')  # half a line
    worker.relay(folder, 0, once=True)
    assert json.loads((run_dir / "pruning.json").read_text()) == {"step": 10, "prune": False}  # 0.85 beats 0.8
    # Preempted: the verdict requeued the job, so the trial stays RUNNING for the next attempt.
    (run_dir / "events.jsonl").write_text(json.dumps({"t": 1, "event": "attempt_end", "job_id": "1000", "attempt": "0",
                                                      "decision": "requeue"})
                                          + "\n")
    assert worker.end(folder, 0, 75) == worker.EXIT_REQUEUED
    be(monkeypatch, 0, attempt=1)
    assert worker.next_trial(folder, 0) == 0 and assignment(folder, 0)[0] == number  # the same trial again
    with open(run_dir / "reports.jsonl", "a") as f:  # the resumed run replays step 10, then goes on
        f.write('ue": 0.5}\n{"step": 10, "values": {"test_accuracy": 0.86}}\n{"step": 20, "value": 0.3}\n')
    worker.relay(folder, 0, once=True)
    trial = studies.open_study(worker.record_of(folder), folder).trials[number]
    assert trial.state.name == "RUNNING" and trial.intermediate_values == {10: 0.85, 20: 0.5}
    assert json.loads((run_dir / "pruning.json").read_text()) == {"step": 20, "prune": True}  # 0.5 trails 0.9
    write_json(run_dir / "result.json", {"outcome": "pruned", "global_step": 20, "exit_code": 0})
    assert worker.end(folder, 0, 0) == 0
    trial = studies.open_study(worker.record_of(folder), folder).trials[number]
    assert trial.state.name == "PRUNED" and trial.intermediate_values == {10: 0.85, 20: 0.5}


def test_the_relay_ends_with_its_trial_and_the_script_kills_the_relay_itself(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, squeue: Path) -> None:
    """A relay polls while its trial trains: it ends once the trial has a result (or the worker moved on, or died),
    and the workers' script holds the relay's own pid (not a subshell's, whose kill left the relay polling)."""
    folder = local_sweep(tmp_path, TPE)
    be(monkeypatch, 0)
    assert worker.next_trial(folder, 0) == 0
    _, run_dir, _ = assignment(folder, 0)
    relay = subprocess.Popen([sys.executable, "-m", "cluster.sweeps.worker", "relay", str(folder), "--worker", "0"],
                             cwd=ROOT, env=clean_env({"PYTHONPATH": str(ROOT), "SLURM_ARRAY_JOB_ID": "900"}))
    try:
        time.sleep(1)
        assert relay.poll() is None  # the trial trains: the relay polls
        write_json(run_dir / "result.json", {"outcome": "finished", "test_accuracy": 0.5, "exit_code": 0})
        assert relay.wait(timeout=120) == 0  # ended on its own, with its trial
    finally:
        relay.kill()
    recorder = tmp_path / "python"  # stands in for the interpreter: says its pid, then polls forever
    recorder.write_text(f"#!/bin/sh\necho $$ > {shlex.quote(str(tmp_path / 'pid'))}\nexec sleep 600\n")
    recorder.chmod(0o755)
    from cluster.sweeps.script import worker_script

    text = worker_script(load_profile("dev"), str(recorder), folder, 1, Trainer(()), "test")
    (line,) = [x.strip() for x in text.splitlines() if " relay " in x and "relay=$!" in x]
    shell = subprocess.run(["bash", "-c", f'sweep={shlex.quote(str(folder))}; {line}; sleep 1; echo "$relay"; '
                            'kill "$relay"; wait "$relay" 2>/dev/null; echo done'], capture_output=True, text=True,
                           timeout=60)
    started, said = (tmp_path / "pid").read_text().strip(), shell.stdout.split()
    assert said == [started, "done"], (said, started, shell.stderr)
    assert not alive(started)


def test_a_trial_whose_worker_slurm_no_longer_lists_is_failed_and_run_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, squeue: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = local_sweep(tmp_path, TPE.replace("trials: 4", "trials: 3"))
    for w in (0, 1):
        be(monkeypatch, w)
        assert worker.next_trial(folder, w) == 0
    lost, _, lost_args = assignment(folder, 1)
    be(monkeypatch, 0)
    finished(assignment(folder, 0)[1], test_accuracy=0.5)
    assert worker.end(folder, 0, 0) == 0
    squeue.write_text("garbage\n")  # squeue answers: exit 1, another error
    (tmp_path / "bin" / "squeue").write_text("#!/bin/sh\necho 'slurm_load_jobs error: timeout' >&2; exit 1\n")
    assert worker.next_trial(folder, 0) == 0  # squeue could not answer: nothing concluded
    assert studies.open_study(worker.record_of(folder), folder).trials[lost].state.name == "RUNNING"
    finished(assignment(folder, 0)[1], test_accuracy=0.6)
    assert worker.end(folder, 0, 0) == 0
    (tmp_path / "bin" / "squeue").write_text(f"#!/bin/sh\ncat {shlex.quote(str(squeue))}\n")
    squeue.write_text("900_0|RUNNING\n")  # worker 1 was cancelled: Slurm lists only this one
    assert worker.next_trial(folder, 0) == 0
    study = studies.open_study(worker.record_of(folder), folder)
    assert study.trials[lost].state.name == "FAIL" and "900_1" in study.trials[lost].user_attrs["lost"]
    retry, _, retry_args = assignment(folder, 0)
    assert study.trials[retry].user_attrs["retry_of"] == lost and retry_args[-3:-2] == lost_args[-3:-2]
    assert "its values run again as a new trial" in capsys.readouterr().err
    finished(assignment(folder, 0)[1], test_accuracy=0.7)
    assert worker.end(folder, 0, 0) == 0 and worker.next_trial(folder, 0) == worker.EXIT_DONE


@pytest.mark.parametrize(("listed", "retried"), [("900_0|PENDING\n", True), ("", False)])
def test_sweep_status_fails_a_lost_trial_and_retries_it_only_while_a_worker_lives(
        listed: str, retried: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, squeue: Path) -> None:
    folder = local_sweep(tmp_path, TPE)
    be(monkeypatch, 1)
    assert worker.next_trial(folder, 1) == 0
    lost = assignment(folder, 1)[0]
    for var in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):  # sweep-status runs on a login node
        monkeypatch.delenv(var)
    squeue.write_text(listed)  # worker 1 is gone; worker 0 still pending, or nobody left
    rows, study = sweep_status.status(folder)
    assert study.trials[lost].state.name == "FAIL" and "900_1" in study.trials[lost].user_attrs["lost"]
    assert [t.user_attrs.get("retry_of") for t in study.trials if t.number != lost] == ([lost] if retried else [])
    assert {r.index: r.state for r in rows}[lost] == "failed"


def test_two_status_pages_judging_one_lost_trial_at_once_fail_it_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, squeue: Path) -> None:
    """`make sweep WAIT=1` asks every 5 s, a worker asks too: both find worker 1's trial lost at the same moment (the
    fake squeue answers neither until both asked). The second to fail it died with UpdateFinishedTrialError (a
    worker's array task ended with it); now it leaves the trial to the first, and one retry is enqueued."""
    import threading

    folder = local_sweep(tmp_path, TPE)
    be(monkeypatch, 1)
    assert worker.next_trial(folder, 1) == 0
    lost_trial = assignment(folder, 1)[0]
    for var in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(var)
    squeue.write_text("900_0|PENDING\n")  # worker 1 is gone, worker 0 lives to take the retry
    asked = tmp_path / "asked"
    asked.mkdir()
    (tmp_path / "bin" / "squeue").write_text(
        f"#!/bin/sh\ntouch {shlex.quote(str(asked))}/$$\nwhile [ $(ls {shlex.quote(str(asked))} | wc -l) -lt 2 ]; "
        f"do sleep 0.05; done\ncat {shlex.quote(str(squeue))}\n")
    errors: list[BaseException] = []

    def page() -> None:
        try:
            sweep_status.status(folder)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    pages = [threading.Thread(target=page) for _ in range(2)]
    for t in pages:
        t.start()
    for t in pages:
        t.join(timeout=120)
    assert not errors, errors
    study = studies.open_study(worker.record_of(folder), folder)
    assert study.trials[lost_trial].state.name == "FAIL"
    assert [t.user_attrs.get("retry_of") for t in study.trials].count(lost_trial) == 1


@pytest.mark.parametrize("line", ["0.85", "[1, 2]", '{"step": 3, "values": 5}', '{"step": true, "value": 0.5}',
                                  '{"step": 4, "value": "high"}', '"text"'])
def test_a_report_line_of_any_other_shape_is_skipped_not_fatal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               squeue: Path, line: str) -> None:
    """A command writes reports.jsonl itself: a line that is JSON but not a report killed the relay (each later
    should_prune then waited a minute) and end (the trial stayed RUNNING, the worker exited)."""
    folder = local_sweep(tmp_path, TPE + "\npruner: median\nmetric: test_accuracy")
    be(monkeypatch, 0)
    assert worker.next_trial(folder, 0) == 0
    number, run_dir, _ = assignment(folder, 0)
    (run_dir / "reports.jsonl").write_text(f'{line}\n{{"step": 10, "value": 0.5}}\n')
    finished(run_dir, test_accuracy=0.9)
    assert worker.end(folder, 0, 0) == 0
    trial = studies.open_study(worker.record_of(folder), folder).trials[number]
    assert trial.state.name == "COMPLETE" and trial.intermediate_values == {10: 0.5}


def test_a_worker_stopped_past_the_locks_age_does_not_free_the_next_holders_lock(tmp_path: Path) -> None:
    """Worker A holds the ask lock and is stopped (SIGSTOP, a suspended job) until its lock looks stale; B takes it
    over. A, woken, left the critical section by removing the lock: B's, so a third worker could ask beside B."""
    a = worker._lock(tmp_path)
    a.__enter__()
    old = time.time() - 3600
    os.utime(tmp_path / ".ask.lock", (old, old))  # A stopped for an hour
    b = worker._lock(tmp_path)
    b.__enter__()  # taken over
    a.__exit__(None, None, None)
    assert (tmp_path / ".ask.lock").is_dir()  # still B's
    b.__exit__(None, None, None)
    assert not (tmp_path / ".ask.lock").exists()


def test_a_trial_in_the_ledger_is_running_while_its_worker_holds_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, squeue: Path) -> None:
    """`cluster runs --trials` and `cluster status <trial>` read the worker's file: once it was named by array and
    index, every running trial read as ended."""
    from cluster.job import ledger
    from cluster.runs.table import Slurm, trial_state

    monkeypatch.setenv(ledger.LEDGER_ENV, str(tmp_path / "ledger"))
    folder = local_sweep(tmp_path, TPE)
    be(monkeypatch, 0)
    assert worker.next_trial(folder, 0) == 0
    number = assignment(folder, 0)[0]
    (record,) = [r for r in ledger.records() if r.kind == "trial"]
    assert (record.job_id, record.trial) == ("900_0", number)
    assert trial_state(record, Slurm(queue={"900_0": ("RUNNING", "n1")}), [])[0] == "running"
    assert trial_state(record, Slurm(queue={}), [])[0] == "ended"


def test_a_worker_whose_trials_keep_failing_stops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  squeue: Path) -> None:
    folder = local_sweep(tmp_path, TPE.replace("trials: 4", "trials: 9"))
    be(monkeypatch, 0)
    for _ in range(worker.FAILURES_IN_A_ROW):
        assert worker.next_trial(folder, 0) == 0
        run_dir = assignment(folder, 0)[1]
        write_json(run_dir / "result.json", {"outcome": "failed", "cause": "ValueError: bad", "exit_code": 1})
        assert worker.end(folder, 0, 1) == 0
    assert worker.next_trial(folder, 0) == worker.EXIT_STOP
    study = studies.open_study(worker.record_of(folder), folder)
    assert [(t.state.name, t.user_attrs["cause"]) for t in study.trials] == [("FAIL", "ValueError: bad")] * 3


@pytest.mark.parametrize(("result", "rc", "state"), [
    ({"outcome": "finished", "test_loss": 1.5}, 0, ("COMPLETE", 1.5)),
    ({"outcome": "pruned", "global_step": 4}, 0, ("PRUNED", None)),
    ({"outcome": "finished", "test_accuracy": 0.5}, 0, ("FAIL", None)),  # the metric is missing
    ({"outcome": "finished", "test_loss": float("nan")}, 0, ("FAIL", None)),
    ({"outcome": "failed", "reason": "user error: not retried"}, 1, ("FAIL", None)),
    (None, 137, ("FAIL", None)),
])
def test_how_a_trial_ended(result: dict[str, object] | None, rc: int, state: tuple[str, float | None],
                           tmp_path: Path) -> None:
    if result is not None:
        (tmp_path / "result.json").write_text(json.dumps(result))
    got = worker._outcome(tmp_path, rc, "test_loss")
    assert got[:2] == state and (got[2] or state[0] == "COMPLETE")


def test_status_and_page_from_the_study(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, squeue: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    import matplotlib.image

    folder = local_sweep(tmp_path, "method: random\ntrials: 4\nmetric: test_loss\nmode: min\n"
                                   "parameters: {optim.lr: {type: float, low: 0.001, high: 0.1, log: true}}")
    outcomes = [("finished", 0.5), ("finished", 0.25), ("pruned", None)]
    for i, (outcome, loss) in enumerate(outcomes):
        be(monkeypatch, 0)
        worker.next_trial(folder, 0)
        run_dir = assignment(folder, 0)[1]
        for step in (10, 20):
            (run_dir / "reports.jsonl").open("a").write(json.dumps({"step": step, "value": 1.0 / (step + i)}) + "\n")
        write_json(run_dir / "result.json", {"outcome": outcome, "test_loss": loss, "global_step": 20})
        (run_dir / "report.html").write_text("<html></html>")
        worker.end(folder, 0, 0)
    be(monkeypatch, 1)
    worker.next_trial(folder, 1)  # still running
    monkeypatch.setattr(sweep_status, "slurm_states", lambda arrays: {("900", 0): "completed", ("900", 1): "pending"})
    rc, out, _ = cli(["sweep-status", str(folder)], capsys)
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].startswith("sweep s-1: random, pruner none, 4 of 4 trials, workers: array 900")
    assert lines[1].split() == ["trial", "optim.lr", "state", "steps", "test_loss", "worker"]
    rows = [line.split() for line in lines[2:6]]
    assert [(r[0], r[2], r[3], r[4], r[5]) for r in rows] == [
        ("1", "complete", "2", "0.2500", "900_0"), ("0", "complete", "2", "0.5000", "900_0"),
        ("2", "pruned", "2", f"{1 / 22:.4f}", "900_0"), ("3", "requeued", "0", "-", "900_1")]
    assert lines[6] == f"best: trial 1 (test_loss 0.25, min): {folder / 'trials' / '1'}"
    assert lines[7] == f"report: {folder / 'sweep.html'}"
    page = (folder / "sweep.html").read_text()
    for title in ("optimisation history", "intermediate values (pruned trials end early)", "parameter importances"):
        assert f"<h2>{title}</h2><img alt='{title}' src='data:image/png;base64," in page
    assert page.count(">report<") == 3 and "<tr class='pruned'>" in page and "http" not in page
    import base64
    import io

    first = page.split("base64,")[1].split("'")[0]
    pixels = matplotlib.image.imread(io.BytesIO(base64.b64decode(first)), format="png")
    assert pixels.shape[1] > 300 and pixels.std() > 0.01


@pytest.mark.parametrize(("queue", "acct", "want"), [
    ((0, "900_1|RUNNING"), "900_0|COMPLETED\n900_1|RUNNING", {0: "completed", 1: "running"}),
    ((0, "900_[0-1]|PENDING"), "900_0|REQUEUED\n900_1|PENDING", {0: "pending", 1: "pending"}),  # the controller's
    ((0, ""), "900_0|CANCELLED by 0\n900_1|REQUEUED", {0: "cancelled", 1: "ended"}),  # cancelled while requeuing
    ((1, "slurm_load_jobs error: Invalid job id specified"), "900_0|PENDING", {0: "ended"}),  # every job gone
    (None, "900_0|REQUEUED\n900_1|COMPLETED", {0: "requeued", 1: "completed"}),  # no squeue: sacct as it is
])
def test_a_workers_state_is_the_controllers_while_it_lists_it_else_the_accountings_final_one(
        monkeypatch: pytest.MonkeyPatch, queue: tuple[int, str] | None, acct: str,
        want: dict[int, str]) -> None:
    """squeue first: sacct keeps REQUEUED for good for a job cancelled while its requeue completed, and `sweep --wait`
    counted such a worker as alive forever."""
    def ask(cmd: list[str]) -> subprocess.CompletedProcess[str] | None:
        if cmd[0] == "sacct":
            return subprocess.CompletedProcess(cmd, 0, acct + "\n", "")
        if queue is None:
            return None
        rc, text = queue
        return subprocess.CompletedProcess(cmd, rc, "" if rc else text + "\n", text if rc else "")

    monkeypatch.setattr(lost, "ask", ask)
    assert sweep_status.slurm_states(["900"]) == {("900", i): state for i, state in want.items()}
    data = SweepFile(arrays=("900",), spec={"max_parallel": 2})
    ended = sum(state in sweep_status.FINISHED for state in want.values())
    assert sweep_status.workers_ended(data, set(), gone=False) == (ended, 2)


def test_the_session_reports_and_every_rank_agrees_to_prune(tmp_path: Path) -> None:
    """The char LM on 2 processes, as a sweep's trial: rank 0 writes its evaluation to reports.jsonl; an answer
    'prune' for that step (the relay's file) stops both ranks at the same step, and the result says pruned."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "pruning.json").write_text(json.dumps({"step": 12, "prune": True}))  # the pruner's answer for step 12
    from .conftest import ok, result_of, run_trainer
    from .test_session import CHAR_LM, LM

    proc = ok(run_trainer([*LM, f"run.dir={run}"], tmp_path, nproc=2, script=CHAR_LM,
                          env={"TRAINER_PRUNING": "1", "TRAINER_TRIAL": "s-1-7"}))
    result = result_of(run)
    assert result["outcome"] == "pruned" and result["global_step"] == 12, proc.stdout
    rows = [json.loads(line) for line in (run / "reports.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [12] and math.isfinite(rows[0]["value"])  # rank 0 alone writes
    assert result["test_loss"] == rows[0]["value"]
    # Outside a sweep (no TRAINER_PRUNING) the same answer file is ignored: the run trains to its end.
    again = tmp_path / "again"
    again.mkdir()
    (again / "pruning.json").write_text(json.dumps({"step": 12, "prune": True}))
    ok(run_trainer([*LM, f"run.dir={again}"], tmp_path, script=CHAR_LM))
    assert result_of(again)["outcome"] == "finished" and result_of(again)["global_step"] == 24


@pytest.fixture
def chromium() -> str:
    found = next((shutil.which(n) for n in ("chromium", "chromium-browser") if shutil.which(n)), None)
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is not installed under CI (.ci/run installs it)")
        pytest.skip("no chromium: apt-get install chromium")
    return found


def test_the_dashboard_serves_the_sweeps_study_in_a_real_browser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 squeue: Path, chromium: str) -> None:
    folder = local_sweep(tmp_path, TPE)
    be(monkeypatch, 0)
    worker.next_trial(folder, 0)
    finished(assignment(folder, 0)[1], test_accuracy=0.625)
    worker.end(folder, 0, 0)
    port = str(free_port())
    server = subprocess.Popen([sys.executable, "-m", "cluster", "sweep-dashboard", str(folder), "--port", port],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        assert server.stdout is not None
        first = server.stdout.readline()
        assert f"http://127.0.0.1:{port}/dashboard/" in first, first
        url = f"http://127.0.0.1:{port}/dashboard/studies/1"
        for _ in range(240):  # the server is up once its API answers (2 minutes: a machine 4× as slow)
            api = subprocess.run(["curl", "-sf", f"http://127.0.0.1:{port}/api/studies"], capture_output=True, text=True)
            if api.returncode == 0:
                break
            time.sleep(0.5)
        assert '"study_name": "s-1"' in api.stdout.replace('":"', '": "'), api.stdout
        dom = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=15000",
                              "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
        assert "s-1" in dom and "0.625" in dom, dom[-2000:]  # the study's name and its best value, rendered by the app
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def test_the_tpe_sampler_of_a_spec_concentrates_near_the_optimum(tmp_path: Path) -> None:
    """The spec's sampler (seeded, with sampler_args) driving a real Optuna study of a known objective: after its
    start-up trials TPE samples nearer the optimum (lr = 0.03) than the spec's random sampler with the same seed."""
    import optuna

    def median_distance(spec_text: str) -> float:
        spec = sweep_spec.load_spec(write(tmp_path, spec_text))
        study = optuna.create_study(direction="maximize", sampler=studies.sampler(spec, seed=1))
        for _ in range(spec.trials or 0):
            trial = study.ask(studies.space(spec))
            study.tell(trial, -abs(math.log10(trial.params["optim.lr"] / 0.03)))
        dist = sorted(abs(math.log10(t.params["optim.lr"] / 0.03)) for t in study.trials[10:])
        return dist[len(dist) // 2]

    space = "parameters: {optim.lr: {type: float, low: 0.0001, high: 0.5, log: true}}"
    tpe = median_distance(f"method: tpe\ntrials: 30\nsampler_args: {{n_startup_trials: 4}}\n{space}")
    random = median_distance(f"method: random\ntrials: 30\n{space}")
    assert tpe < 0.75 * random, (tpe, random)  # decades from the optimum, median of trials 10-29


def test_a_database_password_is_never_shown_nor_recorded_in_the_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from cluster.sweeps import storage_url

    monkeypatch.chdir(tmp_path)
    url = "mysql+pymysql://alice:S3CRETPW@db.example:3306/sweeps"
    spec = write(tmp_path, f"{TPE}\nstorage: \"{url}\"")
    spec.chmod(0o644)
    rc, out, err = cli(["sweep", str(spec), "--dry-run"], capsys)
    assert rc == 0, err
    assert "S3CRETPW" not in out + err and "study in mysql+pymysql://alice:***@db.example:3306/sweeps" in out
    assert f"warning: {spec} holds a database password and other users can read it: `chmod 600 {spec}`" in err
    spec.chmod(0o600)
    assert cli(["sweep", str(spec), "--dry-run"], capsys)[2] == ""
    # What the workers get: the whole URL in a file only this user reads; sweep.json keeps the hidden one.
    folder = tmp_path / "sweep"
    folder.mkdir()
    storage_url.keep(url, folder)
    secret = folder / storage_url.SECRET
    assert secret.stat().st_mode & 0o777 == 0o600 and storage_url.connect_url(storage_url.hidden(url), folder) == url
    # Or no password in the spec at all: the environment's.
    monkeypatch.setenv(storage_url.PASSWORD_ENV, "fromenv")
    bare = "mysql+pymysql://alice@db.example/sweeps"
    assert storage_url.connect_url(bare, tmp_path) == "mysql+pymysql://alice:fromenv@db.example/sweeps"
    assert storage_url.connect_url("journal", folder) == "journal" and storage_url.hidden("journal") == "journal"
    storage_url.keep(bare, tmp_path)  # nothing to keep
    assert not (tmp_path / storage_url.SECRET).exists()


def test_a_command_sweep_takes_any_metric_its_script_writes_and_prunes_on_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    spec = write(tmp_path, "command: 'python train.py --lr {optim.lr}'\nmetric: val_loss\nmode: min\npruner: median\n"
                 + TPE.replace("trials: 4", "trials: 3"))
    rc, out, err = cli(["sweep", str(spec), "--dry-run"], capsys)
    assert rc == 0, err
    assert "pruner median" in out


def test_trials_by_number_go_through_the_storages_public_methods(tmp_path: Path) -> None:
    """cluster.sweeps.study.Trials: what a worker does to a trial it did not ask for in this process (re-attach, report,
    fail as lost), by trial number, in a journal study."""
    import optuna

    from cluster.sweeps.study import Trials, storage

    store = storage("journal", tmp_path)
    study = optuna.create_study(storage=store, study_name="s")
    first, second = study.ask(), study.ask()
    trials = Trials(optuna.load_study(study_name="s", storage=store), store)
    trials.live(second.number).report(0.5, step=3)
    assert trials.fail(first.number, "lost", "its worker is gone")
    assert not trials.fail(first.number, "lost", "judged again")  # ended already: left as the first judge left it
    assert trials.frozen(second.number).intermediate_values == {3: 0.5}
    got = trials.frozen(first.number)
    assert got.state == optuna.trial.TrialState.FAIL and got.user_attrs == {"lost": "its worker is gone"}
