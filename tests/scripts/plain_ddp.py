"""A plain DDP script that knows nothing of this project: torch only, `init_process_group()` with env://.

Each rank all-reduces rank + 1 and prints one JSON line (and writes it to $OUT_DIR/rank-<r>.json, or into $RUN_DIR).
Extra arguments are echoed back, to check they arrive unchanged.
"""

import json
import os
import socket
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
rank, world = dist.get_rank(), dist.get_world_size()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
model(torch.ones(2, 4)).sum().backward()  # one DDP gradient all-reduce
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
line = {"rank": rank, "world_size": world, "local_rank": int(os.environ["LOCAL_RANK"]),
        "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]), "master_addr": os.environ["MASTER_ADDR"],
        "host": socket.gethostname(), "node": os.environ.get("SLURMD_NODENAME"),
        "nodelist": os.environ.get("SLURM_JOB_NODELIST"), "sum": value.item(), "argv": sys.argv[1:],
        "grad": model.module.weight.grad.tolist()}
print(json.dumps(line), flush=True)
out = os.environ.get("OUT_DIR") or os.environ.get("RUN_DIR")
if out:
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(line, f)
dist.barrier()
dist.destroy_process_group()
# gloo's worker threads may still be freeing tensors while the interpreter finalizes, which aborts a finished
# process now and then ("terminate called without an active exception", SIGABRT; trainer/core/errors.py exit_now):
# these tests check what the launchers give a script, so the script ends without finalization, output flushed.
sys.stdout.flush()
os._exit(0)
