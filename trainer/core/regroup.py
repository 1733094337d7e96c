"""A new process group of the survivors, without a new process: who is alive, their new ranks, the group itself.

The rendezvous store lives outside the ranks (``python -m trainer.store``), so any rank may be lost, rank 0 included.
Each rank holds a presence connection to that process (``Presence``); the kernel closes it when the rank's process
ends however it ends, and the store process marks the rank lost at once (``lost/<rank>``). No thread of the rank has
to run for it, so a rank busy in C++ with Python's lock held is not mistaken for a lost one. When a collective fails,
the survivors leave the group and join the next generation: the first to arrive decides the members (every rank not
lost, once each has joined), every survivor takes its place among them, and the group is made again on keys of that
generation.
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from trainer.core.exits import SPARE_BASE, node_name


class Grow(RuntimeError):
    """Warm spares wait at the store while the group is smaller than the job's first: the ranks agreed at this step
    boundary to take them in. Raised by ``Session.should_save`` into the loop's ``except RuntimeError``, whose
    ``Session.regroup`` does it; no rank was lost."""


class RegroupFailed(RuntimeError):
    """The survivors of a lost rank could not go on in place (a second loss meanwhile, a global batch the survivors
    cannot share): the attempt ends, and the job takes the restart path. An echo of the loss, never its cause."""


@dataclass(frozen=True)
class Place:
    """A rank's place in one generation of the job's process group."""

    generation: int
    rank: int
    world_size: int
    members: tuple[int, ...]
    """The first generation's ranks in this one, in order (new rank = index)."""

    @staticmethod
    def first(rank: int, world_size: int) -> Place:
        """Generation 0: every rank."""
        return Place(0, rank, world_size, tuple(range(world_size)))


def decide(known: Iterable[int], lost: set[int], joined: set[int], spares: Iterable[int] = (),
           size: int = 0) -> tuple[int, ...]:
    """The members of the next generation: the known ranks that are not lost and have joined, in order, then waiting
    spares (not lost) in the lost ranks' places, up to ``size`` members in all."""
    members = [r for r in sorted(known) if r not in lost and r in joined]
    return tuple(members + [r for r in spares if r not in lost][:max(0, size - len(members))])


class Presence:
    """This rank's connection to the store process, open as long as the process lives (TCP keepalive: a node that
    vanishes without closing it is noticed in about 5 s)."""

    def __init__(self, host: str, port: int, rank: int, timeout: float = 60.0, node: str = "") -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in (("TCP_KEEPIDLE", 2), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, option):
                self.sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
        self.sock.sendall(f"{rank} pid={os.getpid()}{f' node={node}' if node else ''}\n".encode())

    def close(self) -> None:
        """A rank that ends cleanly says so first: ``done`` is not ``lost``."""
        try:
            self.sock.sendall(b"done\n")
        finally:
            self.sock.close()


def join(store: Any, generation: int, origin: int, known: Iterable[int], timeout: float = 60.0,
         sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic,
         size: int | None = None) -> Place:
    """Join ``generation`` as rank ``origin`` of the first generation (the name ranks go by); the first to arrive
    decides the members, with waiting spares in the lost ranks' places up to ``size`` members (default: as many as
    ``known``). A rank neither lost nor joined within ``timeout`` (hung) is left out. Raises RuntimeError if this rank
    is not among the members (it came too late)."""
    prefix = f"generation/{generation}"
    store.set(f"{prefix}/joined/{origin}", "1")
    if int(store.add(f"{prefix}/arrived", 1)) == 1:
        ranks, deadline = sorted(known), clock() + timeout
        while True:
            lost = {r for r in ranks if store.check([f"lost/{r}"])}
            joined = {r for r in ranks if store.check([f"{prefix}/joined/{r}"])}
            if set(ranks) <= lost | joined or clock() > deadline:
                break
            sleep(0.01)  # a survivor still on its way out of the failed collective
        spares = waiting_spares(store)
        members = decide(ranks, lost | {r for r in spares if store.check([f"lost/{r}"])}, joined, spares,
                         size or len(ranks))
        for r in members:
            if r in spares:
                store.set(f"spare/{r}/generation", str(generation))  # a spare waits on this key (take_place)
        store.set(f"{prefix}/lost", "1" if lost else "0")  # a loss (max_failures counts it), or growing back
        store.set(f"{prefix}/members", ",".join(map(str, members)))
    return place_in(store, generation, origin, timeout)


def place_in(store: Any, generation: int, origin: int, timeout: float) -> Place:
    """``origin``'s place among ``generation``'s members, once they are decided."""
    store.wait([f"generation/{generation}/members"], timedelta(seconds=timeout))
    members = members_of(store, generation)
    if origin not in members:
        raise RuntimeError(f"rank {origin} was left out of generation {generation} (members {list(members)})")
    return Place(generation, members.index(origin), len(members), members)


