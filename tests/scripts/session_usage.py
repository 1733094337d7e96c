"""A loop of its own that slips as users of other libraries would (tests/test_session_usage.py). argv: ``slips``
(each slip tried and its refusal printed: ``refused <field>: <message>``), or ``train <stop> [--no-finish]``: a loop
without ``sess.steps`` counting its own steps to ``stop``; then the session's key=value overrides."""

import sys
from pathlib import Path

import torch
from torch import nn

import trainer

what, rest = sys.argv[1], sys.argv[2:]
stop = int(rest.pop(0)) if what == "train" else 0
finish = "--no-finish" not in rest
args = [a for a in rest if a != "--no-finish"]
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))


def refused(call: object) -> None:
    try:
        call() if callable(call) else None
        print("allowed", flush=True)
    except trainer.UserError as exc:
        print(f"refused {exc.field}: {exc.message}", flush=True)


def slips() -> int:
    refused(lambda: trainer.Session(args, extra_config={"data": Path("/data")}))
    with trainer.Session(args) as sess:
        refused(lambda: sess.log({"phase": "warm-up"}, 0))
        refused(lambda: sess.loader(data, 8, sampler=range(64)))
        if sess.env.world_size > 1:
            refused(lambda: sess.restore(model=nn.Linear(4, 1)))  # never wrapped
        model = sess.wrap(nn.Linear(4, 1))
        if sess.env.world_size > 1:
            refused(lambda: sess.wrap(model))  # already inside DDP
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = sess.loader(data, 8)
        refused(lambda: sess.save(1))
        refused(lambda: sess.restore(model=model, counter=5))
        refused(lambda: sess.restore(model=model, optimizer=opt))  # the loader left out
        sess.restore(model=model, optimizer=opt, loader=loader)
        refused(lambda: sess.restore(model=model, optimizer=opt, loader=loader))
        refused(lambda: sess.loader(data, 8))
        return sess.finish()


def train() -> int:
    with trainer.Session(args) as sess:
        model = sess.wrap(nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = sess.loader(data, 8)
        step = sess.restore(model=model, optimizer=opt, loader=loader)
        batches = loader.forever()
        trained = 0
        while step < stop:  # no sess.steps(): the loop counts for itself
            x, y = next(batches)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            step, trained = step + 1, trained + 1
            if sess.should_save(step):
                sess.save(step)
        print(f"trained {trained} steps", flush=True)
        return sess.finish() if finish else 0


trainer.main(slips if what == "slips" else train)
