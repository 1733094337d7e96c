"""The two launchers behind one interface: an sbatch script rendered here, or submitit's executor and tasks.

``pick(name)`` is the one place that knows the launchers by name; everything else holds a ``Launcher``.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from cluster.job.nodes import job_state_now
from cluster.launch.command import Work
from cluster.launch.render import (
    RUN_DIR_DEFAULT,
    container_prefix,
    doctor_step,
    dq,
    flight_recorder,
    host_python,
    render_sbatch,
    requeue_rule,
    run_dir_lines,
)
from cluster.launch.submission import Submission, python_for
from cluster.launch.submitit_adapter import renderable, submission_text
from cluster.profile import Profile
from trainer.core.errors import UserError
from trainer.core.exits import EXIT_INTERRUPTED

Recorder = Callable[[str, str], None]
"""Called with the job id and its log (file or folder) once Slurm took the job: the ledger's record."""


class Launcher(Protocol):
    """How a submission reaches Slurm."""

    name: str
    task_logs: bool
    """One log file per task (instead of one batch log labelled by rank)."""

    def warned_with(self, p: Profile) -> str:
        """The signal a job is warned with before its time limit or a preemption."""
        ...

    def check(self, s: Submission) -> None:
        """Refuse (``UserError``) what this launcher cannot run."""
        ...

    def script(self, s: Submission) -> str:
        """The exact batch script it would submit (dry runs, golden files)."""
        ...

    def submit(self, s: Submission, wait: bool, avoid: list[str], record: Recorder) -> int:
        """Submit, excluding the nodes in ``avoid``; ``record`` once there is a job id; with ``wait``, report its end."""
        ...


def _no_grace() -> None:
    raise UserError("profile.signal_grace_s", "0 (no warning signal) needs the sbatch launcher, and a command that "
                    "saves itself: submitit always warns, and requeue_on_signal stops a command on the warning",
                    "signal_grace_s: 120 (time for one save), or LAUNCHER=sbatch without requeue_on_signal")


class Sbatch:
    """A script rendered from the profile (cluster/launch/render.py), given to ``sbatch``."""

    name, task_logs = "sbatch", False

    def warned_with(self, p: Profile) -> str:
        return f"SIG{p.signal}"

    def check(self, s: Submission) -> None:
        if s.profile.signal_grace_s == 0 and s.profile.requeue_on_signal:
            _no_grace()

    def script(self, s: Submission) -> str:
        return sbatch_script(s.profile, s.work)

    def submit(self, s: Submission, wait: bool, avoid: list[str], record: Recorder) -> int:
        return _submit_sbatch(s, wait, avoid, record)


class Submitit:
    """submitit's executor: its own batch script, the task pickled (cluster/launch/task.py)."""

    name, task_logs = "submitit", True

    def warned_with(self, p: Profile) -> str:
        return "SIGUSR2"

    def check(self, s: Submission) -> None:
        p = s.profile
        if p.signal != "USR2" or p.launch != "srun":
            raise UserError("profile.signal" if p.signal != "USR2" else "profile.launch",
                            "submitit always warns with USR2 and starts one task per process",
                            "use signal: USR2 and launch: srun with submitit, or LAUNCHER=sbatch")
        if p.signal_grace_s == 0:
            _no_grace()
        if p.regroup:  # submitit's script has no store to start and keeps srun's --kill-on-bad-exit=1
            raise UserError("profile.regroup", "true (going on without a restart) needs the sbatch launcher: "
                            "submitit's batch script starts no store, and its srun ends every task when one is lost",
                            "LAUNCHER=sbatch, or regroup: false")

    def script(self, s: Submission) -> str:
        print(f"# each task runs: {s.work.task_line(s.profile)}", file=sys.stderr)
        return submitit_script(s.profile, s.work)

    def submit(self, s: Submission, wait: bool, avoid: list[str], record: Recorder) -> int:
        return _submit_submitit(s, wait, avoid, record)


LAUNCHERS: dict[str, Launcher] = {"submitit": Submitit(), "sbatch": Sbatch()}


def pick(name: str) -> Launcher:
    """The launcher called ``name`` (``LAUNCHER=``, ``--launcher``, or a ledger record's)."""
    if name not in LAUNCHERS:
        raise UserError("LAUNCHER", f"must be {' or '.join(LAUNCHERS)}, got {name!r}", "LAUNCHER=sbatch or leave it unset")
    return LAUNCHERS[name]


