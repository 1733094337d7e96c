"""Survivors of a lost rank regroup in place on a store of their own (trainer.core.regroup, python -m trainer.store):
no process starts, any rank may be the one lost, rank 0 (the store's usual host) included."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from trainer.core.exits import SPARE_BASE
from trainer.core.regroup import Membership, Presence, decide, join
from trainer.store import kill_stuck
from trainer.store import start as start_store

from .conftest import ROOT, clean_env, outputs


@pytest.mark.parametrize(("lost", "joined", "spares", "members"), [
    (set(), {0, 1, 2}, [], (0, 1, 2)),      # nobody lost: everyone goes on
    ({0}, {1, 2}, [], (1, 2)),              # rank 0, the store's usual host, lost: the others go on
    ({2}, {0, 1, 2}, [], (0, 1)),           # joined, then lost before the decision: out
    (set(), {0, 2}, [], (0, 2)),            # neither lost nor joined by the deadline (hung): out
    ({1}, {0, 2}, [4, 3], (0, 2, 4)),       # a spare takes the lost rank's place, the first offered first
    ({1, 4}, {0, 2}, [4, 3], (0, 2, 3)),    # a spare that is gone itself is passed over
    ({0, 1}, {2}, [3], (2, 3)),             # fewer spares than lost ranks: the group shrinks
    (set(), {0, 1, 2}, [3], (0, 1, 2)),     # nobody lost: the spare keeps waiting
])
def test_the_members_are_the_ranks_not_lost_that_joined_then_spares(lost: set[int], joined: set[int],
                                                                    spares: list[int],
                                                                    members: tuple[int, ...]) -> None:
    assert decide(range(3), lost, joined, spares, size=3) == members


def test_the_first_to_arrive_waits_for_every_rank_not_lost_then_all_take_their_places() -> None:
    """Three ranks in threads on one in-memory store; rank 1 is marked lost (as the store process does when its
    presence connection closes)."""
    store = dist.HashStore()  # type: ignore[attr-defined]
    store.set("lost/1", "1")
    with ThreadPoolExecutor(2) as pool:  # the two survivors join at once
        places = list(pool.map(lambda r: join(store, 1, r, range(3), timeout=60), (2, 0)))
    assert [(p.rank, p.world_size, p.members) for p in places] == [(1, 2, (0, 2)), (0, 2, (0, 2))]
    with pytest.raises(RuntimeError, match="rank 1 was left out of generation 1"):
        join(store, 1, 1, range(3), timeout=60)
    # generation 1 began with a loss (max_failures counts it); generation 2 takes in a spare and grows back: no loss
    store.set("spares/count", "1")
    store.set("spares/0", "1000000")
    with ThreadPoolExecutor(2) as pool:
        grown = list(pool.map(lambda r: join(store, 2, r, (0, 2), timeout=60, size=3), (0, 2)))
    assert grown[0].members == (0, 2, 1_000_000) and store.get("spare/1000000/generation") == b"2"
    assert (store.get("generation/1/lost"), store.get("generation/2/lost")) == (b"1", b"0")


def test_a_rank_neither_lost_nor_joined_is_left_out_at_the_deadline() -> None:
    """Time from an injected clock: the decision waits for the hung rank until the deadline, not longer."""
    store, now = dist.HashStore(), [0.0]  # type: ignore[attr-defined]

    def sleep(s: float) -> None:
        now[0] += s

    place = join(store, 1, 0, range(2), timeout=5, sleep=sleep, clock=lambda: now[0])
    assert (place.members, 5.0 < now[0] < 5.1) == ((0,), True)


def test_the_store_process_marks_a_rank_lost_when_its_presence_ends_without_done(tmp_path: Path) -> None:
    store_proc, ports = start_store(tmp_path / "port", env=clean_env(), cwd=ROOT)
    try:
        client = dist.TCPStore("127.0.0.1", ports[0], is_master=False, timeout=timedelta(seconds=60))  # type: ignore[attr-defined]
        quits, dies = Presence("127.0.0.1", ports[1], 3), Presence("127.0.0.1", ports[1], 4)
        quits.close()
        dies.sock.close()  # as the kernel does for a killed process
        client.wait(["lost/4"], timedelta(seconds=60))
        assert not client.check(["lost/3"])
    finally:
        store_proc.terminate()
        assert store_proc.wait(timeout=60) == 0


def test_a_rank_that_ends_after_the_store_process_died_ends_as_it_would_have(tmp_path: Path) -> None:
    """The store process is gone by the time a finished rank leaves (its node lost, or stopped first): leaving says
    so in a note instead of raising, which turned a finished run's exit 0 into an error."""
    store_proc, ports = start_store(tmp_path / "port", env=clean_env(), cwd=ROOT)
    try:
        member = Membership.__new__(Membership)
        member.store = dist.TCPStore("127.0.0.1", ports[0], is_master=False,  # type: ignore[attr-defined]
                                     timeout=timedelta(seconds=10))
        member.presence = Presence("127.0.0.1", ports[1], 0)
    finally:
        store_proc.kill()
        store_proc.wait(timeout=60)
    member.close()


