"""Render the sbatch script for a profile: resources, the launch line and the requeue rule, nothing else.

Every value that reaches the shell passes through ``shlex.quote``; ``#SBATCH`` values are checked
by the profile (names) or quoted here (paths). The same renderer writes the hand-run templates in
``slurm/`` (tests keep them identical to its output).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Protocol

from cluster.job.rules import RequeueRule
from cluster.profile import Profile
from trainer.core.env import PORT_BASE, PORT_SPAN, default_run_dir
from trainer.core.errors import UserError

RUN_DIR_DEFAULT = default_run_dir("$SLURM_JOB_ID")
"""The run folder a batch script uses when neither ``RUN_DIR`` nor ``run.dir=`` names one."""


def sbatch_directives(p: Profile) -> list[str]:
    """The ``#SBATCH`` header; site-specific lines carry a ``# SITE`` marker line above them."""
    ranged = p.ranged
    lines = [
        f"#SBATCH --job-name={p.job_name}",
        f"#SBATCH --nodes={p.allocation}",
        # With --ntasks-per-node, Slurm 22.05 starts a node range at its minimum although more nodes are idle
        # (measured on the dev cluster): a range asks for one task per node holding the node's share of cores,
        # and srun places the processes (_srun).
        *([] if ranged else [f"#SBATCH --ntasks-per-node={1 if p.launch == 'torchrun' else p.ntasks_per_node}"]),
        f"#SBATCH --cpus-per-task={p.cpus_per_task * (p.ntasks_per_node if ranged else p.procs_per_task)}",
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
        *([f"#SBATCH --signal={p.signal}@{p.signal_grace_s}"] if p.signal_grace_s else []),
        "#SBATCH --requeue=expedite" if p.requeue_expedite == "yes" else "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={_sbatch_path(p.log_dir + '/%x-%j.out')}",
    ]
    return lines


def _sbatch_path(path: str) -> str:
    # sbatch reads #SBATCH values itself (no shell); it honours double quotes around a value.
    if '"' in path or "\n" in path:
        raise UserError("profile.log_dir", f"{path!r} contains a double quote or newline", "choose a plainer folder name")
    return f'"{path}"' if any(c in path for c in " \t'$;&|<>()`\\") else path


DOCKER_TASK = Path(__file__).resolve().parents[2] / "containers" / "docker-task.sh"
APPTAINER_TASK = DOCKER_TASK.with_name("apptainer-task.sh")


def container_prefix(p: Profile) -> str:
    """What goes between ``srun …`` and ``python3 …`` so each task runs inside the profile's image.

    The run folder (``$RUN_DIR``, made absolute before) and the working folder are mounted at the same
    paths, so checkpoints, logs and the requeue marker land on the host, where the requeue rule reads them.
    """
    c = p.container
    image = shlex.quote(c.image or "")
    mounts = c.mounts  # checked by the profile: no characters the shell treats specially
    if c.runtime == "apptainer":  # a SIF unpacked once per node: a squashfuse mount dies of Slurm's signals
        nv = "--nv " if p.gpus_per_node else ""
        return f'{shlex.quote(str(APPTAINER_TASK))} {nv}--bind "{",".join(["$PWD", "$RUN_DIR", *mounts])}" -- {image}'
    if c.runtime == "pyxis":
        binds = ",".join(["$PWD:$PWD", "$RUN_DIR:$RUN_DIR", *mounts])
        return f'--container-image={image} --container-mounts="{binds}" --container-workdir="$PWD"'
    if c.runtime == "docker":
        vols = " ".join(f"-v {m}" for m in mounts)
        return f'{shlex.quote(str(DOCKER_TASK))} -v "$RUN_DIR:$RUN_DIR" {vols + " " if vols else ""}-- {image}'
    return ""


def dq(text: str) -> str:
    """``text`` escaped for use inside double quotes in a shell script."""
    return "".join("\\" + c if c in '\\"$`' else c for c in text)


