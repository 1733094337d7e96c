"""What a checkpoint holds of the objects a loop restores, and how it goes back into them.

One file (rank 0 writes every object's state) or sharded (models and optimizers through
``torch.distributed.checkpoint``, every rank writing its share; the rest in the folder's ``extra.pt``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer.checkpoint.resume import Resumed
from trainer.checkpoint.rng import set_rng_state
from trainer.core import dist as tdist
from trainer.core.env import DistEnv
from trainer.core.errors import UserError

STATE_VERSION = 2
"""Checkpoint layout: named objects plus step, world_size, config, rng, tracking, meta (1: before the session API)."""

RESERVED = ("step", "world_size", "config", "version", "tracking", "meta", "rng")
"""Keys of a checkpoint the session writes itself: not names for restored objects."""

PLAIN = (int, float, str, bool, type(None))
"""Exact types: numpy's float64 is a float subclass that pickles as numpy and does not load back."""


def check_names(objects: dict[str, Any]) -> None:
    """Refuse restored objects named like the session's own checkpoint fields."""
    taken = sorted(set(objects) & set(RESERVED))
    if taken:
        raise UserError("Session.restore", f"{', '.join(taken)} is reserved for the session's own checkpoint fields "
                        f"({', '.join(RESERVED)}): pass it under another name", "rename it")


def own_fields(step: int, world_size: int, config: dict[str, Any], run_id: str | None,
               meta: dict[str, Any]) -> dict[str, Any]:
    """The session's own fields of a checkpoint (RESERVED, less ``rng``, which the checkpointer adds)."""
    return {"step": step, "world_size": world_size, "config": config, "version": STATE_VERSION,
            "tracking": {"run_id": run_id}, "meta": meta}


class PerRank:
    """Wrap a stateful object whose state differs per rank (an iterable data set's position, a ``torch.Generator``):
    saved from every rank, restored to the same rank when the world size is unchanged."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj


def _unwrap(obj: Any) -> Any:
    return obj.module if isinstance(obj, DDP) else obj


def state_of(obj: Any) -> Any:
    """An object's state: a copy of a plain dict, a generator's ``get_state()``, else ``state_dict()`` (of the module
    inside DDP)."""
    if isinstance(obj, torch.Generator):
        return obj.get_state()
    return dict(obj) if isinstance(obj, dict) else _unwrap(obj).state_dict()


def load_into(obj: Any, state: Any) -> None:
    """Put ``state`` back into ``obj`` (a dict is replaced in place)."""
    if isinstance(obj, dict):
        obj.clear()
        obj.update(state)
    elif isinstance(obj, torch.Generator):
        obj.set_state(state)
    else:
        _unwrap(obj).load_state_dict(state)


def check_plain(value: Any, where: str) -> None:
    """Refuse (a UserError naming ``where``) a ``value`` holding something a checkpoint cannot load back safely
    (torch.load(weights_only=True)): found at save time, not when a requeued job would fail to resume."""
    if isinstance(value, dict):
        for k, v in value.items():
            check_plain(k, where)
            check_plain(v, f"{where}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_plain(v, f"{where}[{i}]")
    elif type(value) not in PLAIN and not isinstance(value, torch.Tensor):
        raise UserError(where, f"a {type(value).__module__}.{type(value).__qualname__}: checkpoints hold tensors, "
                        "numbers, strings, None and lists/dicts of them", "convert it, e.g. float(x), str(path)")


def is_sharded_object(obj: Any) -> bool:
    """Saved through DCP in a sharded checkpoint (a model or an optimizer), not in ``extra.pt``."""
    return isinstance(_unwrap(obj), nn.Module | torch.optim.Optimizer)


def collect(objects: dict[str, Any], sharded: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Collective: (what DCP saves, what rank 0 saves) for ``objects``; without ``sharded`` everything is rank 0's."""
    through_dcp = {n: _unwrap(o) for n, o in objects.items() if sharded and is_sharded_object(o)}
    rest: dict[str, Any] = {}
    for name, obj in objects.items():
        if name in through_dcp:
            continue
        rest[name] = tdist.gather(state_of(obj.obj)) if isinstance(obj, PerRank) else state_of(obj)
        if isinstance(obj, dict) or isinstance(getattr(obj, "obj", None), dict):
            check_plain(rest[name], name)  # the user's own dict: what torch's own objects hold always loads
    return through_dcp, rest


