"""Elastic resume: the global batch is the contract, the sample cursor is global, a run cut into attempts on
different numbers of processes trains on the uninterrupted run's samples, step by step (real processes, gloo)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer.core.env import DistEnv
from trainer.core.errors import UserError
from trainer.data.batches import check_worlds, plan
from trainer.data.loader import Loader, train_loader
from trainer.data.samplers import GlobalBatchSampler

from .conftest import ROOT, SMALL, faults, ok, outputs, result_of, run_trainer, spawn_ranks

LOOP = ROOT / "tests" / "scripts" / "elastic_loop.py"


def env_of(rank: int, world: int) -> DistEnv:
    return DistEnv(rank, rank, world, world, 0, 1, "127.0.0.1", 29500, None, "torchrun")


@pytest.mark.parametrize(("global_batch", "world", "cap", "micro", "accumulation"), [
    (64, 2, 32, 32, 1),
    (64, 1, 32, 32, 2),
    (64, 4, 32, 16, 1),   # the cap is an upper bound: fewer samples per process when more share the batch
    (48, 1, 20, 16, 3),   # 48 in micro-batches of at most 20: three equal ones (two of 24 would not fit)
    (30, 3, 4, 2, 5),     # 10 per process, at most 4 at once: 5 × 2 (4 + 4 + 2 would weigh samples unequally)
    (7, 7, 1, 1, 1),
])
def test_the_plan_splits_the_global_batch_into_equal_micro_batches(global_batch: int, world: int, cap: int,
                                                                   micro: int, accumulation: int) -> None:
    p = plan(global_batch, world, cap)
    assert (p.micro, p.accumulation) == (micro, accumulation)
    assert p.micro * p.accumulation * p.world_size == global_batch and p.micro <= cap


def test_a_global_batch_the_processes_cannot_share_names_the_numbers_and_a_fix() -> None:
    with pytest.raises(UserError) as info:
        plan(63, 2, 32)
    assert info.value.field == "data.global_batch_size"
    assert "63 samples per step do not split equally across 2 processes" in info.value.message
    assert "data.global_batch_size=64" in info.value.hint and "run on" in info.value.hint
    with pytest.raises(UserError) as info:
        check_worlds(96, [4, 5, 6, 7, 8], 32)  # a node range: every world size it may start with
    assert "across 5 processes" in info.value.message and "4-8" in info.value.message
    check_worlds(96, [2, 4, 6, 8], 32)


def _steps(world: int, global_batch: int = 12, cap: int = 4, n: int = 50, epoch: int = 1) -> list[list[int]]:
    """Every optimizer step of an epoch as the sorted global sample ids all ranks of ``world`` take together."""
    p = plan(global_batch, world, cap)
    ranks = []
    for r in range(world):
        s = GlobalBatchSampler(n, p, r, seed=3)
        s.start_epoch(epoch)
        ranks.append(list(s))
    return [sorted(i for r in ranks for micro in r[k * p.accumulation:(k + 1) * p.accumulation] for i in micro)
            for k in range(n // global_batch)]


def test_every_world_size_takes_the_same_samples_at_every_step() -> None:
    one = _steps(1)
    assert len(one) == 4 and all(len(step) == 12 for step in one)
    assert len({i for step in one for i in step}) == 48  # no sample twice; the last partial batch (2) is dropped
    for world in (2, 3, 4, 6, 12):
        assert _steps(world) == one, world
    assert _steps(2, epoch=2) != one  # another epoch, another order


def test_a_position_saved_on_two_processes_continues_exactly_on_three() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(50))
    two = [Loader(data, env_of(r, 2), 4, 3, plan(12, 2, 4)) for r in range(2)]
    for loader in two:
        it = iter(loader)
        for _ in range(2 * loader.accumulation):  # two optimizer steps
            next(it)
    state = two[0].state_dict()
    assert state["samples"] == 24 and state["global_batch_size"] == 12
    three = [Loader(data, env_of(r, 3), 4, 3, plan(12, 3, 4)) for r in range(3)]
    for loader in three:
        assert loader.exact_after(state)
        loader.load_state_dict(state)
    rest = [[int(i) for (b,) in loader for i in b] for loader in three]
    assert sorted(sum(rest, [])) == sorted(sum(_steps(1, n=50, epoch=0)[2:], []))
    assert all(loader.epoch == 1 and loader.position == 0 for loader in three)


def _kept_after_two_steps(data: torch.utils.data.Dataset[Any], world: int) -> dict[str, int]:
    """A job that may change size, on ``world`` processes of 4 samples each (its global batch kept), after two steps:
    the loader state its checkpoint holds."""
    loaders = [train_loader(data, env_of(r, world), 4, None, 3, print, resizable=True) for r in range(world)]
    for loader in loaders:
        it = iter(loader)
        next(it), next(it)
    return loaders[0].state_dict()


def test_a_kept_global_batch_continues_exactly_on_another_size_and_says_no_other_batch() -> None:
    """A node range without a global batch keeps its first attempt's (3 × 4 = 12): resumed on two processes, it
    adopts the checkpoint's 12 (not 2 × 4) and counts as exact, so no note of another global batch is printed."""
    data = torch.utils.data.TensorDataset(torch.arange(50))
    state = _kept_after_two_steps(data, 3)
    assert state["global_batch_size"] == 12
    two = [train_loader(data, env_of(r, 2), 4, None, 3, print, resizable=True) for r in range(2)]
    for loader in two:
        assert loader.exact_after(state)
        loader.load_state_dict(state)
        assert loader.plan is not None and loader.plan.global_batch == 12 and loader.accumulation == 2
    fixed = train_loader(data, env_of(0, 2), 4, None, 3, print)  # a job of fixed size: its own batches, said so
    assert not fixed.exact_after(state)