def flight_recorder(p: Profile, folder: str) -> list[str]:
    """GPU jobs: NCCL's flight recorder, so a collective timeout leaves each rank's last collectives in ``folder``.

    ``folder`` is shell text for inside double quotes (see :func:`dq`)."""
    if not p.gpus_per_node:
        return []
    return [
        "# NCCL flight recorder: on a collective timeout every rank dumps its recent collectives (who waited on whom).",
        'export TORCH_NCCL_TRACE_BUFFER_SIZE="${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}"',
        'export TORCH_NCCL_DUMP_ON_TIMEOUT="${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}"',
        # Bash parses quotes inside "${X:-…}": the folder goes through a plain assignment first.
        f'nccl_trace="{folder}/nccl-trace-rank-"',
        'export TORCH_NCCL_DEBUG_INFO_TEMP_FILE="${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-$nccl_trace}"',
        "",
    ]


def _srun(p: Profile, python: str, keep: bool = False) -> tuple[str, str]:
    """``srun …`` (with the container prefix) and the interpreter each task starts; restarting in place, on this
    attempt's nodes (``$step_nodes``, see :func:`in_place_loop`); ``keep``: the step outlives a task's death."""
    inside = container_prefix(p)
    tasks = 1 if p.launch == "torchrun" else p.ntasks_per_node
    place = f' --nodes="$need" --nodelist="$step_nodes" --ntasks=$(( need * {tasks} ))' if p.in_place else ""
    if p.ranged:  # the allocation was asked for without --ntasks-per-node (see sbatch_directives)
        place += f" --ntasks-per-node={tasks} --cpus-per-task={p.cpus_per_task * p.procs_per_task}"
    # --label: each task's lines carry its number ("1: …"), so `python -m cluster logs --rank 1` finds them.
    srun = f"srun --kill-on-bad-exit={0 if keep else 1} --label{place}" + (f" {inside}" if inside else "")
    return srun, "python3" if inside else shlex.quote(python)


def store_lines(python: str, max_failures: int, replace: str = "", inside: str = "", host: str = "") -> list[str]:
    """Start this attempt's store (``python -m trainer.store``) beside the batch shell, on the first node, and export
    where it serves as TRAINER_STORE; without it (it did not start) the attempt runs as any other. Recoveries in
    place count against ``max_failures`` (TRAINER_MAX_FAILURES). ``replace``: the training command (its overrides, not
    sbatch's, which follow): the store starts it as a warm spare on each lost rank's node (``--on-lost``), taken in at
    a step boundary where the node still runs processes. A rank the others find stuck is killed there (``--on-hang``).
    ``inside``: the container prefix; the store then runs in the image, and the host's ``host`` runs its actions
    (srun is the host's), which it passes on through a FIFO."""
    on_lost = ""
    if replace:
        srun = ('TRAINER_SPARE=$(( 1000 + TRAINER_REPLACEMENT )) srun --overlap --kill-on-bad-exit=0 --label --nodes=1 '
                f'--ntasks=1 --nodelist="$TRAINER_LOST_NODE" {replace}')
        on_lost = " --on-lost \"$on_lost\""
    actions = f'{on_lost} --on-hang "$on_hang"'
    log = '>> "$RUN_DIR/store.log" 2>&1 &'
    serve = '-m trainer.store --port-file "$store_file" --live-file "$store_file.live" --host-name "$store_host"'
    start = [f"{shlex.quote(python)} {serve}{actions} {log}", "store_pid=$!"] if not inside else [
        "# The store runs in the image, which has no srun: its actions go to the host through a FIFO (none: no store).",
        'actions="$store_file.actions" && rm -f "$actions" && store_pid="" actions_pid=""',
        'if mkfifo "$actions"; then',
        f'  {host} -m trainer.store --actions-from "$actions"{actions} {log}',
        "  actions_pid=$!",
        f'  {inside} python3 {serve} --actions-to "$actions" {log}',
        "  store_pid=$!",
        "fi",
    ]
    return [
        "# The job's store in a process of its own (profile regroup: true): when a rank is lost, the others regroup on",
        "# it and go on in their processes; srun keeps the step (--kill-on-bad-exit=0), the verdict reads every rank.",
        *(["# A warm spare is started on the lost rank's node (if it still runs processes) and joins at a step boundary.",
           f"on_lost={shlex.quote(srun)}$( (( $# == 0 )) || printf ' %q' \"$@\")"] if replace else []),
        "# A rank the others' hang watchdogs find stuck is killed on its node, and they go on without it.",
        "on_hang=" + shlex.quote('srun --overlap --nodes=1 --ntasks=1 --nodelist="$TRAINER_HUNG_NODE" '
                                 'kill -KILL "$TRAINER_HUNG_PID"'),
        f"unset TRAINER_STORE; export TRAINER_MAX_FAILURES={max_failures}",
        'store_host=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
        'store_file="$RUN_DIR/.store-${TRAINER_ATTEMPT:-${SLURM_RESTART_COUNT:-0}}" && rm -f "$store_file"{,.live}',
        *start,
        'for _ in $(seq 600); do [[ -s $store_file || -z $store_pid ]] && break; sleep 0.1; done',
        'if read -r store_port presence_port 2>/dev/null < "$store_file"; then',
        '  export TRAINER_STORE="$store_host:$store_port:$presence_port"',
        "else",
        '  echo "note: the job\'s store did not start ($RUN_DIR/store.log): a lost rank restarts the attempt" >&2',
        "fi",
    ]


