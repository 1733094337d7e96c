"""An own loop on the session API with a global batch, for elastic-resume tests (any number of processes).

    python elastic_loop.py run.dir=RUN [dist.strategy=fsdp] [checkpoint.poll_steps=1]

Each sample is (id, x, y). Every optimizer step all ranks gather the ids they trained on; rank 0 appends
``{"step", "ids"}`` (the step's ids, sorted) to RUN/trace.jsonl, so a run cut into attempts on different world
sizes can be compared with an uninterrupted one step by step. At the end rank 0 writes the whole parameters to
RUN/final.pt.
"""

import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

import trainer

N, D, GLOBAL, MICRO, STEPS = 400, 8, 24, 6, 30


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(D, 2)

    def fsdp_blocks(self) -> list[nn.Module]:
        return list(self.blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main() -> int:
    with trainer.Session(sys.argv[1:]) as sess:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(N, D, generator=g)
        data = TensorDataset(torch.arange(N), x, (x.sum(1) > 0).long())
        model = sess.wrap(Net())
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        loader = sess.loader(data, batch_size=MICRO, global_batch_size=GLOBAL)
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
                with open(sess.run_dir / "trace.jsonl", "a") as f:
                    f.write(json.dumps({"step": step, "ids": sorted(sum(everyone, []))}) + "\n")
            if sess.should_save(step):
                sess.save(step)
                if sess.preempted:
                    break
        code = sess.finish()
        whole = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                 for n, p in sess.model.named_parameters()}  # type: ignore[union-attr]
        if code == 0 and sess.is_main:
            torch.save(whole, sess.run_dir / "final.pt")
        return code


if __name__ == "__main__":
    trainer.main(main)
