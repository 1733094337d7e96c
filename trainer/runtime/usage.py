"""How a loop uses its session, checked where a slip would otherwise cost a run: each refused at the call, with the
call named and a HINT (exit 2), instead of training for hours and then failing, or resuming wrong in silence."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer.checkpoint.resume import Resumed
from trainer.checkpoint.state import PerRank, check_names
from trainer.core.errors import UserError
from trainer.data.loader import Loader

if TYPE_CHECKING:
    from trainer.runtime.parts import Parts

ORDER = "wrap, then loader, then restore (once), then steps: examples/char_lm/train.py"


def check_wrap(model: nn.Module) -> None:
    """Refuse a model already inside DDP or FSDP: wrapped twice, its checkpoint's names gain a ``module.`` prefix that
    a resume on another number of processes cannot read."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing can be sharded with it yet
    if isinstance(model, DistributedDataParallel) or (fsdp is not None and isinstance(model, fsdp.FSDPModule)):
        raise UserError("Session.wrap", f"the model is already wrapped ({type(model).__name__})",
                        "pass the plain nn.Module: wrap places it on the device and wraps it itself")


def check_restore(objects: Mapping[str, Any], wrapped: nn.Module | None, loaders: list[Any], world_size: int,
                  again: bool) -> None:
    """Refuse what restore cannot save or resume exactly: a second call, an object without state, a model ``wrap``
    never saw on several processes (its replicas would drift apart unseen), a training loader left out (a resume
    would read its first batches again)."""
    if again:
        raise UserError("Session.restore", "called a second time", f"call it once: {ORDER}")
    check_names(dict(objects))
    for name, obj in objects.items():
        inner = obj.obj if isinstance(obj, PerRank) else obj
        if not isinstance(inner, dict | torch.Generator) and not (hasattr(inner, "state_dict")
                                                                   and hasattr(inner, "load_state_dict")):
            raise UserError(f"Session.restore({name}=…)", f"a {type(inner).__name__!r} object has no state to checkpoint",
                            "pass objects with state_dict()/load_state_dict() (models, optimizers, schedulers, "
                            "the loader from Session.loader), dicts of plain values, or a torch.Generator")
        if world_size > 1 and wrapped is None and isinstance(inner, nn.Module):
            raise UserError(f"Session.restore({name}=…)", f"a model Session.wrap never saw, on {world_size} processes: "
                            "nothing keeps its replicas equal", f"model = sess.wrap(model) first ({ORDER})")
    given = {id(o) for o in objects.values()}
    for loader in loaders:
        if isinstance(loader, Loader) and id(loader) not in given:
            raise UserError("Session.restore", "a loader from Session.loader is not among the objects: a resume "
                            "would read its first batches again", "restore(..., loader=loader)")


def check_loader(restored: bool) -> None:
    """Refuse a training loader made after restore: its position could not be resumed."""
    if restored:
        raise UserError("Session.loader", "called after restore: its position would start over at every resume",
                        f"make the loader first and pass it to restore ({ORDER})")


def say_resumed(say: Callable[[str], None], resumed: Resumed | None, step: int, objects: Mapping[str, Any]) -> None:
    """The resume's line, and a note for each iterable data set whose stream starts again: read by a loader restore
    was given, itself not restored (its position is its own: ``PerRank(dataset)`` with ``state_dict``, read here)."""
    if resumed is None:
        return
    say(f"resumed from {resumed.path}{' (a snapshot in node memory)' if resumed.memory else ''} at step {step}")
    given = {id(o.obj if isinstance(o, PerRank) else o) for o in objects.values()}
    for name, obj in objects.items():
        if isinstance(obj, Loader) and obj.iterable and id(obj.dataset) not in given:
            say(f"note: the iterable data set of {name!r} starts its stream again from the beginning: to continue it, "
                "give it state_dict/load_state_dict, read it in this process (no loader workers) and restore it "
                "too, as PerRank(dataset)")


def metric_values(metrics: Mapping[str, Any]) -> dict[str, float]:
    """``Session.log``'s values as floats (tensors detached); a value that is not a number is refused by name."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor):
            value = value.detach()
        try:
            out[key] = float(value)
        except (TypeError, ValueError, RuntimeError):
            raise UserError(f"Session.log({key!r})", f"{value!r} is not a number", "log numbers or one-element "
                            "tensors; say text with sess.print") from None
    return out


def opened(parts: Parts | None) -> Parts:
    """The run's parts, once ``restore`` has opened the run folder."""
    if parts is None:
        raise UserError("Session.restore", "not called yet: it opens the run folder and loads the checkpoint",
                        f"call it before steps, should_save, save and finish ({ORDER})")
    return parts
