"""Under srun: a session's rank and its loader workers report the CPUs they may run on and torch's threads there.

Each task prints one JSON line: {"rank", "cpus", "threads", "workers": [[cpus, threads], ...]} (run.dir: argv[1]).
"""

import json
import os
import sys

import torch
from torch.utils.data import Dataset, get_worker_info

import trainer


class Where(Dataset[list[int]]):
    """Each item: the CPUs of the worker that loads it, then its torch threads, then the worker's id."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> list[int]:
        info = get_worker_info()
        return [*sorted(os.sched_getaffinity(0)), torch.get_num_threads(), info.id if info else -1]


with trainer.Session(["train.device=cpu", f"run.dir={sys.argv[1]}"]) as sess:
    loader = sess.loader(Where(), batch_size=1, num_workers=2)
    seen = {tuple(int(x) for x in batch[:-1]) for batch in loader}  # a batch of one: a tensor per field
    print(json.dumps({"rank": sess.env.rank, "cpus": sorted(os.sched_getaffinity(0)),
                      "threads": torch.get_num_threads(), "workers": sorted(list(s) for s in seen)}), flush=True)
