"""Rendered batch scripts: golden files, shell validity, quoting of hostile input, profile errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.__main__ import main as cluster_main
from cluster.launch.command import Command, Trainer, parse
from cluster.launch.launchers import pick, sbatch_script, submitit_script
from cluster.launch.render import render_sbatch
from cluster.launch.submission import Submission
from cluster.launch.submit import submit
from cluster.profile import load_profile
from trainer.core.errors import UserError

from .conftest import ROOT, clean_env

GOLDEN = Path(__file__).parent / "golden"
HOSTILE = ["optim.lr=0.1", "run.name=a'; touch pwned; echo 'x", 'run.name="$(touch pwned)"', "run.name=a b;c|d`touch pwned`"]


def normalized(text: str) -> str:
    """Machine-specific paths replaced, so golden files hold on any checkout."""
    return text.replace(sys.executable, "<python>").replace(str(Path.cwd()), "<cwd>")


def rendered(launcher: str, nodes: int, launch: str = "srun") -> str:
    p = load_profile("dev", {"nodes": nodes, "launch": launch})
    work = Trainer(("optim.lr=0.1",))
    return normalized(sbatch_script(p, work) if launcher == "sbatch" else submitit_script(p, work))


CASES = [("sbatch", 1, "srun"), ("sbatch", 2, "srun"), ("submitit", 1, "srun"), ("submitit", 2, "srun"),
         ("sbatch", 2, "torchrun")]


@pytest.mark.parametrize(("launcher", "nodes", "launch"), CASES)
def test_golden(launcher: str, nodes: int, launch: str) -> None:
    path = GOLDEN / f"{launcher}-{launch}-nodes{nodes}.sh"
    text = rendered(launcher, nodes, launch)
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"rendered script changed; UPDATE_GOLDEN=1 pytest {__file__} to accept"
    assert text.count(f"--nodes={nodes}") == 1 and "SLURM_NNODES" not in text.replace('"$SLURM_NNODES"', "")


def _shellcheck(path: Path, *extra: str) -> None:
    if shutil.which("shellcheck") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("shellcheck is missing under CI: .ci/run installs it")
        pytest.skip("shellcheck not installed")
    proc = subprocess.run(["shellcheck", "-s", "bash", *extra, str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize(("launcher", "nodes", "launch"), CASES)
def test_rendered_scripts_pass_bash_n_and_shellcheck(tmp_path: Path, launcher: str, nodes: int, launch: str) -> None:
    p = load_profile("dev", {"nodes": nodes, "launch": launch})
    path = tmp_path / "job.sh"
    work = Trainer(tuple(HOSTILE))
    path.write_text(sbatch_script(p, work) if launcher == "sbatch" else submitit_script(p, work))
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    _shellcheck(path, "--exclude=SC2016")  # SC2016 flags the hostile '$(...)' we quote on purpose


@pytest.mark.parametrize("launch", ["srun", "torchrun"])
def test_golden_node_range(tmp_path: Path, launch: str) -> None:
    """NODES=1-4 on 2-process nodes: one allocation task per node (Slurm starts a range at its minimum when asked
    for tasks per node), srun places the processes on however many nodes the attempt got."""
    p = load_profile("dev", {"nodes": 4, "min_nodes": 1, "tasks_per_node": 2, "launch": launch, "doctor": True})
    path, raw = GOLDEN / f"sbatch-{launch}-range1-4.sh", sbatch_script(p, Trainer(tuple(HOSTILE)))
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(normalized(raw))
    assert normalized(raw) == path.read_text(), f"rendered script changed; UPDATE_GOLDEN=1 pytest {__file__} to accept"
    assert "--ntasks-per-node" not in raw.split("#SBATCH --time")[0] and "--min-nodes 1" in raw
    (tmp_path / "job.sh").write_text(raw)
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sh")]).returncode == 0
    _shellcheck(tmp_path / "job.sh", "--exclude=SC2016")


@pytest.mark.parametrize(("launch", "sets", "name"), [
    ("srun", {"nodes": 2, "spare_nodes": 1}, "spare1"),
    ("torchrun", {"nodes": 2, "spare_nodes": 1}, "spare1"),
    ("srun", {"nodes": 3, "min_nodes": 2, "spare_nodes": 1}, "range2-3-spare1"),
    ("srun", {"nodes": 3, "regroup": True}, "regroup3"),  # no restart: the survivors go on in place
    ("srun", {"nodes": 2, "spare_nodes": 1, "regroup": True}, "regroup-spare1"),  # a warm spare on the third node
    # the store in the image, its actions run by the host's python3 (srun is the host's), passed on through a FIFO
    ("srun", {"nodes": 2, "spare_nodes": 1, "regroup": True, "container.runtime": "apptainer",
              "container.image": "/images/trainer.sif"}, "apptainer-regroup-spare1"),
    ("srun", {"nodes": 3, "regroup": True, "container.runtime": "docker", "container.image": "trainer:1"},
     "docker-regroup3"),
])
def test_golden_in_place_restarts(tmp_path: Path, launch: str, sets: dict[str, object], name: str) -> None:
    """Spare nodes, and a node range with a spare: the batch script restarts inside its allocation."""
    p = load_profile("dev", {**sets, "launch": launch, "doctor": True})
    path, raw = GOLDEN / f"sbatch-{launch}-{name}.sh", sbatch_script(p, Trainer(tuple(HOSTILE)))
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(normalized(raw))
    assert normalized(raw) == path.read_text(), f"rendered script changed; UPDATE_GOLDEN=1 pytest {__file__} to accept"
    (tmp_path / "job.sh").write_text(raw)
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sh")]).returncode == 0
    _shellcheck(tmp_path / "job.sh", "--exclude=SC2016")


@pytest.mark.parametrize("name", ["train.sbatch", "train-torchrun.sbatch", "run.sbatch"])
def test_templates_pass_bash_n_and_shellcheck(name: str) -> None:
    path = ROOT / "slurm" / name
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    _shellcheck(path)


@pytest.mark.parametrize("launch", ["srun", "torchrun", "command"])
def test_hand_run_templates_are_what_the_renderer_makes(launch: str) -> None:
    name = {"srun": "train.sbatch", "torchrun": "train-torchrun.sbatch", "command": "run.sbatch"}[launch]
    sets = ["--set", "log_dir=."] + {"srun": [], "torchrun": ["--set", "launch=torchrun"], "command": ["--command"]}[launch]
    proc = subprocess.run([sys.executable, "-m", "cluster", "render", "--cluster", "example-h100", *sets],
                          capture_output=True, text=True, cwd=ROOT, check=True)
    assert proc.stdout == (ROOT / "slurm" / name).read_text(), "regenerate with the command in the file's header"
    text = proc.stdout
    assert "set -euo pipefail" in text and "--kill-on-bad-exit=1" in text and "# SITE" in text


def _run_script(script: str, tmp: Path, rc: int = 0, restarts: int = 0, marker: bool = False,
                records: list[dict[str, object]] | None = None, before: list[str] | None = None) -> dict[str, object]:
    """Execute a rendered script with fake srun/scontrol/sinfo that record how they were called; srun leaves the
    exit ``records`` the ranks would (trainer/core/exits.py); ``before``: the classes of earlier attempts' verdicts."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    rec = tmp / "calls.jsonl"
    run_dir = tmp / "run"
    (tmp / "records.json").write_text(json.dumps([{"phase": "train", "t": i, **r} for i, r in enumerate(records or [])]))
    # srun's first call ends as told (records, marker, rc); a later one (an attempt inside the allocation) finishes.
    first = tmp / "srun-called"
    leave = (f"if os.path.exists({str(first)!r}): sys.exit(0)\nopen({str(first)!r}, 'w')\n"
             f"d = os.path.join({str(run_dir)!r}, 'exits', '77.{restarts}'); os.makedirs(d, exist_ok=True)\n"
             f"for r in json.load(open({str(tmp / 'records.json')!r})): "
             "open(os.path.join(d, f\"train-{r['rank']}.json\"), 'w').write(json.dumps(r))\n")
    outputs = {"sinfo": "print('n1 idle\\nn2 idle\\nn3 idle')\n",
               "scontrol": "if sys.argv[1:3] == ['show', 'hostnames']: print('n1\\nn2\\nn3')\n"}
    for tool in ("srun", "scontrol", "sinfo"):
        signal = ", os.environ.get('TRAINER_SIGNAL')" if tool == "srun" else ""  # srun's: what the tasks get
        leave_marker = f"open({str(run_dir / 'requeue.json')!r}, 'w').write('{{}}')\n" if marker and tool == "srun" else ""
        (bin_dir / tool).write_text(
            "#!/usr/bin/env python3\nimport json, os, sys\n"
            f"open({str(rec)!r}, 'a').write(json.dumps([{tool!r}, sys.argv[1:], os.environ.get('RUN_DIR'){signal}]) + '\\n')\n"
            f"{outputs.get(tool, '')}{leave if tool == 'srun' else ''}{leave_marker}sys.exit({rc if tool == 'srun' else 0})\n")
        (bin_dir / tool).chmod(0o755)
    run_dir.mkdir(exist_ok=True)
    (run_dir / "requeue.json").write_text("{}")  # a stale marker from an earlier attempt must not count
    (run_dir / "events.jsonl").write_text("".join(json.dumps({"t": i, "event": "attempt_end", "class": c, "job_id": "77"}) + "\n"
                                                  for i, c in enumerate(before or [])))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77", "TRAINER_SUSPECTS": str(tmp / "s.json"),
           "SLURM_RESTART_COUNT": str(restarts), "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2", "RUN_DIR": str(run_dir)}
    (tmp / "job.sh").write_text(script)
    proc = subprocess.run(["bash", str(tmp / "job.sh")], cwd=tmp, env=env, capture_output=True, text=True)
    calls = [json.loads(line) for line in rec.read_text().splitlines()] if rec.exists() else []
    return {"rc": proc.returncode, "calls": calls, "out": proc.stdout + proc.stderr}


