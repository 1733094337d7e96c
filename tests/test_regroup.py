"""Survivors of a lost rank regroup in place on a store of their own (trainer.core.regroup, python -m trainer.store):
no process starts, any rank may be the one lost, rank 0 (the store's usual host) included."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from trainer.core.regroup import Presence, decide, join

from .conftest import ROOT, clean_env, outputs


@pytest.mark.parametrize(("lost", "joined", "members"), [
    (set(), {0, 1, 2}, (0, 1, 2)),   # nobody lost: everyone goes on
    ({0}, {1, 2}, (1, 2)),           # rank 0, the store's usual host, lost: the others go on
    ({2}, {0, 1, 2}, (0, 1)),        # joined, then lost before the decision: out
    (set(), {0, 2}, (0, 2)),         # neither lost nor joined by the deadline (hung): out
])
def test_the_members_are_the_ranks_not_lost_that_joined(lost: set[int], joined: set[int],
                                                        members: tuple[int, ...]) -> None:
    assert decide(range(3), lost, joined) == members


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


def test_a_rank_neither_lost_nor_joined_is_left_out_at_the_deadline() -> None:
    """Time from an injected clock: the decision waits for the hung rank until the deadline, not longer."""
    store, now = dist.HashStore(), [0.0]  # type: ignore[attr-defined]

    def sleep(s: float) -> None:
        now[0] += s

    place = join(store, 1, 0, range(2), timeout=5, sleep=sleep, clock=lambda: now[0])
    assert (place.members, 5.0 < now[0] < 5.1) == ((0,), True)


def test_the_store_process_marks_a_rank_lost_when_its_presence_ends_without_done(tmp_path: Path) -> None:
    store_proc, ports = start_store(tmp_path)
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


def start_store(folder: Path) -> tuple[subprocess.Popen[str], tuple[int, int]]:
    """``python -m trainer.store`` on free ports, once it listens."""
    port_file = folder / "port"
    store = subprocess.Popen([sys.executable, "-m", "trainer.store", "--host", "127.0.0.1", "--port-file",
                              str(port_file)], cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not port_file.exists():
        assert store.poll() is None and time.monotonic() < deadline, store.communicate()[0]
        time.sleep(0.1)
    first, second = port_file.read_text().split()
    return store, (int(first), int(second))


@pytest.mark.parametrize("lost", [0, 2])
def test_the_survivors_of_a_killed_rank_regroup_without_a_new_process(tmp_path: Path, lost: int) -> None:
    store, ports = start_store(tmp_path)
    ranks: list[subprocess.Popen[str]] = []
    try:
        ranks = [subprocess.Popen([sys.executable, str(ROOT / "tests/scripts/regroup_rank.py"), "127.0.0.1",
                                   *map(str, ports), str(r), "3", str(tmp_path)], cwd=ROOT, env=clean_env(),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
                 for r in range(3)]
        deadline = time.monotonic() + 240
        while len(list(tmp_path.glob("ready.*"))) < 3:
            assert all(p.poll() is None for p in ranks) and time.monotonic() < deadline, \
                outputs([p for p in ranks if p.poll() is not None], timeout=5)
            time.sleep(0.1)
        os.killpg(ranks[lost].pid, signal.SIGKILL)
        survivors = [p for r, p in enumerate(ranks) if r != lost]
        outs = outputs(survivors, timeout=180)
        assert [p.returncode for p in survivors] == [0, 0], outs
        seen = [json.loads(o.strip().splitlines()[-1]) for o in outs]
        kept = tuple(r for r in range(3) if r != lost)
        assert [(s["old_rank"], s["rank"], s["world"], tuple(s["members"])) for s in seen] == \
               [(r, i, 2, kept) for i, r in enumerate(kept)]
        assert [s["last_sum"] for s in seen] == [2.0, 2.0]  # the new group's all-reduce: the two survivors
        assert [s["pid"] for s in seen] == [p.pid for p in survivors]  # the same processes went on
    finally:
        for p in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        store.terminate()
        store.communicate(timeout=60)