def test_a_kept_global_batch_that_a_smaller_size_cannot_split_becomes_the_nearest_that_it_can() -> None:
    """Kept at 4 × 4 = 16 and resumed (or regrouped) on 3 processes, which cannot share 16: 15 from there on, said
    once, and not counted as exact; the job goes on instead of failing as bad input at its second loss."""
    data = torch.utils.data.TensorDataset(torch.arange(200))
    state = _kept_after_two_steps(data, 4)
    said: list[str] = []
    three = [train_loader(data, env_of(r, 3), 4, None, 3, said.append, resizable=True) for r in range(3)]
    for loader in three:
        assert not loader.exact_after(state)
        loader.load_state_dict(state)
        assert loader.plan is not None and loader.plan.global_batch == 15
    assert said.count("note: the first attempt's global batch of 16 does not split equally across 3 processes: 15 "
                      "samples per step from here on (data.global_batch_size sets one that every size divides)") == 3
    taken = [int(i) for loader in three for (b,) in [next(iter(loader))] for i in b]
    seen = set(three[0].sampler.order(0)[:32])  # type: ignore[union-attr]  # the 2 steps of 16 trained before
    assert len(taken) == 3 * three[0].batch_size and not set(taken) & seen
    again = three[0].state_dict()  # saved on 3 (15 a step): back on 4, the first attempt's 16 again, not 15 or less
    assert (again["global_batch_size"], again["kept_global_batch"]) == (15, 16)
    back = train_loader(data, env_of(0, 4), 4, None, 3, said.append, resizable=True)
    assert not back.exact_after(again)
    back.load_state_dict(again)
    assert back.plan is not None and back.plan.global_batch == 16 and sum("not split" in m for m in said) == 3
    on_three = train_loader(data, env_of(0, 3), 4, None, 3, said.append, resizable=True)
    assert on_three.exact_after(again)  # the same size again: its very batches
    with pytest.raises(UserError, match="16 samples per step do not split equally across 3"):  # the user's own
        train_loader(data, env_of(0, 3), 4, 16, 3, print)


def _trace(run: Path) -> list[dict[str, object]]:
    """Each step's sample ids (the ledger's other fields say who trained them)."""
    return [{k: e[k] for k in ("step", "ids")} for e in map(json.loads, (run / "trace.jsonl").read_text().splitlines())]


