"""Preflight doctor: ``python -m trainer.doctor [--container RUNTIME:IMAGE] [key=value ...]``.

Run it the way training runs (``srun python -m trainer.doctor`` in an allocation, ``make doctor`` locally,
or as the first step of a batch script): every rank checks what concerns it, rank 0 prints one pass/fail
table for the whole job, and every rank exits 1 when any check failed anywhere (0 otherwise, 2 on bad input).
Takes the trainer's own overrides, so it checks the run folder, backend and tracking mode training will use.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.core import config as config_mod
from trainer.core import exits
from trainer.core.env import DistEnv, discover, host_facts, job_info, without_placement
from trainer.core.errors import UserError, recorded
from trainer.core.schema import Config
from trainer.doctor.checks import (
    FAIL,
    PASS,
    SHARED_GPU_HINT,
    SKIP,
    WARN,
    Check,
    check_all_reduce,
    check_bytecode,
    check_container,
    check_gpus,
    check_master,
    check_model_memory,
    check_run_folder,
    check_scontrol,
    check_tracking,
    check_transport,
    check_versions,
    container_spec,
    shared_gpus,
)

if TYPE_CHECKING:
    import torch

EXIT_FAILED = 1


# ---- the table -----------------------------------------------------------------------------------------

def merge(per_rank: list[list[Check]], hosts: list[str]) -> list[Check]:
    """One row per check for the whole job: failures name their ranks; otherwise rank 0's view."""
    rows = []
    for i, first in enumerate(per_rank[0]):
        views = [(r, checks[i]) for r, checks in enumerate(per_rank) if i < len(checks)]
        for status in (FAIL, WARN, PASS, SKIP):
            bad = [(r, c) for r, c in views if c.status == status]
            if bad:
                break
        if status in (FAIL, WARN):
            shown = "; ".join(f"rank {r} ({hosts[r]}): {c.detail}" for r, c in bad[:3])
            more = f" (and {len(bad) - 3} more ranks)" if len(bad) > 3 else ""
            rows.append(Check(first.name, status, (shown if len(views) > 1 else bad[0][1].detail) + more, bad[0][1].hint))
        else:
            rows.append(next(c for r, c in views if c.status == status))
    return rows


def render(rows: list[Check], header: str) -> str:
    """The pass/fail table, with a HINT under every failure or warning."""
    width = max(len(r.name) for r in rows)
    lines = [header, f"{'check':<{width}}  result  detail"]
    for r in rows:
        lines.append(f"{r.name:<{width}}  {r.status:<6}  {r.detail}")
        if r.status in (FAIL, WARN) and r.hint:
            lines.append(f"{'':<{width}}          HINT: {r.hint}")
    failed = [r.name for r in rows if r.status == FAIL]
    lines.append(f"doctor: {len(failed)} check(s) failed: {', '.join(failed)}" if failed else "doctor: all checks passed")
    return "\n".join(lines)


def describe(exc: BaseException) -> str:
    """Type and first line of an exception, plus the line after NCCL's "Last error:", which names the cause."""
    lines = str(exc).splitlines() or [""]
    text = f"{type(exc).__name__}: {lines[0]}"
    after = [b for a, b in zip(lines[:-1], lines[1:], strict=True) if a.strip() == "Last error:" and b.strip()]
    return text + (f" (last error: {after[0].strip()})" if after else "")


def report_alone(checks: list[Check], env: DistEnv, host: str, why: str) -> int:
    """Without a working process group there is no gathered table: each rank prints its own failures; 1."""
    if env.rank == 0:
        print(render(checks, f"doctor: rank 0 of {env.world_size} on {host} ({why}: this rank only)"), flush=True)
    else:
        for c in checks:
            if c.status == FAIL:
                print(f"doctor: rank {env.rank} ({host}): {c.name}: FAIL {c.detail}", file=sys.stderr)
                if c.hint:
                    print(f"doctor: rank {env.rank} ({host}): HINT: {c.hint}", file=sys.stderr)
        sys.stderr.flush()
    return EXIT_FAILED


def run(args: list[str], container: str | None = None, timeout_s: float = 60.0) -> int:
    """Check this process's part, gather every rank's rows, print the table on rank 0; 1 if anything failed."""
    exits.started(None, phase="doctor")  # before anything can fail: a rank that never ends its record was killed
    cfg = config_mod.load(args)
    cfg = dataclasses.replace(cfg, dist=dataclasses.replace(cfg.dist, timeout_s=min(cfg.dist.timeout_s, timeout_s)))
    env, facts, info = discover(), host_facts(), job_info()
    host = facts.node
    checks = [check_versions(), check_bytecode(), check_gpus(cfg, env, facts, info), check_model_memory(cfg, env),
              check_master(env), check_scontrol(env, facts),
              check_tracking(cfg, info=info, env=env), check_container(container, facts)]
    from trainer.testing import faults  # here: it loads torch, which `--help` and bad arguments never need

    if faults.install().doctor_fails(host, env.rank):
        checks.append(Check("fault", FAIL, f"injected on {host} (TRAINER_FAULTS doctor_fail_node or _rank)", ""))
    code = _checked(cfg, env, checks, host, info.gpus_on_node)
    _record(env.rank, host, checks, code)
    return code


