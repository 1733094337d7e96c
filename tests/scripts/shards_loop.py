"""An own loop on the session API over JSONL shards (trainer.data.Shards), for exactly-once tests.

    python shards_loop.py SHARD_DIR WORKERS run.dir=RUN [overrides]

Each sample is a row ``{"id", "x"}``. Every optimizer step all ranks gather the ids they trained on; rank 0 appends
``{"step", "world", "ranks": [[ids of rank 0], …]}`` to RUN/ledger.jsonl: the per-sample ledger the tests read.
"""

import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import trainer
from trainer.data import Shards

GLOBAL, MICRO, STEPS = 12, 4, 40


def sample(row: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.tensor(row["x"])
    return torch.tensor(row["id"]), x, (x.sum() > 0).long()


def main() -> int:
    folder, workers, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    with trainer.Session(overrides) as sess:
        data = Shards(folder, transform=sample, shuffle_window=5)
        model = sess.wrap(nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = sess.loader(data, batch_size=MICRO, global_batch_size=GLOBAL, num_workers=workers)
        start = sess.restore(model=model, optimizer=opt, loader=loader)
        batches = loader.forever()
        for step in sess.steps(start, STEPS):
            ids = []
            for micro in range(loader.accumulation):
                i, xb, yb = next(batches)
                ids += i.tolist()
                with sess.no_sync(model, skip=micro < loader.accumulation - 1):
                    loss = nn.functional.cross_entropy(model(xb), yb) / loader.accumulation
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            everyone: list[list[int]] = [[] for _ in range(sess.env.world_size)]
            dist.all_gather_object(everyone, ids)
            if sess.is_main:
                with open(sess.run_dir / "ledger.jsonl", "a") as f:
                    f.write(json.dumps({"step": step, "world": sess.env.world_size, "ranks": everyone}) + "\n")
            if sess.should_save(step):
                sess.save(step)
                if sess.preempted:
                    break
        return sess.finish()


if __name__ == "__main__":
    trainer.main(main)
