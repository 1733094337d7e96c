"""A session whose rank is lost goes on in place (``Session.regroup``): the survivors keep their processes, form a new
group on the job's store (python -m trainer.store), agree on the newest step they hold and train on with the same
global batches. The strongest check: the result equals a restart from a checkpoint at that step, bit for bit."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import warm
from trainer.core.env import StoreAddress
from trainer.core.errors import UserError
from trainer.core.exits import SPARE_BASE
from trainer.core.regroup import lost_members
from trainer.data.batches import plan
from trainer.data.loader import Loader
from trainer.store import start as start_store

from .conftest import ROOT, SMALL, clean_env, outputs, spawn_ranks
from .test_elastic import env_of
from .test_tracking import run_files
from .wandb_records import summary

LOOP = ROOT / "tests" / "scripts" / "elastic_loop.py"
COMMON = ["tracking.mode=disabled", "run.report=false", "train.device=cpu", "checkpoint.poll_steps=1"]


def _events(run: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines()) if e["event"] == kind]


def _trace(run: Path) -> dict[int, tuple[int, list[int]]]:
    """Each step's (world size, sample ids), the last line of a step winning."""
    return {e["step"]: (e["world"], e["ids"]) for e in map(json.loads, (run / "trace.jsonl").read_text().splitlines())}


def _ranks(args: list[str], tmp: Path, world: int, env: dict[str, str] | None = None) -> None:
    procs = spawn_ranks([*COMMON, *args], tmp, world, env, script=LOOP)
    outs = outputs(procs, timeout=180)
    assert [p.returncode for p in procs] == [0] * world, "\n".join(outs)


@contextlib.contextmanager
def _store(tmp: Path) -> Iterator[dict[str, str]]:
    """The job's store process for one test; the environment that points the ranks at it."""
    store, (port, presence) = start_store(tmp / "ports", env=clean_env(), cwd=ROOT)
    try:
        yield {"TRAINER_STORE": f"127.0.0.1:{port}:{presence}"}
    finally:
        store.terminate()
        store.communicate(timeout=60)


def _kill_when(procs: list[Any], lost: int, ready: Callable[[], bool],
               sig: signal.Signals = signal.SIGKILL) -> list[str]:
    """SIGKILL (``sig``) rank ``lost`` (its process group) from outside once ``ready()``; the others' outputs, each
    exit 0."""
    try:
        deadline = time.monotonic() + 180
        while not ready():
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, \
                outputs([p for p in procs if p.poll() is not None], timeout=5)
            time.sleep(0.02)
        os.killpg(procs[lost].pid, sig)
        rest = [p for r, p in enumerate(procs) if r != lost]
        outs = outputs(rest, timeout=180)
        assert [p.returncode for p in rest] == [0] * len(rest), "\n".join(outs)
        return outs
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)


def _spare(args: list[str], tmp: Path, env: dict[str, str], local_rank: int = 0) -> Any:
    """A warm spare of the elastic loop beside the job (TRAINER_SPARE=0: it imports everything and waits at the store
    ``env`` names); ``local_rank``: its slot on the machine."""
    spare_env = {"RANK": "0", "LOCAL_RANK": str(local_rank), "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "TRAINER_SPARE": "0", **env}
    return warm.Popen([sys.executable, str(LOOP), *args], cwd=tmp, env=clean_env(spare_env), stdout=subprocess.PIPE,
                      stderr=subprocess.STDOUT, text=True)


def _spares_waiting(env: dict[str, str]) -> Callable[[], int]:
    """How many spares wait at the store ``env`` names."""
    host, port, _ = env["TRAINER_STORE"].split(":")
    client = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))  # type: ignore[attr-defined]
    return lambda: int(client.add("spares/count", 0))


def _stepped(run: Path, steps: int = 1) -> Callable[[], bool]:
    """Whether the run's trace (the elastic loop's) holds ``steps`` steps; with 0, whether its first step ended."""
    if not steps:
        return lambda: (run / "events.jsonl").exists() and bool(_events(run, "first_step"))
    return lambda: (run / "trace.jsonl").exists() and len((run / "trace.jsonl").read_text().splitlines()) >= steps


