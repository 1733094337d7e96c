"""What the built-in trainer's overrides must pass before a job is queued, not after its queue wait: the trainer's own
config checks, a global batch that every world size of a node range can split, and memory snapshots the nodes can
hold (torch is imported only here, and only for the trainer: listing or rendering never loads it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cluster.job import nodes
from cluster.profile import Profile
from trainer.core.errors import UserError
from trainer.core.legacy import LEGACY
from trainer.core.schema import takes_snapshots
from trainer.data.batches import check_worlds

if TYPE_CHECKING:
    from trainer.core.schema import Config


def trainer_args(args: list[str], warned_with: str, p: Profile) -> None:
    """Bad overrides (``run.dir`` taken out) fail here, not on the cluster. The job's warning signal is the profile's,
    not a trainer key."""
    for arg in args:
        key = arg.partition("=")[0]
        if key == "checkpoint.signal":
            raise UserError(key, "is no longer a key: the trainer saves on the signal the job is warned "
                            f"with ({warned_with}, the profile's signal), and on SIGUSR2 and SIGTERM",
                            "leave it out; another signal: --set signal=USR1 (SET=\"signal=USR1\")")
        if key in LEGACY:
            raise UserError(key, f"is no longer a key ({LEGACY[key][1]})", f"leave {arg!r} out")
    from trainer.builtin.build import checked  # torch: never loaded to list or render

    cfg, params = checked(args)
    if cfg.data.global_batch_size:  # now, not after the queue wait: every world size the job may start with
        check_worlds(cfg.data.global_batch_size, p.world_sizes(), cfg.data.batch_size)
    snapshot_room(p, cfg, params)


def snapshot_room(p: Profile, cfg: Config, params: int | None) -> None:
    """Memory snapshots that the nodes' /dev/shm (by default half their memory) cannot hold: refused with the
    figures when asked for (checkpoint.memory=on), one note for auto; nothing when sinfo or the model cannot say."""
    mem = nodes.memory_mb(p.partition) if takes_snapshots(cfg, p.in_place, p.regroup) and params else None
    if not mem or not params:
        return
    state = params * 4 * (1 + (2 if cfg.optim.name == "adamw" else 1))  # fp32 weights, optimizer moments
    world = p.nodes * p.ntasks_per_node
    share = 2 * p.ntasks_per_node / world if cfg.dist.sharded and world > p.ntasks_per_node else 1.0
    need, room = 2 * state * share, mem * 2**20 / 2  # two snapshots kept; fsdp: this node's shards and a partner's
    if need <= room:
        return
    what = (f"memory snapshots need about {need / 2**30:.1f} GiB of /dev/shm on each node, and the nodes of "
            f"{p.partition or 'the cluster'} have {mem / 1024:.1f} GiB of memory (/dev/shm: usually half)")
    if cfg.checkpoint.memory == "on":
        raise UserError("checkpoint.memory", what, "checkpoint.memory=off, or dist.strategy=fsdp on more nodes "
                        "(each node then holds less)")
    print(f"note: {what}: the job goes without them (checkpoint.memory=auto)")