def members_of(store: Any, generation: int) -> tuple[int, ...]:
    """The members ``generation``'s first arrival decided (generation 1 on: 0 has no key), as started."""
    return tuple(int(r) for r in store.get(f"generation/{generation}/members").decode().split(",") if r)


def offer_spare(store: Any, origin: int) -> None:
    """Put this waiting process (``origin``: a number no rank has, e.g. world size + n) on the spares' list."""
    store.set(f"spares/{int(store.add('spares/count', 1)) - 1}", str(origin))


def waiting_spares(store: Any) -> list[int]:
    """The offered spares that no generation has taken yet, in the order they were offered."""
    offered = [int(store.get(f"spares/{i}").decode()) for i in range(int(store.add("spares/count", 0)))]
    return [r for r in offered if not store.check([f"spare/{r}/generation"])]


class SpareReleased(Exception):
    """The attempt ended while this spare waited: nobody needs it (``Membership.close`` on any rank released it)."""


def take_place(store: Any, origin: int, poll_s: float = 0.05, timeout: float = 60.0) -> Place:
    """Block until a generation takes this spare (a rank was lost), for as long as the attempt runs; its place there.
    SpareReleased once the attempt has ended without needing it."""
    while not store.check([f"spare/{origin}/generation"]):
        if store.check(["spares/released"]):
            raise SpareReleased(f"spare {origin} was not needed: the attempt ended")
        time.sleep(poll_s)
    generation = int(store.get(f"spare/{origin}/generation").decode())
    return place_in(store, generation, origin, timeout)


def form(store: Any, place: Place, backend: str, timeout: timedelta) -> None:
    """Make ``place``'s process group on its generation's keys of ``store``."""
    dist.init_process_group(backend, store=dist.PrefixStore(f"group/{place.generation}", store),  # type: ignore[attr-defined]
                            rank=place.rank, world_size=place.world_size, timeout=timeout)


def leave(place: Place) -> None:
    """Destroy the failed group (nothing when none is left); warn when something still holds it."""
    if dist.is_initialized():
        failed = weakref.ref(dist.group.WORLD)
        dist.destroy_process_group()
        if failed() is not None:  # a survivor waiting on this rank learns nothing until dist.timeout_s
            print(f"warning: rank {place.members[place.rank]}: the failed process group is still held in this process "
                  "(its connections stay open)", file=sys.stderr, flush=True)


def next_group(store: Any, place: Place, known: Iterable[int], backend: str, timeout: timedelta,
               size: int | None = None) -> Place:
    """After a failed collective: leave the group first (its sockets close, so a survivor still waiting in it fails
    too and comes), join the next generation, and make its group. No process starts. Call it outside the ``except``
    block of the failure, or after freeing the exception's frames (``runtime/recovery.let_go``): they hold the old
    group, whose sockets would stay open."""
    leave(place)
    place = join(store, place.generation + 1, place.members[place.rank], known, timeout.total_seconds(), size=size)
    form(store, place, backend, timeout)
    return place


def lost_members(store: Any, members: Iterable[int], wait_s: float = 2.0, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic) -> list[int]:
    """The ``members`` (first-generation ranks) the store marked lost, waiting up to ``wait_s`` for one: a failed
    collective may be seen before the store has seen the connection close. Empty when none is: a member that ended
    on purpose (``ended/<rank>``: finished, or failed on its own) or an error that is not a lost peer."""
    members, deadline = list(members), clock() + wait_s
    while True:
        lost = [r for r in members if store.check([f"lost/{r}"])]
        if lost or any(store.check([f"ended/{r}"]) for r in members) or clock() > deadline:
            return lost
        sleep(0.01)


