"""Cluster profiles: everything a site needs (partition, GPUs, time, container) in one YAML file.

Profiles live in ``cluster/profiles/<name>.yaml`` (or any path) and are merged over the
:class:`Profile` defaults with OmegaConf; ``NODES=`` and friends override them last.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.core.errors import UserError
from trainer.core.files import load_yaml

PROFILES = Path(__file__).resolve().parent / "profiles"


@dataclass
class ContainerConfig:
    runtime: str = "none"
    """none, apptainer, pyxis or docker."""
    image: str | None = None
    """Image: a .sif path (apptainer), an image reference or .sqsh (pyxis), an image name (docker)."""
    mounts: list[str] = field(default_factory=list)
    """Extra host:container bind mounts (data sets); the run folder is always mounted."""


@dataclass
class Profile:
    name: str = "default"
    """Profile name (the file's stem)."""
    partition: str | None = None
    """Slurm partition (site-specific)."""
    account: str | None = None
    """Slurm account to charge (site-specific)."""
    qos: str | None = None
    """Slurm QOS (site-specific)."""
    constraint: str | None = None
    """Node feature constraint, e.g. h100 (site-specific)."""
    nodes: int = 1
    """Nodes per job (make submit NODES=…); with min_nodes, the most an attempt starts on."""
    min_nodes: int = 0
    """The fewest nodes an attempt may start on (sbatch launcher: `--nodes=min_nodes-nodes`, make submit NODES=1-2);
    0: exactly `nodes`. A requeue without a blamed node then starts on the nodes left; the global batch stays."""
    gpus_per_node: int = 0
    """GPUs per node; one training process runs per GPU (0: CPU nodes)."""
    tasks_per_node: int = 0
    """Processes per node; 0 means gpus_per_node, or 1 on CPU nodes."""
    cpus_per_task: int = 1
    """CPU cores per process (DataLoader workers run on these)."""
    mem_per_task_gb: float = 0
    """Memory per process in GB; 0 leaves the partition's default."""
    time_min: int = 60
    """Time limit in minutes."""
    job_name: str = "train"
    """Slurm job name (letters, digits, '.', '_' and '-')."""
    launch: str = "srun"
    """srun (one task per process, rank from SLURM_*) or torchrun (one task per node, c10d rendezvous)."""
    signal: str = "USR2"
    """Signal Slurm sends before the time limit; the trainer saves and exits 75 on it."""
    signal_grace_s: int = 120
    """Seconds before the time limit that the signal is sent (enough for one save); 0: no signal (sbatch launcher),
    the trainer saves before the limit on its own (it reads the job's end time)."""
    max_requeues: int = 3
    """Requeues after a preemption or time-limit save before the job gives up."""
    max_failures: int = 3
    """Retries after an infrastructure failure (a rank killed, a lost peer, a hang, a node failing the doctor), each
    without the blamed node; a user error or an out-of-memory is never retried."""
    spare_nodes: int = 0
    """Nodes held beyond `nodes` (sbatch launcher): after an infrastructure failure the next attempt starts at once
    in the allocation without the blamed node, instead of going back to the queue."""
    regroup: bool = False
    """The job's store runs in a process of its own on the first node and srun keeps the step when a task dies
    (--kill-on-bad-exit=0): the survivors of a lost rank go on in place, in their own processes (Session.regroup).
    srun launch; no container, Apptainer or Docker (not pyxis)."""
    mtbf_hours: float = 24.0
    """Hours between failures of one node, the prior of `checkpoint.cadence=auto` (exported as TRAINER_MTBF_HOURS)."""
    suspect_hours: float = 24.0
    """How long a blame counts as evidence against a node (`python -m cluster suspects` shows the evidence)."""
    suspect_after: int = 2
    """New jobs avoid a node blamed by this many different jobs within suspect_hours (hard evidence, such as a
    failed doctor check or a device error, at once); fewer blames leave it in use."""
    requeue_expedite: str = "auto"
    """auto: jobs ask for an expedited requeue (eligible at once, first in the queue, instead of waiting out the
    credential's life: 120 s by default) where the cluster offers one (Slurm 25.11 and later, with
    SlurmctldParameters=enable_expedited_requeue); yes or no: always or never."""
    storm_after: int = 3
    """A job stops after this many attempts in a row ended before passing the step they started from (a fault that
    comes back at once); 0: never."""
    requeue_on_signal: bool = False
    """Commands (CMD=…) that do not save on the warning: stop them shortly before the time limit and requeue the
    job anyway (they start again, from their own checkpoints if they keep any)."""
    doctor: bool = False
    """Run `python -m trainer.doctor` over the allocation before training (DOCTOR=0|1 at submit time overrides)."""
    python: str = "python"
    """Python on the compute nodes; 'python' means the interpreter that submits (same venv)."""
    log_dir: str = "runs/slurm"
    """Folder for Slurm's and submitit's logs."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run before the launch, e.g. `module load cuda` (site-specific)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables exported to every task, e.g. NCCL_SOCKET_IFNAME."""
    container: ContainerConfig = field(default_factory=ContainerConfig)
    """Container runtime and image."""

    @property
    def ntasks_per_node(self) -> int:
        """Processes per node as Slurm will start them."""
        return self.tasks_per_node or self.gpus_per_node or 1

    @property
    def node_range(self) -> str:
        """The nodes an attempt trains on: ``nodes``, or ``min_nodes-nodes``."""
        return f"{self.min_nodes}-{self.nodes}" if 0 < self.min_nodes < self.nodes else str(self.nodes)

    @property
    def ranged(self) -> bool:
        """An attempt may train on fewer nodes than ``nodes`` (down to ``min_nodes``)."""
        return "-" in self.node_range

    @property
    def allocation(self) -> str:
        """Slurm's --nodes value: the training nodes and the spares, a range when the job may shrink."""
        top = self.nodes + self.spare_nodes
        return f"{self.min_nodes}-{top}" if self.ranged else str(top)

    @property
    def in_place(self) -> bool:
        """The batch script restarts inside its allocation after a failure (a spare takes over, or it shrinks)."""
        return self.spare_nodes > 0 or self.ranged

    def world_sizes(self) -> list[int]:
        """Every number of training processes an attempt of this profile may start with."""
        return [n * self.ntasks_per_node for n in range(self.min_nodes or self.nodes, self.nodes + 1)]

    @property
    def procs_per_task(self) -> int:
        """Training processes each Slurm task starts: 1 with srun, the node's share with torchrun."""
        return self.ntasks_per_node if self.launch == "torchrun" else 1


def bad(key: str, message: str, hint: str) -> UserError:
    return UserError(f"profile.{key}", message, hint)


def load_profile(name_or_path: str, overrides: dict[str, object] | None = None) -> Profile:
    """A validated profile from ``cluster/profiles/<name>.yaml`` or a YAML path, with overrides applied."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILES / f"{name_or_path}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PROFILES.glob("*.yaml")))
        raise UserError("CLUSTER", f"no profile {name_or_path!r} ({path})", f"use one of: {known}, or a YAML path")
    schema = OmegaConf.structured(Profile(name=path.stem))
    loaded = load_yaml(path, "CLUSTER", "pass a profile name or a YAML path")
    try:
        merged = OmegaConf.merge(schema, loaded)
        for key, value in (overrides or {}).items():
            _set(merged, key, value)
        profile: Profile = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:  # an unknown key, a wrong type, an interpolation the profile cannot resolve
        key = getattr(exc, "full_key", None) or "?"
        valid = ", ".join(f.name for f in fields(Profile))
        raise bad(str(key), str(exc).splitlines()[0].rstrip("."), f"check {path}; valid keys: {valid}") from None
    validate(profile)
    return profile


def _set(cfg: Any, key: str, value: object) -> None:
    """One ``--set KEY=VALUE``: the text as typed for a scalar key (read as YAML, account=0123 became 83, env.X=yes
    True, and '# …' was dropped), as YAML only for a list or a mapping; ``${…}`` stays literal text."""
    if isinstance(value, str) and isinstance(OmegaConf.select(cfg, key, default=None), ListConfig | DictConfig):
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise bad(key, f"{value!r} is not a YAML list or mapping ({str(exc).splitlines()[0]})",
                      f"e.g. --set '{key}=[a, b]'") from None
    elif isinstance(value, str):
        value = value.replace("${", "\\${")
    OmegaConf.update(cfg, key, value, merge=True)


def validate(p: Profile) -> None:
    """Reject values Slurm would refuse later (or, worse, accept and misuse)."""
    for key in ("nodes", "time_min", "cpus_per_task"):
        if getattr(p, key) < 1:
            raise bad(key, f"must be >= 1, got {getattr(p, key)}", f"e.g. {key}: 1")
    for key in ("gpus_per_node", "tasks_per_node", "mem_per_task_gb", "signal_grace_s", "max_requeues", "max_failures",
                "suspect_hours", "spare_nodes", "mtbf_hours"):
        if getattr(p, key) < 0:
            raise bad(key, f"must be >= 0, got {getattr(p, key)}", f"e.g. {key}: 0")
    if p.suspect_after < 1:
        raise bad("suspect_after", f"must be >= 1, got {p.suspect_after}: 0 would avoid every node ever blamed",
                   "suspect_after: 2 (blames from two different jobs), or 1 to avoid a node at its first blame")
    if p.requeue_expedite not in ("auto", "yes", "no"):
        raise bad("requeue_expedite", f"must be auto, yes or no, got {p.requeue_expedite!r}", "requeue_expedite: auto")
    if p.storm_after < 0:
        raise bad("storm_after", f"must be >= 0, got {p.storm_after}", "storm_after: 3, or 0 to never stop for it")
    if not 0 <= p.min_nodes <= p.nodes:
        raise bad("min_nodes", f"must be between 0 and nodes={p.nodes}, got {p.min_nodes}",
                   f"e.g. NODES=1-{p.nodes} (min_nodes: 1), or min_nodes: 0 for exactly {p.nodes}")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", p.job_name):
        raise bad("job_name", f"{p.job_name!r} has characters Slurm and shells treat specially",
                   "use letters, digits, '.', '_' and '-'")
    for key in ("partition", "account", "qos", "constraint"):
        value = getattr(p, key)
        if value is not None and not re.fullmatch(r"[A-Za-z0-9._,&|:\[\]*-]+", value):
            raise bad(key, f"{value!r} is not a valid Slurm {key}", f"e.g. {key}: gpu")
    if p.launch not in ("srun", "torchrun"):
        raise bad("launch", f"must be srun or torchrun, got {p.launch!r}", "launch: srun")
    if p.regroup and (p.launch != "srun" or p.container.runtime == "pyxis"):
        raise bad("regroup", f"needs launch: srun, and no container, Apptainer or Docker (got launch: {p.launch}, "
                  f"container: {p.container.runtime}; pyxis starts the image only through srun, and the job's store "
                  "runs beside the batch shell)", "regroup: false, or launch: srun with container: {runtime: apptainer}")
    if p.signal not in ("USR1", "USR2", "TERM", "INT", "HUP"):
        raise bad("signal", f"unsupported signal {p.signal!r}", "signal: USR2 (USR1 may be taken by NCCL)")
    if p.container.runtime not in ("none", "apptainer", "pyxis", "docker"):
        raise bad("container.runtime", f"must be none, apptainer, pyxis or docker, got {p.container.runtime!r}",
                   "container: {runtime: none}")
    if p.container.runtime != "none" and not p.container.image:
        raise bad("container.image", f"is required with runtime {p.container.runtime}", "e.g. image: trainer.sif")
    for mount in p.container.mounts:
        if not re.fullmatch(r"[A-Za-z0-9._/@+=-]+(:[A-Za-z0-9._/@+=-]+)?(:ro|:rw)?", mount):
            raise bad("container.mounts", f"{mount!r} is not a plain HOST[:CONTAINER] path",
                       "use absolute paths without spaces, quotes or commas, e.g. /data:/data")
    for key in ("python", "log_dir"):
        if not str(getattr(p, key)).strip():
            raise bad(key, "is empty", f"e.g. {key}: {getattr(Profile(), key)}")
    if 0 < p.mem_per_task_gb < 1 / 1024:  # --mem-per-cpu=0M is "all the node's memory" to Slurm
        raise bad("mem_per_task_gb", f"{p.mem_per_task_gb} is under 1 MiB", "e.g. mem_per_task_gb: 4, or 0 for "
                  "the partition's default")
    for name, value in p.env.items():
        if not isinstance(value, str | int | float | bool):
            raise bad(f"env.{name}", f"must be one value, got {value!r}", f"e.g. env: {{{name}: value}}")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise bad(f"env.{name}", "is not a valid variable name", "use letters, digits and '_'")
        if name == "WANDB_API_KEY":
            raise bad("env.WANDB_API_KEY", "secrets do not belong in profiles (they end up in rendered scripts)",
                       "export WANDB_API_KEY in your shell or use ~/.netrc; Slurm passes the environment on")


def node_range(text: str) -> dict[str, object]:
    """``--nodes`` as profile keys: ``N`` (exactly), ``MIN-MAX`` (a range: min_nodes and nodes)."""
    low, dash, high = text.partition("-")
    if not re.fullmatch(r"[0-9]+(-[0-9]+)?", text) or int(low) < 1 or (dash and int(high) < int(low)):  # ASCII only
        raise UserError("NODES", f"{text!r} is neither a node count nor a range MIN-MAX of at least 1 node",
                        "e.g. NODES=2, or NODES=1-2")
    return {"nodes": int(high or low), "min_nodes": int(low) if high else 0}