def sbatch_script(p: Profile, work: Work) -> str:
    """The script `LAUNCHER=sbatch` submits: the built-in trainer with its overrides, or a command."""
    return render_sbatch(p, python_for(p), work, f"rendered from profile {p.name!r} by `python -m cluster submit`")


def executor(p: Profile, work: Work) -> Any:
    """A submitit Slurm executor configured from the profile for ``work`` (its run folder, when given; the optional
    preflight doctor checks with the trainer's overrides)."""
    import submitit

    if p.spare_nodes:
        raise UserError("profile.spare_nodes", "needs the sbatch launcher (submitit starts its tasks itself, on every "
                        "node of the job)", "LAUNCHER=sbatch, or spare_nodes: 0")
    if p.min_nodes and p.min_nodes < p.nodes:
        raise UserError("profile.min_nodes", f"a node range ({p.node_range}) needs the sbatch launcher: submitit asks "
                        "for a fixed node count and waits for a result from each of its nodes × tasks_per_node tasks",
                        f"LAUNCHER=sbatch, or NODES={p.nodes}")
    folder = Path(p.log_dir) / "%j"
    inside = container_prefix(p)
    # slurm_max_num_timeout=0: submitit's own requeueing is off (the tasks replace its handler); the teardown
    # below applies the same requeue rule as an sbatch script, in the batch shell, outside any container.
    # slurm_python goes into srun's line as it is (submitit quotes only its own default): one word, spaces and all.
    ex = submitit.AutoExecutor(folder=folder, cluster="slurm", slurm_max_num_timeout=0,
                               slurm_python=f"{inside} python3" if inside else shlex.quote(python_for(p)))
    setup = [f"export {k}={shlex.quote(str(v))}" for k, v in sorted(p.env.items())] + list(p.setup)
    setup += [f"export TRAINER_MTBF_HOURS={p.mtbf_hours:g}"] if p.mtbf_hours != 24 else []
    setup += flight_recorder(p, f"{dq(str(Path(p.log_dir).resolve()))}/$SLURM_JOB_ID")
    setup += run_dir_lines(shlex.quote(work.run_dir) if work.run_dir else RUN_DIR_DEFAULT, "USR2",  # submitit: USR2
                           p.signal_grace_s)
    host = host_python(p, python_for(p))
    teardown = ["rc=$?  # the tasks' exit code (srun's, the line above)",
                *requeue_rule(p, host, report=not work.reports_itself and not inside)]
    py = "python3" if inside else shlex.quote(python_for(p))
    doctor = f"srun --kill-on-bad-exit=1 {inside + ' ' if inside else ''}{py} -m trainer.doctor"
    doctor += "".join(f" {shlex.quote(a)}" for a in work.doctor_args)
    setup += doctor_step(p, [doctor], host)
    params: dict[str, Any] = {
        "name": p.job_name,
        "nodes": p.nodes,
        "tasks_per_node": p.ntasks_per_node,
        "cpus_per_task": p.cpus_per_task,
        "timeout_min": p.time_min,
        "slurm_signal_delay_s": p.signal_grace_s,
        "slurm_srun_args": ["--kill-on-bad-exit=1"],
        "slurm_setup": setup,
        "slurm_additional_parameters": {"requeue": "expedite" if p.requeue_expedite == "yes" else True},
        "slurm_teardown": teardown,
    }
    if p.gpus_per_node:
        params["gpus_per_node"] = p.gpus_per_node
    if p.mem_per_task_gb:
        params["mem_gb"] = p.mem_per_task_gb * p.ntasks_per_node
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(p, key):
            params[f"slurm_{key}"] = getattr(p, key)
    ex.update_parameters(**params)
    return ex



def submitit_script(p: Profile, work: Work) -> str:
    """The exact batch script submitit would submit for this profile (its submission file text)."""
    with renderable():
        ex = executor(p, work)
    return submission_text(ex)



def tail(path: Path, lines: int = 12) -> str:
    """The last lines of a log (empty when it does not exist)."""
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
    except OSError:
        return ""



def sbatch(script: str, avoid: list[str], wait: bool = False) -> tuple[str, subprocess.Popen[str]]:
    """Give ``script`` to sbatch, excluding ``avoid``: the job id ("" when refused: its message is on stderr) and the
    process (with ``wait``, it returns when the job ends). Every sbatch submission goes through here (jobs, sweeps)."""
    cmd = ["sbatch", "--parsable", *(["--wait"] if wait else []), *([f"--exclude={','.join(avoid)}"] if avoid else [])]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(script)
    proc.stdin.close()
    return proc.stdout.readline().strip().split(";")[0], proc


