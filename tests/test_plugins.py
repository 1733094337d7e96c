"""Bring your own model, data and task: a user package outside the repo, trained by import path with real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from trainer.core.config import help_text
from trainer.core.errors import UserError

from .conftest import SMALL, clean_env, faults, ok, outputs, result_of, run_trainer, spawn_ranks

NETS = '''
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, dim_in: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim_in, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


def broken(**kwargs):
    raise ValueError("boom in the factory")


def not_a_module():
    return 42


NOT_CALLABLE = 3
'''

DATA = '''
import torch
import torch.distributed as dist
from torch.utils.data import Dataset, IterableDataset


def _xy(n, dim, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=gen)
    w = torch.randn(dim, generator=gen)
    return x, x @ w / dim**0.5 + 0.05 * torch.randn(n, generator=gen)


class Pairs(Dataset):
    """Nested dict samples: {"x": ..., "target": {"y": ...}}."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "target": {"y": self.y[i]}}


class Stream(IterableDataset):
    """Each rank reads its own share; its position is its state (torch's Stateful protocol)."""

    def __init__(self, x, y):
        self.x, self.y, self.pos = x, y, 0

    def __iter__(self):
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        mine = list(range(rank, len(self.x), world))
        while self.pos < len(mine):
            i = mine[self.pos]
            self.pos += 1
            yield {"x": self.x[i], "target": {"y": self.y[i]}}
        self.pos = 0  # the next pass starts from the beginning

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


def build(n: int = 768, dim: int = 8, seed: int = 0):
    x, y = _xy(n, dim, seed)
    cut = n * 3 // 4
    return Pairs(x[:cut], y[:cut]), Pairs(x[cut:], y[cut:])


def build_stream(n: int = 768, dim: int = 8, seed: int = 0):
    train, test = build(n, dim, seed)
    return Stream(train.x, train.y), test


def needs_files(path: str):
    raise FileNotFoundError(f"no such file: {path}")


def not_data():
    return 42, None
'''

TASK = '''
import torch.nn.functional as F


class Regression:
    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def training_step(self, model, batch):
        return self.scale * F.mse_loss(model(batch["x"]), batch["target"]["y"])

    def eval_step(self, model, batch):
        err = (model(batch["x"]) - batch["target"]["y"]) ** 2
        return {"mse": (err.sum(), err.numel())}


class NoSteps:
    pass
