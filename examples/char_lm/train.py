"""A character-level GPT trained by its own loop on the trainer's session API.

    torchrun --nproc-per-node=2 examples/char_lm/train.py --max-steps 300
    python examples/char_lm/train.py --max-steps 300 run.dir=runs/char checkpoint.every_steps=50
    torchrun --nproc-per-node=2 examples/char_lm/train.py --global-batch 32 run.dir=runs/char   # then on 1 process
    python examples/char_lm/make_shards.py /tmp/bytes && python examples/char_lm/train.py --shards /tmp/bytes

Flags shape the model and the loop; ``key=value`` words configure the session (run folder, checkpoints, W&B:
see `python -m trainer --help`). The text is Python's own standard library source: on every machine, no download;
with ``--shards DIR`` it is read from byte shards (make_shards.py) through trainer.Shards, as large data would be.
Preempted (USR2/TERM), it saves, exits 75 and, started again, continues bit-exactly where it stopped. With
``--global-batch`` the samples of each optimizer step are fixed whatever the number of processes, so it may also
continue on another number of processes (to float tolerance: sums are reduced in another order). In a job whose
store runs apart (profile ``regroup: true``, TRAINER_STORE) a lost process's peers go on in their own processes.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from model import GPT, GPTConfig
from torch.utils.data import Dataset

import trainer
import trainer.data

MODULES = ("argparse", "dataclasses", "json.decoder", "textwrap", "fractions", "shlex", "pathlib", "typing")


def corpus(max_bytes: int) -> torch.Tensor:
    text = b"".join(Path(importlib.import_module(m).__file__ or "").read_bytes() for m in MODULES)[:max_bytes]
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


def parse() -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-steps", type=int, default=300, help="optimizer steps in all")
    p.add_argument("--batch-size", type=int, default=16, help="windows per process per micro-step")
    p.add_argument("--accum", type=int, default=2, help="micro-steps per optimizer step")
    p.add_argument("--global-batch", type=int, default=0,
                   help="windows per optimizer step on any number of processes (then --batch-size caps the "
                        "micro-batch and the accumulation is derived); 0: --batch-size × processes × --accum")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=20, help="steps of linear warm-up before the cosine decay")
    p.add_argument("--eval-every", type=int, default=100, help="steps between evaluations")
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--max-bytes", type=int, default=300_000, help="bytes of text to train and evaluate on")
    p.add_argument("--sample", type=int, default=3, help="lines to sample at the end")
    p.add_argument("--shards", type=Path, help="a folder of byte shards (make_shards.py): train-*.bin and val-*.bin")
    return p.parse_known_args()  # what is left are the session's key=value overrides


def shifted(chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A window of block + 1 tokens as (input, target)."""
    return chunk[:-1], chunk[1:]


def datasets(args: argparse.Namespace, block: int) -> tuple[Dataset[Any], Dataset[Any]]:
    """Training and evaluation windows: of the byte shards in ``--shards``, else of the text in memory."""
    if args.shards:
        read = trainer.data.Tokens(block, dtype="uint8")
        return (trainer.Shards(f"{args.shards}/train-*.bin", read, shifted),
                trainer.Shards(f"{args.shards}/val-*.bin", read, shifted))
    data = corpus(args.max_bytes)
    cut = int(0.9 * len(data))
    return trainer.data.Windows(data[:cut], block), trainer.data.Windows(data[cut:], block)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Warm-up, then cosine to a tenth of the peak."""
    if step < args.warmup:
        return (step + 1) / args.warmup
    done = (step - args.warmup) / max(1, args.max_steps - args.warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, done)))


@torch.no_grad()
def evaluate(sess: trainer.Session, model: torch.nn.Module, loader: Any, amp: Any) -> float:
    """Mean loss over the whole evaluation set: each rank sums its shard, then one all-reduce. (eval_batches: with
    dist.strategy=fsdp every rank runs as many forward passes; the padding ones do not count.)"""
    model.eval()
    device = sess.device
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for (x, y), counts in sess.eval_batches(loader):
        with amp():
            loss = model(x.to(device), y.to(device)).double()
        if counts:
            total[0] += loss * y.numel()
            total[1] += y.numel()
    dist.all_reduce(total)
    model.train()
    return float(total[0] / total[1])


def train(sess: trainer.Session, args: argparse.Namespace, model: torch.nn.Module, opt: torch.optim.Optimizer,
          sched: Any, loader: Any, batches: Any, val: Any, start: int) -> float:
    """The steps after ``start``; the validation loss last measured."""
    accum = loader.accumulation  # after restore or a regroup: the global batch's split on this world size
    cuda, val_loss = sess.device.type == "cuda", float("nan")

    def amp() -> Any:  # bf16 on GPUs; the CPU trains in fp32
        return torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()

    for step in sess.steps(start, args.max_steps):
        for micro in range(accum):  # gradients are all-reduced on the last micro-step only
            x, y = (t.to(sess.device, non_blocking=True) for t in next(batches))
            with sess.no_sync(model, skip=micro < accum - 1), amp():
                loss = model(x, y) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if step % 10 == 0:  # reading the loss syncs with the device: not every step
            sess.log({"train/loss": float(loss.detach()) * accum, "train/lr": sched.get_last_lr()[0]}, step)
        if step % args.eval_every == 0 or step == args.max_steps:
            val_loss = evaluate(sess, model, val, amp)
            sess.log({"eval/loss": val_loss}, step)
            sess.report(step, val_loss)  # a sweep's pruner judges it (nothing happens outside a sweep)
            if sess.should_prune():
                break
        if sess.should_save(step):
            sess.save(step)
            if sess.preempted:
                break
    if start >= args.max_steps:  # resumed at the end: no step ran, so measure it once (result.json gets a number)
        val_loss = evaluate(sess, model, val, amp)
    return val_loss


def main() -> int:
    args, overrides = parse()
    with trainer.Session(overrides) as sess:
        c = GPTConfig(block=args.block, layers=args.layers, dim=args.dim)
        model = sess.wrap(GPT(c))
        cuda = sess.device.type == "cuda"
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)

        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_at(step, args))
        train_set, val_set = datasets(args, c.block)
        loader = sess.loader(train_set, args.batch_size, args.global_batch or None, accumulation=args.accum)
        val = sess.eval_loader(val_set, args.batch_size)
        start = sess.restore(model=model, optimizer=opt, scheduler=sched, loader=loader)
        batches = loader.forever()
        while True:
            try:
                val_loss = train(sess, args, model, opt, sched, loader, batches, val, start)
                break
            except RuntimeError as exc:  # a lost peer (a job that regroups): the others go on in their processes
                start = sess.regroup(exc)  # the newest step they all hold; any other error is raised again
        code = sess.finish({"test_loss": val_loss})
        if code == 0 and args.sample:  # every rank: a sharded model gathers its parameters in each forward
            torch.manual_seed(0)
            raw: GPT = sess.model  # type: ignore[assignment]  # the module itself, not DDP's wrapper
            out = raw.generate(torch.tensor([[ord("\n")]], device=sess.device), 60 * args.sample)
            sess.print("sample:\n" + bytes(out[0].tolist()).decode("utf-8", "replace"))
        return code


if __name__ == "__main__":
    trainer.main(main)