def test_hostile_overrides_arrive_verbatim_and_nothing_executes(tmp_path: Path, hostile_dir: Path) -> None:
    p = load_profile("dev")
    script = sbatch_script(p, Trainer(tuple([*HOSTILE, f"run.dir={hostile_dir}"])))
    env_dir = tmp_path / "x"
    env_dir.mkdir()
    res = _run_script(script.replace('RUN_DIR=${RUN_DIR:-', 'RUN_DIR=${RUN_DIR_UNSET:-'), env_dir)
    srun = [c for c in res["calls"] if c[0] == "srun"]  # type: ignore[union-attr,index]
    assert len(srun) == 1
    argv = srun[0][1]
    for arg in HOSTILE:
        assert arg in argv
    # The run folder reaches the trainer as RUN_DIR, the warning signal as TRAINER_SIGNAL: neither as a key.
    assert srun[0][2] == str(hostile_dir.resolve()) and srun[0][3] == "SIGUSR2"  # type: ignore[index]
    assert not any(a.startswith(("run.dir=", "checkpoint.signal=")) for a in argv)
    assert not list(tmp_path.rglob("pwned")) and not list(Path.cwd().glob("pwned"))


KILLED = [{"rank": 0, "node": "n1", "code": 1, "class": "infrastructure", "cause": "lost a peer", "echo": True, "step": 7},
          {"rank": 1, "node": "n2", "code": None}]
