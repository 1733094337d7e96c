"""``python -m trainer.store [--host H] [--port P] [--port-file F]``: a job's rendezvous store in a process of its own.

Held by rank 0, the store would end with it; held here, any rank may be lost and the others regroup on it
(``trainer.core.regroup``). Beside the store it listens for each rank's presence connection (a second port) and marks
a rank ``lost/<rank>`` in the store the moment its connection closes without a ``done`` (with one, ``ended/<rank>``:
its peers' failed collectives are then no lost peer's). It serves until SIGTERM or
SIGINT. ``--port 0`` takes free ports; ``--port-file`` gets "STORE_PORT PRESENCE_PORT" (atomically) once both listen.

``--on-lost CMD`` runs the shell command CMD for each rank lost, with TRAINER_LOST_RANK, TRAINER_LOST_NODE (where it
ran), TRAINER_REPLACEMENT (1, 2, …: a number for a warm spare it may start) and TRAINER_STORE (this store, at
``--host-name``) in its environment: the batch script
starts a warm spare on the lost rank's node there, which the group takes in at a step boundary when the node still
runs processes (only the process was lost). ``--on-hang CMD`` kills a rank the others found stuck (the hang
watchdog: ``hung/<k>``), with TRAINER_HUNG_RANK, TRAINER_HUNG_NODE and TRAINER_HUNG_PID; without it the store kills
it where it runs on this host. The commands still running when the store stops are ended with it. ``--live-file F``
holds the number of processes training now (ranks, and spares a generation took in), rewritten as it changes: the
batch script waits on it, since srun's step ends with its own tasks while the spares that took their places train on.

Inside a container the store has torch but no ``srun``, and the batch host has ``srun`` but maybe no torch: the store
then passes each action as one line to a FIFO (``--actions-to F``), and ``python3 -m trainer.store --actions-from F
--on-lost CMD --on-hang CMD``, torch-free, runs them on the host.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

from trainer.core.exits import SPARE_BASE, node_name


def watch_presence(server: socket.socket, store: Any, on_lost: Callable[[int, str], None] = lambda r, n: None,
                   on_hung: Callable[[int, str, int], None] = lambda r, n, p: None,
                   on_live: Callable[[int], None] = lambda n: None, stop: threading.Event | None = None) -> None:
    """Accept presence connections; a rank whose connection ends without ``done`` is lost (``on_lost(rank, node)``).
    Between events, the ranks the others asked to have killed (``hung/<k>``, stuck): ``on_hung(rank, node, pid)``;
    and ``on_live(n)`` whenever the number of processes training (``training``) changes. Until ``stop`` is set."""
    sel = selectors.DefaultSelector()
    sel.register(server, selectors.EVENT_READ)
    seen: dict[socket.socket, bytes] = {}
    asked, live = 0, -1
    while not (stop and stop.is_set()):
        for key, _ in sel.select(timeout=0.2):
            sock: socket.socket = key.fileobj  # type: ignore[assignment]
            if sock is server:
                conn, _ = server.accept()
                sel.register(conn, selectors.EVENT_READ)
                seen[conn] = b""
                continue
            try:
                data = sock.recv(64)
            except OSError:
                data = b""
            seen[sock] += data
            if data:
                if data.endswith(b"\n") and seen[sock].count(b"\n") == 1:  # its hello, whole
                    announce(seen[sock])
                continue
            sel.unregister(sock)
            sock.close()
            rank, facts, words = hello(seen.pop(sock))
            if rank is not None:
                lost = "done" not in words
                # the value: when (the store host's clock), for the recovery's detection time
                store.set(f"{'lost' if lost else 'ended'}/{rank}", f"{time.time():.3f}")
                if lost:
                    on_lost(rank, facts.get("node", ""))
        try:
            asked = kill_stuck(store, seen.values(), asked, on_hung)
            if live != (now := training(store, seen.values())):
                live = now
                on_live(live)
        except Exception as exc:  # noqa: BLE001 - this thread must go on: the ranks' ends still have to be seen
            print(f"store: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}", flush=True)


def announce(said: bytes) -> None:
    """A warm spare's hello: it is up (imports done, connected) and waits for a lost rank's place."""
    rank, facts, _ = hello(said)
    if rank is not None and rank >= SPARE_BASE:
        print(f"store: warm spare {rank} up on {facts.get('node') or '?'} (pid {facts.get('pid', '?')}), waiting for "
              "a place", flush=True)


def kill_stuck(store: Any, said: Iterable[bytes], asked: int, on_hung: Callable[[int, str, int], None]) -> int:
    """``on_hung`` for each rank asked to be killed since the first ``asked`` (``hung/<k>``) that is still connected
    (``said``: what each connection said); how many were dealt with so far. A request counted but not written yet
    is waited for (without blocking: the next call), unless a later one is written (its asker died in between)."""
    count = int(store.add("hung/count", 0))
    if asked >= count:  # nothing asked (each round): the connections are read only when something is
        return asked
    live = {r: f for r, f, _ in map(hello, said) if r is not None}
    while asked < count:
        if not store.check([f"hung/{asked}"]):
            if not any(store.check([f"hung/{k}"]) for k in range(asked + 1, count)):
                return asked
            asked += 1
            continue
        stuck = int(store.get(f"hung/{asked}").decode())
        asked += 1
        if stuck in live and live[stuck].get("pid", "").isdigit():
            on_hung(stuck, live[stuck].get("node", ""), int(live[stuck]["pid"]))
    return asked


def training(store: Any, said: Iterable[bytes]) -> int:
    """The connected processes that train: every rank not done, and the spares a generation has taken (a spare still
    waiting does not count: it leaves once the others end)."""
    ranks = [r for r, _, words in map(hello, said) if r is not None and "done" not in words]
    return sum(1 for r in ranks if r < SPARE_BASE or store.check([f"spare/{r}/generation"]))


def hello(said: bytes) -> tuple[int | None, dict[str, str], list[str]]:
    """What a presence connection said: its rank, its ``key=value`` facts (pid, node) and its words."""
    words = said.decode(errors="replace").split()
    facts = dict(w.split("=", 1) for w in words if "=" in w)
    return (int(words[0]) if words and words[0].isdigit() else None), facts, words


class Actions:
    """What the store runs for the job's ranks, each command in a process of its own: ``--on-lost`` for each rank
    lost, ``--on-hang`` for each rank the others found stuck (without it: SIGKILL where the rank runs on this host).
    The commands still running end with the store."""

    def __init__(self, on_lost: str | None, on_hang: str | None) -> None:
        self.on_lost, self.on_hang, self.count = on_lost, on_hang, 0
        self.started: list[subprocess.Popen[bytes]] = []
        self.address = ""
        """TRAINER_STORE for what it starts: HOST:PORT:PRESENCE_PORT."""

    def lost(self, rank: int, node: str) -> None:
        if self.on_lost:
            self.count += 1
            print(f"store: rank {rank} lost on {node or '?'}: {self.on_lost}", flush=True)
            self._run(self.on_lost, TRAINER_LOST_RANK=str(rank), TRAINER_LOST_NODE=node,
                      TRAINER_REPLACEMENT=str(self.count))

    def hung(self, rank: int, node: str, pid: int) -> None:
        print(f"store: rank {rank} on {node or '?'} (pid {pid}) is stuck; the others asked to go on without it",
              flush=True)
        if self.on_hang:
            self._run(self.on_hang, TRAINER_HUNG_RANK=str(rank), TRAINER_HUNG_NODE=node, TRAINER_HUNG_PID=str(pid))
        elif node == node_name():  # what the ranks say they run on, read the same way here
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        else:
            print(f"store: no --on-hang command to kill it on {node}", flush=True)

    def _run(self, command: str, **env: str) -> None:
        self.started.append(subprocess.Popen(["bash", "-c", command], start_new_session=True,
                                             env={**os.environ, **env, "TRAINER_STORE": self.address}))

    def serve(self, fifo: Path) -> None:
        """Run the actions a relayed store (``Relay``) writes to ``fifo``, one line each, until the process ends."""
        fd = os.open(fifo, os.O_RDWR)  # a writer of our own: no end of file between the store's writes
        with os.fdopen(fd, "rb", buffering=0) as lines:
            for line in iter(lines.readline, b""):
                _, words, _ = hello(line)  # the same key=value words a presence connection says
                try:
                    self.address = words.get("address", self.address)
                    if words.get("do") == "lost":
                        self.lost(int(words["rank"]), words.get("node", ""))
                    elif words.get("do") == "hung":
                        self.hung(int(words["rank"]), words.get("node", ""), int(words["pid"]))
                except (KeyError, ValueError):
                    print(f"store: a line passed on that says nothing to do: {line[:200]!r}", flush=True)

    def stop(self, grace_s: float = 10.0) -> None:
        """End what still runs: at once where it waits (a released spare leaves by itself), else after ``grace_s``."""
        deadline = time.monotonic() + grace_s
        for proc in self.started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                proc.wait()


class Relay:
    """A store's actions passed on as lines to ``fifo``, for ``Actions.serve`` on the batch host to run."""

    def __init__(self, fifo: Path) -> None:
        self.fifo = fifo
        self.address = ""
        """The store's own, passed on with every action (the host's side may have opened the FIFO only since)."""

    def tell(self, **words: object) -> None:
        """One line of ``key=value`` words (under PIPE_BUF bytes: written whole, never mixed with another)."""
        line = " ".join(f"{k}={v}" for k, v in {**words, "address": self.address}.items() if v != "")
        try:
            fd = os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK)
            try:
                os.write(fd, (line + "\n").encode())
            finally:
                os.close(fd)
        except OSError as exc:
            print(f"store: cannot pass {words.get('do')} on to {self.fifo}: {exc}", flush=True)

    def lost(self, rank: int, node: str) -> None:
        self.tell(do="lost", rank=rank, node=node)

    def hung(self, rank: int, node: str, pid: int) -> None:
        self.tell(do="hung", rank=rank, node=node, pid=pid)

    def stop(self) -> None:
        """Nothing runs here: what the host's side started ends with it."""