def spare_lines(p: Profile, command: str) -> list[str]:
    """Warm spares on the allocation's nodes this attempt does not train on (``regroup`` with ``spare_nodes``): one
    process per task, each waiting at the store (TRAINER_SPARE) until a lost rank's place is its own."""
    tasks = p.ntasks_per_node
    return [
        "# Warm spares on the allocation's other nodes: each process waits at the store for a lost rank's place.",
        "# (not the nodes the verdict avoids: a blamed node is no place for a spare)",
        'spare_hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | grep -vxF -f <(tr , \'\\n\' <<<"$step_nodes,$avoid") '
        '| paste -sd, - || true)',
        'spare_pid=""',
        'if [[ -n $spare_hosts && -n ${TRAINER_STORE:-} ]]; then',
        '  spares=$(( $(tr -cd , <<<"$spare_hosts" | wc -c) + 1 ))',
        f'  TRAINER_SPARE=0 srun --kill-on-bad-exit=0 --label --nodes="$spares" --nodelist="$spare_hosts" '
        f'--ntasks=$(( spares * {tasks} )) {command} &',
        "  spare_pid=$!",
        "fi",
    ]


def launch_line(p: Profile, python: str, args: list[str], module: str = "trainer", user_args: bool = True) -> list[str]:
    """The lines that start the training processes on every node (``"$@"``: overrides given to sbatch)."""
    keep = p.regroup and module == "trainer"
    srun, py = _srun(p, python, keep)
    # The run folder and the warning signal reach the trainer as RUN_DIR and TRAINER_SIGNAL (run_dir_lines).
    overrides = "".join(f" {shlex.quote(a)}" for a in args) + (' "$@"' if user_args else "")
    if p.launch == "srun":
        inside = container_prefix(p)
        cmd = f"{inside} {py}" if inside else py
        spares = spare_lines(p, f"{cmd} -m {module}{overrides}") if keep and p.spare_nodes else []
        fixed = "".join(f" {shlex.quote(a)}" for a in args)  # a replacement gets sbatch's overrides from the store line
        store = store_lines(python, p.max_failures, f"{cmd} -m {module}{fixed}" if user_args else "", inside,
                            host_python(p, python)) if keep else []
        return [*store, *spares, f"{srun} {py} -m {module}{overrides}"]
    # One torchrun per node; c10d rendezvous on the first node, port derived as trainer/core/env.py does.
    # torchrun's agent has no handler for USR1/USR2 and would die of the warning signal: it ignores it
    # (inherited through exec), the trainers it starts install their own handler.
    ignore = f"bash -c 'trap \"\" {p.signal}; exec \"$@\"' torchrun " if p.signal in ("USR1", "USR2") else ""
    return [
        'head=${step_nodes%%,*}' if p.in_place else 'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
        f"port=$(( {PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN} ))",
        f"{srun} {ignore}{py} -m torch.distributed.run \\",
        f'    --nnodes="{"$need" if p.in_place else "$SLURM_NNODES"}" --nproc-per-node={p.ntasks_per_node} \\',
        '    --rdzv-backend=c10d --rdzv-endpoint="$head:$port" --rdzv-id="$SLURM_JOB_ID" \\',
        f"    -m {module}{overrides}",
    ]