USER_BUG = [{"rank": 1, "node": "n2", "code": 1, "class": "user_error", "cause": "ValueError: x", "where": "m.py:3"},
            {"rank": 0, "node": "n1", "code": 1, "class": "infrastructure", "cause": "lost a peer", "echo": True}]
REQUEUE = ["scontrol", ["requeue", "77"]]
EXCLUDE_N2 = ["scontrol", ["update", "JobId=77", "ExcNodeList=n2"]]
RULES = [  # rc, restarts, marker, records, earlier verdicts, the scontrol calls that change the job, exit code
    (0, 0, False, None, [], [], 0),
    (1, 0, False, None, [], [], 1),    # a failure: the stale marker of an earlier attempt was cleared before srun
    (75, 0, False, None, [], [REQUEUE], 0),
    (1, 1, True, None, [], [REQUEUE], 0),     # torchrun's agent reports 1, the marker (left by this attempt) says "saved"
    (75, 3, False, None, ["preempted"] * 3, [], 75),  # max_requeues reached
    (137, 0, False, KILLED, [], [REQUEUE, EXCLUDE_N2], 0),  # the cluster's: requeued without the node
    (137, 0, True, KILLED, [], [REQUEUE], 0),  # saved by every rank before one was killed: a preemption
    (1, 0, False, USER_BUG, [], [], 1),  # the user's: never retried
    (137, 3, False, KILLED, ["infrastructure"] * 3, [], 137),  # max_failures reached
]


