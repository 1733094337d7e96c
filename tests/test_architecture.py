"""The dependency rule (docs/architecture.md) as checked contracts: the real tree keeps them, planted violations break
them, and the command-line tools start without torch."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT, clean_env

LINT = Path(sys.executable).parent / "lint-imports"


def lint(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT), "--no-cache"], cwd=tree, env=clean_env({"PYTHONPATH": str(tree)}),
                          capture_output=True, text=True, timeout=120)


def test_the_tree_keeps_every_contract() -> None:
    proc = lint(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


PLANTED = [  # (file, line added, what the report must say)
    ("trainer/runtime/session.py", "from trainer.builtin import train",
     "trainer.runtime is not allowed to import trainer.builtin"),
    ("trainer/data/loader.py", "from trainer.testing import faults",  # test faults act through core/hooks.py only
     "trainer.data is not allowed to import trainer.testing"),
    ("trainer/runtime/health/audit.py", "def f():\n    import trainer.runtime.saving.policy",
     "trainer.runtime.health is not allowed to import trainer.runtime.saving"),
    ("trainer/runtime/poll.py", "import trainer.runtime.records.attempts",
     "trainer.runtime.poll is not allowed to import trainer.runtime.records"),
    ("trainer/core/files.py", "def f():\n    import trainer.runtime.session",  # a function-level import counts
     "trainer.core is not allowed to import trainer.runtime"),
    ("trainer/runtime/fsdp.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import trainer.doctor.run",
     "trainer.runtime is not allowed to import trainer.doctor"),
    ("trainer/builtin/oom.py", "import trainer.checkpoint.layout",
     "trainer.builtin is not allowed to import trainer.checkpoint"),
    ("trainer/report.py", "import trainer.export", "trainer.report is not allowed to import trainer.export"),
    ("trainer/core/env.py", "import cluster.profile", "trainer is not allowed to import cluster"),
    ("trainer/checkpoint/layout.py", "def f():\n    import trainer.checkpoint.file",
     "No cycles are allowed in trainer.checkpoint"),
    ("cluster/sweeps/trials.py", "def f():\n    import cluster.sweeps.status", "No cycles are allowed in cluster"),
    ("trainer/data/shards.py", "import trainer.runtime.session", "trainer.data is not allowed to import trainer.runtime"),
    ("cluster/sweeps/folder.py", "import cluster.launch.render", "cluster.sweeps.worker is not allowed to import cluster.launch"),
    ("cluster/job/ledger.py", "import cluster.launch.submit", "cluster.job is not allowed to import cluster.launch"),
    ("cluster/runs/logs.py", "import cluster.sweeps.study", "cluster.runs is not allowed to import cluster.sweeps"),
    ("cluster/sweeps/spec.py", "import cluster.runs.table", "cluster.sweeps is not allowed to import cluster.runs"),
    ("cluster/job/nodes.py", "def f():\n    import omegaconf", "cluster.job is not allowed to import omegaconf"),
    ("trainer/core/exits.py", "def f():\n    import torch", "cluster.job is not allowed to import torch"),
]


@pytest.mark.parametrize(("where", "line", "said"), PLANTED, ids=[p[0] for p in PLANTED])
def test_a_planted_violation_breaks_the_check(tmp_path: Path, where: str, line: str, said: str) -> None:
    for part in ("trainer", "cluster", "benchmarks", ".importlinter"):
        copy = shutil.copytree if (ROOT / part).is_dir() else shutil.copy
        copy(ROOT / part, tmp_path / part)
    with open(tmp_path / where, "a") as f:
        f.write(f"\n\n{line}  # planted\n")
    proc = lint(tmp_path)
    assert proc.returncode == 1 and said in " ".join(proc.stdout.split()), proc.stdout + proc.stderr


@pytest.mark.parametrize("argv", [["-c", "import trainer; trainer.UserError"], ["-m", "cluster", "--help"],
                                  ["-m", "trainer.report", "--help"], ["-m", "trainer.launch", "--help"],
                                  ["-m", "trainer.store", "--help"]])
def test_command_line_tools_start_without_torch(argv: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-X", "importtime", *argv], cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    loaded = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in loaded and "matplotlib" not in loaded


def test_a_rank_starts_without_what_only_some_jobs_use() -> None:
    """A rank's start-up is mostly imports (docs/benchmarks.md section 8): the session loads FSDP2 and DTensor (0.6 s,
    sympy among them) only where a model is sharded or a sharded group regroups, and W&B, optuna, torchvision and
    matplotlib only where a run uses them."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", "import trainer.runtime.session"], cwd=ROOT,
                          env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    loaded = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" in loaded  # the check sees what a rank loads
    assert not loaded & {"torch.distributed.fsdp", "torch.distributed.tensor", "sympy", "wandb", "optuna",
                         "torchvision", "matplotlib"}, sorted(loaded & {"torch.distributed.fsdp", "sympy", "wandb"})


def test_no_module_is_over_400_lines() -> None:
    sizes = {p.relative_to(ROOT): len(p.read_text().splitlines())
             for part in ("trainer", "cluster", "benchmarks") for p in (ROOT / part).rglob("*.py")}
    assert not {p: n for p, n in sizes.items() if n > 400}
