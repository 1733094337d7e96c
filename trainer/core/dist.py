"""Process group: nccl on CUDA, gloo on CPU; bounded timeouts; one device per process."""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainer.core import exits
from trainer.core.env import DistEnv, StoreAddress
from trainer.core.errors import UserError
from trainer.core.regroup import Membership
from trainer.core.schema import Config

_HOST_GROUP: Any = None


def pick_device(env: DistEnv, want: str, gpus_on_node: int = 0) -> torch.device:
    """``cuda:<gpu_index>`` when CUDA is there and wanted, else the CPU (``gpus_on_node``: SLURM_GPUS_ON_NODE)."""
    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", gpu_index(torch.cuda.device_count(), env, gpus_on_node))


def cpu_threads(env: DistEnv, allowed: int, node_cpus: int, omp: str | None) -> int | None:
    """torch's intra-op threads for this rank, or None where OMP_NUM_THREADS decides (torch reads it itself).

    A rank bound to fewer CPUs than the node has (Slurm's --cpu-bind, taskset) runs on all of its own; ranks that
    see the whole node share it among the local ranks: torch alone would give each every core, so 8 ranks of a
    128-core node ran 128 threads each. Loader workers inherit the rank's CPU set and run one thread each."""
    if omp:
        return None
    if allowed < node_cpus:
        return max(1, allowed)
    return max(1, node_cpus // max(1, env.local_world_size))


def use_cpu_threads(env: DistEnv) -> None:
    """Set torch's intra-op threads as :func:`cpu_threads` decides from this process's CPU set, where torch still has
    its own default (every CPU of the set): a count the user's code set before the session stands."""
    allowed = len(os.sched_getaffinity(0))
    threads = cpu_threads(env, allowed, os.cpu_count() or 1, os.environ.get("OMP_NUM_THREADS"))
    if threads and torch.get_num_threads() == allowed:
        torch.set_num_threads(threads)


def gpu_index(visible: int, env: DistEnv, gpus_on_node: int = 0) -> int:
    """Which of the ``visible`` GPUs this process trains on, or a UserError naming a layout that cannot work.

    Where every local rank sees the node's GPUs (torchrun's workers; srun without GPU binding), rank r takes GPU r.
    Where a task sees fewer GPUs than there are tasks on its node, Slurm bound GPUs to tasks (--gpus-per-task,
    --gpu-bind), each sees only its own and takes the first, unless the tasks' sets cannot all be disjoint among the
    ``gpus_on_node`` Slurm allocated (0: not known): then two would share a GPU, which NCCL refuses mid-start-up."""
    tasks, local = env.local_world_size, env.local_rank
    if visible == 0:
        raise UserError("train.device", "cuda was asked for but no GPU is visible", "use train.device=cpu or auto")
    if env.agent or visible >= tasks or not gpus_on_node:  # every local rank sees the same GPUs, or cannot tell
        if local < visible:
            return local
        if visible == 1 and not env.agent and not gpus_on_node:  # bound per task by a launcher that does not say
            return 0
        raise UserError("LOCAL_RANK", f"local rank {local} has no GPU of its own: {tasks} processes on this node, "
                        f"{visible} GPU(s) visible",
                        f"start one process per GPU (make train NPROC={visible}, torchrun --nproc-per-node={visible}, "
                        "Slurm: ntasks-per-node = gpus-per-node), or train on the CPU with train.device=cpu")
    if visible * tasks > gpus_on_node:  # not one set of its own per task: some GPU is seen by two tasks
        raise UserError("LOCAL_RANK", f"{tasks} tasks on this node each see {visible} of the {gpus_on_node} GPU(s) "
                        "Slurm allocated here: tasks would share a GPU",
                        f"one task per GPU: --gpus-per-node={tasks} (or --gpus-per-task=1), or "
                        f"--ntasks-per-node={gpus_on_node}; or train on the CPU with train.device=cpu")
    return 0


def resolve_master(env: DistEnv) -> str:
    """MASTER_ADDR's address as this node resolves it; a UserError (with the fix) when it does not."""
    try:
        return str(socket.getaddrinfo(env.master_addr, env.master_port, type=socket.SOCK_STREAM)[0][4][0])
    except OSError:
        raise UserError(
            "MASTER_ADDR",
            f"host {env.master_addr!r} does not resolve on {socket.gethostname()}",
            "every node must resolve the first node's name (DNS or /etc/hosts), or set MASTER_ADDR to its IP",
        ) from None


def setup(env: DistEnv, cfg: Config, device: torch.device, store: StoreAddress | None = None,
          spare: int | None = None) -> Membership | None:
    """Join the process group of all ranks; a lone process gets an in-memory group (no port needed). With ``store``
    (the job's store in a process of its own) through it, and this rank's membership, which can regroup, returned;
    ``spare``: a warm spare's number, which waits until a lost rank's place is its own (see ``placed``)."""
    backend = cfg.dist.backend if cfg.dist.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise UserError("dist.backend", "nccl needs CUDA devices", "use dist.backend=gloo (or auto) on the CPU")
    timeout = timedelta(seconds=cfg.dist.timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if env.world_size == 1 and spare is None:  # a spare's own step may have one task: it joins the job's group
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)  # type: ignore[attr-defined]
        return None
    membership = None
    if store:
        try:
            membership = Membership(store.host, store.port, store.presence, env.rank, env.world_size, backend, timeout,
                                    spare)
            exits.went_on_without(membership.replaced())  # a spare's end record names the ranks it replaced
        except (RuntimeError, OSError) as exc:
            if _timed_out(exc) and "trying to connect" not in str(exc):  # the store answered; a peer never came
                raise _not_all_came(env, f"the job's store at {store.host}:{store.port}", timeout, True) from None
            raise UserError("TRAINER_STORE", f"rank {env.rank}: the job's store at {store.host}:{store.port} did "
                            f"not answer: {(str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]}",
                            "start python -m trainer.store first (the batch script does), or unset TRAINER_STORE") \
                from None
    else:
        _join(env, backend, timeout, device)
    _host_group(backend)
    return membership


def regroup(membership: Membership, env: DistEnv) -> DistEnv:
    """Collective among the survivors of a failed collective (and spares taking lost ranks' places): leave the
    failed group, make the next generation's, and return ``env`` with this rank's place in it. Nothing may hold the
    failed group any more (DDP's reducer, an exception's frames): its sockets close only once it is freed, and a
    survivor waiting in it for this rank learns of the loss from that."""
    global _HOST_GROUP
    _HOST_GROUP = None
    membership.next()
    _host_group(membership.backend)
    return placed(env, membership)


def placed(env: DistEnv, membership: Membership) -> DistEnv:
    """``env`` with this process's rank and world size in the membership's current generation."""
    return dataclasses.replace(env, rank=membership.place.rank, world_size=membership.place.world_size)


def _host_group(backend: str) -> None:
    """Collective: every rank makes it here, in the same order. gloo's default group already works on host tensors."""
    global _HOST_GROUP
    _HOST_GROUP = dist.new_group(backend="gloo") if backend != "gloo" else None


def host_group() -> Any:
    """The group for small agreements between ranks on host tensors (flags): reading its answer never waits for the
    GPU's queued work, as reading a device tensor would. ``None`` (the default group) under gloo."""
    return _HOST_GROUP


def _join(env: DistEnv, backend: str, timeout: timedelta, device: torch.device) -> None:
    resolve_master(env)  # without this check the rendezvous retries an unknown host for many minutes
    if env.rank == 0 and not env.agent:  # rank 0 will listen on MASTER_PORT: taken means another job has it
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            # As the store's own socket: connections of an earlier rendezvous on this port (the doctor's, a previous
            # attempt's) linger in TIME_WAIT and must not count; a listening socket still does.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("", env.master_port))
            except OSError as exc:
                raise _port_error(env, f"cannot listen on it ({exc.strerror})") from None
    host = f"[{env.master_addr}]" if ":" in env.master_addr else env.master_addr
    target: dict[str, Any] = {"init_method": f"tcp://{host}:{env.master_port}"}
    if env.agent:
        # torchrun's agent keeps one store for every round of its workers: after a restart (--max-restarts) the
        # first round's keys (its ranks' addresses) would still answer. Each round gets keys of its own.
        agent_store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False,  # type: ignore[attr-defined]
                                    timeout=timeout)
        target = {"store": dist.PrefixStore(f"trainer/round_{env.agent_restart}", agent_store)}  # type: ignore[attr-defined]
    try:
        dist.init_process_group(
            backend,
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
            device_id=device if backend == "nccl" else None,
            **target,
        )
    except (RuntimeError, OSError) as exc:  # DistNetworkError, DistStoreError: refused, reset, timed out
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        if _timed_out(exc):  # the port was fine: a peer (rank 0 included) never arrived
            raise _not_all_came(env, f"{env.master_addr}:{env.master_port}", timeout,
                                env.rank == 0 and not env.agent) from None
        if "NCCL" in first:  # the rendezvous worked (NCCL starts after it): the GPUs are the cause, not the port
            raise UserError("dist.backend", f"rank {env.rank}: NCCL could not start on {device}: {first}",
                            "two processes on one GPU is the usual cause ('invalid usage'): give each task its own "
                            "GPU (Slurm: --gpus-per-task=1; torchrun: --nproc-per-node ≤ GPUs), `make doctor` names "
                            "the ranks that share one; NCCL_DEBUG=WARN says more") from None
        raise _port_error(env, first) from None


