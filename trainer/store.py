"""``python -m trainer.store [--host H] [--port P] [--port-file F]``: a job's rendezvous store in a process of its own.

Held by rank 0, the store would end with it; held here, any rank may be lost and the others regroup on it
(``trainer.core.regroup``). Beside the store it listens for each rank's presence connection (a second port) and marks
a rank ``lost/<rank>`` in the store the moment its connection closes without a ``done`` (with one, ``ended/<rank>``:
its peers' failed collectives are then no lost peer's). It serves until SIGTERM or
SIGINT. ``--port 0`` takes free ports; ``--port-file`` gets "STORE_PORT PRESENCE_PORT" (atomically) once both listen.
"""

from __future__ import annotations

import argparse
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any


def watch_presence(server: socket.socket, store: Any) -> None:
    """Accept presence connections; a rank whose connection ends without ``done`` is lost."""
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
                # the value: when (the store host's clock), for the recovery's detection time
                store.set(f"{'ended' if 'done' in words[1:] else 'lost'}/{words[0]}", f"{time.time():.3f}")


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
    args = parser.parse_args(argv)
    import torch.distributed as dist  # after parsing: --help needs no torch

    from trainer.core.files import write_atomic

    done = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, done)  # before any thread: sigwait below takes them
    store = dist.TCPStore(args.host, args.port, is_master=True, wait_for_workers=False,  # type: ignore[attr-defined]
                          timeout=timedelta(seconds=60))
    presence = socket.create_server((args.host, 0))
    threading.Thread(target=watch_presence, args=(presence, store), name="presence", daemon=True).start()
    ports = f"{store.port} {presence.getsockname()[1]}"
    if args.port_file:
        write_atomic(args.port_file, ports + "\n", durable=False)
    print(f"store: serving on {args.host}, ports {ports} (store, presence)", flush=True)
    signal.sigwait(done)
    return 0


if __name__ == "__main__":
    sys.exit(main())