def test_the_store_process_counts_the_processes_training_for_the_batch_script(tmp_path: Path) -> None:
    """--live-file: ranks count until they end, a waiting spare only once a generation takes it (srun's step ends with
    its own tasks; the batch script waits on this count for the spares that took their places)."""
    live = tmp_path / "live"
    store_proc, ports = start_store(tmp_path / "port", env=clean_env(), cwd=ROOT, options=("--live-file", str(live)))

    def reads(n: int) -> None:
        deadline = time.monotonic() + 60
        while not (live.exists() and live.read_text() == f"{n}\n"):
            assert time.monotonic() < deadline, f"--live-file never read {n}: {live.read_text() if live.exists() else ''}"
            time.sleep(0.05)

    try:
        client = dist.TCPStore("127.0.0.1", ports[0], is_master=False, timeout=timedelta(seconds=60))  # type: ignore[attr-defined]
        reads(0)
        rank, spare = Presence("127.0.0.1", ports[1], 0), Presence("127.0.0.1", ports[1], SPARE_BASE + 1)
        reads(1)  # the spare waits: not counted
        client.set(f"spare/{SPARE_BASE + 1}/generation", "1")
        reads(2)  # taken in
        rank.sock.close()  # killed
        reads(1)  # the spare trains on alone
        spare.close()
        reads(0)
    finally:
        store_proc.terminate()
        out = store_proc.communicate(timeout=60)[0]
        assert store_proc.returncode == 0, out
    assert f"warm spare {SPARE_BASE + 1} up on ? (pid {os.getpid()}), waiting for a place" in out, out  # its log says
    assert out.count("warm spare") == 1, out  # once, and never for a rank


def test_the_store_kills_each_stuck_rank_asked_for_and_never_blocks_on_a_request_not_written() -> None:
    """``hung/count`` is counted before ``hung/<k>`` is written: a request not written yet is waited for on the next
    round (the presence thread never blocks on it), and one whose asker died in between is passed over once a later
    one is written. Only a rank still connected is killed, with its pid and node from its presence."""
    store, killed = dist.HashStore(), []  # type: ignore[attr-defined]
    said = [b"1 pid=11 node=n2\n", b"2 pid=12 node=n3\n"]

    def kill(rank: int, node: str, pid: int) -> None:
        killed.append((rank, node, pid))

    store.add("hung/count", 1)
    assert kill_stuck(store, said, 0, kill) == 0 and not killed  # counted, not written: next round
    store.set("hung/0", "2")
    assert kill_stuck(store, said, 0, kill) == 1 and killed == [(2, "n3", 12)]
    store.add("hung/count", 2)  # requests 1 (its asker died before writing it) and 2
    store.set("hung/2", "1")
    assert kill_stuck(store, said, 1, kill) == 3 and killed[1:] == [(1, "n2", 11)]
    store.add("hung/count", 1)
    store.set("hung/3", "7")  # a rank no longer connected: nothing to kill
    assert kill_stuck(store, said, 3, kill) == 4 and len(killed) == 2


def run_job(folder: Path, lost: int, spares: int = 0) -> list[dict[str, object]]:
    """Three ranks (and ``spares`` warm spares) of tests/scripts/regroup_rank.py on a store process; rank ``lost`` is
    SIGKILLed from outside once every rank has done 10 all-reduces. What each process that went on printed."""
    store, ports = start_store(folder / "port", env=clean_env(), cwd=ROOT)
    procs: list[subprocess.Popen[str]] = []
    try:
        for who in [*map(str, range(3)), *(f"spare:{3 + n}" for n in range(spares))]:
            procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests/scripts/regroup_rank.py"), "127.0.0.1",
                                           *map(str, ports), who, "3", str(folder)], cwd=ROOT, env=clean_env(),
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True))
        deadline = time.monotonic() + 240
        while len(list(folder.glob("ready.*"))) < 3 or len(list(folder.glob("spare.*"))) < spares:
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, \
                outputs([p for p in procs if p.poll() is not None], timeout=5)
            time.sleep(0.1)
        os.killpg(procs[lost].pid, signal.SIGKILL)
        rest = [p for r, p in enumerate(procs) if r != lost]
        outs = outputs(rest, timeout=180)
        assert [p.returncode for p in rest] == [0] * len(rest), outs
        seen = [json.loads(o.strip().splitlines()[-1]) for o in outs]
        assert [s["pid"] for s in seen] == [p.pid for p in rest]  # the same processes went on: none started
        return seen
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        store.terminate()
        store.communicate(timeout=60)


