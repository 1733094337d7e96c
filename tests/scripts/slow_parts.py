"""An own loop on Session where one rank is slow outside the forward and optimizer step, as a user's job can be: its
data set sleeps in ``__getitem__`` (``--slow data``), or its loop does host work after each step (``--slow host``).

``python tests/scripts/slow_parts.py --slow data --slow-rank 1 --slow-ms 2 --steps 80 key=value…``; ``--slow none``
trains evenly (a test slows a rank from outside).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn
from torch.utils.data import Dataset

import trainer


class Sleepy(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Random regression pairs; each read sleeps ``ms`` milliseconds (a slow disk or decoder on one rank)."""

    def __init__(self, n: int, ms: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y, self.ms = torch.randn(n, 16, generator=g), torch.randn(n, 1, generator=g), ms

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ms:
            time.sleep(self.ms / 1000)
        return self.x[i], self.y[i]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--slow", choices=("data", "host", "none"), required=True, help="none: slowed from outside")
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--slow-ms", type=float, default=2.0, help="per sample (data) or per step (host)")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--hidden", type=int, default=32, help="width: 512 makes a step mostly computation")
    p.add_argument("--batch", type=int, default=8)
    a, rest = p.parse_known_args()
    with trainer.Session(rest) as sess:
        slow = sess.env.rank == a.slow_rank
        h = a.hidden
        model = sess.wrap(nn.Sequential(nn.Linear(16, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 1)))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        data = Sleepy(4096, a.slow_ms if slow and a.slow == "data" else 0.0)
        loader = sess.loader(data, batch_size=a.batch)
        start = sess.restore(model=model, optimizer=opt, loader=loader)
        batches = loader.forever()
        for step in sess.steps(start, a.steps):
            x, y = next(batches)
            loss = nn.functional.mse_loss(model(x.to(sess.device)), y.to(sess.device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if slow and a.slow == "host":
                time.sleep(a.slow_ms / 1000)  # host work of the user's own, outside forward and optimizer
            if sess.should_save(step):
                sess.save(step)
                if sess.preempted:
                    break
        return sess.finish()


if __name__ == "__main__":
    sys.argv[0] = __file__
    trainer.main(main)