@pytest.mark.parametrize(("rc", "restarts", "marker", "records", "before", "changes", "exit_code"), RULES)
def test_requeue_rule(tmp_path: Path, rc: int, restarts: int, marker: bool, records: list[dict[str, object]] | None,
                      before: list[str], changes: list[list[object]], exit_code: int) -> None:
    res = _run_script(sbatch_script(load_profile("dev"), Trainer(())), tmp_path, rc, restarts, marker, records, before)
    assert _changes(res) == changes, res
    assert res["rc"] == exit_code, res


def test_spare_nodes_restart_inside_the_allocation(tmp_path: Path) -> None:
    """A rank killed on n2: the next attempt starts at once on n1 and n3 (no requeue), as attempt "0.1"."""
    p = load_profile("dev", {"spare_nodes": 1})
    res = _run_script(sbatch_script(p, Trainer(())), tmp_path, 137, 0, False, KILLED)
    assert res["rc"] == 0 and _changes(res) == [], res
    sruns = [c[1] for c in res["calls"] if c[0] == "srun"]  # type: ignore[index,union-attr]
    assert [a[:4] for a in sruns] == [  # type: ignore[index]
        ["--kill-on-bad-exit=1", "--label", "--nodes=2", "--nodelist=n1,n2"],
        ["--kill-on-bad-exit=1", "--label", "--nodes=2", "--nodelist=n1,n3"],
        ["--overlap", "--nodes=3", "--nodelist=n1,n2,n3", "--ntasks-per-node=1"]], sruns  # snapshots cleared at the end
    ends = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    ends = [e for e in ends if e["event"] == "attempt_end"]
    assert [(e["attempt"], e["decision"]) for e in ends] == [("0", "restart_here"), ("0.1", "done")], ends
    assert "#SBATCH --nodes=3" in sbatch_script(p, Trainer(()))
    with pytest.raises(UserError, match="spare_nodes"):
        submit(Submission.parse(p, []), pick("submitit"), True, False)


@pytest.mark.parametrize(("nodes", "args", "error"), [
    ("1-2", ["data.global_batch_size=64"], None),
    ("2", [], None),
    ("1-3", ["data.global_batch_size=64"], "error: data.global_batch_size: 64 samples per step do not split equally "
                                           "across 3 processes, one of the world sizes 1-3"),
    ("2-1", [], "error: NODES: '2-1' is neither a node count nor a range MIN-MAX of at least 1 node"),
    ("0-2", [], "error: NODES: '0-2' is neither"),
    ("1-x", [], "error: NODES: '1-x' is neither"),
    ("²", [], "error: NODES: '²' is neither"),  # a digit to str.isdigit, not to int(): a traceback
    ("٣", [], "error: NODES: '٣' is neither"),  # an Arabic-Indic 3, rendered as --nodes=3
])
def test_a_node_range_is_asked_of_slurm_and_the_global_batch_checked_for_each_size(
        capsys: pytest.CaptureFixture[str], nodes: str, args: list[str], error: str | None) -> None:
    code = cluster_main(["submit", "--launcher", "sbatch", "--dry-run", "--nodes", nodes, "--", *args])
    out, err = capsys.readouterr()
    assert code == (2 if error else 0), err
    if error:
        assert err.startswith(error) and "HINT: " in err
    else:
        assert f"#SBATCH --nodes={nodes}\n" in out
    if nodes == "1-2":  # submitit expects a result from every task of a fixed node count: it says so
        assert cluster_main(["submit", "--dry-run", "--nodes", nodes]) == 2
        assert "error: profile.min_nodes: a node range (1-2) needs the sbatch launcher" in capsys.readouterr().err


