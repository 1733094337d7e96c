"""What to print when a rank runs out of memory: a summary, concrete hints, exit 2; the last checkpoint is untouched."""

from __future__ import annotations

import sys

import torch

from trainer.core.env import DistEnv
from trainer.core.errors import UserError
from trainer.core.schema import Config


def out_of_memory(exc: BaseException, cfg: Config, env: DistEnv, device: torch.device, step: int, epoch: int = 0,
                  setup: bool = False, batch: int = 0) -> UserError:
    """What to print when this rank runs out of memory; nothing is saved, so the last checkpoint stays intact.

    A function, not a Trainer method: construction (``setup``) may fail before there is a Trainer to ask.
    """
    if device.type == "cuda":
        print(torch.cuda.memory_summary(device, abbreviated=True), file=sys.stderr, flush=True)
    b, accum = batch or cfg.data.batch_size, cfg.optim.grad_accum  # batch: the micro-batch a global batch derived
    if setup:  # before the first batch: the weights, optimizer state or DDP's buckets do not fit, whatever the batch
        key = "model.target" if cfg.model.target else "model.name"
        where = f"rank {env.rank}, setting up before step {step}"
        hints = ["check that nothing else holds this GPU's memory (nvidia-smi): one trainer process per GPU",
                 f"a smaller model than {cfg.model.target or cfg.model.name}, or a GPU with more memory",
                 "checkpoints are untouched"]
        if not cfg.dist.sharded:  # weights, gradients and optimizer state: FSDP keeps 1/N of them per GPU
            hints.insert(1, "dist.strategy=fsdp: parameters, gradients and optimizer state split across the "
                            f"processes (about 1/{env.world_size} each here; more GPUs, less each)")
    else:
        key, where = "data.batch_size", f"rank {env.rank}, step {step}, epoch {epoch}"
        hints = [f"halve the micro-batch: data.batch_size={max(1, b // 2)} (the global batch of "
                 f"data.global_batch_size={cfg.data.global_batch_size} stays: the accumulation doubles)"
                 if cfg.data.global_batch_size else f"halve the batch and keep the global batch: "
                 f"data.batch_size={max(1, b // 2)} optim.grad_accum={accum * 2}"]
        if cfg.train.precision == "fp32":
            hints.append("train.precision=bf16 (about half the activation memory)")
        hints += ["dist.strategy=fsdp dist.activation_checkpointing=true (activations recomputed per block; "
                  "weights and optimizer state split across processes)" if not cfg.dist.sharded else
                  "dist.activation_checkpointing=true (activations recomputed per block in the backward pass)",
                  "evaluation already runs under torch.no_grad; a checkpoint, if any, is untouched"]
    first_line = (str(exc).splitlines() or [type(exc).__name__])[0]  # torch may raise it with no message
    return UserError(key, f"out of memory ({where}; batch {b} per process, {cfg.train.precision}): {first_line}",
                     "; ".join(hints))
