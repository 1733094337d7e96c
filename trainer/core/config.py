"""Typed configuration: dataclass defaults ← packaged YAML ← user YAML ← ``key=value`` overrides. Every field carries a
docstring (``python -m trainer --help``); a bad key, type or value is a :class:`UserError` naming the key."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.core.errors import UserError
from trainer.core.files import load_yaml
from trainer.core.legacy import LEGACY, take_legacy


@dataclass
class DataConfig:
    name: str = "synthetic"
    """Built-in data set: synthetic (no download), mnist, cifar10, imagefolder, shards (WebDataset tar); not with data.target."""
    target: str | None = None
    """Your data: import path (pkg.mod:build or pkg.mod.build) of a function returning (train, eval) data sets
    (eval may be None); map-style sets get the exact-resume sampler, iterable ones need train.max_steps."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for data.target, e.g. data.kwargs.path=/data/x."""
    root: str | None = None
    """Folder of mnist/cifar10/imagefolder, or of the shards (train/ and val/ inside or not; or a glob); no download."""
    batch_size: int = 32
    """Samples per process per micro-step; the global batch is batch_size × processes × grad_accum. With
    data.global_batch_size set: the most samples a process runs at once (the micro-batch is derived)."""
    global_batch_size: int = 0
    """Samples per optimizer step, whatever the number of processes (0: batch_size × processes × grad_accum):
    gradient accumulation is derived at start-up, so a run resumed on another world size trains on the same
    global batches, step by step (map-style and sharded sets; the last partial global batch of each epoch is dropped)."""
    num_workers: int = -1
    """DataLoader worker processes per rank; 0 loads in the training process; -1 (auto): 0 for the in-memory
    synthetic set, else up to 4, leaving each process's share of cores one core to compute on."""
    synthetic_train_size: int = 8192
    """Training samples of the synthetic data set."""
    synthetic_test_size: int = 2048
    """Test samples of the synthetic data set."""
    synthetic_noise: float = 6.0
    """Noise level of the synthetic data set: higher is harder."""
    image_size: int = 28
    """Side of the square images fed to the model (synthetic and imagefolder)."""


@dataclass
class ModelConfig:
    name: str = "cnn"
    """Built-in model: cnn (the small conv net, 1→10→10 conv, fc to classes) or any torchvision classification
    model by name (resnet18, vgg16, mobilenet_v3_small, …; untrained); ignored when model.target is set."""
    target: str | None = None
    """Your model: import path (pkg.mod:Class or pkg.mod.factory) of an nn.Module class or a function returning one."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for model.target (or extra ones for a torchvision model), e.g. model.kwargs.depth=6."""
    num_classes: int = 10
    """Number of output classes of the built-in models (imagefolder: must match the number of class folders)."""
    small_input_stem: bool = True
    """torchvision models on small images (< 64 px): resnets get a 3×3 stride-1 first conv and no max-pool, VGGs
    lose their last max-pool, so 28–32 px inputs keep a spatial extent."""


@dataclass
class OptimConfig:
    name: str = "sgd"
    """Optimizer: sgd (with momentum) or adamw."""
    lr: float = 0.05
    """Peak learning rate."""
    momentum: float = 0.9
    """SGD momentum."""
    weight_decay: float = 0.0
    """Weight decay."""
    schedule: str = "cosine"
    """Learning-rate schedule after warm-up: cosine (to zero) or constant."""
    warmup_steps: int = 20
    """Optimizer steps of linear warm-up."""
    grad_accum: int = 1
    """Micro-steps accumulated per optimizer step (gradients are all-reduced only on the last)."""
    grad_clip: float = 0.0
    """Clip the global gradient norm to this value; 0 turns clipping off."""


@dataclass
class TaskConfig:
    target: str | None = None
    """How a batch becomes a loss and evaluation metrics: import path of a class or factory returning a Task
    (see trainer/builtin/task.py); default: image classification (cross-entropy, accuracy)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for task.target."""