def command_line(p: Profile, python: str, words: list[str]) -> list[str]:
    """The line that starts a user's command in every task, through ``python -m trainer.launch`` (torchrun's
    variables, the warning signal) with ``words`` (its options, ``--``, the command); ``"$@"``: arguments given to
    sbatch, appended to the command."""
    srun, py = _srun(p, python, p.regroup)
    store = store_lines(python, p.max_failures, "", container_prefix(p), host_python(p, python)) if p.regroup else []
    return [*store, f'{srun} {py} -m trainer.launch {shlex.join(words)} "$@"']


def verdict_lines(p: Profile, python: str, phase: str) -> list[str]:
    """The verdict on the attempt (cluster/job/verdict.py), run in the batch shell with the host's python: it requeues or
    ends the job, and its exit code is the job's; restarting in place it may instead start the next attempt here."""
    verdict = (f"{python} -m cluster.job.verdict --phase {phase} --rc \"$rc\" --max-requeues {p.max_requeues} "
               f"--max-failures {p.max_failures} --suspect-hours {p.suspect_hours:g}"
               + (f" --suspect-after {p.suspect_after}" if p.suspect_after != 2 else "")
               + (f" --storm-after {p.storm_after}" if p.storm_after != 3 else "")
               + (f" --min-nodes {p.min_nodes}" if p.ranged else ""))
    if p.in_place:
        verdict = f'next=$({verdict} --in-place --least {p.min_nodes if p.ranged else p.nodes} --most {p.nodes})'
    # trap '' TERM: a requeue signals this shell too; it must live to exclude the blamed nodes (inherited by the verdict).
    lines = ["trap '' TERM", f"verdict=0; {verdict} || verdict=$?"]
    if p.container.runtime != "none":  # the host's python3 may be missing: the plain rule still requeues a saved run
        lines += ["if (( verdict == 126 || verdict == 127 )); then",
                  '  echo "no python3 on this host for the verdict: the plain requeue rule" >&2',
                  f'  {RequeueRule(p.max_requeues).shell()} && scontrol requeue "$SLURM_JOB_ID" && exit 0',
                  '  exit "$rc"',
                  "fi"]
    if p.in_place:  # the verdict's last line asks for the next attempt here, on the nodes its step-nodes line names
        lines.append('if [[ ${next##*$\'\\n\'} == restart-here:* ]]; then '
                     "step_nodes=$(sed -n 's/^step-nodes: //p' <<<\"$next\") "
                     + ("avoid=${next##*restart-here: } " if p.regroup and p.spare_nodes else "")
                     + "h=$(sed -n 's/^here: //p' <<<\"$next\") here=${h:-$(( here + 1 ))}; trap - TERM; continue; fi")
    return [*lines, 'exit "$verdict"']


def in_place_loop(p: Profile, attempt: list[str]) -> list[str]:
    """Restarting in place (spare nodes, a node range), the first attempt runs on ``nodes`` of the allocation's nodes
    and every later one on the nodes the verdict names (it reads what the job holds now from Slurm: a node range goes
    on with fewer, down to ``min_nodes``, and never asks for a node it gave back)."""
    avoid = ' avoid=""' if p.regroup and p.spare_nodes else ""  # where no warm spare goes (spare_lines)
    how = (f"on up to {p.nodes} of the allocation's nodes, at least {p.min_nodes}" if p.ranged
           else f"on {p.nodes} of the allocation's nodes")
    return [
        f"# Restarts in place (spare_nodes: {p.spare_nodes}, nodes: {p.node_range}): each attempt runs {how};",
        "# after a failure the verdict may start the next one here at once, on the nodes it names.",
        "# (sed, not head: it reads every name, so scontrol never dies of SIGPIPE under pipefail)",
        f'here=0{avoid} step_nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n "1,{p.nodes}p" | paste -sd, -)',
        "while :; do",
        '  rm -f "$RUN_DIR/requeue.json"  # only this attempt\'s marker may count',
        '  TRAINER_ATTEMPT=${SLURM_RESTART_COUNT:-0}',
        '  if (( here )); then TRAINER_ATTEMPT+=".$here"; fi',
        "  export TRAINER_ATTEMPT",
        "  need=$(( $(tr -cd , <<<\"$step_nodes\" | wc -c) + 1 ))",
        '  job_event job_start ", \\"attempt\\": \\"$TRAINER_ATTEMPT\\", \\"step_nodes\\": \\"$step_nodes\\""',
        '  echo "attempt $TRAINER_ATTEMPT of job $SLURM_JOB_ID starts on $step_nodes" >&2',
        *(f"  {line}" if line else "" for line in attempt),
        "done",
    ]


