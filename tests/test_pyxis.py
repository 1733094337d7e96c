"""Pyxis and enroot, built from their sources by containers/pyxis.sh, on the dev cluster (Slurm 22.05): the image
imported from the private engine with `enroot import dockerd://`, then the jobs Apptainer's tests run: training on 2
nodes, and one job that loses a rank (its node blamed by the verdict outside the container), is preempted and ends
as if uninterrupted. Neither tool is packaged in Debian, and CI reaches no copy of their sources: these skip where
the dev cluster runs no pyxis."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

from .conftest import ROOT, SMALL, exported, faults, go, held
from .test_docker import engine_env, image
from .test_healing import events, excluded, finished, kill_rank, submit
from .test_slurm import cluster_cmd, sh, slurm_env

__all__ = ["engine_env", "image", "slurm_env"]  # the fixtures

SLOW = [*SMALL, "train.epochs=2", "checkpoint.every_steps=3"]


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
    run = tmp_path_factory.mktemp("ref") / "run"
    proc = cluster_cmd(["--launcher", "sbatch", "--wait", *(a for s in inside(squashfs) for a in ("--set", s)), "--",
                        *SLOW, f"run.dir={run}"], pyxis_env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((run / "result.json").read_text())
    assert result["world_size"] == 2 and len(set(result["param_checksums"])) == 1, result
    nodes = Path(pyxis_env["SLURM_CONF"]).parent / "enroot"
    left = [p for node in ("n1", "n2", "n3") for p in (nodes / node / "data").glob("*")]
    assert left == [], left  # pyxis removed each step's container
    return str(result["param_checksums"][0])


def test_a_job_under_pyxis_loses_a_rank_then_is_preempted_and_ends_as_if_uninterrupted(
        squashfs: Path, pyxis_env: dict[str, str], tmp_path: Path, reference: str) -> None:
    """As with Apptainer: rank 1's python3 (a process of this machine, in its enroot container) is SIGKILLed from
    outside and the verdict blames its node; then Slurm's warning signal reaches the session inside the container;
    the third attempt ends with the uninterrupted run's parameters."""
    run = tmp_path / "run"
    env = {**pyxis_env, **faults(at={"0": {"wait_at_step": 4}, "1": {"wait_at_step": 2}}),
           "TRAINER_SUSPECTS": str(tmp_path / "suspects.json")}
    job = submit(env, "sbatch", [*SLOW, f"run.dir={run}"], inside(squashfs))
    held(run, ranks=2)
    node = kill_rank(job, 1, 0, sig=signal.SIGKILL)
    go(run)
    held(run, ranks=2, attempt="1")
    assert sh(["scancel", "--signal=USR2", job], env).returncode == 0
    result = finished(run, job, env)
    assert result["outcome"] == "finished" and result["param_checksums"] == [reference, reference], result
    ends = events(run, "attempt_end")
    assert [e["class"] for e in ends] == ["infrastructure", "preempted", "finished"], ends
    assert (ends[0]["blamed"], ends[0]["decision"]) == ([node], "requeue"), ends[0]
    assert node in excluded(job, env)
