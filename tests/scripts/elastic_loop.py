"""An own loop on the session API with a global batch, for elastic-resume tests (any number of processes).

    python elastic_loop.py run.dir=RUN [dist.strategy=fsdp] [checkpoint.poll_steps=1]
    python elastic_loop.py --shards DIR --workers N run.dir=RUN …     # JSONL shards {"id", "x"} (trainer.Shards)
    python elastic_loop.py --stop K --pace 0.05 run.dir=RUN …         # end at step K; sleep between steps

With TRAINER_STORE set the survivors of a lost rank go on in place (the documented ``except RuntimeError`` pattern).

Each sample is (id, x, y). Every optimizer step all ranks gather the ids they trained on; rank 0 appends
``{"step", "world", "ranks": [[ids of rank 0], …], "ids": sorted}`` to RUN/trace.jsonl, the per-sample ledger that
compares a run cut into attempts on different world sizes with an uninterrupted one step by step. At the end rank 0
writes the whole parameters to RUN/final.pt.
"""

import argparse
import json
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import trainer

N, D = 400, 8
TENSORS = {"global": 24, "micro": 6, "steps": 30}
SHARDS = {"global": 12, "micro": 4, "steps": 40}


class Net(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(width, 2)

    def fsdp_blocks(self) -> list[nn.Module]:
        return list(self.blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def row(sample: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A JSONL shard's row as (id, x, y)."""
    x = torch.tensor(sample["x"])
    return torch.tensor(sample["id"]), x, (x.sum() > 0).long()


def data(shards: str | None) -> tuple[Dataset[Any], int]:
    if shards:
        return trainer.Shards(shards, transform=row, shuffle_window=5), 4
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, D, generator=g)
    return TensorDataset(torch.arange(N), x, (x.sum(1) > 0).long()), D


def trace(sess: trainer.Session, step: int, ids: list[int]) -> None:
    """Every rank's sample ids of ``step``, appended by rank 0 to RUN/trace.jsonl."""
    everyone: list[list[int]] = [[] for _ in range(sess.env.world_size)]
    dist.all_gather_object(everyone, ids)
    if sess.is_main:
        with open(sess.run_dir / "trace.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "world": sess.env.world_size, "ranks": everyone,
                                "ids": sorted(sum(everyone, []))}) + "\n")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shards")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--stop", type=int, default=0, help="the last step (default: the data's)")
    p.add_argument("--pace", type=float, default=0.0, help="seconds to sleep after each step")
    args, overrides = p.parse_known_args()
    sizes = SHARDS if args.shards else TENSORS
    with trainer.Session(overrides) as sess:
        dataset, width = data(args.shards)
        model = sess.wrap(Net(width))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        loader = sess.loader(dataset, batch_size=sizes["micro"], global_batch_size=sizes["global"],
                             num_workers=args.workers)
        start = sess.restore(model=model, optimizer=opt, loader=loader)
        batches = loader.forever()
        while True:
            try:
                for step in sess.steps(start, args.stop or sizes["steps"]):
                    ids = []
                    for micro in range(loader.accumulation):
                        i, xb, yb = next(batches)
                        ids += i.tolist()
                        with sess.no_sync(model, skip=micro < loader.accumulation - 1):
                            loss = nn.functional.cross_entropy(model(xb), yb) / loader.accumulation
                        loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    trace(sess, step, ids)
                    time.sleep(args.pace)
                    if sess.should_save(step):
                        sess.save(step)
                        if sess.preempted:
                            break
                break
            except RuntimeError as exc:  # a lost peer: the survivors go on from the newest step they hold
                start = sess.regroup(exc)
        code = sess.finish()
        whole = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                 for n, p in sess.model.named_parameters()}  # type: ignore[union-attr]
        if code == 0 and sess.is_main:
            torch.save(whole, sess.run_dir / "final.pt")
        return code


if __name__ == "__main__":
    trainer.main(main)