@dataclass
class TrainConfig:
    epochs: int = 3
    """Passes over the training data."""
    max_steps: int = 0
    """Stop after this many optimizer steps (0: train.epochs decides); required for iterable data sets."""
    eval_every: int = 0
    """Optimizer steps between evaluations; 0: at each epoch end (map-style data) and at the end of training."""
    seed: int = 0
    """Seed for data, initial weights and shuffling; equal seeds give equal runs."""
    precision: str = "fp32"
    """fp32, bf16 (autocast) or fp16 (autocast + GradScaler, CUDA only)."""
    compile: bool = False
    """Wrap the model in torch.compile (meant for CUDA)."""
    log_every: int = 50
    """Optimizer steps between log lines when there is no terminal for a progress bar."""
    deterministic: bool = False
    """Use deterministic algorithms only (slower on GPUs; CPU runs are deterministic anyway). On GPUs this
    sets ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` unless already set, as cuBLAS requires."""
    device: str = "auto"
    """auto (cuda:LOCAL_RANK when CUDA exists, else cpu), cpu or cuda."""


@dataclass
class DistConfig:
    backend: str = "auto"
    """Process-group backend: auto (nccl with CUDA, else gloo), nccl or gloo."""
    timeout_s: float = 300.0
    """Seconds a collective (or the rendezvous) may wait for a peer before the job fails."""
    heartbeat_timeout_s: float = -1.0
    """Seconds of no progress on a rank (after step 1) before a hang report names the stuck ranks; -1: 0.8 × timeout_s; 0: off."""
    strategy: str = "ddp"
    """ddp (each rank holds the whole model) or fsdp (FSDP2: parameters, gradients and optimizer state split across
    ranks, for models bigger than one GPU; checkpoints are then sharded)."""
    activation_checkpointing: bool = False
    """fsdp: recompute each sharded block's activations in the backward pass (less memory, about a third more compute)."""

    @property
    def heartbeat_s(self) -> float:
        """The heartbeat timeout in effect (auto resolved); 0 when off."""
        return 0.8 * self.timeout_s if self.heartbeat_timeout_s < 0 else self.heartbeat_timeout_s


@dataclass
class CheckpointConfig:
    resume: str = "auto"
    """auto (newest complete checkpoint in the run folder, if any), never, or a checkpoint path."""
    every_steps: int = 0
    """Save every N optimizer steps; 0 turns step-based saves off."""
    every_minutes: float = 0.0
    """Save when this many minutes have passed since the last save; 0 turns it off."""
    cadence: str = "fixed"
    """fixed (every_steps / every_minutes decide), or auto: also save every √(2 × measured save stall × mean time
    between unannounced interruptions), the interval re-derived as both are measured (printed in one line)."""
    mtbf_hours: float = 0.0
    """auto cadence's prior: hours between failures of one node (0: the profile's mtbf_hours, else 24)."""
    keep: int = 3
    """Complete checkpoints kept in the run folder (older ones are deleted)."""
    async_save: bool = False
    """Write periodic checkpoints in a background thread; training pauses only to copy the state into host
    buffers kept for the run (one extra host copy of the model and optimizer state)."""
    poll_steps: int = 10
    """Optimizer steps between the ranks' checks for a signal or a timed save (and at every epoch end)."""
    format: str = "auto"
    """file (rank 0 writes one file), dcp (every rank writes its share: torch.distributed.checkpoint, a folder per
    step, loadable onto any number of processes), or auto (dcp with dist.strategy=fsdp, else file)."""
    memory: str = "auto"
    """Snapshots in node memory between saves, restored by a restart in the allocation without reading the shared file
    system: on, off, or auto (on when the job restarts in place, spare nodes or a node range)."""
    memory_every_steps: int = 0
    """Steps between memory snapshots; 0: chosen from their measured stall, as checkpoint.cadence=auto does."""


