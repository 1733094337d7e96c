"""Where this process sits in the job: the only module that reads rank variables (but for core/exits.py, which names
its exit record by rank with the standard library alone, so that the host's python3 can read it).

torchrun's variables win over Slurm's, Slurm's over a lone process. Nothing here writes
``os.environ``: the result is a frozen :class:`DistEnv` that the rest of the trainer passes around.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import hostlist

from trainer.core.errors import UserError
from trainer.core.exits import node_name

Source = Literal["torchrun", "slurm", "single"]

TRAINER_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS",
    "SLURM_NODEID", "SLURM_NNODES",
    "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST", "SLURM_STEP_NUM_NODES", "SLURM_JOB_ID", "SLURM_STEP_ID",
    "SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_JOB_NAME",
    "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_RESTART_COUNT", "SLURM_GPUS_ON_NODE", "WANDB_API_KEY",
    "TRAINER_FAULTS", "RUN_DIR", "TRAINER_SIGNAL", "TRAINER_CHECKSUM", "TRAINER_MTBF_HOURS", "TRAINER_SIGNAL_GRACE_S",
    "TRAINER_TRIAL", "TRAINER_PRUNING", "TRAINER_IN_PLACE", "TRAINER_NODES", "TRAINER_MEMORY_DIR", "SLURM_JOB_END_TIME",
    "TRAINER_STORE", "TRAINER_SPARE", "TRAINER_MAX_FAILURES",
)
"""Every variable this module reads (besides HOME/NETRC for W&B's netrc): container launchers pass them all in."""

PORT_BASE = 15000
"""Derived ports lie in [15000, 30000): below Linux's ephemeral range (32768+) so a port picked
from the job id does not collide with outgoing connections, and distinct for concurrent jobs."""
PORT_SPAN = 15000


@dataclass(frozen=True)
class DistEnv:
    """One process's place in a (possibly multi-node) job."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    job_id: str | None
    source: Source
    agent: bool = False
    """Started by torchrun's agent (TORCHELASTIC_RUN_ID set), which itself holds MASTER_PORT on the head node."""
    agent_restart: int = 0
    """TORCHELASTIC_RESTART_COUNT: how often the agent restarted its workers (its store keeps earlier rounds' keys)."""

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the only rank with side effects (files, logs, tracking)."""
        return self.rank == 0


@dataclass(frozen=True)
class JobInfo:
    """What the scheduler says about the job as a whole (for run names, tags and tracking)."""

    job_name: str | None
    array_job_id: str | None
    array_task_id: str | None
    restart_count: int
    gpus_on_node: int
    wandb_key: bool
    """Whether a W&B API key is available (environment or netrc); the key itself is never read."""
    run_dir: str | None = None
    """RUN_DIR: the run folder the batch script watches for the requeue marker (the session's default run.dir)."""
    warning_signal: str | None = None
    """TRAINER_SIGNAL: the signal Slurm warns this job with (e.g. SIGUSR2), set by the batch script and by
    `python -m trainer.launch`; it saves like SIGUSR2 and SIGTERM."""
    signal_grace_s: float = 0.0
    """TRAINER_SIGNAL_GRACE_S: how long before the time limit the warning signal comes (the profile's
    signal_grace_s): a signal then is the limit's, and its requeue is not counted as a preemption."""
    mtbf_hours: float = 24.0
    """TRAINER_MTBF_HOURS: hours between failures of one node (the profile's mtbf_hours, exported by the batch
    script), the auto checkpoint cadence's prior; checkpoint.mtbf_hours overrides it."""
    trial: str | None = None
    """TRAINER_TRIAL: ``<sweep id>-<trial number>`` when this run is a sweep's trial (its W&B name; the sweep id its
    group), set by the sweep's worker."""
    pruning: bool = False
    """TRAINER_PRUNING=1: the sweep has a pruner, whose answer to each reported value ``should_prune`` waits for."""
    checksum: bool = False
    """TRAINER_CHECKSUM=1: at the end, every rank's parameter hash in result.json (a full model copy to the CPU; the
    tests' proof that the ranks agree)."""
    in_place: bool = False
    """TRAINER_IN_PLACE=1: the batch script restarts a failed attempt inside the allocation (spare nodes, a node
    range), where snapshots in node memory can be restored (``checkpoint.memory=auto`` takes them then)."""
    end_time: float | None = None
    """SLURM_JOB_END_TIME (Slurm 23.02 and later): when the job's time limit ends, as it stood at the start."""
    memory_dir: str = "/dev/shm"
    """TRAINER_MEMORY_DIR: where each node keeps memory snapshots (a RAM-backed folder local to the node)."""
    resizable: bool = False
    """TRAINER_NODES=MIN-MAX with MIN < MAX (a node range's batch script): the job may go on with fewer nodes or be
    requeued onto more, so a loader without a global batch keeps its first attempt's."""
    store: StoreAddress | None = None
    """TRAINER_STORE=HOST:PORT:PRESENCE_PORT: the job's store runs in a process of its own (``python -m
    trainer.store``), so the survivors of a lost rank regroup without a restart (``Session.regroup``)."""
    spare: int | None = None
    """TRAINER_SPARE=N: this process is a warm spare of the job, number N + its rank among the spares (the tasks of a
    spare step, or 0): it waits at the store until a lost rank's place is its own, then takes the state from the
    others and trains (``Session`` blocks until then)."""
    max_failures: int | None = None
    """TRAINER_MAX_FAILURES: the profile's max_failures; recoveries in place count against it (None: no limit)."""


@dataclass(frozen=True)
class StoreAddress:
    """Where ``python -m trainer.store`` serves: its store's port and its presence port, on one host."""

    host: str
    port: int
    presence: int

    @staticmethod
    def parse(text: str) -> StoreAddress | None:
        """``HOST:PORT:PRESENCE_PORT`` (None when empty), or a UserError naming TRAINER_STORE."""
        if not text:
            return None
        host, _, ports = text.rpartition(":")
        host, _, port = host.rpartition(":")
        if not (host and port.isdigit() and ports.isdigit() and 0 < int(port) < 65536 and 0 < int(ports) < 65536):
            raise UserError("TRAINER_STORE", f"must be HOST:PORT:PRESENCE_PORT, got {text!r}",
                            "python -m trainer.store --port-file F writes the two ports; unset it to rendezvous "
                            "at MASTER_ADDR:MASTER_PORT (no regrouping)")
        return StoreAddress(host.strip("[]"), int(port), int(ports))


def job_info(environ: Mapping[str, str] | None = None) -> JobInfo:
    """Job-level facts from Slurm's variables, and whether W&B has credentials."""
    env = os.environ if environ is None else environ
    key = bool(env.get("WANDB_API_KEY"))
    if not key:
        try:
            import netrc

            path = env.get("NETRC") or os.path.join(env.get("HOME", "~"), ".netrc")
            key = netrc.netrc(os.path.expanduser(path)).authenticators("api.wandb.ai") is not None
        except (OSError, netrc.NetrcParseError):
            key = False
    return JobInfo(
        job_name=env.get("SLURM_JOB_NAME"),
        array_job_id=env.get("SLURM_ARRAY_JOB_ID"),
        array_task_id=env.get("SLURM_ARRAY_TASK_ID"),
        restart_count=_int(env, "SLURM_RESTART_COUNT", "set by Slurm", default=0),
        gpus_on_node=_int(env, "SLURM_GPUS_ON_NODE", "set by Slurm", default=0),
        wandb_key=key,
        run_dir=env.get("RUN_DIR") or None,
        warning_signal=env.get("TRAINER_SIGNAL") or None,
        checksum=env.get("TRAINER_CHECKSUM") == "1",
        trial=env.get("TRAINER_TRIAL") or None,
        pruning=env.get("TRAINER_PRUNING") == "1",
        signal_grace_s=_positive(env.get("TRAINER_SIGNAL_GRACE_S"), 0.0),
        mtbf_hours=_positive(env.get("TRAINER_MTBF_HOURS"), 24.0),
        in_place=env.get("TRAINER_IN_PLACE") == "1",
        end_time=_positive(env.get("SLURM_JOB_END_TIME"), 0.0) or None,
        memory_dir=env.get("TRAINER_MEMORY_DIR") or "/dev/shm",
        resizable=_ranged(env.get("TRAINER_NODES", "")) or bool(env.get("TRAINER_STORE")),
        store=StoreAddress.parse(env.get("TRAINER_STORE", "")),
        spare=_spare(env),
        max_failures=_int(env, "TRAINER_MAX_FAILURES", "the profile's max_failures; unset: no limit")
        if env.get("TRAINER_MAX_FAILURES") else None,
    )


def _spare(env: Mapping[str, str]) -> int | None:
    """TRAINER_SPARE: a warm spare's number (needs TRAINER_STORE), or None."""
    if not env.get("TRAINER_SPARE"):
        return None
    hint = "TRAINER_SPARE=0 for the first warm spare of a job whose store runs apart (TRAINER_STORE); unset otherwise"
    spare = _int(env, "TRAINER_SPARE", hint)
    if spare < 0 or not env.get("TRAINER_STORE"):
        raise UserError("TRAINER_SPARE", f"a spare needs a number >= 0 and the job's store, got {spare}"
                        + ("" if env.get("TRAINER_STORE") else " without TRAINER_STORE"), hint)
    return spare


def _ranged(nodes: str) -> bool:
    """Whether ``MIN-MAX`` is a range of more than one node count."""
    lo, _, hi = nodes.partition("-")
    return lo.isdigit() and hi.isdigit() and int(lo) < int(hi)


def _positive(text: str | None, default: float) -> float:
    """A positive number the batch script rendered from the profile (checked there); anything else: ``default``."""
    try:
        value = float(text or default)
    except ValueError:
        return default
    return value if value > 0 else default


@dataclass(frozen=True)
class HostFacts:
    """What the preflight doctor reports about this process's host (not passed into containers)."""

    cuda_visible_devices: str | None
    """CUDA_VISIBLE_DEVICES as this process sees it (Slurm's GPU binding, or the user's); None when unset."""
    container: str | None
    """The container runtime this process runs under (apptainer, docker, podman), or None."""
    node: str
    """Slurm's name for this node (SLURMD_NODENAME), else the host name."""


def host_facts(environ: Mapping[str, str] | None = None, root: str = "/") -> HostFacts:
    """GPU visibility and container markers, for `python -m trainer.doctor`."""
    env = os.environ if environ is None else environ
    container = None
    if env.get("APPTAINER_CONTAINER") or env.get("SINGULARITY_CONTAINER"):
        container = "apptainer"
    elif os.path.exists(os.path.join(root, ".dockerenv")):
        container = "docker"
    elif os.path.exists(os.path.join(root, "run", ".containerenv")):
        container = "podman"
    return HostFacts(cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"), container=container,
                     node=node_name(env))


def fault_spec(environ: Mapping[str, str] | None = None) -> str:
    """TRAINER_FAULTS: faults the tests inject (see trainer/testing/faults.py); never part of the public config."""
    return (os.environ if environ is None else environ).get("TRAINER_FAULTS", "")


def without_placement(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` minus every variable that tells a process where it runs: for launching a fresh job."""
    placement = set(TRAINER_VARIABLES) - {"WANDB_API_KEY"}
    return {k: v for k, v in environ.items() if k not in placement and not k.startswith(("SLURM_", "TORCHELASTIC_"))}


def torchrun_environ(env: DistEnv) -> dict[str, str]:
    """torchrun's variables for a process Slurm placed, so ``init_process_group()`` (env://) works unmodified."""
    return {"RANK": str(env.rank), "LOCAL_RANK": str(env.local_rank), "WORLD_SIZE": str(env.world_size),
            "LOCAL_WORLD_SIZE": str(env.local_world_size), "GROUP_RANK": str(env.node_rank),
            "NODE_RANK": str(env.node_rank), "MASTER_ADDR": env.master_addr, "MASTER_PORT": str(env.master_port)}


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm hostlist such as ``gpu-[01-03,10],cpu7`` (same order as ``scontrol show hostnames``)."""
    try:
        hosts: list[str] = hostlist.expand_hostlist(nodelist)
    except hostlist.BadHostlist as exc:
        raise UserError(
            "SLURM_JOB_NODELIST",
            f"cannot expand node list {nodelist!r} ({exc})",
            "this variable is set by Slurm; run inside an allocation (srun/sbatch) or unset the SLURM_* variables",
        ) from None
    if not hosts:
        raise UserError("SLURM_JOB_NODELIST", "node list is empty", "run inside a Slurm allocation")
    return hosts


def port_from_job_id(job_id: str | None, default: int = 29500) -> int:
    """A rendezvous port derived from the job id, so two jobs sharing a node do not collide."""
    if job_id is None:
        return default
    digits = re.sub(r"\D", "", job_id)
    return PORT_BASE + int(digits) % PORT_SPAN if digits else default


def tasks_per_node(spec: str, node_index: int, field: str) -> int:
    """Tasks on node ``node_index`` from Slurm's compressed form, e.g. ``2(x3),1``."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise UserError(field, f"cannot parse {spec!r}", "expected Slurm's form, e.g. '4' or '2(x3),1'")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if len(counts) == 1 and "(" not in spec:  # one plain number (SLURM_NTASKS_PER_NODE) applies to every node
        return counts[0]
    if node_index >= len(counts):
        raise UserError(field, f"{spec!r} describes {len(counts)} nodes, but this is node {node_index}",
                        "this variable is set by Slurm; run inside the allocation it belongs to")
    return counts[node_index]


def _int(env: Mapping[str, str], name: str, hint: str, default: int | None = None) -> int:
    raw = env.get(name)
    if (raw is None or raw == "") and default is not None:
        return default
    if raw is None or raw == "":
        raise UserError(name, "is not set", hint)
    try:
        return int(raw)
    except ValueError:
        raise UserError(name, f"must be an integer, got {raw!r}", hint) from None


def _check(env: DistEnv, names: dict[str, str], hint: str) -> DistEnv:
    """Reject values that cannot describe one process of a real job."""
    if env.world_size < 1:
        raise UserError(names["world_size"], f"must be >= 1, got {env.world_size}", hint)
    if not 0 <= env.rank < env.world_size:
        raise UserError(names["rank"], f"rank {env.rank} is outside world size {env.world_size}", hint)
    if env.local_world_size < 1 or not 0 <= env.local_rank < env.local_world_size:
        raise UserError(
            names["local_rank"],
            f"local rank {env.local_rank} is outside {env.local_world_size} local processes",
            hint,
        )
    if not 0 <= env.node_rank < env.num_nodes:
        raise UserError(names["node_rank"], f"node rank {env.node_rank} is outside {env.num_nodes} nodes", hint)
    if not 1 <= env.master_port <= 65535:
        raise UserError("MASTER_PORT", f"must be a TCP port, got {env.master_port}",
                        "unset it to derive one from the job id")
    return env


def _from_torchrun(env: Mapping[str, str]) -> DistEnv:
    hint = "launch with torchrun, which sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT together"
    world_size = _int(env, "WORLD_SIZE", hint)
    local_world_size = _int(env, "LOCAL_WORLD_SIZE", hint, default=world_size)
    addr = env.get("MASTER_ADDR")
    if not addr:
        raise UserError("MASTER_ADDR", "is not set although RANK is", hint)
    result = DistEnv(
        rank=_int(env, "RANK", hint),
        local_rank=_int(env, "LOCAL_RANK", hint),
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=_int(env, "GROUP_RANK" if env.get("GROUP_RANK") else "NODE_RANK", hint, default=0),
        num_nodes=max(1, world_size // max(1, local_world_size)),
        master_addr=addr,
        master_port=_int(env, "MASTER_PORT", hint),
        job_id=env.get("SLURM_JOB_ID"),
        source="torchrun",
        agent=env.get("TORCHELASTIC_RUN_ID") is not None,
        agent_restart=_int(env, "TORCHELASTIC_RESTART_COUNT", "set by torchrun", default=0),
    )
    names = {"world_size": "WORLD_SIZE", "rank": "RANK", "local_rank": "LOCAL_RANK", "node_rank": "GROUP_RANK"}
    return _check(result, names, hint)


def _from_slurm(env: Mapping[str, str]) -> DistEnv:
    hint = "start one task per process with srun (sbatch alone runs a single batch shell)"
    world_size = _int(env, "SLURM_NTASKS", hint)
    node_rank = _int(env, "SLURM_NODEID", hint)
    # Step variables describe the srun step we are in; job variables the whole allocation.
    nodelist_var = "SLURM_STEP_NODELIST" if env.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
    nodelist = env.get(nodelist_var)
    if not nodelist:
        raise UserError("SLURM_JOB_NODELIST", "is not set although SLURM_PROCID is", hint)
    hosts = expand_nodelist(nodelist)
    num_nodes = _int(env, "SLURM_STEP_NUM_NODES" if env.get("SLURM_STEP_NUM_NODES") else "SLURM_NNODES", hint,
                     default=len(hosts))
    per_node_var = next(
        (v for v in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if env.get(v)),
        None,
    )
    local_world_size = (
        tasks_per_node(env[per_node_var], node_rank, per_node_var) if per_node_var else max(1, world_size // num_nodes)
    )
    job_id = env.get("SLURM_JOB_ID")
    port_raw = env.get("MASTER_PORT")
    result = DistEnv(
        rank=_int(env, "SLURM_PROCID", hint),
        local_rank=_int(env, "SLURM_LOCALID", hint),
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        num_nodes=num_nodes,
        master_addr=env.get("MASTER_ADDR") or hosts[0],
        master_port=_int(env, "MASTER_PORT", hint) if port_raw else port_from_job_id(job_id),
        job_id=job_id,
        source="slurm",
    )
    names = {"world_size": "SLURM_NTASKS", "rank": "SLURM_PROCID",
             "local_rank": "SLURM_LOCALID", "node_rank": "SLURM_NODEID"}
    return _check(result, names, hint)


def default_run_dir(job_id: str) -> str:
    """A run's folder when none is given (run.dir, RUN_DIR): ``runs/<job id>`` under the folder the job starts in, so
    that a requeued job finds its checkpoints again. The one place it is decided: the batch scripts render it with
    ``$SLURM_JOB_ID``, the ledger records it with the job's id, the session uses it."""
    return f"runs/{job_id}"


def discover(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read the process's place from torchrun's variables, else Slurm's, else a single process."""
    env = os.environ if environ is None else environ
    if env.get("RANK") is not None or env.get("TORCHELASTIC_RUN_ID") is not None:
        return _from_torchrun(env)
    # The batch shell of an sbatch job has SLURM_PROCID=0 too; only a step (srun) has SLURM_STEP_ID.
    # A batch shell is then treated as one process of its own, not as rank 0 of SLURM_NTASKS.
    if env.get("SLURM_PROCID") is not None and env.get("SLURM_STEP_ID") not in (None, "batch", "extern"):
        return _from_slurm(env)
    job_id = env.get("SLURM_JOB_ID")
    return DistEnv(0, 0, 1, 1, 0, 1, "127.0.0.1", port_from_job_id(job_id), job_id, "single")
