"""Warm processes: a test's ``python -m trainer …`` forked from a process that has already imported torch.

A small tool of the tests, on the standard library alone: this module is what tests use (``Popen``, ``run``,
``children_cpu``), ``server.py`` the server it starts, ``shim.py`` the stand-in interpreter of the forked processes.

Of a small test run's ~4 CPU-seconds, ~3 are a new interpreter importing torch (and torch._dynamo, which DDP and the
optimizers import), and the suite starts a few hundred such processes on 2 cores. Here a server per pytest process
imports them once and forks each requested process from that state, sharing the import copy-on-write. In a forked
child ``sys.executable`` is a stand-in (shim.py) that has the server fork the Python processes it starts too (the
end-of-run report).

What a test gets is still a real process running the real, unmodified code with a real ``torch.distributed``: its own
pid (signals, ``killpg``, SIGKILL faults reach it), its own session (as ``start_new_session`` gives), the environment,
folder, ``sys.argv``, ``sys.path`` (``PYTHONPATH`` too) and standard streams it asked for, and its exit status
(negative for a signal, as ``subprocess`` reports it). What differs from a new interpreter: the preloaded modules are
already imported; the hash seed and the global state of ``random`` and numpy are the server's (the runs seed
their own generators); ``sys.executable`` is the stand-in; at exit (after threads, atexit and
a collection, as usual) modules are not torn down, so an object still referenced then is not finalized (nor can
a crash in that teardown show); a missing script or module is a traceback, not one line; and
``/proc/PID/cmdline`` shows the server's. Variables read before the preload (``PYTHON*`` but ``PYTHONPATH``,
``OMP_*``, ``MKL_*``, ``LD_*``, ``TORCH*``, ``CUDA*``) get a server of their own; an interpreter flag, a
``sitecustomize`` on ``PYTHONPATH`` and ``TRAINER_TEST_COLD=1`` get a new interpreter. Tests of launchers
themselves (torchrun, Slurm jobs, ``trainer.launch``, the cluster CLI) keep starting new interpreters.

``Popen`` and ``run`` take the arguments of their ``subprocess`` namesakes that the tests use.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from benchmarks.procfs import CSTIME, CUTIME, stat
from tests.warm.shim import LOAD_TIME, customized, forkable, load_time

ROOT = Path(__file__).resolve().parents[2]
SHIM = Path(__file__).with_name("shim.py")


def _load_time(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(load_time(env).items()))


class _Server:
    """A server for one load-time environment of this pytest process, started at first use and stopped at exit."""

    def __init__(self, fixed: tuple[tuple[str, str], ...]) -> None:
        self.folder = tempfile.mkdtemp(prefix="warm-")
        self.path = os.path.join(self.folder, "sock")
        env = {k: v for k, v in os.environ.items() if not k.startswith(LOAD_TIME)}
        env.update(fixed, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-u", "-m", "tests.warm.server", self.path], cwd=ROOT, env=env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)
        from tests import leftovers

        leftovers.keep(self.proc.pid)
        atexit.register(self.stop)
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline()
        if not ready:
            raise RuntimeError(f"warm server did not start (exit {self.proc.wait()})")
        self.base_path: list[str] = json.loads(ready)
        # The stand-in: shim.py as it is, run by this interpreter without site (-IS), its settings beside it.
        self.shim = os.path.join(self.folder, "python")
        Path(self.shim + ".json").write_text(json.dumps({"python": sys.executable, "socket": self.path,
                                                         "base_path": self.base_path, "fixed": dict(fixed)}))
        Path(self.shim).write_text(f"#!{sys.executable} -IS\n" + SHIM.read_text())
        os.chmod(self.shim, 0o755)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


# One per load-time environment met (an in-process test may set, say, TORCHINDUCTOR_CACHE_DIR in this process's
# environment, which the processes it starts then inherit); a server that cannot start leaves its runs cold.
_servers: dict[tuple[tuple[str, str], ...], _Server | None] = {}
MAX_SERVERS = 3


def _server_for(argv: list[str], env: dict[str, str]) -> _Server | None:
    if os.environ.get("TRAINER_TEST_COLD") == "1" or argv[:1] != [sys.executable] or not forkable(argv[1:]):
        return None
    if customized(env):  # it runs as the interpreter starts (tests/audit's write log): before any preload
        return None
    key = _load_time(env)
    server = _servers.get(key)
    if server is not None and server.proc.poll() is not None:
        del _servers[key]  # died: start another
    if key not in _servers and len(_servers) < MAX_SERVERS:
        try:
            _servers[key] = _Server(key)
        except RuntimeError:
            _servers[key] = None
    return _servers.get(key)


def children_cpu() -> float:
    """CPU seconds of the processes this pytest process's servers have forked and reaped so far."""
    total = 0.0
    for server in filter(None, _servers.values()):
        fields = stat(server.proc.pid)
        if fields is not None:
            total += (int(fields[CUTIME]) + int(fields[CSTIME])) / os.sysconf("SC_CLK_TCK")
    return total


