"""The one adapter for what a regroup needs of DDP beyond its public API (its constructor run again on a live wrapper,
a process group made by hand): DDP holds its group for its whole life, and a failed group's sockets close only once
nothing holds it.
``tests/test_regroup.py`` pins what is used here.

``detach`` makes DDP again in place on a one-process group of its own (no sockets) so that the failed group can go;
``remake`` makes it again on the new default group. Swapping the group alone (``_update_process_group``) is not enough: a
failure at the second step can leave one member with rebuilt buckets and another with the first step's single one,
and the next all-reduce then sums unlike gradients (seen: the replicas disagreed after a regroup at step 1). A fresh
reducer has the first layout on every member, as a restart would make it.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def wrap(module: torch.nn.Module, device: torch.device, sync: bool = True) -> DDP:
    """DDP around ``module`` on its device (``sync``: the initial broadcast from rank 0; a warm spare's state comes
    from the others instead)."""
    return DDP(module, device_ids=[device.index] if device.type == "cuda" else None, init_sync=sync)


def placeholder(timeout: timedelta = timedelta(seconds=60)) -> dist.ProcessGroup:
    """A process group of this process alone, made without a rendezvous and known to nobody else."""
    group = dist.ProcessGroup(dist.HashStore(), 0, 1)  # type: ignore[attr-defined]
    gloo = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timeout)  # type: ignore[attr-defined]
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return group


def detach(ddp: DDP) -> None:
    """Let go of DDP's current group (a failed one): a fresh reducer on a placeholder until ``remake``, so that the
    old reducer goes, and with it the failed step's pending work, which holds the group's connections."""
    remake(ddp, placeholder())


def remake(ddp: DDP, group: dist.ProcessGroup | None = None) -> None:
    """DDP made again, in place (the loop's reference stays valid), on ``group`` (None: the current default group):
    a fresh reducer, no initial sync (the state is agreed apart). Hooks registered on the wrapper itself are gone."""
    DDP.__init__(ddp, ddp.module, device_ids=ddp.device_ids, process_group=group, init_sync=False)