def _changes(res: dict[str, object]) -> list[list[object]]:
    """The scontrol calls that change the job (requeue, update), without the run folder."""
    return [c[:2] for c in res["calls"] if c[0] == "scontrol" and c[1][0] in ("requeue", "update")]  # type: ignore[index,union-attr]


def test_api_key_never_rendered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "sekrit-123")
    p = load_profile("dev")
    assert "sekrit" not in sbatch_script(p, Trainer(())) + submitit_script(p, Trainer(()))
    with pytest.raises(UserError, match="secrets"):
        load_profile("dev", {"env.WANDB_API_KEY": "x"})


@pytest.mark.parametrize(("sets", "field"), [
    (["nodez=2"], "profile.nodez"),
    (["nodes=0"], "profile.nodes"),
    (["nodes=two"], "profile.nodes"),
    (["job_name=a b"], "profile.job_name"),
    (["partition=gpu;rm"], "profile.partition"),
    (["launch=mpirun"], "profile.launch"),
    (["container.runtime=podman"], "profile.container.runtime"),
    (["min_nodes=3"], "profile.min_nodes"),
    (["suspect_after=0"], "profile.suspect_after"),
    (["storm_after=-1"], "profile.storm_after"),
    (["regroup=true", "launch=torchrun"], "profile.regroup"),
    (["regroup=true", "container.runtime=pyxis", "container.image=x"], "profile.regroup"),
    (["python="], "profile.python"),  # srun '' -m trainer.launch
    (["log_dir="], "profile.log_dir"),  # --output=/%x-%j.out, the root folder
    (["mem_per_task_gb=0.0001"], "profile.mem_per_task_gb"),  # --mem-per-cpu=0M: all the node's memory
])
def test_bad_profile_values_fail_before_submitting(capsys: pytest.CaptureFixture[str], sets: list[str], field: str) -> None:
    argv = ["submit", "--cluster", "dev", "--launcher", "sbatch"] + [a for s in sets for a in ("--set", s)]
    assert cluster_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {field}") and "HINT: " in err


@pytest.mark.parametrize(("key", "typed", "field", "kept"), [
    ("account", "0123", "account", "0123"),              # YAML read it as octal 83
    ("env.X", "0x10", "env", "0x10"),             # as 16
    ("env.X", "yes", "env", "yes"),               # as True
    ("env.X", "hello #world", "env", "hello #world"),  # as "hello"
    ("env.X", "${foo}", "env", "${foo}"),         # an interpolation: a traceback at to_object
    ("env.X", "[1", "env", "[1"),                 # a YAML error: a traceback
    ("nodes", "3", "nodes", 3),                          # typed keys still take their type
    ("setup", "[module load x, echo y]", "setup", ["module load x", "echo y"]),  # lists are YAML
])
def test_set_values_reach_the_profile_as_typed(key: str, typed: str, field: str, kept: object) -> None:
    """`--set KEY=VALUE` on the command line: the text itself for a text key, never a YAML reading of it."""
    p = load_profile("dev", {key: typed})
    assert (p.env["X"] if field == "env" else getattr(p, field)) == kept


def test_unknown_profile_and_bad_training_override(capsys: pytest.CaptureFixture[str]) -> None:
    assert cluster_main(["submit", "--cluster", "nope", "--dry-run"]) == 2
    assert "error: CLUSTER" in capsys.readouterr().err
    assert cluster_main(["submit", "--cluster", "dev", "--dry-run", "--", "optim.lrr=1"]) == 2
    assert "error: optim.lrr" in capsys.readouterr().err
    for launcher in ("submitit", "sbatch"):  # the job's warning signal is the profile's: no trainer key names it
        for sig in ("SIGINT", "SIGUSR2"):
            assert cluster_main(["submit", "--launcher", launcher, "--dry-run", "--", f"checkpoint.signal={sig}"]) == 2
            err = capsys.readouterr().err
            assert err.startswith("error: checkpoint.signal: is no longer a key") and "HINT: leave it out" in err


