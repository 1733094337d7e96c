"""One rank of a job whose survivors regroup in place (trainer.core.regroup), or with ``spare:N`` a warm spare that
waits for a lost rank's place. The ranks all-reduce until a peer is lost; the next generation (survivors, and the
spare if one waits) takes the count of steps done from its rank 0, does 20 more all-reduces, and each member prints
what it saw as JSON."""

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.core.regroup import Place, Presence, form, next_group, offer_spare, take_place

host, port, presence_port, who, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
folder, timeout = Path(sys.argv[6]), timedelta(seconds=60)
spare = who.startswith("spare:")
origin = int(who.removeprefix("spare:"))
store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
presence = Presence(host, presence_port, origin)
if spare:
    offer_spare(store, origin)
    (folder / f"spare.{origin}").touch()
    place = take_place(store, origin)
    form(store, place, "gloo", timeout)
else:
    place = Place.first(origin, world)
    form(store, place, "gloo", timeout)
done, after, lost_at, regrouped_s, first_after = 0, 0, None, 0.0, 0.0
state = torch.zeros(1)
if place.generation:  # the spare: the steps done so far, from the new group's rank 0
    dist.broadcast(state, 0)
    done = int(state.item())
while after < 20:
    value = torch.ones(1)
    try:
        dist.all_reduce(value)
    except RuntimeError:  # a peer is gone: the survivors go on without it (outside this block: see next_group)
        lost_at = time.monotonic()
    if lost_at is not None and place.generation == 0:
        place = next_group(store, place, range(world), "gloo", timeout)
        regrouped_s = time.monotonic() - lost_at
        state = torch.tensor([float(done)])
        dist.broadcast(state, 0)  # a spare in the lost rank's place learns where the others are
        continue
    done += 1
    if done == 10:
        (folder / f"ready.{origin}").touch()  # the test kills a rank once every rank got here
    if place.generation:
        after += 1
        first_after = first_after or time.time()  # wall clock: the test compares it with the kill's
    time.sleep(0.01)
presence.close()
print(json.dumps({"origin": origin, "rank": place.rank, "world": place.world_size, "members": place.members,
                  "last_sum": float(value), "done": done, "pid": os.getpid(), "regrouped_s": regrouped_s,
                  "first_after": first_after}), flush=True)
dist.destroy_process_group()
