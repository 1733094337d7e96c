"""The preflight doctor's individual checks: each returns one table row (a :class:`Check`) for this rank."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainer.core.env import DistEnv, HostFacts, JobInfo, host_facts, job_info
from trainer.core.errors import UserError
from trainer.core.schema import Config

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "skip"
NODE = host_facts().node
"""This node's name in messages: Slurm's (SLURMD_NODENAME), else the host name."""
RUNTIMES = ("apptainer", "docker", "pyxis")
SHARED_GPU_HINT = ("give each task its own GPU: --gpus-per-task=1 (or --gpu-bind=single:1), "
                   "or ntasks-per-node = the node's GPU count")


@dataclass
class Check:
    """One row of the table, as one rank saw it."""

    name: str
    status: str
    detail: str
    hint: str = ""


# ---- checks that need no other rank --------------------------------------------------------------

def check_versions(python: tuple[int, ...] = tuple(sys.version_info[:3])) -> Check:
    """Python, torch, CUDA and NCCL versions (fails only when torch has no distributed support; warns where this
    Python can hang a forked loader worker)."""
    import torch
    import torch.distributed as dist

    from trainer.data.workers import hangs_in_fork

    parts = [f"python {'.'.join(map(str, python))}", f"torch {torch.__version__}"]
    if torch.version.cuda:
        parts.append(f"CUDA {torch.version.cuda}")
    if torch.cuda.is_available():
        parts.append("NCCL " + ".".join(map(str, torch.cuda.nccl.version())))
    if not dist.is_available():
        return Check("versions", FAIL, ", ".join(parts) + ": built without torch.distributed",
                     "install a torch wheel from pytorch.org (the default ones include distributed)")
    if hangs_in_fork(python):
        return Check("versions", WARN, ", ".join(parts) + ": this Python can hang a loader worker inside fork (CPython "
                     "gh-112275); the session finds such a worker within 10 s and forks it again",
                     "use Python 3.11.10+ or 3.12.1+ (or data.num_workers=0: no worker processes)")
    return Check("versions", PASS, ", ".join(parts))


BYTECODE_PROBE = ("_dynamo", "convert_frame.py")
"""A module of torch's that every start imports (the first optimizer does), and among the costliest to compile."""


def check_bytecode(torch_dir: Path | None = None, dont_write: bool | None = None) -> Check:
    """Whether torch starts from cached bytecode: where none is cached and this Python cannot keep it
    (PYTHONDONTWRITEBYTECODE, a read-only image), every start of every rank compiles torch's sources again."""
    import importlib.util

    if torch_dir is None:
        import torch

        torch_dir = Path(torch.__file__).parent
    dont_write = sys.dont_write_bytecode if dont_write is None else dont_write
    source = torch_dir.joinpath(*BYTECODE_PROBE)
    if not source.exists():
        return Check("bytecode", SKIP, f"{source} not found")
    cached = Path(importlib.util.cache_from_source(str(source)))
    if cached.exists():
        return Check("bytecode", PASS, "torch's modules start from cached bytecode")
    folder = next(p for p in (cached.parent, *cached.parents) if p.exists())
    why = "PYTHONDONTWRITEBYTECODE is set" if dont_write else "" if os.access(folder, os.W_OK) else f"{folder} is read-only"
    if not why:
        return Check("bytecode", PASS, "torch's bytecode is not cached yet: the first start keeps it")
    return Check("bytecode", WARN, f"no cached bytecode for torch and {why}: every start compiles torch's sources "
                 "again (about 6 s a start on 2 cores: torch and torch._dynamo import in 9.9 s instead of 3.3)",
                 f"compile them once where torch is installed (the image): python -m compileall -q -j 0 {torch_dir}")