class RendezvousTimeout(RuntimeError):
    """Not every rank reached the rendezvous in ``dist.timeout_s``: a peer that never started or hung before it (a
    stuck mount, a GPU that hangs at start). An echo: the missing rank's own record (or its lack: it was killed)
    names the node; never bad input, so the job is retried."""


def _timed_out(exc: BaseException) -> bool:
    """Whether a rendezvous failed by waiting too long (torch: "Timed out after N seconds waiting for clients",
    "The client socket has timed out after N ms while trying to connect"), not by a refused or taken port."""
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def _not_all_came(env: DistEnv, where: str, timeout: timedelta, serves: bool) -> RendezvousTimeout:
    """``serves``: this rank holds the rendezvous (rank 0's store), so the others never came; else it never answered."""
    within = f"in {timeout.total_seconds():.0f} s (dist.timeout_s)"
    if serves:
        return RendezvousTimeout(f"rank {env.rank}: not every rank of {env.world_size} reached the rendezvous at "
                                 f"{where} {within}: a rank that never started or hung before it")
    return RendezvousTimeout(f"rank {env.rank}: the rendezvous at {where} did not answer {within}: its host never "
                             "served it (rank 0's own error, if any, is the cause)")


def _port_error(env: DistEnv, what: str) -> UserError:
    return UserError("MASTER_PORT", f"rank {env.rank}: the rendezvous at {env.master_addr}:{env.master_port} failed: "
                     f"{what}", f"another process on {env.master_addr} may hold port {env.master_port} (two jobs on "
                     "one node with the same MASTER_PORT?): unset MASTER_PORT to derive one from the job id, or set "
                     "a free one (15000-29999); if rank 0 died first, its own error is the cause")


