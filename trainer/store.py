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
runs processes (only the process was lost). The commands still running when the store stops are ended with it.
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
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any


def watch_presence(server: socket.socket, store: Any, on_lost: Callable[[int, str], None] = lambda r, n: None) -> None:
    """Accept presence connections; a rank whose connection ends without ``done`` is lost (``on_lost(rank, node)``)."""
    sel = selectors.DefaultSelector()
    sel.register(server, selectors.EVENT_READ)
    seen: dict[socket.socket, bytes] = {}
    while True:
        for key, _ in sel.select():
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
                continue
            sel.unregister(sock)
            sock.close()
            words = seen.pop(sock).decode(errors="replace").split()
            if words and words[0].isdigit():
                lost = "done" not in words[1:]
                # the value: when (the store host's clock), for the recovery's detection time
                store.set(f"{'lost' if lost else 'ended'}/{words[0]}", f"{time.time():.3f}")
                if lost:
                    on_lost(int(words[0]), next((w[5:] for w in words if w.startswith("node=")), ""))


class Replacements:
    """``--on-lost``: the command for each lost rank, in a process of its own; those still running end with the store."""

    def __init__(self, command: str | None) -> None:
        self.command, self.count = command, 0
        self.started: list[subprocess.Popen[bytes]] = []
        self.address = ""
        """TRAINER_STORE for what it starts: HOST:PORT:PRESENCE_PORT."""

    def __call__(self, rank: int, node: str) -> None:
        if not self.command:
            return
        self.count += 1
        env = {**os.environ, "TRAINER_LOST_RANK": str(rank), "TRAINER_LOST_NODE": node,
               "TRAINER_REPLACEMENT": str(self.count), "TRAINER_STORE": self.address}
        print(f"store: rank {rank} lost on {node or '?'}: {self.command}", flush=True)
        self.started.append(subprocess.Popen(["bash", "-c", self.command], env=env, start_new_session=True))

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


def start(port_file: Path, env: dict[str, str] | None = None, cwd: Path | None = None,
          timeout: float = 120.0) -> tuple[subprocess.Popen[str], tuple[int, int]]:
    """Start ``python -m trainer.store`` on this host's loopback and free ports; once it listens, the process and
    its (store, presence) ports. RuntimeError, with what it printed, if it ends or does not listen in ``timeout``."""
    store = subprocess.Popen([sys.executable, "-m", "trainer.store", "--host", "127.0.0.1", "--port-file",
                              str(port_file)], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
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
    args = parser.parse_args(argv)
    import torch.distributed as dist  # after parsing: --help needs no torch

    from trainer.core.files import write_atomic

    done = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, done)  # before any thread: sigwait below takes them
    store = dist.TCPStore(args.host, args.port, is_master=True, wait_for_workers=False,  # type: ignore[attr-defined]
                          timeout=timedelta(seconds=60))
    presence = socket.create_server((args.host, 0))
    replacements = Replacements(args.on_lost)
    threading.Thread(target=watch_presence, args=(presence, store, replacements), name="presence",
                     daemon=True).start()
    ports = f"{store.port} {presence.getsockname()[1]}"
    replacements.address = f"{args.host_name}:{ports.replace(' ', ':')}"
    if args.port_file:
        write_atomic(args.port_file, ports + "\n", durable=False)
    print(f"store: serving on {args.host}, ports {ports} (store, presence)", flush=True)
    signal.sigwait(done)
    replacements.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
