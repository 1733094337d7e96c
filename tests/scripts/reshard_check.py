"""Restore the built-in cnn and its SGD state from a checkpoint onto this many processes; print what was loaded.

    python reshard_check.py checkpoint.resume=RUN_DIR run.dir=NEW [dist.strategy=fsdp]

One JSON line on rank 0: the step, a hash of the whole parameters and one of the whole momentum buffers
(gathered when sharded), to compare loads onto different numbers of processes.
"""

import hashlib
import json
import sys

import torch

import trainer
from trainer.builtin.models import SmallCNN
from trainer.builtin.train import param_checksum


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


with trainer.Session(sys.argv[1:]) as sess:
    model = sess.wrap(SmallCNN(1, 10, 28))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = sess.restore(model=model, optimizer=opt)
    buffers = [whole(opt.state[p]["momentum_buffer"]) for p in model.parameters()]
    momentum = hashlib.sha256(b"".join(b.detach().contiguous().numpy().tobytes() for b in buffers)).hexdigest()[:16]
    sess.print(json.dumps({"step": step, "params": param_checksum(sess.model), "momentum": momentum}))
