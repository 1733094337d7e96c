"""Distributed loaders that know their place: resumed mid-epoch, they skip exactly the batches already trained on."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, TensorDataset

from trainer.core import hooks
from trainer.core.env import DistEnv
from trainer.core.errors import UserError
from trainer.data.batches import BatchPlan, kept_plan, plan
from trainer.data.samplers import GlobalBatchSampler, ResumableSampler, ShardSampler, StreamSampler
from trainer.data.seeding import Seeded, Tagged
from trainer.data.shards import Shards
from trainer.data.workers import checked_iter, worker_init


class InMemory(TensorDataset):
    """Tensors already in memory, fetched a whole batch per indexing op instead of sample by sample + collate."""

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, ...]:
        index = torch.as_tensor(indices)
        return tuple(t[index] for t in self.tensors)


def in_memory_batch(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The collate function for InMemory sets: __getitems__ already returns the batch."""
    return batch


def loader_kwargs(dataset: Dataset[Any], env: DistEnv, device: torch.device, seed: int, signals: tuple[int, ...],
                  kwargs: dict[str, Any]) -> dict[str, Any]:
    """DataLoader arguments with our defaults: workers that ignore preemption signals and report their start
    (trainer.data.workers), pinned memory on GPUs, a generator of its own (the loader never draws on the global RNG
    the model uses), and for tensors in memory a whole batch per indexing op (no per-sample collate)."""
    workers = kwargs.get("num_workers", 0)
    out = {"pin_memory": device.type == "cuda", "persistent_workers": workers > 0,
           "generator": torch.Generator().manual_seed(seed + env.rank),
           **({"collate_fn": in_memory_batch} if isinstance(dataset, InMemory) else {}), **kwargs}
    if workers > 0:
        out["worker_init_fn"] = worker_init(signals, kwargs.get("worker_init_fn"))
    return out