def test_render_refuses_quotes_in_log_dir() -> None:
    with pytest.raises(UserError, match="double quote"):
        render_sbatch(load_profile("dev", {"log_dir": 'a"b'}), "python", Trainer(()), "t")


def test_gpu_jobs_turn_on_nccls_flight_recorder_with_a_quoted_folder(hostile_dir: Path) -> None:
    p = load_profile("dev", {"gpus_per_node": 1, "log_dir": str(hostile_dir)})
    lines = "; ".join(x for x in submitit_script(p, Trainer(())).splitlines() if "nccl_trace" in x)
    shown = subprocess.run(["bash", "-c", f'SLURM_JOB_ID=7; {lines}; printf %s "$TORCH_NCCL_DEBUG_INFO_TEMP_FILE"'],
                           capture_output=True, text=True, cwd=hostile_dir).stdout
    assert shown == f"{hostile_dir}/7/nccl-trace-rank-" and not (hostile_dir / "pwned").exists()
    assert 'nccl_trace="$RUN_DIR/nccl-trace-rank-"' in sbatch_script(p, Trainer(()))
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in sbatch_script(load_profile("dev"), Trainer(()))  # CPU jobs have no NCCL


COMMAND = ["python", "train.py", "a b", "x'; touch pwned; echo 'y", "$(touch pwned)", "`touch pwned`", "--lr=1", "*"]
COMMAND_CASES = [("sbatch", "srun"), ("sbatch", "torchrun"), ("submitit", "srun")]


def command_script(launcher: str, launch: str, **sets: object) -> str:
    p = load_profile("dev", {"launch": launch, **sets})
    cmd = Command(tuple(COMMAND))
    return sbatch_script(p, cmd) if launcher == "sbatch" else submitit_script(p, cmd)


@pytest.mark.parametrize(("launcher", "launch"), COMMAND_CASES)
def test_golden_command_scripts(tmp_path: Path, launcher: str, launch: str) -> None:
    path = GOLDEN / f"{launcher}-command-{launch}.sh"
    text = normalized(command_script(launcher, launch))
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"rendered script changed; UPDATE_GOLDEN=1 pytest {__file__} to accept"
    (tmp_path / "job.sh").write_text(command_script(launcher, launch))
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sh")]).returncode == 0
    _shellcheck(tmp_path / "job.sh", "--exclude=SC2016")


@pytest.mark.parametrize("launch", ["srun", "torchrun"])
def test_command_arguments_arrive_verbatim_and_nothing_executes(tmp_path: Path, launch: str) -> None:
    res = _run_script(command_script("sbatch", launch), tmp_path)
    srun = [c for c in res["calls"] if c[0] == "srun"]  # type: ignore[union-attr,index]
    assert len(srun) == 1, res
    argv = srun[0][1]
    assert argv[argv.index("--") + 1:] == COMMAND  # exactly the words, after trainer.launch's own options
    assert argv[argv.index("trainer.launch") + 1:argv.index("--")] == (
        ["--signal", "USR2"] + (["--torchrun", "1"] if launch == "torchrun" else []))
    assert not list(tmp_path.rglob("pwned")) and not list(Path.cwd().glob("pwned"))


