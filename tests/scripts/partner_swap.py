"""One rank of a sharded snapshot's partner swap (tests/test_snapshots.py): each rank's shard file goes to the next
node. argv: the shared test folder. A rank whose shard file is missing there (removed from outside) must fail the swap
on every rank at the same point, never leave its partner waiting. Prints one line: ``swapped <files>`` or
``failed: <cause>``."""

import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from trainer.checkpoint.memory import MemorySnapshots, place
from trainer.core.env import discover

root = Path(sys.argv[1])
env = discover()
dist.init_process_group("gloo", timeout=timedelta(seconds=20))  # a partner left waiting: a timeout, not a hang
snapshots = MemorySnapshots(env, place(str(root / "shm"), None, 0, root / "run"), sharded=True)
tmp = root / f"tmp-{env.rank}"
try:
    snapshots._swap_with_partner(tmp, [f"__{env.rank}_0.distcp"])
    print("swapped", sorted(p.name for p in tmp.iterdir()), flush=True)
except RuntimeError as exc:
    print(f"failed: {exc}", flush=True)
dist.destroy_process_group()
