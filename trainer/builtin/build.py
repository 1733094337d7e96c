"""Data, model and task from the config: the built-in ones or the user's, checked before anything is written."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import IterableDataset

from trainer.builtin import targets as plugins
from trainer.builtin.data import Data, build_data
from trainer.builtin.models import build_model, check_input
from trainer.builtin.task import Classification, Task
from trainer.core.errors import UserError
from trainer.core.schema import Config


@dataclass
class Parts:
    """What the training loop runs: data sets, the model (on the CPU, unwrapped), the task, and what they came from."""

    data: Data
    model: nn.Module
    task: Task
    record: dict[str, Any]
    """Resolved targets and kwargs, kept in checkpoints and W&B: a resumed run can tell if they changed."""


def _is_task(obj: Any) -> bool:
    return callable(getattr(obj, "training_step", None)) and callable(getattr(obj, "eval_step", None))


TASK_KIND = "an object with training_step(model, batch) and eval_step(model, batch) (see trainer/builtin/task.py)"


def build_task(cfg: Config) -> Task:
    """``task.target(**task.kwargs)``, or the built-in classification."""
    if not cfg.task.target:
        return Classification()
    task: Task = plugins.build(cfg.task.target, cfg.task.kwargs, "task.target", _is_task, TASK_KIND)
    return task


def record(cfg: Config) -> dict[str, Any]:
    """The resolved model, data and task with their kwargs."""
    out: dict[str, Any] = {}
    builtin = {"model": f"trainer.builtin.models:{cfg.model.name}", "data": f"trainer.builtin.data:{cfg.data.name}",
               "task": "trainer.builtin.task:Classification"}
    for group in ("model", "data", "task"):
        section = getattr(cfg, group)
        where = (plugins.describe(section.target, f"{group}.target") if section.target
                 else {"target": builtin[group], "file": ""})
        out[group] = {**where, "kwargs": dict(section.kwargs)}
    return out


def _example(data: Data) -> Any:
    """One training input (for a shape check of built-in models), or None when it cannot be had cheaply."""
    if isinstance(data.train, IterableDataset):
        return None
    try:
        sample = data.train[0]
    except Exception:
        return None
    return sample[0] if isinstance(sample, (tuple, list)) and sample else sample


def build_parts(cfg: Config) -> Parts:
    """Everything user code builds, before any file is written or any device memory is used."""
    plugins.add_import_paths(cfg.run.python_path)
    data = build_data(cfg)
    check_input(cfg.model, data.in_channels, data.image_size, _example(data))
    model = build_model(cfg.model, data.in_channels, data.image_size)
    return Parts(data, model, build_task(cfg), record(cfg))


BUILTIN_SHAPES = {"synthetic": (1, 0), "mnist": (1, 28), "cifar10": (3, 32), "imagefolder": (3, 0), "shards": (3, 0)}
"""(channels, size) of the built-in data sets; size 0: data.image_size."""


def check(cfg: Config) -> int | None:
    """On the submitting machine: resolve every target and build the model and task, without data or memory.

    The data factory is resolved and its kwargs checked but not called: its files may exist only on the cluster.
    The model is built on the meta device: no parameter memory, so any size can be checked anywhere. Returns its
    parameter count (None when it cannot be built there).
    """
    plugins.add_import_paths(cfg.run.python_path)
    meta_params = None
    if cfg.data.target:
        plugins.prepare(cfg.data.target, cfg.data.kwargs, "data.target", "a (train, eval) pair of data sets")
        channels, size = 3, 32  # a stand-in for built-in models on the user's data (known only on the cluster)
    else:
        channels, size = BUILTIN_SHAPES[cfg.data.name]
        size = size or cfg.data.image_size
    try:
        with torch.device("meta"):
            model = build_model(cfg.model, channels, size)
        meta_params = sum(p.numel() for p in model.parameters())
    except NotImplementedError:  # an initialiser the meta device cannot run: the job itself will build it
        pass
    except UserError as err:
        if "meta" not in err.message:  # the same from a user's factory ("Cannot copy out of meta tensor")
            raise
    build_task(cfg)
    record(cfg)
    return meta_params


def load_checked(args: list[str]) -> Config:
    """The config from ``key=value`` arguments with every target resolved and built as :func:`check` does."""
    return checked(args)[0]


def checked(args: list[str]) -> tuple[Config, int | None]:
    """:func:`load_checked`, and the model's parameter count (None when the meta device cannot build it)."""
    from trainer.core.config import load

    cfg = load(args)
    return cfg, check(cfg)