class Loader:
    """Batches of a data set for this rank, with its position as state (``state_dict``/``load_state_dict``).

    Map-style sets are shuffled per epoch by a sampler whose order depends only on (seed, epoch), so a resumed
    run continues with exactly the batches the uninterrupted run would have seen. With a ``plan`` (a global batch)
    each optimizer step takes the same samples whatever the number of processes, so that holds on another world size
    too. A sharded set (``Shards``) is read as one stream by position, with or without a global batch: a resume on any
    world size starts at the next unread sample. Iterable sets read their own share on each rank (the set decides),
    and resume through their own state, if any.
    """

    def __init__(self, dataset: Dataset[Any], env: DistEnv, batch_size: int, seed: int, plan: BatchPlan | None = None,
                 accumulation: int = 1, kept: bool = False, say: Callable[[str], None] | None = None,
                 **kwargs: Any) -> None:
        self.env, self.world_size, self.rank, self.seed, self.kwargs = env, env.world_size, env.rank, seed, kwargs
        self.dataset, self.cap, self.own_accumulation = dataset, batch_size, accumulation
        self.kept, self.say, self.tell = kept, say, say
        """``kept``: the global batch is the first attempt's, not the user's: a checkpoint's replaces it (a job that
        may change size); said once, as the first batch is taken."""
        self.first = plan.global_batch if kept and plan else 0
        """A kept global batch as the first attempt fixed it: each size plans from it (the nearest it can split)."""
        self.fixed = plan is not None
        """A global batch is the contract (the user's, or kept): ``accumulation`` is the plan's."""
        self.iterable = isinstance(dataset, IterableDataset)
        if self.iterable and plan:
            raise UserError("data.global_batch_size", "needs a map-style data set (__len__ and __getitem__): an "
                            "iterable set reads its own share on each process, so its samples per step would change "
                            "with their number", "leave it out (data.batch_size is per process), or index the set")
        if not self.iterable and hasattr(dataset, "__len__") and len(dataset) == 0:
            # Zero steps an epoch: the run would "finish" at once, exit 0, having trained on nothing.
            raise UserError("data", f"the training set holds no sample ({type(dataset).__name__} of length 0)",
                            "check where the set reads its files (data.root, data.kwargs) and any filter that picks "
                            "its samples")
        self._build(plan)
        self.epoch = 0
        """Epochs finished; it moves on as the last batch of an epoch is handed out."""
        self.base = 0
        """Samples of this epoch the whole job had consumed where the current split began (a sharded set resumed on
        another split starts there)."""
        self.position = 0
        """Batches of this epoch this rank has handed out."""
        self.resets = 0
        """How often ``reshape`` moved the position: a running ``forever()`` starts over from it."""

    def _build(self, plan: BatchPlan | None) -> None:
        """The sampler and DataLoader for ``plan`` (None: ``cap`` samples per batch, no global batch)."""
        dataset, kwargs, cap, world = self.dataset, self.kwargs, self.cap, self.world_size
        self.plan, self.batch_size, self.drop_last = plan, plan.micro if plan else cap, False
        self.sampler: ResumableSampler | GlobalBatchSampler | StreamSampler | None = None
        self.loader: DataLoader[Any]
        if self.iterable:
            self.loader = DataLoader(dataset, batch_size=self.batch_size, **kwargs)
            return
        for key in ("sampler", "batch_sampler"):
            if key in kwargs:
                raise UserError(f"Session.loader({key}=…)", "would replace the sampler an exact resume needs",
                                "leave it out: the loader orders each epoch by (seed, epoch); shuffle=False keeps "
                                "the set's own order")
        kwargs = dict(kwargs)
        shuffle = bool(kwargs.pop("shuffle", True)) if not isinstance(dataset, Shards) else True  # shards: their order
        if isinstance(dataset, Shards):
            self.plan = plan or BatchPlan(cap * world, world, cap, 1)
            self.sampler = StreamSampler(dataset, self.plan, self.rank, self.seed)
            batches: Any = self._batched(self.sampler, kwargs)
        elif plan is None:
            self.sampler = ResumableSampler(dataset, self.env, self.seed, shuffle)
            self.drop_last = bool(kwargs.pop("drop_last", False))
            batches = BatchSampler(self.sampler, cap, drop_last=self.drop_last)
        else:
            self.sampler = GlobalBatchSampler(len(dataset), plan, self.rank, self.seed, shuffle)  # type: ignore[arg-type]
            batches = self._batched(self.sampler, kwargs)
        # Workers: random draws by sample (seeding); not for sets that draw none (tensors, shards decoded as they are).
        plain = isinstance(dataset, InMemory) or (isinstance(dataset, Shards) and dataset.transform is None)
        if kwargs.get("num_workers", 0) and not plain:
            dataset, batches = Seeded(dataset, self.seed), Tagged(batches, self.sampler)
        self.loader = DataLoader(dataset, batch_sampler=batches, **kwargs)

    def _batched(self, sampler: GlobalBatchSampler | StreamSampler, kwargs: dict[str, Any]) -> Any:
        for key in ("shuffle", "drop_last"):  # shuffle is taken already, but a sharded set's (its own Order)
            if key in kwargs:  # the global batch decides these: a user's choice would silently be another run
                why = "a sharded set orders itself (Shards' order)" if key == "shuffle" else \
                    "a global batch (yours, or the one a job that may change size keeps) drops the last partial one"
                raise UserError(f"Session.loader({key}=…)", f"cannot be set: {why}", "leave it out")
        if not sampler.steps_per_epoch:
            assert self.plan is not None
            raise UserError("data.global_batch_size", f"{self.plan.global_batch} samples per step are more than the "
                            f"{len(self.dataset)} samples of the training set",  # type: ignore[arg-type]
                            "use a smaller global batch (or batch size)")
        return sampler

    @property
    def accumulation(self) -> int:
        """Micro-batches per optimizer step: the global batch's split on this world size, else the loop's own
        (``Session.loader(accumulation=…)``). Read it after ``restore``: a kept global batch may be a checkpoint's."""
        return self.plan.accumulation if self.fixed and self.plan else self.own_accumulation

    @property
    def _micro_per_step(self) -> int:
        """Micro-batches per global batch of the sampler (1 without a plan)."""
        return self.plan.accumulation if self.plan else 1

    def __len__(self) -> int:
        """Batches per epoch on this rank (map-style sets only)."""
        if isinstance(self.sampler, StreamSampler):  # from the loader's base: the sampler learns it as an epoch starts
            return self.sampler.steps(self.base) * self._micro_per_step
        if isinstance(self.sampler, GlobalBatchSampler):
            return self.sampler.steps_per_epoch * self._micro_per_step
        if self.sampler is None:
            raise TypeError("an iterable data set has no length")
        return -(-self.sampler.num_samples // self.batch_size) if not self.drop_last else \
            self.sampler.num_samples // self.batch_size

    @property
    def epoch_steps(self) -> int:
        """Optimizer steps in a whole epoch (map-style sets), wherever a resume put the position: the schedule's unit."""
        if isinstance(self.sampler, StreamSampler):
            return self.sampler.steps(0)
        if isinstance(self.sampler, GlobalBatchSampler):
            return self.sampler.steps_per_epoch
        return -(-len(self) // self.accumulation)

    def remaining(self) -> int:
        """Batches left in this epoch (a very large number for iterable sets)."""
        return 2**62 if self.sampler is None else len(self) - self.position

    def __iter__(self) -> Iterator[Any]:
        """The rest of the current epoch."""
        if self.kept and self.say is not None and self.plan is not None:  # once: the plan is final after restore
            self.say(f"{self.plan.describe()}: the first attempt's, kept at any size (this job may change size; "
                     "data.global_batch_size / global_batch_size= sets another)")
            self.say = None
        if isinstance(self.sampler, StreamSampler):
            self.sampler.start_epoch(self.epoch, self.position, self.base)
        elif isinstance(self.sampler, GlobalBatchSampler):
            self.sampler.start_epoch(self.epoch, self.position)
        elif self.sampler is not None:
            self.sampler.start_epoch(self.epoch, self.position * self.batch_size)
        left = self.remaining()
        for i, batch in enumerate(checked_iter(self.loader)):
            if hooks.current().records and isinstance(self.sampler, StreamSampler):
                hooks.current().record(self.rank, self.sampler.ledger_entry(self.epoch, self.position))
            self.position += 1
            if i == left - 1:  # the epoch is over once its last batch is out: a save now starts the next one
                self._next_epoch()
            yield batch
        if self.sampler is None:  # an iterable set ran dry: that was an epoch
            self._next_epoch()

    def _next_epoch(self) -> None:
        self.epoch, self.position, self.base = self.epoch + 1, 0, 0

    def forever(self) -> Iterator[Any]:
        """Batch after batch across epochs; after a ``reshape`` (a regroup), from its position on."""
        while True:
            empty, resets = True, self.resets
            for batch in self:
                if self.resets != resets:  # read before the reshape: the new split starts afresh
                    break
                empty = False
                yield batch
                if self.resets != resets:
                    break
            if empty and self.position == 0 and self.resets == resets:
                raise ValueError("the training set yields no batches on this rank")

    def reshape(self, env: DistEnv, state: dict[str, int]) -> None:
        """Go on as ``env``'s rank from ``state`` (a ``state_dict`` taken at a step's start): the same global batches
        on the new number of processes, as a resume from a checkpoint would. A running ``forever()`` follows."""
        self.env, self.world_size, self.rank = env, env.world_size, env.rank
        self._build(self._planned(self.first or self.plan.global_batch) if self.fixed and self.plan else None)
        self.load_state_dict(state)
        self.resets += 1

    def state_dict(self) -> dict[str, int]:
        """The position, and as ``samples`` the samples of this epoch consumed by all ranks together."""
        return {"epoch": self.epoch, "position": self.position, "batch_size": self.batch_size,
                "world_size": self.world_size, "base": self.base,
                "samples": self.base + self.position * self.batch_size * self.world_size,
                "global_batch_size": self.plan.global_batch if self.plan else 0, "kept_global_batch": self.first}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue where ``state`` left off: exactly with the same global batch (on any world size, from a save at
        a step's end), else after the samples already seen, at the start of the next whole step."""
        first = state.get("kept_global_batch") or state.get("global_batch_size", 0)
        if self.kept and first and self.plan and first != self.first:  # the first attempt's global batch
            self.first = first
            self._build(self._planned(first))
        self.epoch, self.position = state["epoch"], state["position"]
        consumed = state.get("samples", state["position"] * state["batch_size"] * state["world_size"])
        split = (state["world_size"], state["batch_size"], state.get("global_batch_size", 0))
        if split == (self.world_size, self.batch_size, self.plan.global_batch if self.plan else 0):
            self.base = state.get("base", 0)  # the very same batches: even a save inside an accumulation window
        elif isinstance(self.sampler, StreamSampler):  # the next unread sample of the stream, whatever the new split
            self.base, self.position = consumed, 0
        elif self.plan is not None and not self.iterable:
            self.position = -(-consumed // self.plan.global_batch) * self.plan.accumulation
        else:
            self.position = consumed // (self.batch_size * self.world_size)
        if self.sampler is not None and self.position >= len(self):  # another batch: the epoch is already over
            self._next_epoch()

    def _planned(self, global_batch: int) -> BatchPlan:
        """``global_batch``'s plan on this world size: the user's must split (else bad input); a kept one that cannot
        becomes the nearest that can, said once."""
        if not self.kept:
            return plan(global_batch, self.world_size, self.cap)
        made, note = kept_plan(global_batch, self.world_size, self.cap)
        if note and self.tell is not None:
            self.tell(note)
        return made

    def exact_after(self, state: dict[str, int]) -> bool:
        """Whether resuming from ``state`` continues with the very global batches the saving run had next (it saved
        at the end of a step: ``should_save`` comes after the optimizer step)."""
        saved, first = state.get("global_batch_size"), state.get("kept_global_batch") or state.get("global_batch_size")
        # Kept: load_state_dict plans from the first attempt's; exact where that gives the saving run's batches.
        adopted = bool(self.kept and first and kept_plan(first, self.world_size, self.cap)[0].global_batch == saved)
        return self.plan is not None and (saved == self.plan.global_batch or adopted)


def train_loader(dataset: Dataset[Any], env: DistEnv, batch_size: int, global_batch_size: int | None, seed: int,
                 say: Callable[[str], None], accumulation: int = 1, resizable: bool = False, **kwargs: Any) -> Loader:
    """``Session.loader``: this rank's resumable batches; with a global batch, its plan printed once. A job that may
    change size (``resizable``) without one keeps its first attempt's: ``batch_size`` × ``accumulation`` × this
    world size, replaced by a checkpoint's at ``load_state_dict``."""
    if batch_size < 1 or (global_batch_size or 0) < 0 or accumulation < 1:
        raise ValueError(f"loader(): batch_size and accumulation must be >= 1 and global_batch_size >= 0, got "
                         f"{batch_size}, {accumulation} and {global_batch_size}")
    kept = resizable and not global_batch_size and not isinstance(dataset, IterableDataset)
    if kept:
        global_batch_size = batch_size * accumulation * env.world_size
    planned = plan(global_batch_size, env.world_size, batch_size) if global_batch_size else None
    if planned and not kept:
        say(f"{planned.describe()} (data.batch_size={batch_size} caps the micro-batch){planned.advice(batch_size)}")
    if resizable and isinstance(dataset, IterableDataset):
        say("note: this job may change size and an iterable data set has no global batch: each process reads "
            "data.batch_size samples a step, so a step's samples change with the number of processes")
    made = Loader(dataset, env, batch_size, seed, planned, accumulation, kept, say, **kwargs)
    if isinstance(dataset, Shards):
        global_batch = made.plan.global_batch if made.plan else 0
        for note in dataset.notes:
            say(f"note: {note}")
        say(f"{dataset.describe()}; {len(made) // made._micro_per_step:,} steps of {global_batch} samples per epoch "
            f"(the last {len(dataset) % global_batch} samples of each epoch's order are left out, as drop_last does)")
    return made


def reshard(loader: DataLoader[Any], env: DistEnv) -> None:
    """An evaluation loader's shard for ``env``'s rank after a regroup (its next pass covers the set again)."""
    if isinstance(loader.sampler, ShardSampler):
        loader.sampler.indices = ShardSampler(len(loader.dataset), env).indices  # type: ignore[arg-type]


def eval_loader(dataset: Dataset[Any], env: DistEnv, batch_size: int, **kwargs: Any) -> DataLoader[Any]:
    """Disjoint shards covering the set exactly once (no padding): all-reduced sums count each sample once."""
    shard = None if isinstance(dataset, IterableDataset) else ShardSampler(len(dataset), env)  # type: ignore[arg-type]
    return DataLoader(dataset, batch_size=batch_size, sampler=shard, **kwargs)