@dataclass
class AuditConfig:
    straggler_ratio: float = 1.3
    """A rank whose compute per step (forwards, optimizer; not collectives) stays above this × the others' is slow."""
    straggler_steps: int = 50
    """Steps a rank must stay that slow before it is named a straggler; 0 turns straggler detection off."""
    straggler_floor_ms: float = 10.0
    """...and above the others' by at least this many milliseconds per step: a small model's noise is no straggler."""
    on_straggler: str = "report"
    """report (event, console, report, status name the node) or restart (save, end the attempt blaming the node)."""
    replicas_every_steps: int = 0
    """DDP: steps between the ranks' comparison of their parameters, which must be bit-identical; 0: before every
    checkpoint save (a disagreement never saves); -1: off."""
    replay_every_steps: int = 0
    """DDP: every N steps each rank's step is computed again by the next rank and the gradients compared bit for bit
    (deterministic algorithms only); 0: off. Make checkpoint.every_steps a multiple of it."""


@dataclass
class RunConfig:
    dir: str | None = None
    """Run folder (config, checkpoints, results). Default: $RUN_DIR (the batch script's), runs/<job id>, runs/<time>."""
    name: str | None = None
    """Human-readable run name (tracking); default: the run folder's name."""
    python_path: list[str] = field(default_factory=list)
    """Folders to make importable for model/data/task targets (the folder the job starts from always is)."""


