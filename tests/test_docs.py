"""The docs: README.md as the front page of a static site built from docs/ (`make docs`), every link and anchor
checked; the README's commands that need no cluster run as written."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT, clean_env

SITE = ROOT / "docs" / "site.py"


def build(root: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SITE), "--root", str(root), "--out", str(out)], capture_output=True,
                          text=True, timeout=120)


def test_the_docs_build_with_every_link_and_anchor_checked(tmp_path: Path) -> None:
    proc = build(ROOT, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pages = {p.relative_to(tmp_path / "site").as_posix() for p in (tmp_path / "site").rglob("index.html")}
    assert {"index.html", "guide/training/index.html", "guide/slurm/index.html", "benchmarks/index.html"} <= pages


def test_the_readme_says_where_make_docs_puts_the_site() -> None:
    """`make docs` runs docs/site.py with its default --out; the README names that folder (it said site/)."""
    default = re.search(r'"--out", type=Path, default=here / "(\w+)" / "(\w+)"', SITE.read_text())
    assert default, "docs/site.py's default output folder"
    assert f"`{default[1]}/{default[2]}/site/`" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize(("page", "link", "said"), [
    ("docs/guide/sweeps.md", "[x](training.md#no-such-section)", "no-such-section"),
    ("README.md", "[y](docs/guide/nope.md)", "nope.md"),
])
def test_a_broken_link_or_anchor_fails_the_build(tmp_path: Path, page: str, link: str, said: str) -> None:
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", root / "docs", ignore=shutil.ignore_patterns("*.json", "*.png"))
    for name in ("README.md", "mkdocs.yml"):
        shutil.copy(ROOT / name, root / name)
    (root / "docs" / "benchmarks.md").write_text("# Benchmarks\n")  # its figure is left out of the copy
    with open(root / page, "a") as f:
        f.write(f"\n\nSee {link}.\n")
    proc = build(root, tmp_path / "out")
    assert proc.returncode != 0 and said in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def readme_commands() -> list[str]:
    """Every command line of the README's bash blocks (comments stripped)."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return [line.split("  #")[0].strip() for block in blocks for line in block.splitlines() if line.strip()]


# The README's commands that need a cluster or minutes, and the tests that run them, or their code path on smaller
# settings (the same targets, scripts and configs).
ELSEWHERE = {
    "make train": "tests/test_ddp.py: the built-in default on 2 processes, smaller; the fresh-clone check before a stop",
    "make test": ".ci/run",
    'make train ARGS="config=examples/own_code/next_token.yaml"': "tests/test_examples.py: that config, 40 steps",
    ".venv/bin/torchrun --nproc-per-node=2 examples/char_lm/train.py --max-steps 300":
        "tests/test_session.py: that script on 2 processes, 24 steps",
    'make dev-cluster && eval "$(slurm/dev-cluster.sh env)"': ".ci/run (the dev clusters every cluster test uses)",
    "make submit NODES=2 WAIT=1": "tests/test_slurm.py: make submit NODES=2 WAIT=1 with small overrides",
    'make submit NODES=2 CMD="python examples/char_lm/train.py --max-steps 500"':
        "tests/test_slurm_commands.py: make submit CMD=… with that script",
    "make runs": "tests/test_runs_cluster.py: python -m cluster runs, which make runs calls",
    "make sweep SWEEP=cluster/sweeps/tpe.yaml WAIT=1": "tests/test_sweep_cluster.py: a TPE sweep, waited for",
}
HERE = [".venv/bin/python -m trainer --help", "make sweep SWEEP=cluster/sweeps/example.yaml DRY_RUN=1"]


def test_every_readme_command_is_run_here_or_by_a_named_test() -> None:
    assert sorted(readme_commands()) == sorted([*ELSEWHERE, *HERE])


@pytest.mark.parametrize("command", HERE)
def test_the_readmes_quick_commands_run_as_written(command: str) -> None:
    proc = subprocess.run(shlex.split(command), cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