NODE_CHECKS = {"gpus", "master", "container", "nccl transport", "fault"}
"""Checks whose failure is the node's (no GPU visible, its name does not resolve, the image is missing there, its
network): the verdict excludes it. Others fail on the configuration (``model memory``: ``resource``)."""


def _record(rank: int, host: str, checks: list[Check], code: int) -> None:
    """This rank's exit record for the batch shell's verdict: a node check that failed here blames this node."""
    mine = [c for c in checks if c.status == FAIL and c.name not in ("process group", "all-reduce")]
    node = [c for c in mine if c.name in NODE_CHECKS]
    if node:
        info = exits.outcome(exits.INFRASTRUCTURE, f"doctor: {node[0].name}: {node[0].detail}", blame=[host])
    elif mine:
        kind = exits.RESOURCE if mine[0].name == "model memory" else exits.USER_ERROR
        info = exits.outcome(kind, f"doctor: {mine[0].name}: {mine[0].detail}")
    elif code:
        info = exits.outcome(exits.INFRASTRUCTURE, "doctor: a check failed on another rank", echo=True)
    else:
        info = exits.outcome(exits.FINISHED, "doctor: all checks passed")
    exits.ended(code, info, phase="doctor", rank=rank)


def _checked(cfg: Config, env: DistEnv, checks: list[Check], host: str, gpus_on_node: int) -> int:
    """The collective part of :func:`run`: 0 when every check passed on every rank, else 1."""
    from trainer.core import dist as tdist

    started = _start_group(cfg, env, checks, host, gpus_on_node)
    if started is None:
        return report_alone(checks, env, host, "no process group")
    device, debug_dir = started
    try:
        rows = _collective_checks(cfg, env, device, debug_dir, checks, host)
    finally:
        tdist.teardown()
        if debug_dir:
            shutil.rmtree(debug_dir, ignore_errors=True)
    if rows is None:
        return report_alone(checks, env, host, "the process group broke")
    return EXIT_FAILED if any(r.status == FAIL for r in rows) else 0


def _start_group(cfg: Config, env: DistEnv, checks: list[Check], host: str,
                 gpus_on_node: int) -> tuple[torch.device, Path | None] | None:
    """The device and the process group (NCCL's debug log on GPUs); None, with a failed row added, when it fails."""
    from trainer.core import dist as tdist

    debug_dir = None
    try:
        device = tdist.pick_device(env, cfg.train.device, gpus_on_node)
        if device.type == "cuda":
            # NCCL reads these at start-up; this process exists only to check, so it may set them for itself.
            debug_dir = Path(tempfile.mkdtemp(prefix="doctor-nccl-"))
            os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET", NCCL_DEBUG_FILE=f"{debug_dir}/nccl.%h.%p")
        tdist.setup(env, cfg, device)
    except Exception as exc:  # no process group: no gathered table; each rank reports its own failures
        if isinstance(exc, UserError):  # the configuration's fault on every rank (nccl without GPUs): not the node's
            checks.append(Check("configuration", FAIL, f"rank {env.rank} on {host}: {exc.field}: {exc.message}",
                                exc.hint))
        else:
            message = describe(exc)
            # NCCL forms its communicator in setup (device_id), so tasks sharing one GPU fail here.
            hint = SHARED_GPU_HINT if "Duplicate GPU" in message else \
                "start every rank as training does (srun in the allocation, or torchrun), within --timeout of each other"
            checks.append(Check("process group", FAIL, f"rank {env.rank} on {host}: {message}", hint))
        if debug_dir:
            shutil.rmtree(debug_dir, ignore_errors=True)
        return None
    return device, debug_dir