class WarmProcess:
    """A forked process seen like a ``subprocess.Popen``: pid, streams, poll, wait, communicate, signals."""

    def __init__(self, server: _Server, args: list[str], cwd: str, env: dict[str, str], stdin: Any, stdout: Any,
                 stderr: Any, text: bool) -> None:
        self.args = args
        self.returncode: int | None = None
        ends: list[int] = []  # ours to close once the child has them
        self.stdout = self.stderr = self.stdin = None
        child_in = os.open(os.devnull, os.O_RDONLY) if stdin in (None, subprocess.DEVNULL) else stdin.fileno()
        if stdin in (None, subprocess.DEVNULL):
            ends.append(child_in)
        child_out, self.stdout = self._stream(stdout, 1, text, ends)
        if stderr == subprocess.STDOUT:
            child_err = child_out
        else:
            child_err, self.stderr = self._stream(stderr, 2, text, ends)
        spec = json.dumps({"argv": args[1:], "cwd": cwd, "env": env, "base_path": server.base_path,
                           "python": server.shim}).encode()
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(server.path)
            socket.send_fds(self._conn, [f"{len(spec)}\n".encode() + spec], [child_in, child_out, child_err])
        except OSError:  # nothing started: close what was opened for it
            self._close()
            raise
        finally:
            for fd in ends:
                os.close(fd)
        self._buffer = b""
        self._outputs: tuple[Any, Any] | None = None
        self._chunks: dict[int, list[bytes]] = {}
        self._done: set[int] = set()
        try:
            self.pid = int(self._line(None))
        except (OSError, RuntimeError):
            self._close()
            raise

    def _close(self) -> None:
        """Close our ends of its pipes and its connection (the process, if any, is not touched)."""
        for s in (self.stdout, self.stderr, self._conn):
            if s is not None:
                s.close()

    @staticmethod
    def _stream(how: Any, default: int, text: bool, ends: list[int]) -> tuple[int, IO[Any] | None]:
        if how == subprocess.PIPE:
            r, w = os.pipe()
            ends.append(w)
            return w, open(r, "r" if text else "rb", encoding="utf-8" if text else None,  # noqa: SIM115
                           errors="replace" if text else None)
        if how == subprocess.DEVNULL:
            fd = os.open(os.devnull, os.O_WRONLY)
            ends.append(fd)
            return fd, None
        return (default if how is None else how.fileno()), None

    def _line(self, timeout: float | None) -> str:
        self._conn.settimeout(timeout)
        while b"\n" not in self._buffer:
            chunk = self._conn.recv(64)
            if not chunk:
                raise RuntimeError(f"warm server lost {self.args}")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = int(self._line(0))
            except (TimeoutError, BlockingIOError):
                return None
            self._conn.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                self.returncode = int(self._line(timeout))
            except (TimeoutError, BlockingIOError):
                raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
            self._conn.close()
        return self.returncode

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """Read stdout and stderr (whichever are pipes) to their end, then wait. Again: the same output. On a
        timeout, what was read so far stays for the next call and is in the TimeoutExpired."""
        if input is not None:
            raise ValueError("warm processes take no input: their stdin is /dev/null or a file")
        if self._outputs is not None:
            self.wait(timeout)
            return self._outputs
        deadline = None if timeout is None else time.monotonic() + timeout
        streams = [s for s in (self.stdout, self.stderr) if s is not None]
        sel = selectors.DefaultSelector()
        for s in streams:
            if s.fileno() not in self._done:
                sel.register(s.fileno(), selectors.EVENT_READ)
        while sel.get_map():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                sel.close()
                out, err = self._decoded()
                raise subprocess.TimeoutExpired(self.args, timeout or 0, out, err)
            for key, _ in sel.select(left):
                data = os.read(key.fd, 1 << 16)
                if data:
                    self._chunks.setdefault(key.fd, []).append(data)
                else:
                    sel.unregister(key.fd)
                    self._done.add(key.fd)
        sel.close()
        self._outputs = self._decoded()
        for s in streams:
            s.close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self._outputs

    def _decoded(self) -> tuple[Any, Any]:
        outs = []
        for s in (self.stdout, self.stderr):
            data = b"".join(self._chunks.get(s.fileno(), [])) if s is not None and not s.closed else None
            outs.append(data.decode("utf-8", "replace") if isinstance(s, io.TextIOBase) and data is not None else data)
        return outs[0], outs[1]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> WarmProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        for s in (self.stdout, self.stderr):
            if s is not None:
                s.close()
        self.wait()


def Popen(args: list[str], *, cwd: Any = None, env: dict[str, str] | None = None, stdin: Any = None,  # noqa: N802
          stdout: Any = None, stderr: Any = None, text: bool = False, start_new_session: bool = False,
          **other: Any) -> Any:
    """``subprocess.Popen(args, …)``, forked warm when ``args`` is ``[sys.executable, "-m", mod | script, …]``
    (the child always leads its own session, as with ``start_new_session=True``, in a new interpreter too: a test
    then signals and kills the same processes either way)."""
    env = dict(os.environ if env is None else env)
    args = [str(a) for a in args]
    plain = all(h is None or h in (subprocess.PIPE, subprocess.DEVNULL, subprocess.STDOUT) or hasattr(h, "fileno")
                for h in (stdout, stderr)) and (stdin is None or stdin == subprocess.DEVNULL or hasattr(stdin, "fileno"))
    server = None if other or not plain else _server_for(args, env)
    if server is not None:
        try:
            return WarmProcess(server, args, os.path.abspath(cwd or os.getcwd()), env, stdin, stdout, stderr, text)
        except (OSError, RuntimeError) as exc:  # the server died before it forked: the next call starts another
            print(f"warm: {exc}; a new interpreter instead", file=sys.stderr)
    return subprocess.Popen(args, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr, text=text,
                            start_new_session=True, **other)


def run(args: list[str], *, cwd: Any = None, env: dict[str, str] | None = None, timeout: float | None = None,
        capture_output: bool = False, text: bool = False) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run`` over ``Popen`` above: on a timeout the process is killed and TimeoutExpired raised."""
    pipe = subprocess.PIPE if capture_output else None
    proc = Popen(args, cwd=cwd, env=env, stdout=pipe, stderr=pipe, text=text)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # Its whole session: a descendant still holding the pipes must not keep the test waiting. Then wait, not
        # read on, as subprocess.run does.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        raise
    return subprocess.CompletedProcess(args, proc.returncode, out, err)
