"""One rank of a job whose survivors regroup in place: all-reduces until a peer is lost, regroups on the store
(trainer.core.regroup), does 20 more all-reduces in the new group and prints what it saw as JSON."""

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.core.regroup import Place, Presence, form, next_group

host, port, presence_port, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
folder = Path(sys.argv[6])
store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60))
presence = Presence(host, presence_port, rank)
place = Place.first(rank, world)
form(store, place, "gloo", timedelta(seconds=60))
done, after, lost_at = 0, 0, None
while after < 20:
    value = torch.ones(1)
    try:
        dist.all_reduce(value)
    except RuntimeError:  # a peer is gone: the survivors go on without it (outside this block: see next_group)
        lost_at = time.monotonic()
    if lost_at is not None and place.generation == 0:
        place = next_group(store, place, range(world), "gloo", timedelta(seconds=60))
        regrouped_s = time.monotonic() - lost_at
        continue
    done += 1
    if done == 10:
        (folder / f"ready.{rank}").touch()  # the test kills a rank once every rank got here
    if place.generation:
        after += 1
    time.sleep(0.01)
presence.close()
print(json.dumps({"old_rank": rank, "rank": place.rank, "world": place.world_size, "members": place.members,
                  "last_sum": float(value), "pid": os.getpid(), "regrouped_s": regrouped_s}), flush=True)
dist.destroy_process_group()
