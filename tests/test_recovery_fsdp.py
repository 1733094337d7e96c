"""A sharded model (``dist.strategy=fsdp``) goes on in place too: the lost rank's shard exists only in a snapshot in
node memory, so the survivors take FSDP2 off the model (trainer/runtime/fsdp_group.py), form the next group, shard the
same modules on it and load the newest snapshot, in their own processes. The result equals a restart from a
checkpoint at that step, bit for bit."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from trainer.core.exits import SPARE_BASE

from .conftest import outputs, spawn_ranks
from .test_recovery import COMMON, LOOP, _events, _kill_when, _ranks, _spare, _spares_waiting, _stepped, _store, _trace

SHARDED = [*COMMON, "dist.strategy=fsdp", "checkpoint.memory=on", "checkpoint.memory_every_steps=3"]


def _final(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "final.pt", weights_only=True)


def _same_as_restart(run: Path, ref: Path, tmp: Path, k: int, world: int) -> None:
    """``run`` equals a run saved at step ``k`` on three processes and resumed from that checkpoint on ``world``:
    every step's samples, and the final weights bit for bit."""
    _ranks(["dist.strategy=fsdp", f"run.dir={ref}", "--stop", str(k)], tmp, 3)
    _ranks(["dist.strategy=fsdp", f"run.dir={ref}"], tmp, world)
    steps = _trace(run)
    assert sorted(steps) == list(range(1, 31)) and steps == _trace(ref)  # each step's samples, the redone ones too
    a, b = _final(ref), _final(run)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize(("lost", "source", "said"), [
    (0, "memory", "a snapshot in node memory"),  # rank 0, the event log's writer
    (2, "disk", "the checkpoint"),  # no snapshots: the newest durable checkpoint, read in the same processes
])
def test_a_sharded_models_survivors_go_on_from_the_newest_snapshot(tmp_path: Path, lost: int, source: str,
                                                                   said: str) -> None:
    """Rank 0 or the last rank SIGKILLed after step 8: the two others load the snapshot (or checkpoint) of step 6
    (every 3 steps) onto two processes, run the steps since it again, and end as a restart from a checkpoint at that
    step would."""
    run, ref = tmp_path / "run", tmp_path / "ref"
    args = SHARDED if source == "memory" else [*COMMON, "dist.strategy=fsdp", "checkpoint.memory=off",
                                               "checkpoint.every_steps=3"]
    with _store(tmp_path) as env:
        env["TRAINER_MEMORY_DIR"] = str(tmp_path / "shm")
        procs = spawn_ranks([*args, f"run.dir={run}", "--pace", "0.05"], tmp_path, 3, env, script=LOOP)
        outs = _kill_when(procs, lost, _stepped(run, 8))
    [regroup] = _events(run, "regroup")
    k = regroup["step"]
    assert (regroup["lost"], regroup["world_size"], regroup["restored_from"]) == ([lost], 2, source), regroup
    assert k % 3 == 0 and k >= 6 and regroup["again"] >= 2, regroup  # a snapshot's step, then the steps since it
    assert f"go on from step {k}" in outs[0] and f"the lost shard came from {said}" in outs[0], outs[0]
    assert not any("is still held" in o for o in outs), outs  # FSDP's meshes let the failed group go
    assert json.loads((run / "result.json").read_text())["global_step"] == 30
    _same_as_restart(run, ref, tmp_path, k, 2)


def test_with_nothing_to_go_back_to_a_sharded_models_attempt_ends(tmp_path: Path) -> None:
    """Lost before the first snapshot and with no checkpoint: the lost shard exists nowhere, so the survivors end the
    attempt (RegroupFailed, naming why) and the restart path takes over."""
    run = tmp_path / "run"
    with _store(tmp_path) as env:
        env["TRAINER_MEMORY_DIR"] = str(tmp_path / "shm")
        procs = spawn_ranks([*SHARDED[:-1], "checkpoint.memory_every_steps=100", f"run.dir={run}", "--pace", "0.05"],
                            tmp_path, 3, env, script=LOOP)
        try:
            deadline, ready = time.monotonic() + 180, _stepped(run, 3)
            while not ready() and time.monotonic() < deadline:
                time.sleep(0.02)
            os.killpg(procs[1].pid, signal.SIGKILL)
            outs = outputs([procs[0], procs[2]], timeout=180)
        finally:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
    assert all(p.returncode not in (0, None) for p in (procs[0], procs[2])), "\n".join(outs)
    assert all("rank 1 lost and the others could not go on in place (RuntimeError: no snapshot in node memory and "
               "no checkpoint holds the lost rank's shard yet): the attempt ends" in o for o in outs), outs
    assert not _events(run, "regroup")


