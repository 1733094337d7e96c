"""Configuration: merge order, overrides, and every error path (one line naming the key, exit 2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainer.core.config import help_text, load
from trainer.core.config_help import field_docs
from trainer.core.errors import UserError
from trainer.core.schema import Config

from . import warm
from .conftest import clean_env


def test_defaults_come_from_dataclasses_and_packaged_yaml() -> None:
    cfg = load([])
    assert cfg.data.name == "synthetic" and cfg.model.name == "cnn"
    assert cfg.optim.lr == Config().optim.lr


def test_merge_order_dataclass_then_packaged_then_user_yaml_then_cli(tmp_path: Path) -> None:
    user = tmp_path / "user.yaml"
    user.write_text("optim:\n  lr: 0.2\n  momentum: 0.5\ntrain:\n  epochs: 7\n")
    cfg = load([f"config={user}", "optim.lr=0.3"])
    assert cfg.optim.lr == 0.3  # CLI beats the user file
    assert cfg.optim.momentum == 0.5  # the user file beats the dataclass default
    assert cfg.train.epochs == 7  # the user file beats the packaged default.yaml
    assert cfg.data.batch_size == Config().data.batch_size


def test_later_user_files_win(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("optim: {lr: 0.1}\n")
    (tmp_path / "b.yaml").write_text("optim: {lr: 0.4}\n")
    assert load([f"config={tmp_path / 'a.yaml'}", f"config={tmp_path / 'b.yaml'}"]).optim.lr == 0.4


def test_packaged_presets_by_name() -> None:
    cfg = load(["config=cifar10", "data.root=/nowhere"])
    assert (cfg.data.name, cfg.model.name) == ("cifar10", "resnet18")


def test_override_types_are_parsed() -> None:
    cfg = load(["optim.lr=0.05", "data.batch_size=64", "train.compile=true", "run.dir=/tmp/x y"])
    assert (cfg.optim.lr, cfg.data.batch_size, cfg.train.compile, cfg.run.dir) == (0.05, 64, True, "/tmp/x y")


def test_every_field_has_a_docstring() -> None:
    from dataclasses import fields

    for group in fields(Config):
        cls = type(getattr(Config(), group.name))
        docs = field_docs(cls)
        assert {f.name for f in fields(cls)} == set(docs), cls.__name__
    assert "optim.lr" in help_text() and "Peak learning rate" in help_text()


ERRORS = [
    (["optim.lrr=0.1"], "optim.lrr", "unknown key", "valid keys under 'optim'"),
    (["nope.lr=0.1"], "nope.lr", "unknown key", "keys start with one of"),
    (["optim=3"], "optim", "is a group", "set one of its keys"),
    (["data.batch_size=abc"], "data.batch_size", "bad value 'abc'", ""),
    (["train.compile=maybe"], "train.compile", "bad value 'maybe'", ""),
    (["train.compile=true", "train.compile_mode=fast"], "train.compile_mode", "must be one of default, reduce-overhead",
     "train.compile_mode=default"),
    (["train.compile_mode=reduce-overhead"], "train.compile_mode", "applies to a compiled model only",
     "train.compile=true"),
    (["data.batch_size=0"], "data.batch_size", "must be > 0", "data.batch_size=32"),
    (["optim.lr=-1"], "optim.lr", "must be > 0", ""),
    (["optim.lr=nan"], "optim.lr", "must be > 0", ""),
    (["optim.grad_clip=-1"], "optim.grad_clip", "must be >= 0", ""),
    (["optim.name=lamb"], "optim.name", "must be one of sgd, adamw", "optim.name=sgd"),
    (["data.name=mnist"], "data.root", "is required", "nothing is downloaded"),
    (["train.precision=fp16", "train.device=cpu"], "train.precision", "needs CUDA", ""),
    (["checkpoint.resume=/no/such/ckpt.pt"], "checkpoint.resume", "does not exist", ""),
    (["checkpoint.signal=SIGFOO"], "checkpoint.signal", "unknown signal", ""),
    (["audit.straggler_ratio=1"], "audit.straggler_ratio", "must be > 1", "audit.straggler_steps=0"),
    (["audit.straggler_floor_ms=-5"], "audit.straggler_floor_ms", "must be 0 or more", "straggler_floor_ms=10"),
    (["lr"], "'lr'", "key=value", ""),
    (["--maxsteps", "5"], "'--maxsteps'", "is no flag of this program", "spelling in `--help`"),  # a script's typo
    (["config=/no/such.yaml"], "config", "does not exist", ""),
]


@pytest.mark.parametrize(("args", "field", "text", "hint"), ERRORS, ids=[" ".join(e[0]) for e in ERRORS])
def test_errors_name_the_key(args: list[str], field: str, text: str, hint: str) -> None:
    with pytest.raises(UserError) as info:
        load(args)
    assert info.value.field == field
    assert text in info.value.message
    assert hint in info.value.hint


def test_bad_yaml_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load([f"config={bad}"])
    bad.write_text("- a list\n")
    with pytest.raises(UserError, match="mapping"):
        load([f"config={bad}"])
    bad.write_text("optim:\n  lrr: 1\n")
    with pytest.raises(UserError) as info:
        load([f"config={bad}"])
    assert "optim.lrr" in info.value.field
    bad.write_text("data:\n  batch_size: many\n")
    with pytest.raises(UserError) as info:
        load([f"config={bad}"])
    assert "data.batch_size" in info.value.field


@pytest.mark.parametrize("args", [["optim.lr=-1"], ["optim.lrr=1"], ["data.name=cifar10", "data.root=/nowhere"]])
def test_cli_bad_input_exits_2_with_one_error_and_hint_and_writes_nothing(tmp_path: Path, args: list[str]) -> None:
    proc = warm.run([sys.executable, "-m", "trainer", *args], cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("error: ") and lines[1].startswith("HINT: "), proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_cli_help_lists_keys(tmp_path: Path) -> None:
    proc = warm.run([sys.executable, "-m", "trainer", "--help"], cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "checkpoint.resume" in proc.stdout


def test_a_batch_script_of_the_previous_version_still_runs_its_injected_keys(tmp_path: Path) -> None:
    """Queued jobs re-run the batch script they were submitted with: `checkpoint.signal=…` and `train.checksum=…`,
    no longer keys, are taken as TRAINER_SIGNAL and TRAINER_CHECKSUM with one note each, and still do their job."""
    import json
    import signal

    from .conftest import SMALL, held

    run = tmp_path / "run"
    args = [*SMALL, "train.epochs=20", "checkpoint.signal=SIGUSR1", "train.checksum=true", "checkpoint.poll_steps=1",
            f"run.dir={run}"]
    env = clean_env({"TRAINER_CHECKSUM": "", "TRAINER_FAULTS": "wait_at_step=3"})
    proc = warm.Popen([sys.executable, "-m", "trainer", *args], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    held(run, [proc])
    proc.send_signal(signal.SIGUSR1)  # the old script's checkpoint.signal: it must save, not kill
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 75, out
    assert "note: checkpoint.signal is no longer a key" in out and "taken as TRAINER_SIGNAL=SIGUSR1" in out
    assert "note: train.checksum is no longer a key" in out and "Traceback" not in out
    assert "signal" not in (run / "config.yaml").read_text() and "checksum" not in (run / "config.yaml").read_text()
    env.pop("TRAINER_FAULTS")
    done = warm.run([sys.executable, "-m", "trainer", *args], cwd=tmp_path, env=env, text=True,
                          capture_output=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(json.loads((run / "result.json").read_text())["param_checksums"]) == 1
