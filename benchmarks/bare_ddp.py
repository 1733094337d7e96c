"""The tutorials' hand-written DDP loop, kept as the baseline for `make bench` (run it with torchrun).

Same model, data and batch as the trainer's default; nothing else: no accumulation, AMP, checkpoints,
evaluation or signal handling. Rank 0 prints one JSON line with its training throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainer.builtin.data import synthetic
from trainer.builtin.models import SmallCNN
from trainer.core.config import load

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--train-size", type=int, default=8192)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
a = parser.parse_args()

cuda = a.device == "cuda"
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
# The same tensors as a plain TensorDataset: sample-by-sample fetch and collate, as in the tutorials.
data = TensorDataset(*synthetic(load([f"data.synthetic_train_size={a.train_size}"])).train.tensors)  # type: ignore[attr-defined]
sampler: DistributedSampler[Any] = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
loader = DataLoader(data, batch_size=a.batch_size, sampler=sampler, pin_memory=cuda)
model = DDP(SmallCNN(1, 10, 28).to(device), device_ids=[device.index] if cuda else None)
opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
first_step_at = None
start = time.perf_counter()
samples = 0
for epoch in range(a.epochs):
    sampler.set_epoch(epoch)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        samples += x.shape[0] * world
        first_step_at = first_step_at or time.time()
elapsed = time.perf_counter() - start
if rank == 0:
    print(json.dumps({"train_time_s": elapsed, "train_samples_per_s": samples / elapsed, "first_step_at": first_step_at,
                      "world_size": world, "pid": os.getpid()}))
dist.barrier()  # without it, gloo may abort when one rank tears down while the other is still in a collective
dist.destroy_process_group()