def test_a_warm_spare_takes_a_sharded_ranks_place(tmp_path: Path) -> None:
    """Three ranks and a warm spare; rank 1 SIGKILLed: the spare shards the model on the new group of three, and all
    three load the newest snapshot (the spare's shard of it too, from the node that holds it)."""
    run, ref = tmp_path / "run", tmp_path / "ref"
    with _store(tmp_path) as env:
        env["TRAINER_MEMORY_DIR"] = str(tmp_path / "shm")
        procs = spawn_ranks([*SHARDED, f"run.dir={run}", "--pace", "0.05"], tmp_path, 3, env, script=LOOP)
        # On one machine the spare stands in the lost rank's slot of the node (a spare node would have its own):
        # two processes with local rank 0 would both write the node's snapshot folder.
        spare = _spare([*SHARDED, f"run.dir={run}", "--pace", "0.05"], tmp_path, env, local_rank=1)
        stepped, spares = _stepped(run, 8), _spares_waiting(env)
        outs = _kill_when([*procs, spare], 1, lambda: stepped() and spares() == 1)
    [regroup] = _events(run, "regroup")
    assert (regroup["lost"], regroup["members"], regroup["world_size"]) == ([1], [0, 2, SPARE_BASE], 3), regroup
    assert "a warm spare took the place: 3 processes go on" in outs[0]
    _same_as_restart(run, ref, tmp_path, regroup["step"], 3)


def test_the_fsdp_adapter_takes_fully_shard_off_and_lets_the_group_go(tmp_path: Path) -> None:
    """trainer/runtime/fsdp_group.py uses FSDP2's state (hooks, param groups, meshes, the composable registry):
    pinned here on a one-process gloo group. After ``release`` nothing holds the old group, the module is its own
    class again with full-size parameters, and after ``remake`` on a new group it trains with its optimizer."""
    import gc
    import weakref

    from torch.distributed.fsdp import FSDPModule

    from trainer.runtime import fsdp_group
    from trainer.runtime.fsdp import shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    model = shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), "fp32", False)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    state = model._get_fsdp_state()  # what release reads, named: a torch upgrade that moves one fails here first
    group = state._fsdp_param_groups[0]
    param = group.fsdp_params[0]
    assert all(hasattr(state, n) for n in ("_pre_forward_hook_handle", "_post_forward_hook_handle", "_mp_policy"))
    assert all(hasattr(group, n) for n in ("mesh_info", "post_forward_mesh_info",
                                           "_module_to_pre_save_state_dict_hook_handle",
                                           "_module_to_pre_load_state_dict_hook_handle"))
    assert all(hasattr(param, n) for n in ("sharded_param", "_orig_size", "_module_info", "_post_load_hook_handle"))
    assert all(hasattr(group.mesh_info.mesh, n) for n in ("_pg_registry", "_root_mesh"))
    del state, group, param
    old = weakref.ref(dist.group.WORLD)
    released = fsdp_group.release(model, [opt], torch.device("cpu"))
    assert not isinstance(model, FSDPModule) and type(model) is torch.nn.Sequential
    assert [p.shape for p in model.parameters()] == [(4, 4), (4,), (4, 4), (4,)] and not opt.state
    assert {p.device.type for p in model.parameters()} == {"meta"}  # no whole copy of the model is made
    dist.destroy_process_group()
    gc.collect()
    assert old() is None
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        fsdp_group.remake(released)
        assert isinstance(model, FSDPModule) and opt.param_groups[0]["params"] == list(model.parameters())
        assert {p.device.type for p in model.parameters()} == {"cpu"}
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        assert len(opt.state) == 4
    finally:
        dist.destroy_process_group()


def test_a_sharded_group_that_went_on_smaller_grows_back(tmp_path: Path) -> None:
    """Rank 2 SIGKILLed after step 8: two go on from the newest snapshot. A warm spare started after that is taken in
    at the next poll: the group snapshots that very step, and the three load it on the new group (no step again). The
    run ends as one saved at each change of size and resumed on the new one would, bit for bit."""
    run, ref = tmp_path / "run", tmp_path / "ref"
    with _store(tmp_path) as env:
        env["TRAINER_MEMORY_DIR"] = str(tmp_path / "shm")
        procs = spawn_ranks([*SHARDED, f"run.dir={run}", "--pace", "0.3"], tmp_path, 3, env, script=LOOP)
        try:
            deadline, ready = time.monotonic() + 180, _stepped(run, 8)
            while not ready() and time.monotonic() < deadline:
                time.sleep(0.02)
            os.killpg(procs[2].pid, signal.SIGKILL)
            while not ((run / "events.jsonl").exists() and _events(run, "regroup")) and time.monotonic() < deadline:
                time.sleep(0.02)
            procs[2] = _spare([*SHARDED, f"run.dir={run}"], tmp_path, env, local_rank=2)  # the lost one's slot
            outs = outputs(procs, timeout=180)
        finally:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(outs)
    shrink, grow = _events(run, "regroup")
    k, j = shrink["step"], grow["step"]
    assert (grow["lost"], grow["was"], grow["world_size"], grow["again"]) == ([], 2, 3, 0), grow
    assert f"grew back: warm spares joined, 2 → 3 processes go on from step {j}" in outs[0]
    assert "(the sharded state of this step from a snapshot in node memory)" in outs[0], outs[0]
    _ranks(["dist.strategy=fsdp", f"run.dir={ref}", "--stop", str(k)], tmp_path, 3)
    _ranks(["dist.strategy=fsdp", f"run.dir={ref}", "--stop", str(j)], tmp_path, 2)
    _ranks(["dist.strategy=fsdp", f"run.dir={ref}"], tmp_path, 3)
    steps = _trace(run)
    assert sorted(steps) == list(range(1, 31)) and steps == _trace(ref)
    assert {w for s, (w, _) in steps.items() if s > j} == {3}
    a, b = _final(ref), _final(run)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