@pytest.mark.parametrize("lost", [0, 2])
def test_survivors_go_on_in_place_and_end_as_a_restart_from_that_step_would(tmp_path: Path, lost: int) -> None:
    """Rank 0 (its event log and result move to the new rank 0) or the last rank: the two others finish the run in
    their own processes, and their weights equal those of a run saved at the agreed step and resumed on two."""
    run, ref = tmp_path / "run", tmp_path / "ref"
    with _store(tmp_path) as env:
        procs = spawn_ranks([*COMMON, f"run.dir={run}", "--pace", "0.05"], tmp_path, 3, env, script=LOOP)
        outs = _kill_when(procs, lost, _stepped(run, 8))
    [regroup] = _events(run, "regroup")
    k = regroup["step"]
    assert (regroup["lost"], regroup["members"], regroup["world_size"], regroup["exact"]) == \
           ([lost], [r for r in range(3) if r != lost], 2, True)
    assert f"regrouped: rank {lost} lost; 2 of 3 processes go on from step {k}" in outs[0]
    # the next attempt inside the allocation (every tool that reads attempts sees it), broken down by phase
    first, again = _events(run, "attempt")
    assert (first["attempt"], again["attempt"], again["within"], again["regroup"], again["processes"],
            again["resumed_step"]) == ("0", "0.1", "0", True, 2, k), again
    assert [e["step"] for e in _events(run, "first_step")] == [1, k + 1]
    assert all(regroup[f"{p}_s"] >= 0 for p in ("detection", "abort", "rendezvous", "transfer")), regroup
    assert not any("is still held" in o for o in outs), outs  # each survivor let the failed group go
    assert json.loads((run / "result.json").read_text())["global_step"] == 30
    _ranks([f"run.dir={ref}", "--stop", str(k)], tmp_path, 3)  # the restart path: saved at k on three …
    _ranks([f"run.dir={ref}"], tmp_path, 2)  # … and resumed from that checkpoint on two
    steps = _trace(run)
    assert sorted(steps) == list(range(1, 31)) and steps == _trace(ref)  # every step's samples, once each
    assert {w for s, (w, _) in steps.items() if s > k} == {2}
    a, b = torch.load(ref / "final.pt", weights_only=True), torch.load(run / "final.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_a_recovery_past_max_failures_ends_the_attempt(tmp_path: Path) -> None:
    """TRAINER_MAX_FAILURES=0 (the profile's max_failures, exported by the batch script): a recovery in place counts
    as a failure, so none is left; the survivors end the attempt (RegroupFailed, naming the limit), nothing regroups."""
    run = tmp_path / "run"
    with _store(tmp_path) as env:
        env["TRAINER_MAX_FAILURES"] = "0"
        procs = spawn_ranks([*COMMON, f"run.dir={run}", "--pace", "0.05"], tmp_path, 3, env, script=LOOP)
        try:
            deadline, ready = time.monotonic() + 180, _stepped(run, 3)
            while not ready() and time.monotonic() < deadline:
                time.sleep(0.02)
            os.killpg(procs[2].pid, signal.SIGKILL)
            outs = outputs(procs[:2], timeout=180)
        finally:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
    assert all(p.returncode not in (0, None) for p in procs[:2]), "\n".join(outs)
    assert all("max_failures=0" in o for o in outs), outs
    assert not _events(run, "regroup") and len(_events(run, "attempt")) == 1


def test_a_stopped_rank_is_killed_by_the_store_and_the_others_go_on_in_place(tmp_path: Path) -> None:
    """Rank 2 of 3 SIGSTOPped from outside (a hang its own watchdog cannot report): after dist.heartbeat_timeout_s the
    others' watchdogs find it stuck and ask the store to kill it (it runs on the store's host), their collective
    fails, and the two go on in place. The hang report stays; the run ends as one saved there and resumed on two."""
    run = tmp_path / "run"
    with _store(tmp_path) as env:
        procs = spawn_ranks([*COMMON, f"run.dir={run}", "--pace", "0.05", "dist.heartbeat_timeout_s=3"], tmp_path, 3,
                            env, script=LOOP)
        outs = _kill_when(procs, 2, _stepped(run, 8), signal.SIGSTOP)
    [regroup] = _events(run, "regroup")  # the survivors finished: only the store can have killed rank 2 meanwhile
    assert (regroup["lost"], regroup["world_size"]) == ([2], 2), regroup
    assert "rank   2 STUCK  wrote nothing: not running (its pulse in the store stood still)" in \
        (run / "hang" / "report.txt").read_text()
    assert f"regrouped: rank 2 lost; 2 of 3 processes go on from step {regroup['step']}" in outs[0]
    steps = _trace(run)
    assert sorted(steps) == list(range(1, 31)) and json.loads((run / "result.json").read_text())["global_step"] == 30


def test_an_error_of_one_rank_is_no_lost_peer_and_ends_the_attempt_on_every_rank(tmp_path: Path) -> None:
    """Rank 1 fails on its own (out of memory at step 5): it ends on purpose, so the others' failed collectives
    are not recovered in place (a bug would only fail again), and every rank exits non-zero; nothing regroups."""
    run = tmp_path / "run"
    with _store(tmp_path) as env:
        env["TRAINER_FAULTS"] = "oom_at_step=4 oom_rank=1"
        procs = spawn_ranks([*COMMON, f"run.dir={run}"], tmp_path, 3, env, script=LOOP)
        outs = outputs(procs, timeout=180)
    assert all(p.returncode not in (0, None) for p in procs), "\n".join(outs)
    assert "simulated out of memory" in outs[1]
    assert not _events(run, "regroup") and "regrouped" not in "".join(outs)


def test_the_ddp_adapter_lets_the_failed_group_go_and_remakes_ddp_on_the_new_one(tmp_path: Path) -> None:
    """trainer/runtime/ddp_group.py runs DDP's constructor again on a live wrapper and makes a process group by hand
    (``ProcessGroup`` + ``_register_backend`` + ``_set_default_backend``): pinned here. Shown on a real DDP (a
    one-process gloo group): after ``detach`` and the group's destruction nothing holds the old group (its sockets
    would close), and after ``remake`` on a new group DDP trains on with a fresh reducer."""
    import gc
    import inspect
    import weakref

    import torch._dynamo  # noqa: F401 - before any group, as tdist.setup does for a job that regroups

    from trainer.runtime import ddp_group

    assert "init_sync" in inspect.signature(DDP.__init__).parameters
    assert all(hasattr(dist.ProcessGroup, n) for n in ("_register_backend", "_set_default_backend"))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    model = ddp_group.wrap(torch.nn.Linear(4, 1), torch.device("cpu"))
    model(torch.ones(2, 4)).sum().backward()
    old, reducer = weakref.ref(dist.group.WORLD), weakref.ref(model.reducer)
    ddp_group.detach(model)
    dist.destroy_process_group()
    gc.collect()
    assert old() is None and reducer() is None  # the failed group, and the reducer that held its work, are gone
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        ddp_group.remake(model)
        assert model.process_group is dist.group.WORLD
        model.module.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        assert model.module.weight.grad is not None and torch.equal(model.module.weight.grad, torch.full((1, 4), 2.0))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("text", "parsed"), [
    ("", None),
    ("n1:15001:15002", StoreAddress("n1", 15001, 15002)),
    ("[fe80::1]:15001:15002", StoreAddress("fe80::1", 15001, 15002)),
    ("n1:15001", "must be HOST:PORT:PRESENCE_PORT"),
    ("n1:0:15002", "must be HOST:PORT:PRESENCE_PORT"),
    ("a'; echo x:1:2x", "must be HOST:PORT:PRESENCE_PORT"),
])
def test_the_store_address_is_parsed_once_or_refused_with_the_fix(text: str, parsed: object) -> None:
    if isinstance(parsed, str):
        with pytest.raises(UserError, match=parsed) as err:
            StoreAddress.parse(text)
        assert err.value.field == "TRAINER_STORE" and "python -m trainer.store" in err.value.hint
    else:
        assert StoreAddress.parse(text) == parsed


