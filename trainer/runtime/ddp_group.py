"""The one adapter for DDP's private process-group swap (``DistributedDataParallel._update_process_group``), which a
regroup needs: DDP holds its group for its whole life, and a failed group's sockets close only once nothing holds it.
``tests/test_regroup.py`` pins what is used here.

``detach`` gives DDP a one-process group of its own (no sockets) so that the failed group can go; ``attach`` gives it
the new default group. DDP resets its reducer and rebuilds its buckets at the next backward, on every member alike.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def placeholder(timeout: timedelta = timedelta(seconds=60)) -> dist.ProcessGroup:
    """A process group of this process alone, made without a rendezvous and known to nobody else."""
    group = dist.ProcessGroup(dist.HashStore(), 0, 1)  # type: ignore[attr-defined]
    gloo = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timeout)  # type: ignore[attr-defined]
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return group


def detach(ddp: DDP) -> None:
    """Let go of DDP's current group (a failed one): it keeps a placeholder until ``attach``."""
    ddp._update_process_group(placeholder())


def attach(ddp: DDP) -> None:
    """Give DDP the current default group (the new generation's)."""
    ddp._update_process_group(dist.group.WORLD)