def _submit_sbatch(s: Submission, wait: bool, avoid: list[str], record: Recorder) -> int:
    p = s.profile
    job_id, proc = sbatch(sbatch_script(p, s.work), avoid, wait)
    if not job_id:
        proc.wait()
        print(f"sbatch refused the job (exit {proc.returncode}); its message is above", file=sys.stderr)
        return proc.returncode or 1
    log = Path(p.log_dir) / f"{p.job_name}-{job_id}.out"
    record(job_id, str(log))
    spare = f" + {p.spare_nodes} spare" if p.spare_nodes else ""
    try:  # the job is Slurm's now: Ctrl-C stops the waiting only
        print(f"submitted job {job_id} (sbatch, {s.work.describe()}{p.nodes}{spare} node(s), profile {p.name})")
        print(f"log:    {log}\nfollow: tail -f {shlex.quote(str(log))}    status: squeue -j {job_id}")
        rc = proc.wait()
    except KeyboardInterrupt:
        proc.terminate()  # sbatch --wait only polls: ending it leaves the job as it is
        return stopped_waiting(job_id)
    if wait:
        print(f"job {job_id} ended with exit code {rc}; the log's last lines:")
        print(tail(log), end="")
    return rc



def _submit_submitit(s: Submission, wait: bool, avoid: list[str], record: Recorder) -> int:
    p = s.profile
    ex = executor(p, s.work)
    if avoid:
        ex.update_parameters(slurm_exclude=",".join(avoid))
    job = ex.submit(s.work.task(p))
    record(str(job.job_id), str(Path(job.paths.stdout).parent))
    try:  # the job is Slurm's now: Ctrl-C stops the waiting only
        print(f"submitted job {job.job_id} (submitit, {s.work.describe()}{p.nodes} node(s), profile {p.name})")
        print(f"logs:   {job.paths.stdout} (rank 0), {job.paths.stderr}")
        print(f"follow: tail -f {shlex.quote(str(job.paths.stdout))}    status: squeue -j {job.job_id}")
        return _result(job, s.work) if wait else 0
    except KeyboardInterrupt:
        return stopped_waiting(str(job.job_id))


def _result(job: Any, work: Work) -> int:
    """``--wait``: the job's end, then its results (0), or why it failed with its logs' last lines (1)."""
    if not ended(job):
        return _failed(job, f"it ended without a result (Slurm no longer lists it; accounting says {job.state})")
    try:
        results = job.results()
    except Exception as exc:  # submitit re-raises the task's error with its log
        errors = [line for line in str(exc).splitlines() if "Error:" in line]  # the task's own error, not the trace
        return _failed(job, errors[-1].strip() if errors else str(exc))
    for line in work.results(str(job.job_id), results):
        print(line)
    return 0


def stopped_waiting(job_id: str) -> int:
    """Ctrl-C while waiting for a job stops the waiting, not the job: one line instead of a traceback, and 130 (the
    shell's code for an interrupted command)."""
    print(f"\nstopped waiting; job {job_id} runs on: python -m cluster status {job_id}", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED


def ended(job: Any, poll_s: float = 2.0, grace_s: float = 15.0) -> bool:
    """Wait until submitit's ``job`` is over: True once squeue no longer lists it and its results are in (or
    submitit's sacct watch says it ended); False once squeue has not listed it for ``grace_s`` and it left no results.

    Results count only once Slurm is done with the job: submitit never removes a task's result file, so an attempt in
    which every rank raised leaves its error there while the verdict has Slurm run the next attempt. Nor does
    accounting end it: a job cancelled while its requeue completed stays REQUEUED there for good, so submitit's own
    wait (``results()``) would never return. While squeue does not answer, the wait goes on."""
    gone_since: float | None = None
    while True:
        now = time.monotonic()
        if job_state_now(str(job.job_id)) == "":  # squeue answered, and no longer lists it
            gone_since = now if gone_since is None else gone_since
            if job.done():
                return True
            if now - gone_since >= grace_s:  # its results may reach a shared disk late
                return False
        time.sleep(poll_s)


def _failed(job: Any, why: str) -> int:
    print(f"job {job.job_id} failed: {why}", file=sys.stderr)
    for path in (job.paths.stdout, job.paths.stderr):
        print(f"--- last lines of {path}", file=sys.stderr)
        print(tail(Path(path)), end="", file=sys.stderr)
    return 1
