"""Pyxis and enroot, built from their sources by containers/pyxis.sh, on the dev cluster (Slurm 22.05): the image
imported from the private engine with `enroot import dockerd://`, then the jobs Apptainer's tests run: training on 2
nodes, and one job that loses a rank (its node blamed by the verdict outside the container), is preempted and ends
as if uninterrupted. Neither tool is packaged in Debian, and CI reaches no copy of their sources: these skip where
the dev cluster runs no pyxis."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from .conftest import ROOT, exported
from .test_apptainer import loses_a_rank_then_is_preempted, uninterrupted
from .test_docker import engine_env, image
from .test_slurm import slurm_env

__all__ = ["engine_env", "image", "slurm_env"]  # the fixtures


@pytest.fixture(scope="module")
def pyxis_env(slurm_env: dict[str, str]) -> dict[str, str]:
    plugins = Path(slurm_env["SLURM_CONF"]).parent / "plugstack.conf"
    if "spank_pyxis.so" not in plugins.read_text():
        pytest.skip("the dev cluster runs no pyxis: `bash containers/pyxis.sh build PYXIS_SRC ENROOT_SRC`, then "
                    "restart it (slurm/dev-cluster.sh down; make dev-cluster)")
    return exported(ROOT / "containers" / "pyxis.sh", slurm_env)


@pytest.fixture(scope="module")
def squashfs(pyxis_env: dict[str, str], engine_env: dict[str, str], image: str,
             tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's image as the squashfs file pyxis starts containers from."""
    out = tmp_path_factory.mktemp("pyxis") / "trainer.sqsh"
    env = {**pyxis_env, **{k: v for k, v in engine_env.items() if k.startswith("DOCKER_")}}
    proc = subprocess.run(["enroot", "import", "-o", str(out), f"dockerd://{image}"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    return out


def inside(squashfs: Path) -> list[str]:
    return ["container.runtime=pyxis", f"container.image={squashfs}"]


@pytest.fixture(scope="module")
def reference(squashfs: Path, pyxis_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> str:
    """The parameter checksum of the training in containers pyxis made, uninterrupted, on 2 nodes; each node's
    container is gone when the step ends."""
    checksum = uninterrupted(inside(squashfs), pyxis_env, tmp_path_factory.mktemp("ref") / "run", timeout=600)
    nodes = Path(pyxis_env["SLURM_CONF"]).parent / "enroot"
    left = [p for node in ("n1", "n2", "n3") for p in (nodes / node / "data").glob("*")]
    assert left == [], left  # pyxis removed each step's container
    return checksum


def test_a_job_under_pyxis_loses_a_rank_then_is_preempted_and_ends_as_if_uninterrupted(
        squashfs: Path, pyxis_env: dict[str, str], tmp_path: Path, reference: str) -> None:
    """As with Apptainer: rank 1's python3 (a process of this machine, in its enroot container) is SIGKILLed from
    outside and the verdict blames its node; then Slurm's warning signal reaches the session inside the container;
    the third attempt ends with the uninterrupted run's parameters."""
    loses_a_rank_then_is_preempted(inside(squashfs), pyxis_env, tmp_path, reference)