'''

PLUGINS = ["model.target=userpkg.nets:MLP", "data.target=userpkg.data:build", "task.target=userpkg.task:Regression",
           "optim.name=adamw", "optim.lr=0.03"]
BASE = [a for a in SMALL if not a.startswith("data.synthetic")] + PLUGINS


@pytest.fixture(scope="module")
def pkg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder outside the repository holding the user's package (jobs start from it, as users do)."""
    root = tmp_path_factory.mktemp("user")
    (root / "userpkg").mkdir()
    for name, text in {"__init__": "", "nets": NETS, "data": DATA, "task": TASK}.items():
        (root / "userpkg" / f"{name}.py").write_text(textwrap.dedent(text))
    return root


def weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(result_of(run)["checkpoint"], weights_only=True)["model"]  # type: ignore[no-any-return]


def test_user_package_trains_with_two_processes_and_ranks_agree(pkg: Path) -> None:
    run = pkg / "runs" / "two"
    proc = ok(run_trainer([*BASE, "train.epochs=3", f"run.dir={run}"], pkg, nproc=2))
    result = result_of(run)
    assert len(set(result["param_checksums"])) == 1  # identical weights on both ranks
    assert result["test_mse"] < 0.2, proc.stdout  # predicting 0 costs E[y²] ≈ 1 on this data
    assert result["plugins"]["model"] == {"target": "userpkg.nets:MLP", "file": str(pkg / "userpkg" / "nets.py"),
                                          "kwargs": {}}
    assert "chance_accuracy" not in result and "test mse" in proc.stdout
    saved = torch.load(result["checkpoint"], weights_only=True)
    assert saved["meta"]["plugins"]["task"]["target"] == "userpkg.task:Regression"
    text = (run / "config.yaml").read_text()
    assert "target: userpkg.nets:MLP" in text
    # Test-only hooks are not part of the product.
    for word in ("debug", "TRAINER_FAULTS", "preempt_at", "delay_s", "hang_at", "oom_at"):
        assert word not in text and word not in help_text()


def test_a_compiled_model_trains_an_epochs_short_last_batch_without_going_dynamic(pkg: Path) -> None:
    """train.compile on the CPU, in a new interpreter (torch reads TORCH_LOGS at import). 432 samples in batches of 128
    end each epoch with 48: that batch gets a graph of its own, and the full batches of epoch 2 still run the static
    one, instead of one recompiled for symbolic sizes (for the rest of the run: benchmarks section 4's +short row)."""
    run = pkg / "runs" / "compiled"
    args = [*BASE, "data.kwargs.n=576", "data.batch_size=128", "train.epochs=2", "train.compile=true", f"run.dir={run}"]
    proc = ok(subprocess.run([sys.executable, "-m", "trainer", *args], cwd=pkg, capture_output=True, text=True,
                             timeout=900, env=clean_env({"TORCH_LOGS": "recompiles,dynamic"})))
    assert "size mismatch at index 0. expected 128, actual 48" in proc.stderr, proc.stderr[-3000:]
    symbolic = [line for line in proc.stderr.splitlines() if "create_symbol" in line and ".size()" in line]
    assert not symbolic and "as dynamic" not in proc.stderr, proc.stderr[-3000:]
    assert result_of(run)["global_step"] == 8 and result_of(run)["test_mse"] < 0.5


@pytest.mark.parametrize("kind", ["map", "stream"])
def test_user_package_survives_preemption_bit_identically(pkg: Path, kind: str) -> None:
    # The stream run also names its targets in the dotted form.
    extra = (["train.epochs=2"] if kind == "map" else
             ["data.target=userpkg.data.build_stream", "model.target=userpkg.nets.MLP", "train.max_steps=14"])
    ref, run = pkg / "runs" / f"ref-{kind}", pkg / "runs" / f"pre-{kind}"
    ok(run_trainer([*BASE, *extra, f"run.dir={ref}"], pkg, nproc=2))
    ranks = spawn_ranks([*BASE, *extra, f"run.dir={run}"], pkg, env=faults(preempt_at_step=9))
    outs = outputs(ranks, timeout=180)
    assert [p.returncode for p in ranks] == [75, 75], outs
    second = ok(run_trainer([*BASE, *extra, f"run.dir={run}"], pkg, nproc=2))
    assert "resumed from" in second.stdout and "starts again" not in second.stdout
    a, b = weights(ref), weights(run)
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ from the uninterrupted run's"


def test_resuming_with_other_targets_says_so(pkg: Path) -> None:
    run = pkg / "runs" / "change"
    ok(run_trainer([*BASE, "train.max_steps=4", f"run.dir={run}"], pkg))
    proc = ok(run_trainer([*BASE, "train.max_steps=6", "task.kwargs.scale=2.0", f"run.dir={run}"], pkg))
    assert "note: task was userpkg.task:Regression {} in the checkpoint, now userpkg.task:Regression {'scale': 2.0}" \
        in proc.stdout
    proc = ok(run_trainer([*BASE, "train.max_steps=8", "model.kwargs.hidden=32", f"run.dir={run}"], pkg), code=2)
    assert "error: checkpoint.resume:" in proc.stderr and "does not fit 'model'" in proc.stderr


BAD = [  # (override, key in the error, words of the message, words of the hint)
    ("model.target=nopkg.nets:MLP", "model.target", "no module named 'nopkg'", "run.python_path"),
    ("model.target=userpkg.nets:Nope", "model.target", "'userpkg.nets' has no attribute 'Nope'", "MLP"),
    ("model.target=userpkg.nets.Nope", "model.target", "has no attribute 'Nope'", "check the spelling"),
    ("model.target=userpkg.nets:NOT_CALLABLE", "model.target", "is a int, not a class or function", "factory"),
    ("model.target=userpkg.nets:broken", "model.target", "raised ValueError: boom in the factory", "run it alone"),
    ("model.target=userpkg.nets:not_a_module", "model.target", "returned builtins.int, not a torch.nn.Module", ""),
    ("model.kwargs.depth=3", "model.kwargs", "does not take these arguments", "its parameters: dim_in, hidden"),
    ("model.target=userpkg", "model.target", "names a module, not something in it", "userpkg:build"),
    ("data.target=userpkg.data:nothing", "data.target", "has no attribute 'nothing'", ""),
    ("data.kwargs.size=3", "data.kwargs", "does not take these arguments", "n, dim, seed"),
    ("task.target=userpkg.task:NoSteps", "task.target", "not an object with training_step", "training_step"),
    ("task.kwargs.wrong=1", "task.kwargs", "does not take", "scale"),
    ("task.target=userpkg.nets:broken", "task.target", "raised ValueError: boom in the factory", "run it alone"),
    ("model.target=userpkg.nets:MLP model.name=x", "model.target", "", ""),  # target wins over name: no error
]


def _main_in(pkg: Path, args: list[str], monkeypatch: pytest.MonkeyPatch, module: str = "trainer") -> int:
    monkeypatch.chdir(pkg)
    monkeypatch.setattr(os, "environ", clean_env())
    if module == "trainer":
        from trainer.__main__ import main

        return main(args)
    from cluster.__main__ import main as cluster_main

    return cluster_main(["submit", "--cluster", "dev", "--dry-run", "--", *args])


@pytest.mark.parametrize(("override", "key", "message", "hint"), BAD)
@pytest.mark.parametrize("front", ["trainer", "submit"])
def test_bad_plugins_fail_before_anything_is_written(pkg: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str], front: str,
                                                     override: str, key: str, message: str, hint: str) -> None:
    run = pkg / "runs" / f"bad-{front}-{BAD.index(next(b for b in BAD if b[0] == override))}"
    args = [*BASE, *override.split(), f"run.dir={run}", "train.max_steps=1"]
    code = _main_in(pkg, args, monkeypatch, front)
    err = capsys.readouterr().err
    if not message:
        assert code == 0, err
        return
    assert code == 2, err
    assert f"error: {key}: " in err and message in err and "HINT: " in err and hint in err.split("HINT:")[1], err
    assert "Traceback" not in err and not run.exists()


def test_a_data_factory_that_raises_fails_before_the_run_folder(pkg: Path) -> None:
    """Data factories run on the cluster only (their files may live there), but still before anything is written."""
    run = pkg / "runs" / "nodata"
    proc = ok(run_trainer([*BASE, "data.target=userpkg.data:needs_files", "data.kwargs.path=/nowhere",
                           f"run.dir={run}"], pkg), code=2)
    assert "error: data.target: userpkg.data:needs_files(...) raised FileNotFoundError: no such file: /nowhere" \
        in proc.stderr and "userpkg/data.py:" in proc.stderr and "HINT:" in proc.stderr
    assert not run.exists()


def test_a_data_factory_returning_something_else_fails_before_the_run_folder(
        pkg: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    run = pkg / "runs" / "notdata"
    code = _main_in(pkg, [*BASE, "data.target=userpkg.data:not_data", f"run.dir={run}"], monkeypatch)
    err = capsys.readouterr().err
    assert code == 2 and "error: data.target: 'userpkg.data:not_data' returned builtins.tuple, not a (train, eval) " \
        "pair of data sets" in err and "HINT: make it return" in err, err
    assert not run.exists()


def test_iterable_data_needs_max_steps(pkg: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    code = _main_in(pkg, [*BASE, "data.target=userpkg.data:build_stream", f"run.dir={pkg / 'runs' / 'x'}"],
                    monkeypatch)
    assert code == 2 and "error: train.max_steps: is required with an iterable data set" in capsys.readouterr().err


def test_python_path_makes_a_package_importable_from_anywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer.builtin.build import load_checked

    elsewhere, start = tmp_path / "code", tmp_path / "start"
    (elsewhere / "farpkg").mkdir(parents=True)
    start.mkdir()
    (elsewhere / "farpkg" / "__init__.py").write_text(textwrap.dedent(NETS))
    monkeypatch.chdir(start)
    monkeypatch.setattr("sys.path", list(__import__("sys").path))  # restored after the test
    with pytest.raises(UserError, match="no module named 'farpkg'"):
        load_checked(["model.target=farpkg:MLP"])
    cfg = load_checked(["model.target=farpkg:MLP", f"run.python_path=[{elsewhere}]"])
    assert cfg.run.python_path == [str(elsewhere)]
