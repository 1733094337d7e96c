"""Under srun: a session's rank and its loader workers report the CPUs they may run on and torch's threads there.

Each task prints one JSON line: {"SLURM_PROCID", "cpus", "threads", "workers": [[cpus…, threads], ...]} (run.dir:
argv[1]).
"""

import json
import os
import sys

import torch
from torch.utils.data import Dataset

import trainer


class Where(Dataset[list[int]]):
    """Each item: the CPUs of the worker that loads it, then its torch threads."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> list[int]:
        return [*sorted(os.sched_getaffinity(0)), torch.get_num_threads()]


with trainer.Session(["train.device=cpu", f"run.dir={sys.argv[1]}"]) as sess:
    loader = sess.loader(Where(), batch_size=1, num_workers=2)
    seen = {tuple(int(x) for x in batch) for batch in loader}  # a batch of one: a tensor per field
    print(json.dumps({"SLURM_PROCID": str(sess.env.rank), "cpus": sorted(os.sched_getaffinity(0)),
                      "threads": torch.get_num_threads(), "workers": sorted(list(s) for s in seen)}), flush=True)