def check_gpus(cfg: Config, env: DistEnv, facts: HostFacts, info: JobInfo) -> Check:
    """GPUs visible to this process against the tasks on its node and CUDA_VISIBLE_DEVICES."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cvd = f"CUDA_VISIBLE_DEVICES={facts.cuda_visible_devices}" if facts.cuda_visible_devices is not None \
        else "CUDA_VISIBLE_DEVICES unset"
    if count == 0:
        if cfg.train.device == "cuda" and not info.gpus_on_node:  # asked for, never allocated: the job's, not the node's
            return Check("train.device", FAIL, f"train.device=cuda, but this task has no GPU ({cvd}; Slurm allocated "
                         "none on this node)", "ask the profile for GPUs (gpus_per_node), or train.device=auto")
        if info.gpus_on_node:
            return Check("gpus", FAIL, f"torch sees no GPU ({cvd}; Slurm allocated {info.gpus_on_node} on this node)",
                         "check the driver (nvidia-smi), `--nv` for apptainer / `--gpus` for docker, "
                         "and that the torch wheel is a CUDA build")
        return Check("gpus", SKIP, f"no GPU ({cvd}): training runs on the CPU")
    from trainer.core.dist import gpu_index

    tasks = env.local_world_size
    try:  # the trainer's own choice, from the same facts
        index = gpu_index(count, env, info.gpus_on_node)
    except UserError as err:
        return Check("gpus", FAIL, f"{err.message} ({cvd})", err.hint)
    if count > tasks:
        return Check("gpus", WARN, f"{count} GPUs visible, {tasks} processes on this node: {count - tasks} idle ({cvd})",
                     "raise tasks per node to the GPU count, or allocate fewer GPUs")
    return Check("gpus", PASS, f"{count} visible, local rank {env.local_rank} → cuda:{index} ({cvd})")


def check_model_memory(cfg: Config, env: DistEnv) -> Check:
    """Whether the model's weights, gradients and optimizer state fit one GPU with this strategy (meta-device count)."""
    import torch

    if not torch.cuda.is_available() or cfg.train.device == "cpu":
        return Check("model memory", SKIP, "no GPU")
    from trainer.builtin.build import check as build_check

    params = build_check(cfg)
    if params is None:
        return Check("model memory", SKIP, "the model cannot be built on the meta device to count its parameters")
    gpu = torch.cuda.get_device_properties(env.local_rank % torch.cuda.device_count()).total_memory
    advice = memory_advice(params, cfg.optim.name, gpu, cfg.dist.sharded, env.world_size)
    if advice:
        return Check("model memory", FAIL, *advice)
    return Check("model memory", PASS, f"{params / 1e6:.1f}M parameters fit ({cfg.dist.strategy})")


def check_master(env: DistEnv) -> Check:
    """MASTER_ADDR resolves here; on the head node (rank 0) the rendezvous port can be bound."""
    if env.world_size == 1:
        return Check("master", SKIP, "one process: no rendezvous")
    from trainer.core.dist import resolve_master

    try:
        addr = resolve_master(env)
    except UserError as err:
        return Check("master", FAIL, f"{env.master_addr!r} does not resolve on {NODE}", err.hint)
    where = f"{env.master_addr}:{env.master_port} ({addr})"
    if env.rank != 0 or env.agent:  # torchrun's agent already holds its port
        return Check("master", PASS, f"{where} resolves")
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", env.master_port))
        except OSError as exc:
            return Check("master", FAIL, f"port {env.master_port} cannot be bound on {NODE} ({exc.strerror})",
                         "another job or process uses it: set MASTER_PORT to a free port (15000-30000)")
    return Check("master", PASS, f"{where} resolves and binds on the head node")


