"""What cluster/launch/submitit_adapter.py uses of submitit's internals, pinned: a submitit release that changes any of it
fails here first (and pyproject.toml's upper bound keeps users on releases this has passed on)."""

from __future__ import annotations

import inspect
import re
from importlib.metadata import version
from pathlib import Path

from cluster.launch.submitit_adapter import renderable, submission_text

from .conftest import ROOT


def test_the_private_names_the_adapter_uses_are_there_with_their_shapes() -> None:
    from submitit.slurm.slurm import SlurmExecutor

    assert isinstance(SlurmExecutor.__dict__["affinity"], classmethod)  # renderable() swaps it for the dry run
    assert list(inspect.signature(SlurmExecutor._make_submission_file_text).parameters) == ["self", "command", "uid"]
    assert isinstance(inspect.getattr_static(SlurmExecutor, "_submitit_command_str"), property)


def test_a_slurm_executor_renders_its_script_without_slurm_and_is_restored(tmp_path: Path) -> None:
    import submitit
    from submitit.slurm.slurm import SlurmExecutor

    before = SlurmExecutor.__dict__["affinity"]
    with renderable():
        ex = submitit.AutoExecutor(folder=tmp_path / "%j", cluster="slurm")
        ex.update_parameters(nodes=2, tasks_per_node=1, timeout_min=5)
    assert SlurmExecutor.__dict__["affinity"] is before
    text = submission_text(ex)
    assert text.startswith("#!/bin/bash") and "#SBATCH --nodes=2" in text and "submitit.core._submit" in text


def test_the_submitit_bound_admits_the_release_tested_here() -> None:
    spec = re.search(r'"(submitit[^"]*)"', (ROOT / "pyproject.toml").read_text()).group(1)  # type: ignore[union-attr]
    low, high = re.fullmatch(r"submitit>=([\d.]+),<([\d.]+)", spec).groups()  # type: ignore[union-attr]
    installed = tuple(int(x) for x in version("submitit").split(".")[:2])
    assert tuple(map(int, low.split("."))) <= installed < tuple(map(int, high.split(".")))
    assert f'"{spec}"' in (ROOT / "containers" / "Dockerfile").read_text()  # the image installs the same range
