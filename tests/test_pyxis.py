"""Pyxis and enroot, built from their sources by containers/pyxis.sh: a 2-node job with container.runtime=pyxis on the
dev cluster (Slurm 22.05), its image imported from the private engine with `enroot import dockerd://`. Neither tool is
packaged in Debian, and CI reaches no copy of their sources: these skip where the dev cluster runs no pyxis."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from .conftest import ROOT, SMALL, exported
from .test_docker import engine_env, image
from .test_slurm import cluster_cmd, slurm_env

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


def test_two_node_job_with_the_pyxis_runtime(squashfs: Path, pyxis_env: dict[str, str], tmp_path: Path) -> None:
    """Both ranks train in containers pyxis made on their nodes, and each node's container is gone after the step."""
    run = tmp_path / "run"
    proc = cluster_cmd(["--launcher", "sbatch", "--wait", "--set", "container.runtime=pyxis", "--set",
                        f"container.image={squashfs}", "--", *SMALL, f"run.dir={run}"], pyxis_env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((run / "result.json").read_text())
    assert result["world_size"] == 2 and len(set(result["param_checksums"])) == 1
    nodes = Path(pyxis_env["SLURM_CONF"]).parent / "enroot"
    left = [p for node in ("n1", "n2", "n3") for p in (nodes / node / "data").glob("*")]
    assert left == [], left  # pyxis removed each step's container