def test_a_lost_member_is_named_and_one_that_ended_on_purpose_is_none() -> None:
    """The store marks ``lost/<rank>`` (the connection dropped) or ``ended/<rank>`` (closed with done); with neither
    the wait ends at its deadline (an injected clock) with nobody lost: the error was no lost peer's."""
    store = dist.HashStore()  # type: ignore[attr-defined]
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    assert lost_members(store, [0, 1, 2], 2.0, sleep, lambda: now[0]) == [] and now[0] > 2.0
    store.set("ended/1", "1")
    now[0] = 0.0
    assert lost_members(store, [0, 1, 2], 2.0, sleep, lambda: now[0]) == [] and now[0] == 0.0
    store.set("lost/2", "1")
    assert lost_members(store, [0, 2], 2.0, sleep, lambda: now[0]) == [2]


def test_a_reshaped_loader_goes_on_as_one_resumed_on_the_new_size_and_forever_follows() -> None:
    """Three ranks' loaders after two steps; the survivors reshape onto two from the mark of step 3's start: their
    batches are a fresh two-rank loader's resumed from that mark, and a running ``forever()`` switches to them."""
    data = torch.utils.data.TensorDataset(torch.arange(60))
    three = [Loader(data, env_of(r, 3), 4, 3, plan(12, 3, 4)) for r in range(3)]
    streams = [loader.forever() for loader in three]
    for stream in streams:
        for _ in range(2):  # two steps of one micro-batch each
            next(stream)
    mark = three[0].state_dict()
    next(streams[0])  # step 3's batch was read before the loss
    fresh = [Loader(data, env_of(r, 2), 4, 3, plan(12, 2, 4)) for r in range(2)]
    for r in range(2):
        three[r].reshape(env_of(r, 2), mark)
        fresh[r].load_state_dict(mark)
        assert three[r].accumulation == 2 and three[r].world_size == 2
        want = [int(i) for (b,) in list(fresh[r])[:4] for i in b]
        assert [int(i) for _ in range(4) for i in next(streams[r])[0]] == want