def _ranks(args: list[str], tmp: Path, world: int, code: int, **fault: int) -> str:
    """Run the elastic loop on ``world`` processes (srun-style); every rank exits ``code``."""
    procs = spawn_ranks(args, tmp, world, faults(**fault) if fault else None, script=LOOP)
    outs = outputs(procs, timeout=180)
    assert [p.returncode for p in procs] == [code] * world, "\n".join(outs)
    return outs[0]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_run_resumed_on_1_then_2_processes_trains_the_uninterrupted_runs_samples(tmp_path: Path,
                                                                                  strategy: str) -> None:
    common = [f"dist.strategy={strategy}", "checkpoint.poll_steps=1", "tracking.mode=disabled", "run.report=false",
              "train.device=cpu"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    _ranks([*common, f"run.dir={ref}"], tmp_path, 2, 0)
    first = _ranks([*common, f"run.dir={run}"], tmp_path, 2, 75, preempt_at_step=6)
    assert "global batch 24 = 2 process(es) × 6 samples × 2 accumulation step(s)" in first
    second = _ranks([*common, f"run.dir={run}"], tmp_path, 1, 75, preempt_at_step=9)
    assert "global batch 24 = 1 process(es) × 6 samples × 4 accumulation step(s)" in second
    assert "written by 2 processes, now 1: the same global batches continue" in second
    assert "the random streams of rank 1 end" in second
    third = _ranks([*common, f"run.dir={run}"], tmp_path, 2, 0)
    assert "written by 1 process, now 2: the same global batches continue" in third
    assert "rank 1 start random streams from the seed" in third
    steps = [t["step"] for t in _trace(run)]
    assert steps == list(range(1, 31)), steps  # 7 steps on 2, 10 on 1, 13 on 2: none twice, none lost
    assert _trace(run) == _trace(ref)
    a, b = torch.load(ref / "final.pt", weights_only=True), torch.load(run / "final.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)


BUILTIN = [*SMALL, "data.global_batch_size=64", "checkpoint.poll_steps=1", "train.epochs=2"]


def test_the_built_in_trainer_resumed_on_another_world_size_ends_as_the_uninterrupted_run(tmp_path: Path) -> None:
    ref, run = tmp_path / "ref", tmp_path / "run"
    ok(run_trainer([*BUILTIN, f"run.dir={ref}"], tmp_path, nproc=2))
    proc = run_trainer([*BUILTIN, f"run.dir={run}"], tmp_path, nproc=2, env=faults(preempt_at_step=9))
    assert proc.returncode != 0 and (run / "checkpoints" / "step_00000010.pt").exists(), proc.stdout + proc.stderr
    resumed = ok(run_trainer([*BUILTIN, f"run.dir={run}"], tmp_path, nproc=1))
    assert "global batch 64 = 1 process(es) × 32 samples × 2 accumulation step(s)" in resumed.stdout
    assert result_of(run)["global_step"] == result_of(ref)["global_step"] == 32  # 1024 // 64 × 2 epochs
    a, b = (torch.load(result_of(r)["checkpoint"], weights_only=True)["model"] for r in (ref, run))
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)
    assert abs(result_of(run)["test_loss"] - result_of(ref)["test_loss"]) < 1e-4
    # Finished: resumed on yet another world size, it trains no step and says so.
    again = ok(run_trainer([*BUILTIN, f"run.dir={run}"], tmp_path, nproc=2))
    assert "finished its 2 epoch(s) at step 32: no step to train" in again.stdout
    assert result_of(run)["global_step"] == 32


def test_without_a_global_batch_a_resume_on_more_processes_still_trains_every_epoch(tmp_path: Path) -> None:
    """1,024 samples, 32 per process: 32 steps an epoch on 1 process, 16 on 2. Saved at step 10 on 1 (320 samples
    of epoch 0 read), resumed on 2: 11 steps finish epoch 0 and 16 make epoch 1, 37 in all; not the 32 that 2
    processes would take from the start (which stopped 5 steps into epoch 1 and said finished)."""
    run = tmp_path / "run"
    args = [*SMALL, "checkpoint.poll_steps=1", "train.epochs=2", f"run.dir={run}"]
    proc = run_trainer(args, tmp_path, nproc=1, env=faults(preempt_at_step=9))
    assert proc.returncode != 0 and (run / "checkpoints" / "step_00000010.pt").exists(), proc.stdout + proc.stderr
    ok(run_trainer(args, tmp_path, nproc=2))
    assert result_of(run)["global_step"] == 37, result_of(run)
    final = torch.load(result_of(run)["checkpoint"], weights_only=True)["loader"]
    assert (final["epoch"], final["position"]) == (2, 0), final


def test_a_global_batch_the_world_size_cannot_split_exits_2_before_training(tmp_path: Path) -> None:
    out = _ranks(["train.device=cpu", f"run.dir={tmp_path / 'run'}", "tracking.mode=disabled"], tmp_path, 2, 0)
    assert "global batch 24" in out  # the script's own global batch splits; now one that does not:
    procs = spawn_ranks([*SMALL, "data.global_batch_size=63", f"run.dir={tmp_path / 'odd'}"], tmp_path, 2)
    outs = outputs(procs, timeout=120)
    assert [p.returncode for p in procs] == [2, 2], outs
    assert "error: data.global_batch_size: 63 samples per step do not split equally across 2 processes" in outs[0]
    assert "HINT: use a multiple of 2 (e.g. data.global_batch_size=64)" in outs[0]
    assert "Traceback" not in outs[0] and not (tmp_path / "odd" / "checkpoints").exists()


def test_a_finished_per_process_batch_run_resumed_on_one_process_trains_no_step(tmp_path: Path) -> None:
    """Without a global batch the step count depends on the world size; a finished run still trains nothing more."""
    run = tmp_path / "run"
    ok(run_trainer([*SMALL, f"run.dir={run}"], tmp_path, nproc=2))
    steps = result_of(run)["global_step"]
    again = ok(run_trainer([*SMALL, f"run.dir={run}"], tmp_path, nproc=1))
    assert "no step to train" in again.stdout and "another global batch" in again.stdout
    assert result_of(run)["global_step"] == steps == 16


@pytest.mark.parametrize(("saved", "now", "expected"), [
    # (global batch or 0, world, position) saved → (global batch, world) now → (epoch, position); 50 samples, cap 4
    ((12, 2, 4), (12, 3), (0, 2)),    # the same global batch: 24 samples seen = 2 steps, 1 micro-batch each on 3
    ((12, 2, 2), (24, 2), (0, 3)),    # 12 seen: the next whole step of 24 (3 micro-batches of 4) is the second
    ((12, 2, 4), (24, 3), (0, 2)),    # 24 seen: 1 step of 24 (2 micro-batches of 4 on 3 processes)
    ((0, 2, 6), (12, 1), (1, 0)),     # 48 seen with 4 per process: no whole step of 12 is left in the epoch
    ((12, 1, 10), (48, 1), (1, 0)),   # 40 seen, inside a step: the one step of 48 would overrun the epoch
])
def test_another_global_batch_resumes_at_the_next_whole_step_or_epoch(saved: tuple[int, int, int],
                                                                      now: tuple[int, int],
                                                                      expected: tuple[int, int]) -> None:
    data = torch.utils.data.TensorDataset(torch.arange(50))
    was_g, was_world, position = saved
    was = Loader(data, env_of(0, was_world), 4, 3, plan(was_g, was_world, 4) if was_g else None)
    state = {**was.state_dict(), "position": position, "samples": position * was.batch_size * was_world}
    g, world = now
    loader = Loader(data, env_of(0, world), 4, 3, plan(g, world, 4))
    loader.load_state_dict(state)
    assert (loader.epoch, loader.position) == expected
    assert len(next(iter(loader))[0]) == loader.batch_size  # a batch, never an empty epoch


def test_bad_loader_arguments_are_refused_with_the_reason() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(50))
    with pytest.raises(UserError, match="more than the 50 samples"):
        Loader(data, env_of(0, 1), 4, 3, plan(64, 1, 4))
    with pytest.raises(UserError, match=r"Session.loader\(drop_last=…\): cannot be set: a global batch"):
        Loader(data, env_of(0, 1), 4, 3, plan(12, 1, 4), drop_last=True)

    with pytest.raises(UserError, match=r"Session.loader\(sampler=…\): would replace the sampler"):
        Loader(data, env_of(0, 1), 4, 3, sampler=range(50))
    # shuffle=False keeps the set's order (it was shuffled anyway), and resumes by position all the same
    for planned in (None, plan(8, 1, 4)):  # with a global batch too (a job that may change size keeps one)
        kept = Loader(data, env_of(0, 1), 4, 3, planned, shuffle=False)
        assert [b[0].tolist() for b, _ in zip(kept.forever(), range(2), strict=False)] == [[0, 1, 2, 3], [4, 5, 6, 7]]

    class Stream(torch.utils.data.IterableDataset[int]):
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(range(10))

    with pytest.raises(UserError, match="needs a map-style data set"):
        Loader(Stream(), env_of(0, 1), 4, 3, plan(12, 1, 4))


