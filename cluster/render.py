"""Render the sbatch script for a profile: resources, the launch line and the requeue rule, nothing else.

Every value that reaches the shell passes through ``shlex.quote``; ``#SBATCH`` values are checked
by the profile (names) or quoted here (paths). The same renderer writes the hand-run templates in
``slurm/`` (tests keep them identical to its output).
"""

from __future__ import annotations

import shlex

from cluster.profile import Profile
from trainer.env import PORT_BASE, PORT_SPAN
from trainer.errors import EXIT_REQUEUE, UserError


def sbatch_directives(p: Profile) -> list[str]:
    """The ``#SBATCH`` header; site-specific lines carry a ``# SITE`` marker line above them."""
    lines = [
        f"#SBATCH --job-name={p.job_name}",
        f"#SBATCH --nodes={p.nodes}",
        f"#SBATCH --ntasks-per-node={1 if p.launch == 'torchrun' else p.ntasks_per_node}",
        f"#SBATCH --cpus-per-task={p.cpus_per_task * p.procs_per_task}",
        f"#SBATCH --time={p.time_min}",
    ]
    if p.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={p.gpus_per_node}")
    if p.mem_per_task_gb:
        lines.append(f"#SBATCH --mem-per-cpu={int(p.mem_per_task_gb * 1024 / p.cpus_per_task)}M")
    for key in ("partition", "account", "qos", "constraint"):
        value = getattr(p, key)
        if value:
            lines += ["# SITE", f"#SBATCH --{key}={value}"]
    lines += [
        # torchrun's agent dies of USR2 (no handler); it forwards TERM to the trainers instead.
        f"#SBATCH --signal={'TERM' if p.launch == 'torchrun' else p.signal}@{p.signal_grace_s}",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={_sbatch_path(p.log_dir + '/%x-%j.out')}",
    ]
    return lines


def _sbatch_path(path: str) -> str:
    # sbatch reads #SBATCH values itself (no shell); it honours double quotes around a value.
    if '"' in path or "\n" in path:
        raise UserError("profile.log_dir", f"{path!r} contains a double quote or newline", "choose a plainer folder name")
    return f'"{path}"' if any(c in path for c in " \t'$;&|<>()`\\") else path


def launch_line(p: Profile, python: str, args: list[str]) -> list[str]:
    """The lines that start the training processes on every node (``"$@"``: overrides given to sbatch)."""
    trainer = " ".join(shlex.quote(a) for a in ["-m", "trainer", *args]) + ' run.dir="$RUN_DIR" "$@"'
    py = shlex.quote(python)
    if p.container.runtime != "none":
        raise UserError("profile.container.runtime", f"{p.container.runtime} launches are not available in this version",
                        "use container: {runtime: none} for now")
    if p.launch == "srun":
        trainer = f"{' '.join(trainer.split(' ')[:2])} checkpoint.signal=SIG{p.signal} {' '.join(trainer.split(' ')[2:])}"
        return [f"srun --kill-on-bad-exit=1 {py} {trainer}"]
    # One torchrun per node; c10d rendezvous on the first node, port derived as trainer/env.py does.
    return [
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"port=$(( {PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN} ))",
        f"srun --kill-on-bad-exit=1 {py} -m torch.distributed.run \\",
        f'    --nnodes="$SLURM_NNODES" --nproc-per-node={p.ntasks_per_node} \\',
        '    --rdzv-backend=c10d --rdzv-endpoint="$head:$port" --rdzv-id="$SLURM_JOB_ID" \\',
        f"    {trainer}",
    ]


def render_sbatch(p: Profile, python: str, args: list[str], origin: str, run_dir: str | None = None) -> str:
    """The complete batch script for profile ``p`` with training overrides ``args``."""
    launch = launch_line(p, python, args)
    default_dir = shlex.quote(run_dir) if run_dir else "runs/$SLURM_JOB_ID"
    lines = ["#!/bin/bash", f"# {origin}", *sbatch_directives(p), "set -euo pipefail", ""]
    if p.setup:
        lines += ["# SITE: setup from the profile", *p.setup, ""]
    for name, value in sorted(p.env.items()):
        lines.append(f"export {name}={shlex.quote(str(value))}")
    lines += [
        "export PYTHONUNBUFFERED=1",
        # A requeued job keeps its id, so it finds its run folder (and checkpoints) again.
        f'RUN_DIR="${{RUN_DIR:-{default_dir}}}"' if not run_dir else f"RUN_DIR=${{RUN_DIR:-{default_dir}}}",
        "",
        "rc=0",
        *launch[:-1],
        launch[-1] + " || rc=$?",
        "",
        f"# Exit {EXIT_REQUEUE} (or the marker, when torchrun's agent hides the code): saved after a signal.",
        f'if [[ $rc -eq {EXIT_REQUEUE} || -f "$RUN_DIR/requeue.json" ]]; then',
        f"  if (( ${{SLURM_RESTART_COUNT:-0}} < {p.max_requeues} )); then",
        '    echo "checkpoint saved: requeueing job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0})"',
        '    scontrol requeue "$SLURM_JOB_ID" || echo "requeue refused (job already ending?)" >&2',
        "    exit 0",
        "  fi",
        f'  echo "not requeueing: {p.max_requeues} requeues done" >&2',
        "fi",
        'exit "$rc"',
    ]
    return "\n".join(lines) + "\n"
