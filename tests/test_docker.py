"""A real image: build containers/Dockerfile on a locally made base, train in it, and run a 2-node Slurm job
with RUNTIME=docker. CI starts a private engine (containers/engine.sh); elsewhere these skip without one."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from .conftest import ROOT, SMALL, exported, faults, go, held
from .test_slurm import cluster_cmd, job_id_of, job_runs, job_state, slurm_env, wait_for

__all__ = ["slurm_env"]  # the fixture, imported for the Slurm tests below

BASE = "slurm-ddp-test-base:bookworm"
IMAGE = "slurm-ddp-trainer:test"


@pytest.fixture(scope="module")
def engine_env() -> dict[str, str]:
    script = ROOT / "containers" / "engine.sh"
    if subprocess.run(["bash", str(script), "status"], capture_output=True).returncode:
        if os.environ.get("CI") == "true":
            pytest.fail("no container engine under CI: .ci/run starts one with containers/engine.sh up")
        pytest.skip("no container engine: `bash containers/engine.sh up` starts a private one")
    return exported(script, dict(os.environ))


@pytest.fixture(scope="module")
def image(engine_env: dict[str, str]) -> str:
    """Our Dockerfile built on the local stand-in for a CUDA PyTorch image. One build at a time: the Apptainer tests,
    on another worker, want it too, and the second build then finds every layer cached."""
    engine_dir = Path(engine_env["DOCKER_HOST"].removeprefix("unix://")).parent  # the engine's own folder
    with open(engine_dir / "test-image.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build_image(engine_env)


def _build_image(engine_env: dict[str, str]) -> str:
    base = subprocess.run(["bash", str(ROOT / "containers" / "test-base.sh"), BASE], env=engine_env,
                          capture_output=True, text=True, timeout=1800)
    assert base.returncode == 0, base.stderr[-3000:]
    build = subprocess.run(["make", "-s", "docker", f"IMAGE={IMAGE}", f"BASE_IMAGE={BASE}"], cwd=ROOT, env=engine_env,
                           capture_output=True, text=True, timeout=1800)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    return IMAGE


def docker(args: list[str], env: dict[str, str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], env=env, capture_output=True, text=True, **kw)  # type: ignore[call-overload]


def test_image_keeps_the_base_torch_and_runs_as_a_user(image: str, engine_env: dict[str, str]) -> None:
    out = docker(["run", "--rm", "--entrypoint", "python3", image, "-c",
                  "import os, torch, trainer; print(torch.__version__, os.getuid())"], engine_env, timeout=120)
    assert out.returncode == 0, out.stderr
    version, uid = out.stdout.split()
    assert version.startswith("2.13.0") and "+cpu" in version  # the base's torch, not a PyPI replacement
    assert uid == "1000"
    # its user cannot write torch's folder: every start must find torch's bytecode compiled when the image was built
    row = docker(["run", "--rm", "-e", "PYTHONDONTWRITEBYTECODE=1", "--entrypoint", "python3", image, "-c",
                  "from trainer.doctor.checks import check_bytecode; print(check_bytecode())"], engine_env, timeout=120)
    assert "status='PASS'" in row.stdout and "cached bytecode" in row.stdout, row.stdout + row.stderr


def test_training_inside_the_image(image: str, engine_env: dict[str, str], tmp_path: Path) -> None:
    tmp_path.chmod(0o777)  # the image's user writes here
    out = docker(["run", "--rm", "--network", "host", "-v", f"{tmp_path}:{tmp_path}", "-e", "OMP_NUM_THREADS=1", image,
                  *SMALL, f"run.dir={tmp_path}/run"], engine_env, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "result.json").read_text())["global_step"] == 32


def test_two_node_job_with_the_docker_runtime(image: str, engine_env: dict[str, str], slurm_env: dict[str, str],
                                             tmp_path: Path) -> None:
    env = {**slurm_env, **{k: v for k, v in engine_env.items() if k.startswith("DOCKER_")}}
    run = tmp_path / "run"
    proc = cluster_cmd(["--launcher", "sbatch", "--wait", "--set", "container.runtime=docker", "--set",
                        f"container.image={image}", "--", *SMALL, f"run.dir={run}"], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((run / "result.json").read_text())
    assert result["world_size"] == 2 and len(set(result["param_checksums"])) == 1


def test_scancel_leaves_no_container_behind(image: str, engine_env: dict[str, str], slurm_env: dict[str, str],
                                            tmp_path: Path) -> None:
    env = {**slurm_env, **{k: v for k, v in engine_env.items() if k.startswith("DOCKER_")}}
    run = tmp_path / "run"
    proc = cluster_cmd(["--launcher", "sbatch", "--set", "container.runtime=docker", "--set", f"container.image={image}",
                        "--", *SMALL, f"run.dir={run}"], {**env, **faults(wait_at_step=3)})  # held until cancelled
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = job_id_of(proc.stdout)

    def containers() -> list[str]:
        return docker(["ps", "-a", "-q", "--filter", f"name=train-{job}-"], env).stdout.split()

    held(run, ranks=2)
    assert len(containers()) == 2
    assert subprocess.run(["scancel", job], env=env).returncode == 0
    wait_for(lambda: containers() == [], timeout=120, what="the containers to be removed")
    wait_for(lambda: job_state(job, env) in ("CANCELLED", "CANCELLED+"), timeout=120, what="CANCELLED")
    assert containers() == []  # none started after the job's end either


def a_stopped_rank_is_killed_by_the_host_and_the_others_go_on(settings: list[str], env: dict[str, str],
                                                               tmp_path: Path) -> str:
    """regroup: true in the image the container ``settings`` name, on three nodes: rank 2's python3 SIGSTOPped from
    outside. The job's store runs in the image, which has no srun: it passes the others' request to kill the stuck
    rank on to the batch host, whose python3 runs srun there, by the process id the rank reported (the host's). The
    two others go on in place, and the job finishes in one attempt of Slurm's; its id."""
    from .test_healing import SLOW, events, finished, kill_rank, submit

    run = tmp_path / "run"
    env = {**env, **faults(at={"0": {"wait_at_step": 4}}), "TRAINER_SUSPECTS": str(tmp_path / "s.json")}
    job = submit(env, "sbatch", [*SLOW, "dist.heartbeat_timeout_s=4", f"run.dir={run}"],
                 [*settings, "nodes=3", "regroup=true"])
    held(run, ranks=3)
    node = kill_rank(job, 2, 0, sig=signal.SIGSTOP)
    go(run)
    result = finished(run, job, env)
    assert result["outcome"] == "finished" and result["world_size"] == 2 and not result["resumed_from"], result
    assert len(set(result["param_checksums"])) == 1, result
    [regroup] = events(run, "regroup")
    assert (regroup["lost"], regroup["step"]) == ([2], 5), regroup
    log = (run / "store.log").read_text()
    assert f"store: rank 2 on {node}" in log and "is stuck" in log, log  # said by the host's side, which killed it
    assert f"store: rank 2 lost on {node}" in log, log  # a replacement asked for, on the host too
    assert job_runs(job, env) == ["COMPLETED"]
    return job


def test_a_stopped_rank_in_docker_is_killed_by_the_host_and_the_others_go_on_in_place(
        image: str, engine_env: dict[str, str], slurm_env: dict[str, str], tmp_path: Path) -> None:
    """As in Apptainer, a regrouping job's containers sharing the host's process ids; no container is left behind,
    the store's included."""
    env = {**slurm_env, **{k: v for k, v in engine_env.items() if k.startswith("DOCKER_")}}
    job = a_stopped_rank_is_killed_by_the_host_and_the_others_go_on(
        ["container.runtime=docker", f"container.image={image}"], env, tmp_path)
    wait_for(lambda: not docker(["ps", "-a", "-q", "--filter", f"name=train-{job}-"], env).stdout.split(),
             timeout=120, what="the job's containers (the store's too) to be removed")


def test_commands_run_in_the_image_and_get_the_warning_through_its_init(
        image: str, engine_env: dict[str, str], slurm_env: dict[str, str], tmp_path: Path) -> None:
    """A plain DDP script, then the char LM warned once: the signal reaches the session inside the container
    (docker-task.sh → the engine's init → the whole process group), it saves, the batch shell requeues."""
    env = {**slurm_env, **{k: v for k, v in engine_env.items() if k.startswith("DOCKER_")}}
    docker_set = ["--set", "container.runtime=docker", "--set", f"container.image={image}"]
    plain = tmp_path / "plain"
    proc = cluster_cmd(["--launcher", "sbatch", "--wait", *docker_set, "--", "python", "tests/scripts/plain_ddp.py"],
                       {**env, "RUN_DIR": str(plain)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [json.loads((plain / f"rank-{r}.json").read_text())["sum"] for r in range(2)] == [3.0, 3.0]

    run = tmp_path / "run"
    lm = ["python", "examples/char_lm/train.py", "--max-steps", "40", "--eval-every", "1000", "--max-bytes", "40000",
          "--batch-size", "8", "--sample", "0", "tracking.mode=disabled", "checkpoint.poll_steps=1"]
    proc = cluster_cmd(["--launcher", "sbatch", *docker_set, "--", *lm],
                       {**env, "RUN_DIR": str(run), **faults(at={"0": {"wait_at_step": 5}})})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = job_id_of(proc.stdout)
    held(run, ranks=2)
    assert subprocess.run(["scancel", "--signal=USR2", job], env=env).returncode == 0
    wait_for(lambda: (run / "result.json").exists(), timeout=240, what="the requeued attempt to finish")
    result = json.loads((run / "result.json").read_text())
    assert result["resumed_from"] and result["global_step"] == 40, result
