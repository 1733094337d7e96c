"""Typed configuration: dataclass defaults ← packaged YAML ← user YAML ← ``key=value`` overrides. Every field carries a
docstring (``python -m trainer --help``); a bad key, type or value is a :class:`UserError` naming the key."""

from __future__ import annotations

import math
from dataclasses import fields
from importlib import resources
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.core.errors import UserError
from trainer.core.files import load_yaml
from trainer.core.legacy import LEGACY, take_legacy
from trainer.core.schema import Config

CHOICES: dict[str, tuple[str, ...]] = {
    "data.name": ("synthetic", "mnist", "cifar10", "imagefolder", "shards"),
    "optim.name": ("sgd", "adamw"),
    "optim.schedule": ("cosine", "constant"),
    "train.precision": ("fp32", "bf16", "fp16"),
    "train.compile_mode": ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
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
        if arg.startswith("-"):  # a script's own flag it does not define reaches the session's overrides
            raise _err(repr(arg), "is no flag of this program, and the session's arguments are key=value",
                       "check the flag's spelling in `--help`; session keys look like `optim.lr=0.05`")
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
    if cfg.train.compile_mode != "default" and not cfg.train.compile:
        raise _err("train.compile_mode", "applies to a compiled model only", "add train.compile=true")
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
    if cfg.dist.sharded and cfg.checkpoint.format == "file":
        raise _err("checkpoint.format", "file cannot hold a model sharded across ranks (dist.strategy=fsdp)",
                   "use checkpoint.format=auto or dcp; `python -m trainer.export` makes one file for inference")
    if cfg.dist.sharded and cfg.train.precision == "fp16":
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
    if cfg.dist.activation_checkpointing and not cfg.dist.sharded:
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

