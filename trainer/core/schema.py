"""The configuration's schema: one dataclass per group, a docstring under every key (``python -m trainer --help``).
What a key means lives here; how arguments and files become a Config (and what is refused) in config.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    """Wrap the model in torch.compile (meant for CUDA), with static shapes: an epoch's short last batch compiles once more."""
    compile_mode: str = "default"
    """torch.compile's mode with train.compile: default, reduce-overhead (CUDA graphs: steps of many small kernels),
    max-autotune or max-autotune-no-cudagraphs (kernels chosen by timing them: a longer first step)."""
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
    def sharded(self) -> bool:
        """Whether each rank holds only its shard of the model (fsdp), not the whole of it (ddp)."""
        return self.strategy == "fsdp"

    @property
    def heartbeat_s(self) -> float:
        """The heartbeat timeout in effect (auto resolved); 0 when off."""
        return 0.8 * self.timeout_s if self.heartbeat_timeout_s < 0 else self.heartbeat_timeout_s


@dataclass
class CheckpointConfig:
    resume: str = "auto"
    """auto (newest complete checkpoint in the run folder, if any); never (the job's first start begins afresh, the
    folder's checkpoints set aside; its requeues continue); or a checkpoint path to start from (once the run folder
    holds checkpoints, its newest wins)."""
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
    system: on, off, or auto (on when the job restarts in place, spare nodes or a node range, or regroups a sharded
    model in place: the lost shard comes from them)."""
    memory_every_steps: int = 0
    """Steps between memory snapshots; 0: chosen from their measured stall, as checkpoint.cadence=auto does."""


@dataclass
class AuditConfig:
    straggler_ratio: float = 1.2
    """A node whose time per step outside waiting for the others stays above this × the other nodes' is slow."""
    straggler_steps: int = 50
    """Steps a node must stay that slow before it is named a straggler; 0 turns straggler detection off."""
    straggler_floor_ms: float = 10.0
    """...and above the others' by at least this many milliseconds per step: a small model's noise is no straggler."""
    on_straggler: str = "report"
    """report (event, console, report, status name the node and the time lost) or restart (save, end the attempt
    blaming the node; not on a job with one node)."""
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
    report: bool = True
    """Write report.html (goodput, plots) when the run ends, in a process of its own (about 1 s of one core); false
    skips it (a sweep's many short trials), and `python -m trainer.report RUN_DIR` writes it later."""


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


def takes_snapshots(cfg: Config, in_place: bool, regroups: bool) -> bool:
    """checkpoint.memory decided: ``on``, or ``auto`` in a job that restarts in its allocation (``in_place``) or that
    regroups a sharded model in place (``regroups``: the lost rank's shard exists nowhere else)."""
    auto = in_place or (regroups and cfg.dist.sharded)
    return cfg.checkpoint.memory == "on" or (cfg.checkpoint.memory == "auto" and auto)
