"""What every benchmark shares: the machine's description, launching runs, and interleaved A/B pairs.

Every comparison runs as interleaved pairs in one invocation (A B, B A, A B, …), so slow drift in the machine's load
hits both sides alike; each pair gives one ratio, and a result is the median ratio shown with its min and max (the noise).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from trainer.core.env import without_placement

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor()
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "gpus": gpus, "platform": platform.platform()}


def pairs(n: int, a: Callable[[], T], b: Callable[[], T], start: int = 0) -> list[tuple[T, T]]:
    """``n`` interleaved pairs (A, B), run A B, B A, A B, …: neither side always runs first, or always after the
    other (whose writes the disk may still be settling). ``start``: the index of the first pair, for a series of
    pairs made one call at a time."""
    out = []
    for i in range(start, start + n):
        if i % 2:
            second = b()
            out.append((a(), second))
        else:
            first = a()
            out.append((first, b()))
    return out


def spread(values: list[float]) -> dict[str, Any]:
    """Every value, their median, min and max."""
    return {"values": values, "median": statistics.median(values), "min": min(values), "max": max(values)}


def show(s: dict[str, Any], fmt: str = "{:.2f}×") -> str:
    """``median (min … max)`` for a table cell."""
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}–{fmt.format(s['max'])})"


def each(s: dict[str, Any]) -> str:
    """Every pair's value, in order."""
    return ", ".join(f"{v:.2f}" for v in s["values"])


def clean_env() -> dict[str, str]:
    env = without_placement(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def torchrun(nproc: int, target: list[str], ok_if: str = "",
             extra: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``target`` under a local torchrun (``extra``: variables on top of a clean environment); return the finished
    process and when it was launched."""
    launched = time.time()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           *target], env={**clean_env(), **(extra or {})}, cwd=ROOT, capture_output=True, text=True,
                          timeout=1800)
    if proc.returncode and not (ok_if and ok_if in proc.stdout):
        raise RuntimeError(f"{' '.join(target)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc, launched


def ranks(nproc: int, target: list[str]) -> str:
    """Run ``target`` as ``nproc`` ranks started directly, as srun starts them (no torchrun agent: for measurements
    inside the ranks, where launching is not what is measured); rank 0's output."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [subprocess.Popen([sys.executable, *target], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={**clean_env(), "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
                                              "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                                              "MASTER_PORT": port})
             for r in range(nproc)]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{' '.join(target)} failed:\n" + "\n".join(o[-2000:] for o in outs))
    return outs[0]


def trainer_run(nproc: int, args: list[str], tmp: Path, device: str = "cpu") -> dict[str, Any]:
    """The built-in trainer: its result.json, plus launch → first optimizer step in seconds."""
    run = Path(tempfile.mkdtemp(dir=tmp))
    # As with the bare loop: gloo's teardown occasionally aborts a rank after the run finished; result.json counts.
    _, launched = torchrun(nproc, ["-m", "trainer", *args, f"run.dir={run}", f"train.device={device}",
                                   "tracking.mode=disabled", "checkpoint.resume=never", "run.report=false"],
                          ok_if="\ndone: test accuracy")  # the report, made once training ended, is not measured
    result: dict[str, Any] = json.loads((run / "result.json").read_text())
    result["launch_to_first_step_s"] = result["first_step_at"] - launched
    shutil.rmtree(run)
    return result


def bare_run(nproc: int, batch: int, size: int, device: str = "cpu") -> dict[str, Any]:
    """The tutorials' loop (benchmarks/bare_ddp.py) on the same model, data and batch."""
    # Its gloo teardown sometimes aborts after it has printed its figures: those still count.
    proc, launched = torchrun(nproc, [str(ROOT / "benchmarks" / "bare_ddp.py"), f"--batch-size={batch}",
                                      f"--train-size={size}", f"--device={device}"], ok_if='"train_samples_per_s"')
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["launch_to_first_step_s"] = result["first_step_at"] - launched
    return result


def publish(out: Path, name: str | None, results: dict[str, Any], lines: list[str]) -> None:
    """A benchmark's end: its results as ``out``/benchmarks-<name>.json (``name`` None: kept by the caller), its
    section spliced into ``out``/benchmarks.md when that page exists, and the section printed."""
    if name is not None:
        (out / f"benchmarks-{name}.json").write_text(json.dumps(results, indent=1) + "\n")
    if (out / "benchmarks.md").exists():
        splice(out / "benchmarks.md", lines)
    print("\n".join(lines))


def splice(md: Path, lines: list[str]) -> None:
    """Put a section (``lines``, its first line the ``## N. Title`` heading) into an existing docs/benchmarks.md:
    in place of the section of that number, else before the first section numbered higher, else at the end."""
    text = md.read_text()
    number = int(re.match(r"## (\d+)\.", lines[0]).group(1))  # type: ignore[union-attr]
    heads = [(int(m.group(1)), m.start()) for m in re.finditer(r"^## (\d+)\.", text, re.M)]
    same = [at for n, at in heads if n == number]
    later = [at for n, at in heads if n > number]
    block = "\n".join(lines).rstrip("\n") + "\n\n"
    if same:
        end = min([at for at in later if at > same[0]] or [len(text)])
        text = text[:same[0]] + block + text[end:]
    else:
        at = min(later or [len(text)])
        text = text[:at] + ("" if at == len(text) and text.endswith("\n\n") else "\n" if at == len(text) else "") \
            + block + text[at:]
    md.write_text(text)


def dev_cluster_env(version: str = "") -> dict[str, str] | None:
    """The environment that talks to the dev cluster of Slurm ``version`` ("": this machine's own), from its ``env``
    lines (``$PATH`` expanded); None when it is down."""
    base = {**clean_env(), **({"SLURM": version} if version else {})}
    script = str(ROOT / "slurm" / "dev-cluster.sh")
    if subprocess.run(["bash", script, "status"], env=base, capture_output=True).returncode:
        return None
    env = dict(base)
    for line in subprocess.run(["bash", script, "env"], env=base, capture_output=True, text=True).stdout.splitlines():
        m = re.fullmatch(r"export (\w+)=(.*)", line.strip())
        if m:
            env[m.group(1)] = string.Template(" ".join(shlex.split(m.group(2)))).safe_substitute(env)
    return env


def standalone(name: str, measure: Callable[[int, Path], dict[str, Any]], section: Callable[[dict[str, Any]], list[str]],
               doc: str, option: str = "repeats", default: int = 3) -> int:
    """``python -m benchmarks.NAME``: measure one section alone (``--OPTION N``), publish it, exit 0."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument(f"--{option}", type=int, default=default)
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    a = parser.parse_args()
    with tempfile.TemporaryDirectory() as t:
        results = measure(getattr(a, option), Path(t))
    publish(a.out, name, results, section(results))
    return 0 if results.get("same_result", True) else 1

