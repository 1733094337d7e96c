"""tests/warm/: a forked process ends, prints and reacts as the same command in a new interpreter does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from . import warm
from .conftest import clean_env

forked_only = pytest.mark.skipif(os.environ.get("TRAINER_TEST_COLD") == "1",
                                 reason="TRAINER_TEST_COLD=1: every process starts a new interpreter, none is forked")

SCRIPTS = {
    "exit code": "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)",
    "exit message": "import sys; sys.exit('bad thing')",
    "traceback": "raise ValueError('boom')",
    "exit -1": "import sys; sys.exit(-1)",
    "exit 2.5": "import atexit, sys; atexit.register(lambda: print('after')); sys.exit(2.5)",
    "keyboard interrupt": "raise KeyboardInterrupt",
    "killed by a signal": "import os, signal; print('x', flush=True); os.kill(os.getpid(), signal.SIGKILL)",
    "argv, folder, path, env": "import os, sys; print(sys.argv[1:], os.getcwd(), sys.path[:2], os.environ['MARK'])",
    "atexit and threads": ("import atexit, threading, time\natexit.register(lambda: print('atexit'))\n"
                           "threading.Thread(target=lambda: (time.sleep(0.3), print('thread'))).start()"),
    "a child of its own": ("import subprocess, sys\nr = subprocess.run([sys.executable, '-m', 'json.tool', '--help'], "
                           "capture_output=True, text=True)\nprint(r.returncode, r.stdout.split()[0])"),
    "a child killed by SIGKILL": ("import os, signal, subprocess, sys\nif sys.argv[1:] == ['child']:\n"
                                  "    os.kill(os.getpid(), signal.SIGKILL)\n"
                                  "print(subprocess.run([sys.executable, __file__, 'child']).returncode)"),
}


@forked_only
@pytest.mark.parametrize("name", list(SCRIPTS))
def test_a_forked_run_matches_a_new_interpreter(name: str, tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPTS[name])
    env = clean_env({"MARK": "it's here", "PYTHONPATH": str(tmp_path / "lib")})
    argv = [sys.executable, str(script), "a b", "c"]
    forked = warm.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    new = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert isinstance(warm.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL), warm.WarmProcess)
    assert (forked.returncode, forked.stdout, forked.stderr) == (new.returncode, new.stdout, new.stderr)


@forked_only
def test_a_module_run_gets_its_cwd_first_on_the_path(tmp_path: Path) -> None:
    (tmp_path / "mod.py").write_text("import sys; print(sys.argv, sys.path[0])")
    argv = [sys.executable, "-m", "mod", "x"]
    forked = warm.run(argv, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=60)
    new = subprocess.run(argv, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert forked.stdout == new.stdout and str(tmp_path) in forked.stdout


@forked_only
def test_signals_reach_it_and_its_stand_in_takes_its_child_along(tmp_path: Path) -> None:
    """SIGTERM to a child started through the stand-in interpreter reaches the child; SIGKILL to the stand-in ends the
    child too, as killing the process its parent knows would."""
    pidfile = tmp_path / "grandchild.pid"
    (tmp_path / "sleeper.py").write_text(f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); "
                                         "time.sleep(60)")
    (tmp_path / "parent.py").write_text(
        "import os, subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"q = subprocess.Popen([sys.executable, {str(tmp_path / 'sleeper.py')!r}])\n"
        f"while not os.path.exists({str(pidfile)!r}): time.sleep(0.05)\n"
        "p.terminate(); q.kill(); print(p.wait(), q.wait())\n")
    proc = warm.Popen([sys.executable, str(tmp_path / "parent.py")], cwd=tmp_path, env=clean_env(),
                      stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.split() == ["-15", "-9"]
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 30
    while Path(f"/proc/{grandchild}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{grandchild}").exists()
    sleeper = warm.Popen([sys.executable, str(tmp_path / "sleeper.py")], cwd=tmp_path, env=clean_env())
    time.sleep(0.5)
    sleeper.send_signal(signal.SIGTERM)
    assert sleeper.wait(10) == -signal.SIGTERM and os.getpgid(os.getpid()) != sleeper.pid


def test_what_a_fork_cannot_give_gets_a_new_interpreter(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("")
    for argv, env in [([sys.executable, "-c", "pass"], clean_env()),
                      ([sys.executable, "-X", "dev", "-m", "json.tool"], clean_env()),
                      ([sys.executable, "-m", "json.tool"], clean_env({"PYTHONPATH": str(tmp_path)}))]:
        proc = warm.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
        assert isinstance(proc, subprocess.Popen), argv
        proc.wait()


@forked_only
def test_a_timeout_kills_its_session_and_keeps_what_was_read(tmp_path: Path) -> None:
    """A descendant holding the output pipe does not keep ``run`` waiting past its timeout."""
    script, begun = tmp_path / "holds.py", tmp_path / "begun"
    script.write_text("import pathlib, subprocess, sys, time\nprint('begun', flush=True)\n"
                      f"pathlib.Path({str(begun)!r}).touch()\n"
                      "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\ntime.sleep(60)")
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        warm.run([sys.executable, str(script)], cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                 timeout=3)
    assert time.monotonic() - start < 40  # not the 60 s its descendant holds the pipe
    begun.unlink(missing_ok=True)
    proc = warm.Popen([sys.executable, str(script)], cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not begun.exists() and time.monotonic() < deadline:  # its line is written: a timeout now keeps it
        time.sleep(0.05)
    with pytest.raises(subprocess.TimeoutExpired) as expired:
        proc.communicate(timeout=1)
    assert expired.value.output == "begun\n"
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.communicate(timeout=30)[0] == "begun\n" and proc.returncode == -signal.SIGKILL


def test_the_harness_is_a_tool_of_its_own_on_the_standard_library() -> None:
    """Importing the harness, its server (before it preloads) and the stand-in loads no project or third-party
    module: what it forks is the project's code, unmixed with its own."""
    code = ("import sys, tests.warm, tests.warm.server, tests.warm.shim\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'trainer', 'cluster', 'torch', 'numpy', 'pytest'}))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent.parent, env=clean_env(),
                          capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (0, "[]\n"), proc.stderr