def start(port_file: Path, env: dict[str, str] | None = None, cwd: Path | None = None,
          timeout: float = 120.0, options: tuple[str, ...] = ()) -> tuple[subprocess.Popen[str], tuple[int, int]]:
    """Start ``python -m trainer.store`` (with ``options``) on this host's loopback and free ports; once it listens,
    the process and its (store, presence) ports. RuntimeError, with what it printed, if it ends or does not listen in
    ``timeout``."""
    store = subprocess.Popen([sys.executable, "-m", "trainer.store", "--host", "127.0.0.1", "--port-file",
                              str(port_file), *options], cwd=cwd, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        if store.poll() is not None or time.monotonic() > deadline:
            store.kill()
            raise RuntimeError(f"python -m trainer.store did not listen: {store.communicate()[0]}")
        time.sleep(0.05)
    first, second = port_file.read_text().split()
    return store, (int(first), int(second))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.store", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--host", default="0.0.0.0", help="the address to listen on")
    parser.add_argument("--port", type=int, default=0, help="the store's port (0: a free one); presence: any free one")
    parser.add_argument("--port-file", type=Path, help="write 'STORE_PORT PRESENCE_PORT' here once both listen")
    parser.add_argument("--host-name", default=socket.gethostname(),
                        help="the name the ranks reach this host by (for --on-lost's TRAINER_STORE)")
    parser.add_argument("--on-lost", help="a shell command to run for each rank lost (TRAINER_LOST_RANK, "
                        "TRAINER_LOST_NODE, TRAINER_REPLACEMENT): e.g. start a warm spare on its node")
    parser.add_argument("--live-file", type=Path, help="hold the number of processes training now here")
    parser.add_argument("--on-hang", help="a shell command to kill a rank the others found stuck (TRAINER_HUNG_RANK, "
                        "TRAINER_HUNG_NODE, TRAINER_HUNG_PID); default: SIGKILL where it runs on this host")
    parser.add_argument("--actions-to", type=Path, help="pass the actions on to this FIFO instead of running them")
    parser.add_argument("--actions-from", type=Path, help="serve no store: run the actions a store passes on to this "
                        "FIFO (--on-lost, --on-hang), until SIGTERM")
    args = parser.parse_args(argv)
    done = {signal.SIGTERM, signal.SIGINT}
    if args.actions_from:
        return run_actions(args.actions_from, Actions(args.on_lost, args.on_hang), done)
    import torch.distributed as dist  # after parsing: --help needs no torch

    from trainer.core.files import write_atomic

    signal.pthread_sigmask(signal.SIG_BLOCK, done)  # before any thread: sigwait below takes them
    store = dist.TCPStore(args.host, args.port, is_master=True, wait_for_workers=False,  # type: ignore[attr-defined]
                          timeout=timedelta(seconds=60))
    presence = socket.create_server((args.host, 0))
    actions: Actions | Relay = Relay(args.actions_to) if args.actions_to else Actions(args.on_lost, args.on_hang)
    live_file = args.live_file

    def live(n: int) -> None:
        if live_file:
            write_atomic(live_file, f"{n}\n", durable=False)

    # Stopped and joined before the process exits: a thread still inside the store's C++ client at exit aborts it.
    stop = threading.Event()
    watcher = threading.Thread(target=watch_presence, args=(presence, store, actions.lost, actions.hung, live, stop),
                               name="presence", daemon=True)
    watcher.start()
    ports = f"{store.port} {presence.getsockname()[1]}"
    actions.address = f"{args.host_name}:{ports.replace(' ', ':')}"
    if args.port_file:
        write_atomic(args.port_file, ports + "\n", durable=False)
    print(f"store: serving on {args.host}, ports {ports} (store, presence)", flush=True)
    signal.sigwait(done)
    stop.set()
    watcher.join(timeout=10)
    actions.stop()
    return 0


def run_actions(fifo: Path, actions: Actions, done: set[signal.Signals]) -> int:
    """``--actions-from``: run what the store passes on until SIGTERM or SIGINT, then end what still runs."""
    signal.pthread_sigmask(signal.SIG_BLOCK, done)
    threading.Thread(target=actions.serve, args=(fifo,), name="actions", daemon=True).start()
    print(f"store: running the actions passed on to {fifo}", flush=True)
    signal.sigwait(done)
    actions.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