def requeue_rule(p: Profile, python: str, report: bool = False) -> list[str]:
    """The rule after the tasks ended with ``$rc``, the one copy for every launcher (sbatch scripts, submitit's
    teardown): the verdict classifies the attempt by its first cause and requeues a preemption save (at most
    ``max_requeues`` times) or an infrastructure failure (at most ``max_failures`` times, without the blamed nodes).
    It runs here, in the batch shell, outside any container. ``report``: write a command's run report (the session
    API writes its own)."""
    return [
        *(["# srun's step ends with its own tasks, but spares that took lost ranks' places may train on: while the store",
           "# counts processes training, the attempt goes on",
           'while [[ -n ${store_pid:-} && $(cat "$store_file.live" 2>/dev/null) =~ ^[1-9] ]] && kill -0 "$store_pid" '
           '2>/dev/null; do sleep 0.2; done'] if p.regroup else []),
        *(["if [[ -n ${spare_pid:-} ]]; then  # spares leave once the attempt ends; a used one ends with the others",
           '  for _ in $(seq 100); do kill -0 "$spare_pid" 2>/dev/null || break; sleep 0.1; done',
           '  kill "$spare_pid" 2>/dev/null || true',
           '  wait "$spare_pid" 2>/dev/null || true',
           "fi"] if p.regroup and p.spare_nodes else []),
        *(['[[ -z ${store_pid:-} ]] || kill "$store_pid" 2>/dev/null || true  # the attempt\'s store']
          if p.regroup else []),
        *(['[[ -z ${actions_pid:-} ]] || { kill "$actions_pid" 2>/dev/null || true; rm -f "$actions"; }  # its actions\' runner']
          if p.regroup and p.container.runtime != "none" else []),
        'job_event job_end ", \\"code\\": $rc"',
        *([f'{python} -m trainer.report "$RUN_DIR" >/dev/null 2>&1 || true  # the attempts as this shell saw them']
          if report else []),
        "# Finished, preempted (saved: requeue), the user's error (stop), or the cluster's (blame, exclude, requeue).",
        *verdict_lines(p, python, "train"),
    ]


def run_dir_lines(default: str, warning: str, grace_s: int, start: bool = True) -> list[str]:
    """``$RUN_DIR``: exported (commands and the session API write there), absolute (mounted into containers by that
    path), and without an earlier attempt's requeue marker (only this attempt's may trigger a requeue); and
    ``$TRAINER_SIGNAL``, the signal Slurm warns the job with (``warning``), on which the session saves, and how long
    before the time limit (``$TRAINER_SIGNAL_GRACE_S``: a signal then is the limit's, not a preemption)."""
    return [
        # A requeued job keeps its id, so it finds its run folder (and checkpoints) again.
        f"export RUN_DIR=${{RUN_DIR:-{default}}} TRAINER_SIGNAL=SIG{warning} TRAINER_SIGNAL_GRACE_S={grace_s}",
        'mkdir -p "$RUN_DIR" && RUN_DIR=$(cd "$RUN_DIR" && pwd -P)',
        'rm -f "$RUN_DIR/requeue.json"',
        "# What the batch shell sees of each attempt, for the run report (trainer/report.py): one line per event.",
        "job_event() {",
        '  printf \'{"t": %s, "event": "%s", "job_id": "%s", "restart": %s, "nodes": %s%s}\\n\' "$(date +%s.%N)" "$1" \\',
        '    "${SLURM_JOB_ID:-0}" "${SLURM_RESTART_COUNT:-0}" "${need:-${SLURM_JOB_NUM_NODES:-1}}" "${2:-}" \\',
        '    >> "$RUN_DIR/events.jsonl" || true',
        "}",
        *(["job_event job_start",
           'echo "attempt ${SLURM_RESTART_COUNT:-0} of job ${SLURM_JOB_ID:-0} starts on ${SLURM_JOB_NODELIST:-?}" >&2']
          if start else []),
    ]