def barrier() -> None:
    """Wait for every rank."""
    torch.distributed.barrier()


def teardown() -> None:
    """Leave the process group (safe to call when none was made)."""
    global _HOST_GROUP
    _HOST_GROUP = None
    if dist.is_available() and dist.is_initialized():
        gloo = dist.get_backend() == "gloo" and dist.get_world_size() > 1
        dist.destroy_process_group()
        if gloo:
            # gloo's worker threads may still hold the last collectives' tensors, whose release needs the GIL:
            # released here while the interpreter is alive (see errors.exit_now for what happens otherwise).
            # `python -m trainer` then skips finalization anyway; this narrows the window for in-process
            # callers such as the submitit task, which must return its result through Python.
            time.sleep(0.2)


def say(env: DistEnv, msg: str) -> None:
    """Print from rank 0 only; everything a user reads goes through here."""
    if env.is_main:
        print(msg, flush=True)


def from_main(box: list[Any]) -> None:
    """Give every rank rank 0's ``box`` contents, in place (a barrier too); with one process there is nothing to send."""
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)


class MainFailed(RuntimeError):
    """Rank 0's failure inside :func:`on_main`, as the other ranks raise it: an echo, never a first cause (rank 0's
    own record has it); ``kind``: the class rank 0 gave it (``exits.classify``)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


def on_main(is_main: bool, fn: Callable[[], Any], what: str = "rank 0") -> Any:
    """Collective: run ``fn`` on rank 0 and hand its result, or its UserError, to every rank: no rank is left waiting
    (a barrier too). Rank 0 re-raises any other error; the others raise a :class:`MainFailed` naming it and ``what``."""
    box: list[Any] = [None]
    if is_main:
        try:
            box[0] = ("ok", fn())
        except UserError as err:
            box[0] = ("error", (err.field, err.message, err.hint))
        except Exception as exc:  # re-raised on rank 0 with its traceback, reported on the others
            box[0] = ("crash", (f"{type(exc).__name__}: {exc}", exits.classify(exc)["class"]))
            from_main(box)
            raise
    from_main(box)
    kind, value = box[0]
    if kind == "error":
        raise UserError(*value)
    if kind == "crash":
        raise MainFailed(f"{what} failed on rank 0: {value[0]}", value[1])
    return value


def gather(obj: Any) -> list[Any]:
    """Every rank's object, in rank order, on every rank."""
    if dist.get_world_size() == 1:  # no pickling round trip for one process
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
