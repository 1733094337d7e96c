"""The server behind tests/warm: preloads torch once, then forks each requested process and reports how it ended.

``python -m tests.warm.server SOCKET`` (tests/warm/__init__.py starts one per pytest process and load-time
environment). It imports the standard library only until ``serve`` preloads; a forked child leaves ``serve`` with its
request and runs it at the top of this module, so nothing of the server is on its stack. A request comes from the
harness or from the stand-in interpreter (tests/warm/shim.py), a forked process's ``sys.executable``.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
from typing import Any

PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "torch.distributed.fsdp",
           "torch.distributed.checkpoint", "torch.utils.data", "numpy", "omegaconf", "yaml", "xxhash", "hostlist",
           "tqdm", "matplotlib", "matplotlib.pyplot")
# The environment variables these read as they load (which a server's processes share): tests/warm/shim.py LOAD_TIME.


def _recv_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One request: the three standard-stream fds (SCM_RIGHTS), then a JSON spec up to EOF of its length line."""
    head, got, _, _ = socket.recv_fds(conn, 64, 3)
    fds = list(got)
    if len(fds) != 3 or b"\n" not in head:
        for fd in fds:
            os.close(fd)
        raise ValueError("half a request")
    size, _, rest = head.partition(b"\n")
    data = rest
    while len(data) < int(size):
        chunk = conn.recv(1 << 16)
        if not chunk:
            break
        data += chunk
    try:
        return json.loads(data), fds
    except ValueError:
        for fd in fds:
            os.close(fd)
        raise


def _reap(owners: dict[int, socket.socket], sel: selectors.BaseSelector) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = owners.pop(pid, None)
        if conn is not None:
            if any(k.fileobj is conn for k in sel.get_map().values()):
                sel.unregister(conn)
            with contextlib.suppress(OSError):  # the test gave up on it
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            conn.close()


def serve(path: str) -> tuple[dict[str, Any], list[int]]:
    """Preload, then fork a child per request; returns only in a child, with its request."""
    for name in PRELOAD:
        importlib.import_module(name)
    gc.freeze()  # the preloaded objects: a child's collections skip them instead of copying their pages
    if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
        sys.exit("warm: the preload started threads; forking from here could deadlock a child")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    owners: dict[int, socket.socket] = {}
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    print(json.dumps(sys.path[1:]), flush=True)  # ready; and the path a new interpreter would start with
    while True:
        for key, _ in sel.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                request = _fork(conn, owners, sel)
                if request is not None:  # in the child
                    signal.set_wakeup_fd(-1)
                    sel.close()
                    for s in (listener, *owners.values(), conn):
                        s.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    return request
            elif key.fileobj is wake_r:
                os.read(wake_r, 4096)
                _reap(owners, sel)
            elif owners.get(key.data) is key.fileobj:  # else reaped (and closed) earlier in this same batch
                sel.unregister(key.fileobj)
                del owners[key.data]
                key.fileobj.close()
                _kill(key.data)


def _kill(pid: int) -> None:
    """SIGKILL a child and its session's group (the group exists once the child has called setsid)."""
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)


def _fork(conn: socket.socket, owners: dict[int, socket.socket],
          sel: selectors.BaseSelector) -> tuple[dict[str, Any], list[int]] | None:
    """Fork for one request. Returns the request in the child; None in the server, whatever the client did (a client
    that died or sent half a request costs its own run, never the server and the other runs)."""
    fds: list[int] = []
    try:
        conn.settimeout(5)
        spec, fds = _recv_request(conn)
    except (OSError, ValueError):
        for fd in fds:
            os.close(fd)
        conn.close()
        return None
    pid = os.fork()
    if pid == 0:
        return spec, fds
    for fd in fds:
        os.close(fd)
    try:
        conn.sendall(f"{pid}\n".encode())
    except OSError:  # gone already: so is the process its parent knew
        conn.close()
        _kill(pid)
        return None
    owners[pid] = conn
    if spec.get("tie"):  # its stand-in (shim.py) is the process its parent knows: dying, it takes the child
        sel.register(conn, selectors.EVENT_READ, pid)
    return None


def become(spec: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: take the request's streams, session, folder, environment and arguments, then run it."""
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    os.chdir(spec["cwd"])
    sys.executable = spec["python"]  # the processes it starts with sys.executable are forked warm too (shim.py)
    os.environ.clear()
    os.environ.update(spec["env"])
    extra = [p for p in spec["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    argv: list[str] = spec["argv"]
    if argv[0] == "-m":
        sys.path[:] = [os.getcwd(), *extra, *spec["base_path"]]
        sys.argv = ["-m", *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(argv[0])
        sys.path[:] = [os.path.dirname(script), *extra, *spec["base_path"]]
        sys.argv = list(argv)
        runpy.run_path(script, run_name="__main__")


def exit_code(code: object) -> int:
    """``SystemExit.code`` as the interpreter turns it into a status: None 0, an int its low byte, anything else
    printed (now, before threads and atexit, as the interpreter does) and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def end(code: int, interrupted: bool = False) -> None:
    """Exit as the interpreter does (join threads, atexit, collect the child's garbage, flush the streams) but without
    tearing down the preloaded modules: every reference count that teardown touches copies a shared page (~0.4 s)."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if interrupted:  # an uncaught KeyboardInterrupt: the interpreter dies of SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


if __name__ == "__main__":
    # The parent dies, the server goes with it (PR_SET_PDEATHSIG); its children live on like any orphan.
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)
    request = serve(sys.argv[1])
    code, interrupted = 0, False
    try:
        become(*request)
    except SystemExit as exc:
        code = exit_code(exc.code)
    except BaseException as exc:
        tb = exc.__traceback__  # from the first frame of the run itself, as a new interpreter shows it
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>"):
            tb = tb.tb_next
        tb = tb or exc.__traceback__
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        code, interrupted = 1, isinstance(exc, KeyboardInterrupt)
    end(code, interrupted)