def test_the_builtin_trainer_goes_on_in_place_when_a_rank_is_killed(tmp_path: Path) -> None:
    """``python -m trainer`` on three processes with the job's store; rank 1 SIGKILLed from outside mid-epoch: the
    other two finish the epoch in their own processes, with the same global batch, and evaluate."""
    run = tmp_path / "run"
    with _store(tmp_path) as env:
        env["TRAINER_FAULTS"] = "step_delay_s=0.1"
        procs = spawn_ranks([*SMALL, *COMMON, f"run.dir={run}", "data.batch_size=16", "audit.replicas_every_steps=1",
                             "tracking.mode=offline", "train.log_every=1"],
                            tmp_path, 3, env)  # the replicas compared at every step: equal after the regroup
        outs = _kill_when(procs, 1, _stepped(run, 0))
    [regroup] = _events(run, "regroup")
    assert regroup["lost"] == [1] and regroup["world_size"] == 2 and 0 < regroup["step"] < 21
    [file] = run_files(run)  # W&B: the next attempt's first row gives its size; the summary counts the recovery
    rec = summary(file)
    sizes = {s: h["world/processes"] for s, h in rec["history"].items() if "world/processes" in h}
    assert sizes == {min(rec["history"]): 3, regroup["step"] + 1: 2}, sizes
    assert rec["summary"]["recoveries"] == 1 and rec["summary"]["recovery/rendezvous_s"] >= 0, rec["summary"]
    result = json.loads((run / "result.json").read_text())
    assert result["global_step"] == 21 and result["world_size"] == 2 and "test_accuracy" in result  # 1024 // 48
    assert "global batch 48 = 3 process(es) × 16 samples × 1 accumulation step(s): the first attempt's, kept" in outs[0]
    assert f"regrouped: rank 1 lost; 2 of 3 processes go on from step {regroup['step']}" in outs[0]


def test_the_char_lm_example_goes_on_in_place(tmp_path: Path) -> None:
    """examples/char_lm (its loop in the documented pattern) on three processes with the job's store; rank 1
    SIGKILLed from outside after its first step: the other two finish and sample, in their own processes."""
    run = tmp_path / "run"
    args = ["--max-steps", "30", "--max-bytes", "40000", "--batch-size", "8", "--sample", "1", "--eval-every", "1000",
            *COMMON, f"run.dir={run}"]
    with _store(tmp_path) as env:
        env["TRAINER_FAULTS"] = "step_delay_s=0.1"
        procs = spawn_ranks(args, tmp_path, 3, env, script=ROOT / "examples" / "char_lm" / "train.py")
        outs = _kill_when(procs, 1, _stepped(run, 0))
    assert "regrouped: rank 1 lost; 2 of 3 processes go on" in outs[0] and "sample:" in outs[0], outs[0]
    assert json.loads((run / "result.json").read_text())["global_step"] == 30