@dataclass
class TrackingConfig:
    mode: str = "auto"
    """W&B: online, offline (sync later with `make sync`), disabled, or auto (offline without a key or a route out)."""
    project: str = "slurm-ddp-trainer"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user); default: the key's default entity."""
    group: str | None = None
    """Run group; default: the Slurm array job id (a sweep), else the Slurm job name."""
    tags: list[str] = field(default_factory=list)
    """Extra tags; Slurm job id, node and process counts are added."""
    dir: str | None = None
    """Folder W&B writes into; default: the run folder."""


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    """Input data."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Network."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """Loss and evaluation metrics."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Training loop."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Process group."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints and preemption."""
    audit: AuditConfig = field(default_factory=AuditConfig)
    """Slow ranks and silent corruption."""
    run: RunConfig = field(default_factory=RunConfig)
    """Run folder."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """Weights & Biases run tracking (rank 0 only)."""


CHOICES: dict[str, tuple[str, ...]] = {
    "data.name": ("synthetic", "mnist", "cifar10", "imagefolder", "shards"),
    "optim.name": ("sgd", "adamw"),
    "optim.schedule": ("cosine", "constant"),
    "train.precision": ("fp32", "bf16", "fp16"),
    "train.device": ("auto", "cpu", "cuda"),
    "dist.backend": ("auto", "nccl", "gloo"),
    "dist.strategy": ("ddp", "fsdp"),
    "checkpoint.format": ("auto", "file", "dcp"), "checkpoint.cadence": ("fixed", "auto"),
    "checkpoint.memory": ("auto", "on", "off"), "audit.on_straggler": ("report", "restart"),
    "tracking.mode": ("auto", "online", "offline", "disabled"),
}

POSITIVE = ("data.batch_size", "data.synthetic_train_size", "data.synthetic_test_size", "data.image_size",
            "model.num_classes", "optim.lr", "optim.grad_accum", "train.epochs", "train.log_every",
            "dist.timeout_s", "checkpoint.keep", "checkpoint.poll_steps")
NON_NEGATIVE = ("data.synthetic_noise", "optim.momentum", "optim.weight_decay", "optim.warmup_steps", "optim.grad_clip",
                "checkpoint.every_steps", "checkpoint.every_minutes", "train.max_steps", "train.eval_every",
                "data.global_batch_size", "checkpoint.mtbf_hours", "checkpoint.memory_every_steps",
                "audit.straggler_steps", "audit.replay_every_steps")


def help_text() -> str:
    """Every key with its default and docstring, for ``--help``."""
    from trainer.core.config_help import help_lines  # the docstrings are parsed only when asked for

    return "\n".join(help_lines(Config()))


def _err(key: str, message: str, hint: str | None = None) -> UserError:
    return UserError(key, message, hint or "see `python -m trainer --help` for every key and its meaning")


def _yaml(path: Path, key: str) -> DictConfig:
    return load_yaml(path, key, "pass an existing YAML file, e.g. config=my.yaml")


def _config_path(value: str) -> Path:
    """``config=cifar10`` names a packaged preset; anything else is a file path."""
    packaged = Path(str(resources.files("trainer") / "configs" / f"{value}.yaml"))
    return packaged if "/" not in value and not value.endswith(".yaml") and packaged.is_file() else Path(value)


def _describe(exc: OmegaConfBaseException) -> str:
    msg = str(exc).splitlines()[0]
    return msg.replace("Key ", "key ").rstrip(".")


def load(args: list[str]) -> Config:
    """Build the config from ``config=FILE`` and ``key=value`` arguments; raise UserError on bad input."""
    files: list[str] = []
    overrides: list[str] = []
    for arg in args:
        if "=" not in arg or arg.startswith("="):
            raise _err(repr(arg), "arguments must look like key=value", "e.g. `optim.lr=0.05 data.batch_size=64`")
        (files if arg.split("=", 1)[0] == "config" else overrides).append(arg)
    cfg = OmegaConf.structured(Config)
    layers: list[tuple[str, DictConfig]] = []
    with resources.as_file(resources.files("trainer") / "configs" / "default.yaml") as packaged:
        layers.append(("configs/default.yaml", _yaml(packaged, "config")))
    layers += [(f, _yaml(_config_path(f.split("=", 1)[1]), "config")) for f in files]
    for name, layer in layers:
        try:
            cfg = OmegaConf.merge(cfg, layer)
        except OmegaConfBaseException as exc:
            key = exc.full_key if getattr(exc, "full_key", None) else name
            raise _err(str(key), f"in {name}: {_describe(exc)}") from None
    for item in overrides:
        key, value = item.split("=", 1)
        if key in LEGACY:
            take_legacy(key, value)
            continue
        free = key in FREE_FORM or key.startswith(tuple(f"{k}." for k in FREE_FORM))  # the user's own kwargs
        if OmegaConf.select(cfg, key, default=_MISSING) is _MISSING and not free:
            group = key.split(".")[0]
            valid = [f.name for f in fields(Config)]
            hint = (f"valid keys under {group!r}: {', '.join(sorted(cfg[group].keys()))}" if group in valid
                    else f"keys start with one of: {', '.join(valid)}")
            raise _err(key, "unknown key", hint)
        if isinstance(OmegaConf.select(cfg, key), DictConfig) and not free:
            raise _err(key, "is a group, not a value", "set one of its keys, e.g. optim.lr=0.1")
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as exc:
            raise _err(key, f"bad value {value!r}: {_describe(exc)}") from None
    conf: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    if conf.checkpoint.memory in ("True", "False"):  # YAML reads on/off (yes/no) as booleans
        conf.checkpoint.memory = "on" if conf.checkpoint.memory == "True" else "off"
    validate(conf)
    return conf


_MISSING = object()
FREE_FORM = ("model.kwargs", "data.kwargs", "task.kwargs")  # the user's own keys (a factory's): any key goes there


def _get(cfg: Config, key: str) -> Any:
    group, name = key.split(".")
    return getattr(getattr(cfg, group), name)


def validate(cfg: Config) -> None:
    """Reject values no run can use, naming the key."""
    for key, choices in CHOICES.items():
        if _get(cfg, key) not in choices:
            raise _err(key, f"must be one of {', '.join(choices)}; got {_get(cfg, key)!r}", f"e.g. {key}={choices[0]}")
    for key in POSITIVE:
        v = _get(cfg, key)
        if not (v > 0 and math.isfinite(v)):
            raise _err(key, f"must be > 0, got {v}", f"pass a positive number, e.g. {key}={_get(Config(), key)}")
    for key in NON_NEGATIVE:
        v = _get(cfg, key)
        if not (v >= 0 and math.isfinite(v)):
            raise _err(key, f"must be >= 0, got {v}", f"pass zero or a positive number, e.g. {key}=0")
    if cfg.data.global_batch_size and cfg.optim.grad_accum != 1:
        raise _err("optim.grad_accum", f"is {cfg.optim.grad_accum}, but with data.global_batch_size the accumulation is "
                   "derived from the world size at start-up", "leave optim.grad_accum out (data.batch_size caps the "
                   "micro-batch)")
    if cfg.data.num_workers < -1:
        raise _err("data.num_workers", f"must be >= -1, got {cfg.data.num_workers}", "-1 (auto), 0, or a count")
    if cfg.data.name != "synthetic" and not cfg.data.root and not cfg.data.target:
        raise _err("data.root", f"is required for data.name={cfg.data.name}",
                   "pass the folder holding the data set, e.g. data.root=/datasets; nothing is downloaded")
    if cfg.train.precision == "fp16" and cfg.train.device == "cpu":
        raise _err("train.precision", "fp16 needs CUDA (GradScaler)", "use train.precision=bf16 or fp32 on the CPU")
    if cfg.checkpoint.resume not in ("auto", "never") and not Path(cfg.checkpoint.resume).exists():
        raise _err("checkpoint.resume", f"{cfg.checkpoint.resume!r} does not exist",
                   "pass auto, never, or the path of a checkpoint file or run folder")
    if not (cfg.dist.heartbeat_timeout_s == -1 or 0 <= cfg.dist.heartbeat_timeout_s < math.inf):
        raise _err("dist.heartbeat_timeout_s", f"must be -1 (auto), 0 (off) or seconds, got {cfg.dist.heartbeat_timeout_s}",
                   "e.g. dist.heartbeat_timeout_s=-1")
    if cfg.dist.heartbeat_timeout_s >= cfg.dist.timeout_s:
        raise _err("dist.heartbeat_timeout_s", f"is {cfg.dist.heartbeat_timeout_s:g} s, not below dist.timeout_s="
                   f"{cfg.dist.timeout_s:g}: collectives would time out first, without saying which rank is stuck",
                   f"e.g. dist.heartbeat_timeout_s={0.8 * cfg.dist.timeout_s:g}, or 0 to turn hang reports off")
    if cfg.dist.strategy == "fsdp" and cfg.checkpoint.format == "file":
        raise _err("checkpoint.format", "file cannot hold a model sharded across ranks (dist.strategy=fsdp)",
                   "use checkpoint.format=auto or dcp; `python -m trainer.export` makes one file for inference")
    if cfg.dist.strategy == "fsdp" and cfg.train.precision == "fp16":
        raise _err("train.precision", "fp16 (GradScaler) is not supported with dist.strategy=fsdp",
                   "use train.precision=bf16: parameters in bf16, gradients reduced in fp32")
    if not (cfg.audit.straggler_ratio > 1 and math.isfinite(cfg.audit.straggler_ratio)):
        raise _err("audit.straggler_ratio", f"must be > 1, got {cfg.audit.straggler_ratio}: a rank at the others' pace "
                   "would be named", "e.g. audit.straggler_ratio=1.3, or audit.straggler_steps=0 to turn detection off")
    if not (cfg.audit.straggler_floor_ms >= 0 and math.isfinite(cfg.audit.straggler_floor_ms)):
        raise _err("audit.straggler_floor_ms", f"must be 0 or more milliseconds, got {cfg.audit.straggler_floor_ms}",
                   "e.g. audit.straggler_floor_ms=10")
    if cfg.audit.replicas_every_steps < -1:
        raise _err("audit.replicas_every_steps", f"must be -1 (off), 0 (at saves) or steps, got "
                   f"{cfg.audit.replicas_every_steps}", "e.g. audit.replicas_every_steps=0")
    if cfg.dist.activation_checkpointing and cfg.dist.strategy != "fsdp":
        raise _err("dist.activation_checkpointing", "applies to the blocks FSDP shards", "add dist.strategy=fsdp")


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML, saved beside each run."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict[str, Any]:
    """The resolved config as plain containers (for checkpoints and W&B)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg))  # type: ignore[return-value]


def from_dict(data: dict[str, Any]) -> Config:
    """Rebuild a Config from its saved form (e.g. inside a checkpoint)."""
    conf: Config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), data))  # type: ignore[assignment]
    return conf

