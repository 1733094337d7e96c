"""The stand-in interpreter: ``sys.executable`` in every process the warm server forks (tests/warm/server.py).

The harness (tests/warm/__init__.py) gives each server a folder with a copy of this file named ``python``, behind a
``#!<the real interpreter> -IS`` line, and its settings beside it in ``python.json``: the real interpreter, the
server's socket, the ``sys.path`` a new interpreter starts with and the server's load-time environment. It runs on the
standard library alone, without ``site`` (~15 ms). A ``-m module`` or ``script`` run whose load-time environment is the
server's has the server fork it (so a forked process's own Python children are forked warm too), relays its signals to
that child and ends as the child ends: with its exit code, or killed by its signal. When the stand-in dies first, the
server kills the child: the process its parent knows takes the child along. Anything else (``-c``, an interpreter flag,
another load-time environment, a ``sitecustomize`` on ``PYTHONPATH``, no server) runs the real interpreter instead.

The rule for which processes a server may fork lives here, where both this stand-in and the harness can read it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from collections.abc import Mapping  # already loaded by json: costs nothing here

# Read by the interpreter or by a preloaded library when it loads: a process that sets them differently needs a server
# of its own (PER_PROCESS ones are applied to each forked process instead).
LOAD_TIME = ("PYTHON", "OMP_", "MKL_", "KMP_", "OPENBLAS", "LD_", "TORCH", "PYTORCH", "CUDA", "TRITON", "MALLOC", "MPL",
             "LANG", "LC_")
PER_PROCESS = frozenset({"PYTHONPATH", "PYTHONUNBUFFERED"})
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def load_time(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` that a server fixes when it starts."""
    return {k: v for k, v in env.items() if k.startswith(LOAD_TIME) and k not in PER_PROCESS}


def customized(env: Mapping[str, str]) -> bool:
    """A ``sitecustomize``/``usercustomize`` on ``PYTHONPATH`` runs as an interpreter starts: before any preload."""
    return any(os.path.exists(os.path.join(p, f"{name}.py")) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p
               for name in ("sitecustomize", "usercustomize"))


def forkable(argv: list[str]) -> bool:
    """Interpreter arguments a forked process can stand for: ``-m module …`` or ``script …``, no flags."""
    return bool(argv) and (argv[0] == "-m" and len(argv) > 1 or not argv[0].startswith("-"))


class _Lines:
    """Integers, one a line, from the server's end of a connection."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.got = b""

    def next(self) -> int:
        while b"\n" not in self.got:
            chunk = self.conn.recv(64)
            if not chunk:
                sys.exit("warm: the server is gone")
            self.got += chunk
        head, _, self.got = self.got.partition(b"\n")
        return int(head)


def run_forked(conn: socket.socket, argv: list[str], base_path: list[str], me: str) -> int:
    """Have the server fork ``argv`` on this process's streams (``me``: its ``sys.executable``), relay signals to it;
    returns its exit status."""
    spec = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "base_path": base_path,
                       "python": me, "tie": True}).encode()
    socket.send_fds(conn, [f"{len(spec)}\n".encode() + spec], [0, 1, 2])
    lines = _Lines(conn)
    child = 0
    early: list[int] = []  # signals that came before the child's pid

    def relay(sig: int, _frame: object) -> None:
        if child:
            os.kill(child, sig)
        else:
            early.append(sig)

    for sig in RELAYED:
        signal.signal(sig, relay)
    child = lines.next()
    for s in early:
        os.kill(child, s)
    return lines.next()


def main() -> None:
    me, argv = os.path.abspath(sys.argv[0]), sys.argv[1:]
    with open(me + ".json", encoding="utf-8") as f:
        settings = json.load(f)
    python: str = settings["python"]
    conn = None
    if forkable(argv) and load_time(os.environ) == settings["fixed"] and not customized(os.environ):
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(settings["socket"])
        except OSError:  # the server is gone
            conn.close()
            conn = None
    if conn is None:
        os.execv(python, [python, *argv])
    code = run_forked(conn, argv, settings["base_path"], me)
    if code < 0:  # killed by a signal: so is the stand-in
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