@pytest.mark.parametrize("lost", [0, 2])
def test_the_survivors_of_a_killed_rank_regroup_without_a_new_process(tmp_path: Path, lost: int) -> None:
    """Rank 0 (the store's usual host) or the last rank: the two others go on in a group of two."""
    seen = run_job(tmp_path, lost)
    kept = tuple(r for r in range(3) if r != lost)
    assert [(s["origin"], s["rank"], s["world"], tuple(s["members"])) for s in seen] == \
           [(r, i, 2, kept) for i, r in enumerate(kept)]
    assert [s["last_sum"] for s in seen] == [2.0, 2.0]  # the new group's all-reduce: the two survivors


def test_a_warm_spare_takes_the_lost_ranks_place(tmp_path: Path) -> None:
    """A spare process started beside the job waits at the store; when rank 1 is killed it joins the survivors'
    next generation (the world stays 3), takes the count of steps done from the new rank 0, and trains on."""
    seen = run_job(tmp_path, lost=1, spares=1)
    assert [(s["origin"], s["rank"], s["world"], tuple(s["members"])) for s in seen] == \
           [(0, 0, 3, (0, 2, 3)), (2, 1, 3, (0, 2, 3)), (3, 2, 3, (0, 2, 3))]
    assert [s["last_sum"] for s in seen] == [3.0, 3.0, 3.0]
    assert len({s["done"] for s in seen}) == 1  # the spare went on from where the survivors were


def test_a_store_in_a_container_passes_its_actions_to_the_host_which_runs_them(tmp_path: Path) -> None:
    """--actions-to: the store (in the image, without srun) writes each action to a FIFO; --actions-from: a torch-free
    interpreter on the host runs it, with what the command needs (the lost rank's node, the store's address)."""
    fifo, out = tmp_path / "actions", tmp_path / "out"
    os.mkfifo(fifo)
    torch_free = ("import runpy, sys; sys.modules['torch'] = None; sys.argv[0] = 'trainer.store'; "
                  "runpy.run_module('trainer.store', run_name='__main__')")
    host = subprocess.Popen([sys.executable, "-c", torch_free, "--actions-from", str(fifo), "--on-lost",
                             f'echo "lost $TRAINER_LOST_RANK $TRAINER_LOST_NODE $TRAINER_REPLACEMENT $TRAINER_STORE" >> {out}',
                             "--on-hang", f'echo "hung $TRAINER_HUNG_RANK $TRAINER_HUNG_NODE $TRAINER_HUNG_PID" >> {out}'],
                            env=clean_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    store_proc, ports = start_store(tmp_path / "port", env=clean_env(), cwd=ROOT, options=("--actions-to", str(fifo)))

    def said(n: int) -> list[str]:
        deadline = time.monotonic() + 60
        while len(lines := (out.read_text().splitlines() if out.exists() else [])) < n:
            assert time.monotonic() < deadline and host.poll() is None, f"the host ran {lines}"
            time.sleep(0.05)
        return lines

    try:
        client = dist.TCPStore("127.0.0.1", ports[0], is_master=False, timeout=timedelta(seconds=60))  # type: ignore[attr-defined]
        stuck = Presence("127.0.0.1", ports[1], 1, node="n2")
        Presence("127.0.0.1", ports[1], 2, node="n3").sock.close()  # killed
        assert said(1) == [f"lost 2 n3 1 {socket.gethostname()}:{ports[0]}:{ports[1]}"]
        with open(fifo, "w") as garbled:  # lines that say nothing to do do not stop the host's side
            garbled.write("nonsense\ndo=lost rank=two\n\n")
        client.set("hung/0", "1")
        client.add("hung/count", 1)
        assert said(2)[1] == f"hung 1 n2 {os.getpid()}"
        stuck.close()
        client.wait(["ended/1"], timedelta(seconds=60))  # seen before the store stops
    finally:
        store_proc.terminate()
        assert store_proc.wait(timeout=60) == 0
        host.terminate()
        assert host.wait(timeout=60) == 0, host.communicate()[0]
