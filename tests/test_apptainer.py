"""Apptainer for real: `make sif` turns the project's Docker image into a SIF (docker save → apptainer build), and the
dev cluster runs jobs inside it: training on 2 nodes, a preemption requeued and resumed bit-identically, a killed
rank classified and its node blamed (the verdict runs outside the container), a command, the doctor's container
check. Apptainer is Debian sid's (containers/apptainer.sh), in a user namespace as an unprivileged user runs it.
CI starts it; elsewhere these skip without it."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from .conftest import ROOT, SMALL, exported, faults, go, held
from .test_docker import a_stopped_rank_is_killed_by_the_host_and_the_others_go_on, engine_env, image
from .test_healing import events, excluded, finished, kill_rank, submit
from .test_slurm import cluster_cmd, sh, slurm_env

__all__ = ["engine_env", "image", "slurm_env"]  # the fixtures, shared

SLOW = [*SMALL, "train.epochs=2", "checkpoint.every_steps=3"]
SQUASHFS = "SQUASHFS_ARGS=-comp lz4"  # builds in half the time of the default gzip here (61 s against 132 s idle)


@pytest.fixture(scope="module")
def apptainer_env(slurm_env: dict[str, str]) -> dict[str, str]:
    """The dev cluster's environment with Apptainer on PATH (its wrapper; sbatch passes PATH on to the tasks)."""
    script = ROOT / "containers" / "apptainer.sh"
    if subprocess.run(["bash", str(script), "status"], capture_output=True).returncode:
        if os.environ.get("CI") == "true":
            pytest.fail("no Apptainer under CI: .ci/run starts it with containers/apptainer.sh up")
        pytest.skip("no Apptainer: `bash containers/apptainer.sh up` makes one from Debian sid")
    # The tasks' unpacked copies of the SIF (1.4 GB each, containers/apptainer-task.sh) go with Apptainer's own state,
    # which `apptainer.sh down` (and CI) removes: in /tmp every new image would leave one behind.
    state = os.environ.get("APPTAINER_DIR") or f"{os.environ.get('TMPDIR', '/tmp')}/slurm-ddp-apptainer"
    return {**exported(script, slurm_env), "TRAINER_IMAGE_CACHE": f"{state}/images"}


@pytest.fixture(scope="module")
def sif(image: str, engine_env: dict[str, str], apptainer_env: dict[str, str],
        tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Docker image as a SIF, built as a user without a daemon at hand builds it: from `docker save`'s archive.
    Built once per image and engine (the compatibility sets of other Slurm versions, beside, use the same one)."""
    engine_dir = Path(engine_env["DOCKER_HOST"].removeprefix("unix://")).parent
    image_id = subprocess.run(["docker", "image", "inspect", "-f", "{{.Id}}", image], env=engine_env,
                              capture_output=True, text=True).stdout.strip().split(":")[-1][:16]
    out = engine_dir / "sif" / f"trainer-{image_id}.sif"
    out.parent.mkdir(exist_ok=True)
    with open(engine_dir / "sif.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists():
            return out
        archive = tmp_path_factory.mktemp("sif") / "image.tar"
        saved = subprocess.run(["docker", "save", image, "-o", str(archive)], env=engine_env, capture_output=True,
                               text=True)
        assert saved.returncode == 0, saved.stderr
        built = subprocess.run(["make", "-s", "sif", f"IMAGE_TAR={archive}", f"SIF={out}.part", SQUASHFS], cwd=ROOT,
                               env=apptainer_env, capture_output=True, text=True, timeout=1800)
        assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
        archive.unlink()
        Path(f"{out}.part").rename(out)
    return out


def inside(sif: Path) -> list[str]:
    return ["container.runtime=apptainer", f"container.image={sif}"]


def uninterrupted(settings: list[str], env: dict[str, str], run: Path, timeout: float = 300) -> str:
    """The parameter checksum of the training in the container ``settings`` name, uninterrupted, on 2 nodes."""
    proc = cluster_cmd(["--launcher", "sbatch", "--wait", *(a for s in settings for a in ("--set", s)), "--", *SLOW,
                        f"run.dir={run}"], env, timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((run / "result.json").read_text())
    assert result["world_size"] == 2 and len(set(result["param_checksums"])) == 1, result
    return str(result["param_checksums"][0])


def loses_a_rank_then_is_preempted(settings: list[str], env: dict[str, str], tmp_path: Path, reference: str) -> None:
    """One job in the container ``settings`` name, two attempts held at a step: in the first, rank 1's python3 (a
    process of this machine, inside the container) is SIGKILLed from outside, and the verdict, outside the container,
    blames its node; in the second, Slurm's warning signal reaches the session inside it; the third ends with the
    uninterrupted run's parameters (``reference``)."""
    run = tmp_path / "run"
    env = {**env, **faults(at={"0": {"wait_at_step": 4}, "1": {"wait_at_step": 2}}),
           "TRAINER_SUSPECTS": str(tmp_path / "suspects.json")}
    job = submit(env, "sbatch", [*SLOW, f"run.dir={run}"], settings)
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


@pytest.fixture(scope="module")
def reference(sif: Path, apptainer_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> str:
    """The parameter checksum of the training inside the SIF, uninterrupted, on 2 nodes."""
    return uninterrupted(inside(sif), apptainer_env, tmp_path_factory.mktemp("ref") / "run")


@pytest.mark.slurm_compat
def test_a_job_in_apptainer_loses_a_rank_then_is_preempted_and_ends_as_if_uninterrupted(
        sif: Path, apptainer_env: dict[str, str], tmp_path: Path, reference: str) -> None:
    """One job, two attempts held at a step: in the first, rank 1's python3 (a process of this machine, inside the
    container) is SIGKILLed from outside, and the verdict, outside the container, blames its node; in the second,
    Slurm's warning signal reaches the session inside it; the third ends as if uninterrupted."""
    loses_a_rank_then_is_preempted(inside(sif), apptainer_env, tmp_path, reference)


def test_a_stopped_rank_in_apptainer_is_killed_by_the_host_and_the_others_go_on_in_place(
        sif: Path, apptainer_env: dict[str, str], tmp_path: Path) -> None:
    """The rank's process id is the host's: Apptainer gives it no namespace of its own."""
    a_stopped_rank_is_killed_by_the_host_and_the_others_go_on(inside(sif), apptainer_env, tmp_path)


def test_a_command_and_the_doctor_run_in_apptainer(sif: Path, apptainer_env: dict[str, str], tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    proc = cluster_cmd(["--launcher", "sbatch", "--wait", *(a for s in inside(sif) for a in ("--set", s)), "--",
                        "python", "tests/scripts/plain_ddp.py"], {**apptainer_env, "RUN_DIR": str(plain)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [json.loads((plain / f"rank-{r}.json").read_text())["sum"] for r in range(2)] == [3.0, 3.0]
    doctor = sh([str(ROOT / ".venv" / "bin" / "python"), "-m", "trainer.doctor", "--local", "1", "--container",
                 f"apptainer:{sif}"], apptainer_env)
    assert "container" in doctor.stdout and f"apptainer, {sif}" in doctor.stdout, doctor.stdout + doctor.stderr