def check_scontrol(env: DistEnv, facts: HostFacts) -> Check:
    """Rank 0 requeues after a signalled save: it needs a working ``scontrol`` (or the batch shell does)."""
    if not env.job_id:
        return Check("scontrol", SKIP, "not in a Slurm job")
    if env.rank != 0:
        return Check("scontrol", SKIP, "only rank 0 requeues")
    exe = shutil.which("scontrol")
    if exe is None:
        if facts.container:
            return Check("scontrol", PASS, f"not in the {facts.container} image: the batch script requeues from outside")
        return Check("scontrol", FAIL, "scontrol is not on PATH: a preempted job could not requeue itself",
                     "add Slurm's bin folder to PATH in the profile's setup lines")
    try:
        proc = subprocess.run([exe, "show", "job", env.job_id], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return Check("scontrol", FAIL, "`scontrol show job` got no answer in 20 s", "check that slurmctld is reachable")
    if proc.returncode:
        return Check("scontrol", FAIL, f"`scontrol show job {env.job_id}` failed: {proc.stderr.strip()[:200]}",
                     "check SLURM_CONF and munge on the compute nodes")
    return Check("scontrol", PASS, f"reaches slurmctld (job {env.job_id})")


def check_tracking(cfg: Config, env: DistEnv, info: JobInfo) -> Check:
    """The W&B mode training would use, from rank 0 (the only rank that tracks)."""
    if env.rank != 0:
        return Check("tracking", SKIP, "only rank 0 tracks")
    from trainer.runtime.records.tracking import resolve_mode

    mode = resolve_mode(cfg.tracking.mode, info)
    if mode == "online" and not info.wandb_key:
        return Check("tracking", FAIL, "tracking.mode=online but no W&B key (WANDB_API_KEY or ~/.netrc)",
                     "export WANDB_API_KEY (Slurm passes it on), or tracking.mode=offline and `make sync` later")
    detail = {"online": "W&B online", "disabled": "W&B disabled",
              "offline": "W&B offline: upload later with `make sync`"}[mode]
    if cfg.tracking.mode == "auto":
        detail += " (auto: " + ("key and route to W&B found)" if mode == "online" else "no key, or no route to W&B)")
    return Check("tracking", PASS, detail)


def container_spec(spec: str) -> tuple[str, str]:
    """``RUNTIME:IMAGE`` split at the first colon (an image may carry a ``:tag``); a UserError when malformed."""
    runtime, colon, image = spec.partition(":")
    hint = "--container apptainer:PATH.sif, docker:IMAGE[:TAG] or pyxis:IMAGE"
    if runtime not in RUNTIMES:
        raise UserError("--container", f"unknown runtime {runtime!r} in {spec!r} (known: {', '.join(RUNTIMES)})", hint)
    if not colon or not image:
        raise UserError("--container", f"{spec!r} names no image after {runtime}:", hint)
    return runtime, image


def check_container(spec: str | None, facts: HostFacts) -> Check:
    """With ``--container RUNTIME:IMAGE``: the runtime is installed and the image is there."""
    if not spec:
        if facts.container:
            return Check("container", PASS, f"running inside a {facts.container} container")
        return Check("container", SKIP, "no container")
    runtime, image = container_spec(spec)  # main() has validated it: this raises only for a direct caller
    if runtime == "pyxis":
        exe = shutil.which("srun")
    else:
        exe = shutil.which(runtime) or (shutil.which("podman") if runtime == "docker" else shutil.which("singularity"))
    if exe is None:
        return Check("container", FAIL, f"{runtime} is not installed on {NODE}",
                     "load its module in the profile's setup lines, or use another runtime")
    if runtime == "apptainer" or image.endswith(".sqsh"):
        if not Path(image).is_file():
            return Check("container", FAIL, f"image file {image!r} is missing on {NODE}",
                         "build it with `make sif` onto storage every node shares")
        return Check("container", PASS, f"{runtime}, {image} ({Path(image).stat().st_size / 2**30:.1f} GiB)")
    if runtime == "docker":
        proc = subprocess.run([exe, "image", "inspect", image], capture_output=True, text=True, timeout=60)
        if proc.returncode:
            return Check("container", FAIL, f"image {image!r} is not on {NODE}",
                         "`make docker IMAGE=…` there, or `docker load` an archive")
        return Check("container", PASS, f"{Path(exe).name}, image {image} present")
    return Check("container", PASS, f"pyxis (srun found); {image} is pulled when the step starts")


# ---- checks that need every rank -------------------------------------------------------------------

def check_run_folder(cfg: Config, env: DistEnv) -> Check:
    """Every rank writes a probe file; rank 0 must see all of them (a folder on shared storage)."""
    import torch.distributed as dist

    root = Path(cfg.run.dir or job_info().run_dir or "runs").absolute()  # RUN_DIR: the batch script's run folder
    token = [f"{env.job_id or 'local'}-{os.getpid()}-{time.time_ns() % 10**9}"]
    dist.broadcast_object_list(token, src=0)
    probe = root / f".doctor-{token[0]}"
    mine: str | None = None
    try:
        probe.mkdir(parents=True, exist_ok=True)
        (probe / f"rank_{env.rank}").write_text(NODE)
    except OSError as exc:
        mine = f"cannot write {str(root)!r} on {NODE}: {exc.strerror or exc}"
    errors: list[str | None] = [None] * env.world_size
    dist.all_gather_object(errors, mine)  # every rank has written (or failed) once this returns
    hint = "set run.dir (or RUN_DIR) to a folder this user can write, on storage every node shares"
    if mine:
        return Check("run folder", FAIL, mine, hint)
    if env.rank != 0:
        return Check("run folder", PASS, f"{root} writable")
    unseen = [r for r in range(env.world_size) if errors[r] is None and not (probe / f"rank_{r}").exists()]
    shutil.rmtree(probe, ignore_errors=True)
    if unseen:
        return Check("run folder", FAIL, f"rank 0 cannot see the files ranks {unseen} wrote in {root}: not shared storage",
                     hint)
    return Check("run folder", PASS, f"{root} writable by all {env.world_size} rank(s) and shared")


def check_all_reduce(env: DistEnv, device: object, megabytes: int) -> Check:
    """A short all-reduce; the bus bandwidth the way nccl-tests reports it."""
    import torch
    import torch.distributed as dist

    if env.world_size == 1:
        return Check("all-reduce", SKIP, "one process")
    x = torch.ones(megabytes * 2**20 // 4, device=device)  # type: ignore[call-overload]
    dist.all_reduce(x)  # warm-up (NCCL sets up its rings here)
    sync: Callable[[], None] = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    sync()
    dist.barrier()
    t0, n = time.perf_counter(), 5
    for _ in range(n):
        dist.all_reduce(x)
    sync()
    elapsed = (time.perf_counter() - t0) / n
    expected = float(env.world_size) ** (n + 1)  # ones, summed n+1 times across the ranks
    if not torch.allclose(x[:1].cpu(), torch.tensor([expected])):
        return Check("all-reduce", FAIL, f"wrong sum {x[0].item()} (expected {expected})", "a broken interconnect or driver")
    bus = x.numel() * 4 / elapsed * 2 * (env.world_size - 1) / env.world_size / 1e9
    backend = dist.get_backend()
    return Check("all-reduce", PASS, f"{backend}, {megabytes} MiB: {elapsed * 1e3:.1f} ms, bus bandwidth {bus:.2f} GB/s")


def check_transport(env: DistEnv, debug_dir: Path | None) -> Check:
    """From NCCL's own INFO log: InfiniBand, sockets, or node-local paths between the GPUs."""
    if debug_dir is None:
        return Check("nccl transport", SKIP, "CPU run (gloo)")
    text = "".join(p.read_text(errors="replace") for p in debug_dir.glob("nccl.*"))
    used = sorted({part.split()[0] for part in text.split(" via ")[1:] if part.strip()})
    net = "InfiniBand" if "NET/IB" in text else "sockets" if "NET/Socket" in text else "unknown"
    detail = f"network plugin: {net}; channels via {', '.join(used) or 'n/a'}"
    if env.num_nodes > 1 and net == "sockets":
        return Check("nccl transport", WARN, detail + ": TCP sockets between nodes",
                     "on InfiniBand clusters load the IB stack in the image and check NCCL_IB_HCA / NCCL_SOCKET_IFNAME")
    return Check("nccl transport", PASS, detail)


def shared_gpus(seen: list[tuple[str, str | None]]) -> dict[int, list[int]]:
    """Each rank that drives the same GPU as another rank on its node -> those other ranks.

    ``seen[r]`` is rank r's (node, GPU UUID), the UUID None on the CPU. Slurm can show every task of a node
    the same single GPU (no per-task binding); ``check_gpus`` alone passes that, NCCL then fails with
    "Duplicate GPU detected".
    """
    shared = {r: [o for o, other in enumerate(seen) if o != r and other == mine]
              for r, mine in enumerate(seen) if mine[1] is not None}
    return {r: others for r, others in shared.items() if others}


STATE_COPIES = {"sgd": 1, "adamw": 2}
"""Optimizer state per parameter, in parameter-sized tensors (SGD's momentum; Adam's two moments)."""


def memory_advice(params: int, optimizer: str, gpu_bytes: int, sharded: bool, world: int) -> tuple[str, str] | None:
    """(what does not fit, what to do) when fp32 parameters + gradients + optimizer state would fill more than 80 %
    of one GPU with this strategy; None when they fit (activations come on top: this is the floor)."""
    total = 4 * params * (2 + STATE_COPIES.get(optimizer, 2))
    per_rank = total / max(1, world) if sharded else total
    if per_rank <= 0.8 * gpu_bytes:
        return None
    what = (f"{params / 1e6:.0f}M parameters need {per_rank / 2**30:.1f} GiB per GPU for weights, gradients and "
            f"{optimizer} state ({'fsdp' if sharded else 'ddp'}), of {gpu_bytes / 2**30:.0f} GiB")
    if not sharded:
        return what, (f"dist.strategy=fsdp splits them across the processes: about {total / max(1, world) / 2**30:.1f} "
                      f"GiB each on {world}; more GPUs lower it further")
    return what, f"run on more GPUs (each keeps 1/N of it), e.g. {2 * world} processes"