def _collective_checks(cfg: Config, env: DistEnv, device: torch.device, debug_dir: Path | None,
                       checks: list[Check], host: str) -> list[Check] | None:
    """The checks that need every rank, then every rank's rows gathered and printed by rank 0; None, with the
    failed check's row replaced in ``checks``, when a peer dies or a collective times out."""
    import torch

    step = "process group"  # the check whose collectives run now: names the row when a peer dies or times out
    try:
        checks.append(Check("process group", PASS, f"{torch.distributed.get_backend()}, {env.world_size} rank(s) on "
                            f"{env.num_nodes} node(s), via {env.source}"))
        step = "run folder"
        checks.append(check_run_folder(cfg, env))
        step = "all-reduce"
        checks.append(check_all_reduce(env, device, 64 if device.type == "cuda" else 8))
        step = "nccl transport"
        checks.append(check_transport(env, debug_dir))
        step = "process group"
        uuid = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None
        per_rank: list[list[Check] | None] = [None] * env.world_size
        gathered: list[tuple[str, str | None] | None] = [None] * env.world_size
        torch.distributed.all_gather_object(per_rank, checks)
        torch.distributed.all_gather_object(gathered, (host, uuid))
        seen = [g or ("?", None) for g in gathered]
        for r, others in shared_gpus(seen).items():  # every rank decides alike, so every rank exits alike
            shared = Check("gpus", FAIL, f"GPU {seen[r][1]} is also used by rank(s) {', '.join(map(str, others))} "
                           "on this node", SHARED_GPU_HINT)
            per_rank[r] = [shared if c.name == "gpus" else c for c in per_rank[r] or []]
        rows = merge([c or [] for c in per_rank], [h for h, _ in seen])
        if env.rank == 0:
            where = f"Slurm job {env.job_id}" if env.job_id else env.source
            print(render(rows, f"doctor: {env.world_size} rank(s) on {env.num_nodes} node(s) ({where})"), flush=True)
        torch.distributed.barrier()
    except Exception as exc:  # a peer died, a connection closed, or a collective timed out (after --timeout)
        hint = ("another rank died or stalled (its own output says why: out of memory, killed, a node failure) "
                "or the network between the nodes dropped; a stalled rank fails the others after --timeout seconds")
        checks[:] = [c for c in checks if c.name != step]
        checks.append(Check(step, FAIL, f"rank {env.rank} on {host}: {describe(exc)}", hint))
        return None
    return rows


def worst_exit(codes: list[int]) -> int:
    """One exit code for N ranks: the worst positive one; 1 when a rank died of a signal (negative) and none failed."""
    return max((c for c in codes if c > 0), default=EXIT_FAILED if any(codes) else 0)


def spawn_local(n: int, argv: list[str]) -> int:
    """``--local N``: N ranks on this machine, placed as torchrun would (without its agent's noise on failure)."""
    with socket.socket() as s:  # a free port, not a fixed one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = without_placement(os.environ)
    procs = [subprocess.Popen([sys.executable, "-m", "trainer.doctor", *argv],
                              env={**base, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(n),
                                   "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for r in range(n)]
    codes = [p.wait() for p in procs]
    for r, code in enumerate(codes):
        if code < 0:  # a signal (the OOM killer, kill -9) leaves the rank itself no chance to say so
            name = {s.value: s.name for s in signal.Signals}.get(-code, f"signal {-code}")
            print(f"doctor: rank {r} was killed by {name}", file=sys.stderr)
    return worst_exit(codes)


def check_args(local: int | None, timeout: float, container: str | None) -> None:
    """The doctor's own flags; a UserError naming the flag."""
    if local is not None and local < 1:
        raise UserError("--local", f"must be at least 1, got {local}", "the number of ranks to start here, e.g. --local 2")
    if not (math.isfinite(timeout) and timeout > 0):
        raise UserError("--timeout", f"must be a positive number of seconds, got {timeout}",
                        "how long a rank waits for the others, e.g. --timeout 60")
    if container is not None:
        container_spec(container)


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the checks; exit 0 (all passed), 1 (a check failed) or 2 (bad arguments)."""
    parser = argparse.ArgumentParser(prog="python -m trainer.doctor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--container", metavar="RUNTIME:IMAGE", help="check that apptainer|docker|pyxis and the image exist")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the other ranks (default 60)")
    parser.add_argument("--local", type=int, metavar="N", help="start N ranks on this machine (what `make doctor` does)")
    parser.add_argument("args", nargs="*", help="training overrides key=value (run.dir, tracking.mode, dist.backend …)")
    ns = parser.parse_args(argv)
    return recorded(lambda: _start(ns), phase="doctor")


def _start(ns: argparse.Namespace) -> int:
    check_args(ns.local, ns.timeout, ns.container)  # before --local starts N ranks that would each say the same
    if ns.local is not None:
        config_mod.load(ns.args)  # a bad key said once here, not by each of N ranks, their lines interleaved
        rank_argv = [*(["--container", ns.container] if ns.container is not None else []), f"--timeout={ns.timeout}",
                     *ns.args]
        return spawn_local(ns.local, rank_argv)
    return run(ns.args, ns.container, ns.timeout)