class Membership:
    """This rank's share of a job whose store is a process of its own: the store client, the presence connection,
    and its place in the current generation (made with the first generation's group)."""

    def __init__(self, host: str, port: int, presence_port: int, rank: int, world_size: int, backend: str,
                 timeout: timedelta, spare: int | None = None) -> None:
        """A rank of the first generation, or with ``spare`` a warm spare of that number (named ``SPARE_BASE +
        spare``), which blocks until a generation takes it."""
        # Imported while a process group exists, torch._dynamo keeps that group alive for good (torch 2.14), and a
        # failed group's connections must close. DDP's constructor imports it anyway (about 1 s): now, before any.
        importlib.import_module("torch._dynamo")
        self.store = dist.TCPStore(host, port, is_master=False, timeout=timeout)  # type: ignore[attr-defined]
        self.address = (host, port)
        origin = rank if spare is None else SPARE_BASE + spare
        self.presence = Presence(host, presence_port, origin, timeout.total_seconds(), node_name())
        self.backend, self.timeout, self.size = backend, timeout, world_size
        self._pulser: Any = None
        if spare is None:
            self.place = Place.first(rank, world_size)
            self.store.set("size", str(world_size))  # the job's size, which a spare may grow a smaller group back to
        else:
            offer_spare(self.store, origin)
            self.place = take_place(self.store, origin)
            self.size = int(self.store.get("size").decode())
        form(self.store, self.place, backend, timeout)

    def replaced(self) -> list[int]:
        """The ranks (as started) the group went on without when this process took its place: the generation before
        this one's members that are not in it (none for a rank of the first generation, or a spare that grew it)."""
        generation = self.place.generation
        if generation == 0:
            return []
        before = members_of(self.store, generation - 1) if generation > 1 else range(self.size)
        return [r for r in before if r not in self.place.members]

    def lost(self, wait_s: float = 2.0) -> list[int]:
        """The current members the store marked lost (see ``lost_members``)."""
        return lost_members(self.store, self.place.members, wait_s)

    def losses(self) -> int:
        """The generations so far that began with a loss (growing back is none): the same on every member."""
        return sum(int(self.store.get(f"generation/{g}/lost").decode()) for g in range(1, self.place.generation + 1))

    def lost_at(self, ranks: Iterable[int]) -> float | None:
        """When the store saw the first of ``ranks`` lost (its host's clock, seconds since the epoch), if it says."""
        times = []
        for r in ranks:
            try:
                times.append(float(self.store.get(f"lost/{r}").decode()))
            except (RuntimeError, ValueError):
                continue
        return min((t for t in times if t > 1e9), default=None)  # a store before this one wrote "1"

    def leave(self) -> None:
        """Leave the failed group (see ``leave``): the first part of ``next``, timed apart."""
        leave(self.place)

    def next(self) -> Place:
        """The next generation's place, its group made (see ``next_group``)."""
        self.place = next_group(self.store, self.place, self.place.members, self.backend, self.timeout, self.size)
        return self.place

    def _pulse_client(self) -> Any:
        """The pulse thread's store client (the main thread's may be mid-request)."""
        if self._pulser is None:
            self._pulser = dist.TCPStore(*self.address, is_master=False, timeout=self.timeout)  # type: ignore[attr-defined]
        return self._pulser

    def members(self) -> tuple[int, ...]:
        """The current group's ranks, as started, in rank order."""
        return self.place.members

    def have_killed(self, ranks: list[int]) -> None:
        """Ask the store process to kill these ranks (as started), stuck (from the hang watchdog's thread)."""
        client = dist.TCPStore(*self.address, is_master=False, timeout=self.timeout)  # type: ignore[attr-defined]
        for r in ranks:
            client.set(f"hung/{int(client.add('hung/count', 1)) - 1}", str(r))

    def pulse(self) -> None:
        """Count once more for this process (``pulse/<origin>``, from the pulse thread): a stopped one's stands still."""
        self._pulse_client().add(f"pulse/{self.place.members[self.place.rank]}", 1)

    def still(self, ranks: tuple[int, ...], wait_s: float, sleep: Callable[[float], None] = time.sleep) -> list[int]:
        """Those of ``ranks`` (as started) whose pulse stood still for ``wait_s`` seconds: stopped, or stuck holding
        the GIL (their pulse thread cannot run either). A client of its own: the pulse thread's is busy meanwhile."""
        client = dist.TCPStore(*self.address, is_master=False, timeout=self.timeout)  # type: ignore[attr-defined]
        before = {r: int(client.add(f"pulse/{r}", 0)) for r in ranks}
        sleep(wait_s)
        return [r for r in ranks if int(client.add(f"pulse/{r}", 0)) == before[r]]

    def can_grow(self) -> bool:
        """Whether warm spares wait while the group is smaller than the job's first generation (a store round trip
        or a few; nothing when the group has its size)."""
        return self.place.world_size < self.size and bool(waiting_spares(self.store))

    def close(self) -> None:
        """This rank ends on purpose (finished, or failed on its own): not lost, and the attempt is over, so the
        spares still waiting leave. A store process already gone (its node lost) leaves nobody to tell: a note, and
        the rank's own end stands (a finished run still exits 0)."""
        for tell in (lambda: self.store.set("spares/released", "1"), self.presence.close):
            try:
                tell()
            except (RuntimeError, OSError) as exc:
                print(f"{node_name()}: note: the job's store did not hear this rank leave ({exc})",
                      file=sys.stderr, flush=True)
