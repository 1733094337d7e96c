"""Run under torchrun: every rank builds the real training loader of a session and reports the indices it gets.

Rank 0 prints one JSON line: {"epochs": [[rank0 indices, rank1 indices, ...], ...], "n": dataset size}.
"""

import json

import torch.distributed as dist

import trainer
from trainer.builtin.data import build_data

with trainer.Session(["data.synthetic_train_size=100", "data.synthetic_test_size=10", "train.device=cpu"]) as sess:
    data = build_data(sess.cfg)
    loader = sess.loader(data.train, batch_size=8, num_workers=1)
    epochs = []
    for epoch in range(2):
        assert loader.epoch == epoch and loader.sampler is not None
        loader.sampler.start_epoch(epoch)
        mine = list(loader.sampler)
        assert sum(len(y) for _, y in loader) == len(mine)  # the loader really draws that many, for this epoch
        everyone: list[list[int]] = [[] for _ in range(sess.env.world_size)]
        dist.all_gather_object(everyone, mine)
        epochs.append(everyone)
    if sess.is_main:
        print(json.dumps({"epochs": epochs, "n": len(data.train)}))  # type: ignore[arg-type]