def restore_objects(resumed: Resumed, objects: dict[str, Any], env: DistEnv, model: nn.Module | None,
                    say: Callable[[str], None], exact: bool = False) -> None:
    """Collective: load every object from the chosen checkpoint (a sharded one resharded onto this world size);
    ``exact``: the loaders continue with the same global batches on any world size (said when it changed)."""
    state = resumed.state
    if state.get("version") != STATE_VERSION:
        raise UserError("checkpoint.resume", f"{resumed.path} has layout {state.get('version')!r}, this version "
                        f"reads layout {STATE_VERSION}", "finish that run with the version that wrote it, or start "
                        "afresh: checkpoint.resume=never or another run.dir")
    same = state["world_size"] == env.world_size
    from_dcp = {n: _unwrap(o) for n, o in objects.items() if resumed.path.is_dir() and is_sharded_object(o)}
    try:
        if from_dcp:
            from trainer.checkpoint.sharded import load_sharded

            load_sharded(resumed.path, from_dcp, model)
    except (RuntimeError, KeyError, ValueError, TypeError) as exc:
        _misfit(resumed, state, ", ".join(from_dcp), exc)
    for name, obj in objects.items():
        if name in from_dcp:
            continue
        if name not in state:
            raise UserError("checkpoint.resume", f"{resumed.path} holds no {name!r}",
                            f"it holds {', '.join(sorted(state))}: restore the objects it was saved with")
        try:
            if not isinstance(obj, PerRank):
                load_into(obj, state[name])
            elif same and state[name] is not None:
                load_into(obj.obj, state[name][env.rank])
        except (RuntimeError, KeyError, ValueError, TypeError) as exc:
            _misfit(resumed, state, name, exc)
    old = int(state["world_size"])
    if env.rank < old:  # a rank that existed continues its own random stream; a new one keeps the seed's
        set_rng_state(state["rng"][env.rank])
    if not same:
        say(world_note(old, env.world_size, exact, [n for n, o in objects.items() if isinstance(o, PerRank)], model))


def world_note(old: int, new: int, exact: bool, per_rank: list[str], model: nn.Module | None) -> str:
    """One line on resuming onto another number of processes: what continues exactly and what does not."""
    if not exact:
        return (f"note: checkpoint was written by {_procs(old)}, now {new}: training continues after the samples "
                "already seen (to within one batch), but with another global batch; set data.global_batch_size "
                "(own loop: sess.loader(..., global_batch_size=N)) to keep it"
                + (f"; per-rank state ({', '.join(per_rank)}) starts afresh" if per_rank else ""))
    streams = (f"{_ranks(old, new - 1)} start random streams from the seed" if new > old else
               f"the random streams of {_ranks(new, old - 1)} end")
    norms = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()) if model else 0
    return (f"note: checkpoint was written by {_procs(old)}, now {new}: the same global batches continue, step "
            f"by step (sums may differ in the last bits: another reduction order); {streams}"
            + (f"; per-rank state ({', '.join(per_rank)}) starts afresh" if per_rank else "")
            + (f"; not exact for this model: its {norms} BatchNorm layer(s) take statistics over each process's "
               "micro-batch, which the split changes" if norms else ""))


def _procs(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


def _ranks(first: int, last: int) -> str:
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def _misfit(resumed: Resumed, state: dict[str, Any], name: str, exc: BaseException) -> None:
    was = state.get("meta", {}).get("plugins", {}).get(name)
    saved_from = f"; it was saved from {was['target']} {was['kwargs']}" if was else ""
    said = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    detail = " ".join(said[:3])  # torch's first line names the model; the next ones the missing and unexpected keys
    raise UserError("checkpoint.resume", f"{resumed.path} does not fit {name!r} "
                    f"({detail[:400]}){saved_from}",
                    "resume with what it was trained with, or start afresh: checkpoint.resume=never "
                    "or another run.dir") from None


