"""Submit training to Slurm through submitit (default) or a rendered sbatch script."""

from __future__ import annotations

import contextlib
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cluster.profile import Profile
from cluster.render import container_prefix, doctor_step, dq, flight_recorder, render_sbatch
from cluster.task import TrainTask
from trainer.build import load_checked as load_train_config
from trainer.errors import UserError


def python_for(p: Profile) -> str:
    """The interpreter the compute nodes run: the profile's, or the one submitting (same venv)."""
    return sys.executable if p.python == "python" else p.python


def split_run_dir(args: list[str]) -> tuple[list[str], str | None]:
    """Take ``run.dir=…`` out of the overrides: the batch script owns it (as RUN_DIR) to find requeue markers."""
    rest = [a for a in args if not a.startswith("run.dir=")]
    dirs = [a.split("=", 1)[1] for a in args if a.startswith("run.dir=")]
    return rest, (dirs[-1] if dirs else None)


def sbatch_script(p: Profile, args: list[str]) -> str:
    """The script `LAUNCHER=sbatch` submits."""
    rest, run_dir = split_run_dir(args)
    return render_sbatch(p, python_for(p), rest, f"rendered from profile {p.name!r} by `python -m cluster submit`",
                         run_dir=run_dir)


def executor(p: Profile, run_dir: str | None = None, args: list[str] | None = None) -> Any:
    """A submitit Slurm executor configured from the profile (``run_dir``: the trainer's, when given; ``args``:
    the training overrides, which the optional preflight doctor checks with)."""
    import submitit

    folder = Path(p.log_dir) / "%j"
    inside = container_prefix(p)
    ex = submitit.AutoExecutor(folder=folder, cluster="slurm", slurm_max_num_timeout=p.max_requeues,
                               slurm_python=f"{inside} python3" if inside else python_for(p))
    setup = [f"export {k}={shlex.quote(str(v))}" for k, v in sorted(p.env.items())] + list(p.setup)
    setup += flight_recorder(p, f"{dq(str(Path(p.log_dir).resolve()))}/$SLURM_JOB_ID")
    teardown: list[str] = []
    if inside:
        # The task runs in the image, where scontrol usually is not: the batch shell requeues instead.
        default = shlex.quote(run_dir) if run_dir else "runs/$SLURM_JOB_ID"
        setup += [f"export RUN_DIR=${{RUN_DIR:-{default}}}",
                  'mkdir -p "$RUN_DIR" && RUN_DIR=$(cd "$RUN_DIR" && pwd -P)',
                  'rm -f "$RUN_DIR/requeue.json"']
        teardown = [f'if [[ -f "$RUN_DIR/requeue.json" ]] && (( ${{SLURM_RESTART_COUNT:-0}} < {p.max_requeues} )); then',
                    '  scontrol requeue "$SLURM_JOB_ID"', "fi"]
    py = "python3" if inside else shlex.quote(python_for(p))
    doctor = f"srun --kill-on-bad-exit=1 {inside + ' ' if inside else ''}{py} -m trainer.doctor"
    doctor += "".join(f" {shlex.quote(a)}" for a in args or []) + (' run.dir="$RUN_DIR"' if inside else "")
    setup += doctor_step(p, [doctor])
    params: dict[str, Any] = {
        "name": p.job_name,
        "nodes": p.nodes,
        "tasks_per_node": p.ntasks_per_node,
        "cpus_per_task": p.cpus_per_task,
        "timeout_min": p.time_min,
        "slurm_signal_delay_s": p.signal_grace_s,
        "slurm_srun_args": ["--kill-on-bad-exit=1"],
        "slurm_setup": setup,
        "slurm_additional_parameters": {"requeue": True},
    }
    if teardown:
        params["slurm_teardown"] = teardown
    if p.gpus_per_node:
        params["gpus_per_node"] = p.gpus_per_node
    if p.mem_per_task_gb:
        params["mem_gb"] = p.mem_per_task_gb * p.ntasks_per_node
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(p, key):
            params[f"slurm_{key}"] = getattr(p, key)
    ex.update_parameters(**params)
    return ex


@contextlib.contextmanager
def renderable() -> Iterator[None]:
    """Let submitit's Slurm executor be built where Slurm is not installed, to print its script (dry runs).

    Its constructor refuses without ``srun`` on PATH, though rendering the script never runs it.
    """
    from submitit.slurm.slurm import SlurmExecutor

    original = SlurmExecutor.__dict__["affinity"]
    SlurmExecutor.affinity = classmethod(lambda cls: 1)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        SlurmExecutor.affinity = original  # type: ignore[method-assign]


