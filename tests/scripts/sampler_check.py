"""Run under torchrun: every rank builds the trainer's real loaders and reports the indices it gets.

Rank 0 prints one JSON line: {"epochs": [[rank0 indices, rank1 indices, ...], ...], "n": dataset size}.
"""

import json

import torch.distributed as dist

from trainer.config import load
from trainer.data import build_data, loaders
from trainer.dist import pick_device, setup, teardown
from trainer.env import discover

cfg = load(["data.synthetic_train_size=100", "data.synthetic_test_size=10", "data.batch_size=8", "data.num_workers=1"])
env = discover()
device = pick_device(env, "cpu")
setup(env, cfg, device)
try:
    data = build_data(cfg)
    train, sampler, _ = loaders(data, cfg, env, device, ())
    epochs = []
    for epoch in range(2):
        sampler.start_epoch(epoch)
        mine = list(sampler)
        assert sum(len(y) for _, y in train) == len(mine)  # the loader really draws that many
        everyone: list[list[int]] = [[] for _ in range(env.world_size)]
        dist.all_gather_object(everyone, mine)
        epochs.append(everyone)
    if env.is_main:
        print(json.dumps({"epochs": epochs, "n": len(data.train)}))
finally:
    teardown()