def doctor_step(p: Profile, launch: list[str], python: str) -> list[str]:
    """The optional preflight step: the doctor, launched exactly as training is; a node failing it is blamed and
    the job requeued without it (the verdict)."""
    return [
        f"# Preflight checks on every node and GPU (profile doctor: {str(p.doctor).lower()}; DOCTOR=0|1 overrides).",
        f'if [[ "${{DOCTOR:-{int(p.doctor)}}}" == 1 ]]; then',
        "  rc=0",
        *(f"  {line}" for line in launch[:-1]),
        f"  {launch[-1]} || rc=$?",
        "  if (( rc )); then",
        '    echo "preflight doctor failed (its table, or the launch error, is above)" >&2',
        *(f"    {line}" for line in verdict_lines(p, python, "doctor")),
        "  fi",
        "fi",
    ]


def host_python(p: Profile, python: str) -> str:
    """The interpreter the batch shell runs the verdict with: the job's, or the host's python3 beside a container."""
    # python3 on the host does not have the project installed: it imports it from the folder the job was submitted in.
    return 'PYTHONPATH="${SLURM_SUBMIT_DIR:-$PWD}" python3' if p.container.runtime != "none" else shlex.quote(python)


def environment(p: Profile) -> list[str]:
    """The profile's setup lines and variables, and the ones every launch needs."""
    lines = ["# SITE: setup from the profile", *p.setup, ""] if p.setup else []
    lines += [f"export {name}={shlex.quote(str(value))}" for name, value in sorted(p.env.items())]
    return [
        *lines,
        "export PYTHONUNBUFFERED=1",
        # Slurm 22.05-23.02's srun does not inherit --cpus-per-task from the allocation.
        'export SRUN_CPUS_PER_TASK="${SLURM_CPUS_PER_TASK:-1}"',
        *([f"export TRAINER_MTBF_HOURS={p.mtbf_hours:g}"] if p.mtbf_hours != 24 else []),
        # Restarts inside the allocation can restore from node memory (checkpoint.memory=auto takes snapshots then).
        *(["export TRAINER_IN_PLACE=1"] if p.in_place else []),
        # A node range may shrink or grow: a loader without a global batch keeps its first attempt's.
        *([f"export TRAINER_NODES={p.node_range}"] if p.ranged else []),
    ]


class Work(Protocol):
    """What a job runs, as the renderer needs it (cluster/launch/command.py: the built-in trainer, or a command)."""

    @property
    def run_dir(self) -> str | None:
        """The run folder it names (None: ``$RUN_DIR`` or the job's)."""

    @property
    def reports_itself(self) -> bool:
        """Whether it writes the run's report (the session does; the batch shell writes a command's)."""

    def prelude(self) -> list[str]:
        """Lines before the first attempt."""
        ...

    def attempt(self, p: Profile, python: str) -> list[str]:
        """An attempt's lines: the optional doctor, then the launch, its exit code in ``$rc``."""
        ...


def render_sbatch(p: Profile, python: str, work: Work, origin: str) -> str:
    """The complete batch script for profile ``p`` running ``work``."""
    lines = ["#!/bin/bash", f"# {origin}", *sbatch_directives(p), "set -euo pipefail", "", *environment(p)]
    lines += [
        *run_dir_lines(shlex.quote(work.run_dir) if work.run_dir else RUN_DIR_DEFAULT, p.signal, p.signal_grace_s,
                       start=not p.in_place),
        "# The ledger (python -m cluster runs): a job sbatch'ed by hand records itself once; a submitted one is there.",
        f'if [[ "${{SLURM_RESTART_COUNT:-0}}" == 0 ]]; then {host_python(p, python)} -m cluster.job.ledger register '
        '"$RUN_DIR" "$@" || true; fi',
        "",
        *flight_recorder(p, "$RUN_DIR"),
        *work.prelude(),
    ]
    rule = requeue_rule(p, host_python(p, python), report=not work.reports_itself and p.container.runtime == "none")
    attempt = [*work.attempt(p, python), "", *rule]
    return "\n".join([*lines, *(in_place_loop(p, attempt) if p.in_place else attempt)]) + "\n"