def test_a_warm_spare_takes_the_lost_ranks_place_and_the_run_ends_as_a_restart_would(tmp_path: Path) -> None:
    """Three ranks and a warm spare process (TRAINER_SPARE=0: it imported everything and waits at the store); rank 1
    SIGKILLed from outside after step 8: the spare takes its place, gets the step, the state and the loader position
    from the others, and the group stays three. The weights equal those of a restart from a checkpoint at that step
    on three processes, bit for bit."""
    run, ref = tmp_path / "run", tmp_path / "ref"
    with _store(tmp_path) as env:
        procs = spawn_ranks([*COMMON, f"run.dir={run}", "--pace", "0.05"], tmp_path, 3, env, script=LOOP)
        spare = _spare([*COMMON, f"run.dir={run}", "--pace", "0.05"], tmp_path, env)
        stepped, spares = _stepped(run, 8), _spares_waiting(env)
        outs = _kill_when([*procs, spare], 1, lambda: stepped() and spares() == 1)
    [regroup] = _events(run, "regroup")
    k = regroup["step"]
    assert (regroup["lost"], regroup["members"], regroup["world_size"], regroup["exact"]) == \
           ([1], [0, 2, SPARE_BASE], 3, False)  # the spare goes by a number no rank has
    assert f"regrouped: rank 1 lost; a warm spare took the place: 3 processes go on from step {k}" in outs[0]
    _ranks([f"run.dir={ref}", "--stop", str(k)], tmp_path, 3)  # the restart path: saved at k on three …
    _ranks([f"run.dir={ref}"], tmp_path, 3)  # … and resumed from that checkpoint on three
    steps = _trace(run)
    assert sorted(steps) == list(range(1, 31)) and steps == _trace(ref)
    a, b = torch.load(ref / "final.pt", weights_only=True), torch.load(run / "final.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_a_group_that_went_on_smaller_grows_back_when_a_warm_spare_comes(tmp_path: Path) -> None:
    """Three ranks and no spare; rank 2 SIGKILLed from outside after step 8: two go on. A warm spare started after
    that (a replacement on a node that came back) is taken in at the next poll, with no rank lost: three again. The
    run ends as one saved at each change of size and resumed on the new one would, bit for bit."""
    run, ref = tmp_path / "run", tmp_path / "ref"
    with _store(tmp_path) as env:
        procs = spawn_ranks([*COMMON, f"run.dir={run}", "--pace", "0.3"], tmp_path, 3, env, script=LOOP)
        try:
            deadline, ready = time.monotonic() + 180, _stepped(run, 8)
            while not ready() and time.monotonic() < deadline:
                time.sleep(0.02)
            os.killpg(procs[2].pid, signal.SIGKILL)
            while not ((run / "events.jsonl").exists() and _events(run, "regroup")) and time.monotonic() < deadline:
                time.sleep(0.02)
            spare = _spare([*COMMON, f"run.dir={run}"], tmp_path, env)
            procs[2] = spare
            outs = outputs(procs, timeout=180)
        finally:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(outs)
    shrink, grow = _events(run, "regroup")
    k, j = shrink["step"], grow["step"]
    assert (grow["lost"], grow["was"], grow["world_size"], grow["members"]) == ([], 2, 3, [0, 1, SPARE_BASE]), grow
    assert [(a["attempt"], a.get("regroup"), a.get("grew")) for a in _events(run, "attempt")] == \
           [("0", None, None), ("0.1", True, None), ("0.2", None, True)]  # growing back is no failure
    assert f"grew back: warm spares joined, 2 → 3 processes go on from step {j}" in outs[0]
    _ranks([f"run.dir={ref}", "--stop", str(k)], tmp_path, 3)  # the restart path: saved at k on three …
    _ranks([f"run.dir={ref}", "--stop", str(j)], tmp_path, 2)  # … on two to j …
    _ranks([f"run.dir={ref}"], tmp_path, 3)  # … and on three again
    steps = _trace(run)
    assert sorted(steps) == list(range(1, 31)) and steps == _trace(ref)
    assert {w for s, (w, _) in steps.items() if s > j} == {3}
    a, b = torch.load(ref / "final.pt", weights_only=True), torch.load(run / "final.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


FRESH = """
import gc, sys, weakref
import torch, torch.distributed as dist
from datetime import timedelta
from trainer.core.regroup import Membership
from trainer.runtime import ddp_group
host, port, presence = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
m = Membership(host, port, presence, 0, 1, "gloo", timedelta(seconds=60))
model = ddp_group.wrap(torch.nn.Linear(4, 1), torch.device("cpu"))
model(torch.ones(2, 4)).sum().backward()
old = weakref.ref(dist.group.WORLD)
ddp_group.detach(model)
dist.destroy_process_group()
gc.collect()
print("held" if old() is not None else "gone")
m.close()
"""


def test_in_a_new_interpreter_a_memberships_first_group_can_go(tmp_path: Path) -> None:
    """A fresh interpreter (not a warm fork: those import torch._dynamo before any group): a rank's first group,
    made through its membership, wrapped by DDP and let go as a regroup does, is freed, so its connections close and
    a survivor waiting on this rank fails at once. (torch._dynamo imported with a group alive would keep it.)"""
    with _store(tmp_path) as env:
        host, port, presence = env["TRAINER_STORE"].split(":")
        out = subprocess.run([sys.executable, "-c", FRESH, host, port, presence], cwd=ROOT, env=clean_env(),
                             capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1:] == ["gone"], out.stdout + out.stderr
