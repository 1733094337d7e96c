"""The batch script of a sweep's workers: one Slurm array of ``max_parallel`` tasks, each running trials one after
another (cluster/sweeps/worker.py asks the study), each trial launched and judged exactly as `make submit LAUNCHER=sbatch`
launches and judges a job (cluster/launch/render.py: the launch line, the verdict, the requeue rule)."""

from __future__ import annotations

import shlex
from pathlib import Path

from cluster.launch.command import Work
from cluster.launch.render import (
    _sbatch_path,
    doctor_step,
    environment,
    flight_recorder,
    host_python,
    launch_line,
    requeue_rule,
    run_dir_lines,
    sbatch_directives,
)
from cluster.profile import Profile
from cluster.sweeps.folder import log_path


def directives(p: Profile, sweep_dir: Path, workers: int) -> list[str]:
    """The profile's ``#SBATCH`` lines, the array of workers, and one log per worker."""
    lines = [line for line in sbatch_directives(p) if not line.startswith("#SBATCH --output=")]
    return [*lines, f"#SBATCH --array=0-{workers - 1}",
            f"#SBATCH --output={_sbatch_path(str(log_path(sweep_dir, '%A_%a')))}"]


def worker_script(p: Profile, python: str, sweep_dir: Path, workers: int, work: Work, origin: str) -> str:
    """The complete worker script: set-up, the optional doctor, then the loop: next trial, launch (``work``: the
    built-in trainer or a command, each trial's arguments given as ``"$@"``), verdict, end."""
    host = host_python(p, python)
    launch = work.launch(p, python)
    rule = requeue_rule(p, host, report=not work.reports_itself and p.container.runtime == "none")
    assert rule[-1] == 'exit "$verdict"'  # the worker goes on to its next trial instead
    doctor = launch_line(p, python, [], module="trainer.doctor", user_args=False)
    body = [
        'ask=0; worker_py next "$sweep" || ask=$?',
        "if (( ask == 3 )); then echo \"worker $worker: the study has all its trials\" >&2; exit 0; fi",
        'if (( ask )); then exit "$ask"; fi',
        'source "$sweep/workers/$task.sh"  # the trial\'s RUN_DIR, and its arguments as "$@"',
        'rm -f "$RUN_DIR/requeue.json"  # only this attempt\'s marker may count',
        "job_event job_start",
        'echo "attempt ${SLURM_RESTART_COUNT:-0} of job ${SLURM_JOB_ID:-0} starts on ${SLURM_JOB_NODELIST:-?}" >&2',
        "# The trial's intermediate values into the study, the pruner's answer back, while it trains.",
        # exec: $! is the relay itself, not a subshell that runs it (killing that left the relay running).
        f'( exec {shlex.quote(python)} -m cluster.sweeps.worker relay "$sweep" ) & relay=$!',
        "rc=0",
        *launch[:-1],
        launch[-1] + " || rc=$?",
        'kill "$relay" 2>/dev/null || true; wait "$relay" 2>/dev/null || true',
        *rule[:-1],
        "# The study learns how the trial ended; a requeued job resumes this trial when it starts again.",
        'ended=0; worker_py end "$sweep" --rc "$rc" || ended=$?',
        "if (( ended == 10 )); then exit 0; fi",
        'if (( ended )); then exit "$ended"; fi',
        "trap - TERM",
    ]
    lines = [
        "#!/bin/bash", f"# {origin}", *directives(p, sweep_dir, workers), "set -euo pipefail", "", *environment(p),
        f"sweep={shlex.quote(str(sweep_dir))} worker=${{SLURM_ARRAY_TASK_ID:-0}}",
        "task=${SLURM_ARRAY_JOB_ID:-local}_$worker  # its files under workers/ (worker.task_name): this array's own",
        f'worker_py() {{ {shlex.quote(python)} -m cluster.sweeps.worker "$@"; }}  # asks and tells the study',
        # The worker's own folder holds the doctor's records; each trial's RUN_DIR is its own (workers/<task>.sh).
        "unset RUN_DIR  # never the submitting shell's: each trial's comes from the study",
        *run_dir_lines('"$sweep/workers/$task"', p.signal, p.signal_grace_s, start=False),
        "",
        *flight_recorder(p, "$sweep/logs"),
        *doctor_step(p, doctor, host),
        "while :; do",
        *(f"  {line}" for line in body),
        "done",
    ]
    return "\n".join(lines) + "\n"