def test_the_plan_says_when_a_global_batch_splits_into_small_micro_batches() -> None:
    p = plan(194, 2, 32)
    assert (p.micro, p.accumulation) == (1, 97)
    assert "a global batch of 192 would run micro-batches of 32" in p.advice(32) and not plan(64, 1, 32).advice(32)


def test_the_out_of_memory_hint_halves_the_micro_batch_the_global_batch_derived() -> None:
    from trainer.builtin.oom import out_of_memory
    from trainer.core.config import load

    cfg = load(["data.global_batch_size=64", "data.batch_size=32"])
    err = out_of_memory(RuntimeError("CUDA out of memory"), cfg, env_of(0, 4), torch.device("cpu"), 3, batch=16)
    assert "batch 16 per process" in err.message and "data.batch_size=8" in err.hint and "grad_accum" not in err.hint


def test_the_report_shows_each_attempts_world_size(tmp_path: Path) -> None:
    from trainer.report import table
    from trainer.runtime.records.attempts import attempts, figures

    lines = [{"t": 1.0, "event": "attempt", "started": 1.0, "nodes": 2, "processes": 2, "resumed_step": 0},
             {"t": 2.0, "event": "exit", "code": 75, "step": 5},
             {"t": 3.0, "event": "attempt", "started": 3.0, "nodes": 1, "processes": 1, "resumed_step": 5},
             {"t": 4.0, "event": "exit", "code": 0, "step": 9}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    text = table(figures(attempts(tmp_path)))
    assert "processes per attempt: 2 → 1" in text and text.splitlines()[0].split()[3:5] == ["nodes", "processes"]