def submitit_script(p: Profile, args: list[str]) -> str:
    """The exact batch script submitit would submit for this profile (its submission file text)."""
    with renderable():
        inner = executor(p, split_run_dir(args)[1], args)._executor
    return str(inner._make_submission_file_text(inner._submitit_command_str, "<uid>"))


def check_slurm() -> None:
    """Fail clearly when there is no Slurm to talk to."""
    if shutil.which("sbatch") is None:
        raise UserError("LAUNCHER", "sbatch is not on PATH", "submit from a Slurm login node, or start `make dev-cluster` "
                        "and run `eval \"$(slurm/dev-cluster.sh env)\"`")


def submit(p: Profile, args: list[str], launcher: str, dry_run: bool, wait: bool) -> int:
    """Submit (or with dry_run print) one training job; with wait, block and report the result."""
    load_train_config([a for a in args if not a.startswith("run.dir=")])  # bad overrides fail here, not on the cluster
    if launcher not in ("submitit", "sbatch"):
        raise UserError("LAUNCHER", f"must be submitit or sbatch, got {launcher!r}", "LAUNCHER=sbatch or leave it unset")
    if launcher == "submitit" and (p.signal != "USR2" or p.launch != "srun"):
        raise UserError("profile.signal" if p.signal != "USR2" else "profile.launch",
                        "submitit always warns with USR2 and starts one task per process",
                        "use signal: USR2 and launch: srun with submitit, or LAUNCHER=sbatch")
    warned_with = "SIGUSR2" if launcher == "submitit" else f"SIG{p.signal}"
    for arg in args:  # a later override would win over the launcher's, and the warning would kill, not save
        key, _, value = arg.partition("=")
        if key == "checkpoint.signal" and value != warned_with:
            raise UserError("checkpoint.signal", f"{value!r} is not the signal this job is warned with ({warned_with})",
                            "leave checkpoint.signal out: the launcher sets it from the profile's signal")
    if dry_run:
        print(sbatch_script(p, args) if launcher == "sbatch" else submitit_script(p, args), end="")
        if launcher == "submitit":  # the task itself travels as a pickle, not in the script
            print(f"# each task runs: python -m trainer {shlex.join(['checkpoint.signal=SIGUSR2', *args])}", file=sys.stderr)
        return 0
    check_slurm()
    Path(p.log_dir).mkdir(parents=True, exist_ok=True)
    if launcher == "sbatch":
        return _submit_sbatch(p, args, wait)
    return _submit_submitit(p, args, wait)


def _submit_sbatch(p: Profile, args: list[str], wait: bool) -> int:
    script = sbatch_script(p, args)
    cmd = ["sbatch", "--parsable", *(["--wait"] if wait else [])]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(script)
    proc.stdin.close()
    job_id = proc.stdout.readline().strip().split(";")[0]
    if not job_id:
        proc.wait()
        print(f"sbatch refused the job (exit {proc.returncode}); its message is above", file=sys.stderr)
        return proc.returncode or 1
    log = Path(p.log_dir) / f"{p.job_name}-{job_id}.out"
    print(f"submitted job {job_id} (sbatch, {p.nodes} node(s), profile {p.name})")
    print(f"log:    {log}\nfollow: tail -f {shlex.quote(str(log))}    status: squeue -j {job_id}")
    rc = proc.wait()
    if wait:
        print(f"job {job_id} ended with exit code {rc}")
        if log.exists():
            print("".join(log.read_text().splitlines(keepends=True)[-5:]), end="")
    return rc


def _submit_submitit(p: Profile, args: list[str], wait: bool) -> int:
    ex = executor(p, split_run_dir(args)[1], args)
    job = ex.submit(TrainTask(["checkpoint.signal=SIGUSR2", *args], p.max_requeues))
    print(f"submitted job {job.job_id} (submitit, {p.nodes} node(s), profile {p.name})")
    print(f"logs:   {job.paths.stdout} (rank 0), {job.paths.stderr}")
    print(f"follow: tail -f {shlex.quote(str(job.paths.stdout))}    status: squeue -j {job.job_id}")
    if not wait:
        return 0
    try:
        results = job.results()
    except Exception as exc:  # submitit re-raises the task's error with its log
        print(f"job {job.job_id} failed: {exc}", file=sys.stderr)
        return 1
    main = results[0]
    scores = ", ".join(f"{k[5:]} {v:.4g}" for k, v in main.items() if k.startswith("test_")) or "no evaluation set"
    print(f"job {job.job_id} done: {scores}, world size {main['world_size']}, checkpoint {main['checkpoint']}")
    for r in results:
        checksum = f", parameter checksum {r['param_checksums'][r['rank']]}" if "param_checksums" in r else ""
        print(f"  rank {r['rank']}: world size {r['world_size']}{checksum}")
    return 0