def test_hand_run_command_template_passes_its_arguments_as_the_command(tmp_path: Path) -> None:
    script = (ROOT / "slurm" / "run.sbatch").read_text()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    rec = tmp_path / "argv.json"
    record = f"open({str(rec)!r}, 'w').write(json.dumps(sys.argv[1:]))"
    (bin_dir / "srun").write_text(f"#!/usr/bin/env python3\nimport json, sys\n{record}\n")
    (bin_dir / "srun").chmod(0o755)
    (tmp_path / "job.sh").write_text(script)
    venv = Path(sys.executable).parent  # the template's user activated the venv
    env = {**os.environ, "PATH": f"{bin_dir}:{venv}:{os.environ['PATH']}", "SLURM_JOB_ID": "5", "RUN_DIR": str(tmp_path / "r")}
    proc = subprocess.run(["bash", str(tmp_path / "job.sh"), *COMMAND], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    argv = json.loads(rec.read_text())
    assert argv[argv.index("--") + 1:] == COMMAND and not list(tmp_path.rglob("pwned"))


def test_requeue_on_signal_gives_the_command_a_deadline() -> None:
    text = command_script("sbatch", "srun", requeue_on_signal=True, signal_grace_s=90)
    assert "-m trainer.launch --signal USR2 --requeue-after 70 -- python train.py" in text


@pytest.mark.parametrize(("rc", "restarts", "marker", "records", "before", "changes", "exit_code"), RULES)
def test_submitit_scripts_apply_the_same_requeue_rule(tmp_path: Path, rc: int, restarts: int, marker: bool,
                                                      records: list[dict[str, object]] | None, before: list[str],
                                                      changes: list[list[object]], exit_code: int) -> None:
    """The rule has one home: submitit's teardown runs the lines an sbatch script ends with."""
    for script in (submitit_script(load_profile("dev"), Trainer(())), command_script("submitit", "srun")):
        case = tmp_path / str(len(list(tmp_path.iterdir())))
        case.mkdir()
        res = _run_script(script, case, rc, restarts, marker, records, before)
        assert _changes(res) == changes, res
        assert res["rc"] == exit_code, res


@pytest.mark.parametrize(("args", "module", "expected"), [
    (["optim.lr=0.1", "train.epochs=2", "run.dir=/r"], None, Trainer(("optim.lr=0.1", "train.epochs=2", "run.dir=/r"))),
    ([], None, Trainer(())),
    (["python", "cluster/__init__.py", "x=1"], None, Command(("python", "cluster/__init__.py", "x=1"))),
    (["python", "-c", "print(1)"], None, Command(("python", "-c", "print(1)"))),
    (["./run.sh"], None, Command(("./run.sh",))),
    (["--lr", "1"], "trainer.launch", Command(("python", "-m", "trainer.launch", "--lr", "1"))),
])
def test_what_a_submission_runs(args: list[str], module: str | None, expected: Trainer | Command) -> None:
    work = parse(args, module)
    assert work == expected
    if isinstance(work, Trainer):  # the batch script owns the folder: run.dir= leaves the overrides for RUN_DIR
        assert (work.overrides, work.run_dir) == (["optim.lr=0.1", "train.epochs=2"], "/r") if args else ([], None)


def test_a_bad_module_name_or_a_missing_script_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert cluster_main(["submit", "--dry-run", "--module", "pkg/train.py", "--", "x"]) == 2
    assert capsys.readouterr().err.startswith("error: --module")
    assert cluster_main(["submit", "--dry-run", "--", "python", "no/such/train.py", "--lr", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: CMD: 'no/such/train.py' is not a file") and "HINT:" in err


@pytest.mark.parametrize("launcher", ["sbatch", "submitit"])
@pytest.mark.parametrize("offered", [True, False])
def test_a_dry_run_prints_what_would_be_submitted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str], launcher: str,
                                                 offered: bool) -> None:
    """The expedited requeue is decided before the script is printed (a Slurm that offers it: the script asks for
    it), and a job its partition cannot hold is refused by a dry run as by a real one."""
    usage = "--requeue[=expedite]" if offered else "--requeue"
    fake = {"sbatch": f"echo '      {usage}     permit the job to be requeued'",
            "scontrol": "echo 'SlurmctldParameters = enable_expedited_requeue'", "sinfo": "printf 'n1 idle\\nn2 idle\\n'"}
    for name, body in fake.items():
        (tmp_path / name).write_text(f"#!/bin/sh\n{body}\n")
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert cluster_main(["submit", "--launcher", launcher, "--dry-run", "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    asked = "--requeue=expedite" in out or "'requeue': 'expedite'" in out or "requeue=expedite" in out
    assert asked is offered, out[:1500]
    assert cluster_main(["submit", "--launcher", launcher, "--dry-run", "--nodes", "3"]) == 2
    assert "error: NODES: 3 node(s) asked for (3 + 0 spare) but partition dev has 2" in capsys.readouterr().err


PREVIOUS = GOLDEN / "previous"
"""Batch scripts as the release before cluster/ became packages (3239243) rendered them: jobs queued or requeued
across an upgrade run these with the new code."""


def _previous(name: str) -> str:
    return (PREVIOUS / name).read_text().replace("<python>", sys.executable).replace("<cwd>", str(ROOT))


@pytest.mark.parametrize(("rc", "records", "changes", "exit_code"), [
    (137, KILLED, [REQUEUE, EXCLUDE_N2], 0),  # the verdict ran (cluster.verdict): requeued without the blamed node
    (75, None, [REQUEUE], 0),
    (1, USER_BUG, [], 1),
])
def test_a_batch_script_of_the_previous_release_runs_against_this_code(
        tmp_path: Path, rc: int, records: list[dict[str, object]] | None, changes: list[list[object]],
        exit_code: int) -> None:
    res = _run_script(_previous("sbatch-srun-nodes2.sh"), tmp_path, rc, 0, False, records)
    assert _changes(res) == changes and res["rc"] == exit_code, res
    assert "No module named" not in str(res["out"]), res["out"]
    ends = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert ends[-1]["event"] == "attempt_end"


def test_the_previous_releases_other_entry_points_still_answer(tmp_path: Path) -> None:
    """The submitit script's teardown (cluster.verdict), a hand-run job's ledger record (cluster.ledger register),
    a sweep worker (cluster.worker) and submitit's pickled tasks (cluster.task): each still reaches this code."""
    import pickle

    from cluster.launch.task import TrainTask

    assert "-m cluster.verdict" in _previous("submitit-srun-nodes2.sh")
    for argv, said in ([["-m", "cluster.ledger"], "usage: python -m cluster.job.ledger register"],
                       [["-m", "cluster.worker", "--help"], "usage: python -m cluster.sweeps.worker"],
                       [["-m", "cluster.verdict", "--help"], "usage: python -m cluster.job.verdict"]):
        proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, env=clean_env())
        assert said in proc.stdout + proc.stderr, (argv, proc.stdout, proc.stderr)
    old = pickle.dumps(TrainTask(["optim.lr=0.1"]), protocol=0).replace(b"cluster.launch.task", b"cluster.task")
    assert b"ccluster.task\nTrainTask" in old
    task = pickle.loads(old)
    assert isinstance(task, TrainTask) and task.args == ["optim.lr=0.1"]


def test_a_job_whose_run_folder_takes_no_fifo_runs_without_a_store_in_a_container() -> None:
    """In an image the store passes its actions to the host through a FIFO in the run folder; where none can be made,
    the attempt gets no store (a lost rank restarts it, as without regroup), one note, and the script goes on under
    `set -e`."""
    from cluster.launch.render import store_lines

    lines = store_lines("/venv/python", 3, "", "/bin/false", "python3")
    script = "\n".join(["set -euo pipefail", "scontrol() { echo n1; }", "RUN_DIR=/nonexistent-run-dir",
                        "SLURM_JOB_NODELIST=n1", *lines,
                        'echo "store_pid=[$store_pid] TRAINER_STORE=[${TRAINER_STORE:-}]"'])
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "store_pid=[] TRAINER_STORE=[]\n", out.stdout + out.stderr
    assert "note: the job's store did not start" in out.stderr


def test_a_dry_run_says_which_suspect_nodes_a_real_submit_would_exclude(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The exclusion is sbatch's command line, not the script: a dry run printed nothing of it."""
    from cluster.job import suspects

    path = tmp_path / "suspects.json"
    suspects.add(path, ["n2"], 1, "7", "device error", hard=True)
    monkeypatch.setenv("TRAINER_SUSPECTS", str(path))
    (tmp_path / "bin").mkdir()
    for tool in ("sinfo", "scontrol"):  # no Slurm to ask (at once): every node counts as usable
        (tmp_path / "bin" / tool).write_text("#!/bin/sh\nexit 1\n")
        (tmp_path / "bin" / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    assert cluster_main(["submit", "--dry-run", "--launcher", "sbatch"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("#!/bin/bash") and "n2" not in out  # stdout stays the script alone
    assert "dry run: a real submit would be excluding suspect node(s) n2" in err, err
