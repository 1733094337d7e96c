"""Snapshots in node memory: the second level of a two-level checkpoint (durable checkpoints are the first).

Between durable saves each node keeps its ranks' state in a RAM-backed folder local to it (``/dev/shm``); sharded
(FSDP) state is copied to a partner node as well (the next node of the attempt), since no other node holds it. A
restart inside the allocation restores from the newest snapshot the nodes of the new attempt hold together: what a
node lacks comes from a node that has it over the process group, never from the shared file system. The durable
checkpoint is used when it is as new, or when no complete snapshot survives. Snapshots belong to one allocation
(the folder is named after the job and its Slurm restart count) and never replace durable saves. Every process that
uses a folder holds its lease, and the first run on a node clears the folders of dead jobs (``lease``).

Per node: ``<memory_dir>/trainer-snapshots-<uid>/<job>-<run>.<restart>/<node>/``
  ``step_<N>.pt``    the whole state, single-file layout (DDP, one process): every node holds it (replicated)
  ``step_<N>/``      sharded: this node's and its partner's DCP shards, ``.metadata``, ``extra.pt`` (the rest)
  ``step_<N>.json``  the manifest, written last: the files this node holds (name → bytes) and every file of the step
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.checkpoint import lease
from trainer.checkpoint.file import Staging, save_atomic
from trainer.checkpoint.layout import EXTRA, PREFIX
from trainer.checkpoint.rng import rng_state
from trainer.core.dist import host_group
from trainer.core.env import DistEnv
from trainer.core.exits import node_name
from trainer.core.files import write_json

KEEP = 2
"""Snapshots each node keeps (the one being written may fail half-way: the one before it stays whole)."""
METADATA = ".metadata"
"""DCP's index of a sharded save, written by rank 0: copied to every node."""
_swept: set[Path] = set()
"""The snapshot roots this process has cleared of dead jobs' folders (once each: a regroup opens its folder again)."""


def place(memory_dir: str, job_id: str | None, restart: int, run_dir: Path) -> Path:
    """This node's snapshot folder for this run in this allocation."""
    run = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:8]
    return Path(memory_dir) / f"trainer-snapshots-{os.getuid()}" / f"{job_id or 'local'}-{run}.{restart}" / node_name()


@dataclass(frozen=True)
class Restored:
    """The snapshot a restart chose: where this node holds it, its state (the single-file layout's, or extra.pt)."""

    path: Path
    state: dict[str, Any]
    step: int
    fetched: int
    """Bytes this node received from other nodes to complete it."""


class MemorySnapshots:
    """Takes and restores one run's snapshots on every rank (collectives on the host group); only each node's first
    local rank writes whole-state files, every rank writes its own shards."""

    def __init__(self, env: DistEnv, folder: Path, sharded: bool, model: nn.Module | None = None) -> None:
        self.env, self.folder, self.sharded, self.model = env, folder, sharded, model
        self.lead = env.local_rank == 0
        self._staging = Staging()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._unsafe: OSError | None = None
        """Why nothing may be written, read or removed under the node's snapshot root (another user's, or none can
        be made there): every snapshot fails with it, a warning, and training goes on."""
        try:
            lease.safe_root(folder.parents[1])
        except OSError as exc:
            self._unsafe = exc
            return
        with contextlib.suppress(OSError):  # a folder that cannot be made: the first snapshot says so
            lease.hold(folder)
            if self.lead and folder.parents[1] not in _swept:
                _swept.add(folder.parents[1])
                lease.sweep(folder.parents[1], folder)

    def _refuse(self) -> None:
        if self._unsafe is not None:
            raise self._unsafe

    # ---- taking ------------------------------------------------------------------------------
    def save(self, state: dict[str, Any], sharded: dict[str, Any], step: int) -> None:
        """Collective: snapshot ``state`` (and the ``sharded`` models and optimizers) as step ``step``. Single-file:
        the copy into host buffers stalls, the write runs in the background. Sharded: written before returning."""
        self.wait()
        state = dict(state, rng=_gather(rng_state()))
        if self.sharded:
            self._save_sharded(state, sharded, step)
        elif self.lead:
            self._refuse()  # after the collective above: no rank is left waiting in it
            staged = self._staging.stage(state)
            self._thread = threading.Thread(target=self._write, args=(staged, step), name="trainer-snapshot")
            self._thread.start()

    def _write(self, state: dict[str, Any], step: int) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            path = self.folder / f"{PREFIX}{step:08d}.pt"
            size, _ = save_atomic(path, state, sync_dir=False)  # RAM-backed: its fsyncs cost nothing
            self._commit(step, {path.name: size}, [path.name])
        except BaseException as exc:  # surfaced by wait()
            self._error = exc

    def _save_sharded(self, state: dict[str, Any], sharded: dict[str, Any], step: int) -> None:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        from trainer.checkpoint.sharded import sharded_state

        tmp = self.folder / f".{PREFIX}{step:08d}.tmp"
        rank0, meta = self.env.rank == 0, [b""]

        def fresh() -> None:
            self._refuse()  # every rank: every rank writes its shards there
            if self.lead:
                for stale in self.folder.glob(f".{PREFIX}*.tmp"):
                    shutil.rmtree(stale, ignore_errors=True)
                tmp.mkdir(parents=True)

        # Each stage's failure (a full /dev/shm on one node) is agreed before the next collective: a rank that
        # raised alone would leave the others waiting in a collective it never joins.
        _settle(fresh)
        _settle(lambda: dcp_save(sharded_state(sharded, self.model), storage_writer=FileSystemWriter(str(tmp))))
        # Every rank's files (their names are DCP's own: "__<rank>_<n>.distcp"), the index, and the partner's copy.
        own = sorted(p.name for p in tmp.glob(f"__{self.env.rank}_*.distcp"))
        _settle(lambda: _require(bool(own), f"a sharded snapshot wrote no __{self.env.rank}_*.distcp file in {tmp}"))
        names = sorted({n for ranks in _gather(own) for n in ranks} | {METADATA, EXTRA})
        _settle(lambda: meta.__setitem__(0, (tmp / METADATA).read_bytes() if rank0 else b""))
        meta[0] = _from_rank0(meta[0] if rank0 else None)

        def extra() -> None:
            if self.lead:
                if not rank0:
                    (tmp / METADATA).write_bytes(meta[0])
                save_atomic(tmp / EXTRA, state, sync_dir=False)

        _settle(extra)
        self._swap_with_partner(tmp, own)

        def commit() -> None:
            if self.lead:
                final = self.folder / f"{PREFIX}{step:08d}"
                shutil.rmtree(final, ignore_errors=True)
                os.replace(tmp, final)
                self._commit(step, {p.name: p.stat().st_size for p in final.iterdir()}, names)

        _settle(commit)

    def _swap_with_partner(self, tmp: Path, own: list[str]) -> None:
        """Collective: send this rank's shard files to the same local rank on the next node; take the previous
        node's. Reading, the exchange's buffers and writing are each agreed: a rank that failed alone would leave its
        partner waiting in a send."""
        local, world = self.env.local_world_size, self.env.world_size
        if world <= local:
            return
        to, frm = (self.env.rank + local) % world, (self.env.rank - local) % world
        files: dict[str, bytes] = {}
        _settle(lambda: files.update({n: (tmp / n).read_bytes() for n in own}))
        meta, data = _swap(files, to, frm)

        def write() -> None:
            for name, blob in _unpack(meta, data).items():
                (tmp / name).write_bytes(blob)

        _settle(write)

    def _commit(self, step: int, held: dict[str, int], files: list[str]) -> None:
        """The manifest (the commit point), then older snapshots go."""
        write_json(self.folder / f"{PREFIX}{step:08d}.json", {"step": step, "held": held, "files": files,
                                                              "time": time.time()})
        for old in sorted(self.folder.glob(f"{PREFIX}*.json"))[:-KEEP]:
            old.unlink(missing_ok=True)
            shutil.rmtree(old.with_suffix(""), ignore_errors=True)
            old.with_suffix(".pt").unlink(missing_ok=True)

    def wait(self) -> None:
        """Block until a background write has committed; re-raise its error here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def clear(self) -> None:
        """Remove this node's snapshots of the run (its end: they never outlive it)."""
        self.wait()
        if self._unsafe is not None:  # nothing of ours there: touch nothing under another user's root
            return
        lease.release(self.folder)
        if self.lead:
            shutil.rmtree(self.folder, ignore_errors=True)
            with contextlib.suppress(OSError):
                self.folder.parent.rmdir()  # the attempt's folder, once no node of it has one left

    # ---- restoring ---------------------------------------------------------------------------
    def holdings(self) -> dict[int, dict[str, Any]]:
        """This node's committed snapshots: step → manifest (only files that are still there and whole)."""
        out: dict[int, dict[str, Any]] = {}
        if self._unsafe is not None:
            return out
        for manifest in self.folder.glob(f"{PREFIX}*.json"):
            try:
                meta = json.loads(manifest.read_text())
            except (OSError, ValueError):
                continue
            base = manifest.with_suffix("") if self.sharded else self.folder
            if all((base / n).is_file() and (base / n).stat().st_size == size for n, size in meta["held"].items()):
                out[int(meta["step"])] = meta
        return out

    def newest(self, after: int) -> Restored | None:
        """Collective: the newest snapshot past step ``after`` (the durable checkpoint's) that the nodes of this
        attempt hold together, completed on every node from the others; None when there is none."""
        seen = _gather((node_name(), self.holdings()))
        for step in sorted({s for _, held in seen for s in held if s > after}, reverse=True):
            files = next(held[step]["files"] for _, held in seen if step in held)
            have = {r: set(held[step]["held"]) if step in held else set() for r, (_, held) in enumerate(seen)}
            if set(files) <= set().union(*have.values()):
                return self._fetch(step, files, [node for node, _ in seen], have)
        return None

    def _fetch(self, step: int, files: list[str], nodes: list[str], have: dict[int, set[str]]) -> Restored:
        """Give every node the files of ``step`` it lacks (the first rank of each node receives them), then load."""
        base = self.folder / f"{PREFIX}{step:08d}" if self.sharded else self.folder
        plan = []
        for node in dict.fromkeys(nodes):
            ranks = [r for r, n in enumerate(nodes) if n == node]
            for name in sorted(set(files) - have[ranks[0]]):
                plan.append((name, min(r for r, held in have.items() if name in held), ranks[0]))
        fetched = 0
        for name, src, dst in plan:  # one transfer at a time, in the same order on every rank: no deadlock
            if self.env.rank == src:
                _send((base / name).read_bytes(), dst)
            elif self.env.rank == dst:
                data = _recv(src)
                base.mkdir(parents=True, exist_ok=True)
                (base / name).write_bytes(data)
                fetched += len(data)
        _barrier()
        path = base if self.sharded else base / files[0]
        state = torch.load(path / EXTRA if self.sharded else path, map_location="cpu", weights_only=True)
        return Restored(path, state, step, fetched)


def _gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` on every rank, over the host group."""
    if dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=host_group())
    return out


def _from_rank0(obj: Any) -> Any:
    box = [obj]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0, group=host_group())
    return box[0]


def _settle(stage: Callable[[], Any]) -> None:
    """Collective: run this rank's part of a stage, then agree whether every rank's went well (over the host group);
    any failure raises a RuntimeError on every rank (its own cause where it failed), so all leave at the same point."""
    cause = ""
    try:
        stage()
    except BaseException as exc:
        if not isinstance(exc, Exception) and not _from_dcp(exc):
            raise
        cause = f"{type(exc).__name__}: {exc}"
    flag = torch.tensor([int(bool(cause))], dtype=torch.int32)
    if dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=host_group())
    if flag.item():
        raise RuntimeError(cause or "another rank's part of the snapshot failed")


def _from_dcp(exc: BaseException) -> bool:
    """Whether ``exc`` is DCP's CheckpointException (a BaseException), without importing DCP (seconds) to ask."""
    api = sys.modules.get("torch.distributed.checkpoint.api")
    return api is not None and isinstance(exc, api.CheckpointException)


def _require(ok: bool, cause: str) -> None:
    if not ok:
        raise RuntimeError(cause)


def _barrier() -> None:
    if dist.get_world_size() > 1:
        dist.barrier(group=host_group())


def _send(data: bytes, dst: int) -> None:
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst, group=host_group())
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, group=host_group())


def _recv(src: int) -> bytes:
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src, group=host_group())
    buf = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(buf, src, group=host_group())
    return buf.numpy().tobytes()


def _swap(files: dict[str, bytes], to: int, frm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Collective: send ``files`` to rank ``to`` while receiving rank ``frm``'s (a ring: every rank sends and receives
    once); returns what came, for ``_unpack``. The buffers are made, and agreed, before any payload moves."""
    blob = json.dumps({n: len(d) for n, d in files.items()}).encode()
    sizes = torch.tensor([len(blob), sum(len(d) for d in files.values())], dtype=torch.int64)
    got_sizes = torch.zeros(2, dtype=torch.int64)
    _both(sizes, got_sizes, to, frm)
    bufs: list[torch.Tensor] = []

    def buffers() -> None:
        joined = b"".join(files.values())
        payload = torch.frombuffer(bytearray(joined), dtype=torch.uint8) if joined else torch.empty(0, dtype=torch.uint8)
        bufs.extend([torch.frombuffer(bytearray(blob), dtype=torch.uint8), torch.empty(int(got_sizes[0]), dtype=torch.uint8),
                     payload, torch.empty(int(got_sizes[1]), dtype=torch.uint8)])

    _settle(buffers)
    out_meta, got_meta, payload, got = bufs
    _both(out_meta, got_meta, to, frm)
    _both(payload, got, to, frm)
    return got_meta, got


def _unpack(meta: torch.Tensor, data: torch.Tensor) -> dict[str, bytes]:
    """The files ``_swap`` received, by name."""
    raw, out, at = data.numpy().tobytes(), {}, 0
    for name, size in json.loads(meta.numpy().tobytes()).items():
        out[name], at = raw[at:at + size], at + size
    return out


def _both(out: torch.Tensor, into: torch.Tensor, to: int, frm: int) -> None:
    """Send ``out`` to ``to`` and receive ``into`` from ``frm`` at once (blocking sends around a ring would wait
    on each other)."""
    reqs = [dist.isend(out, to, group=host_group()), dist.irecv(into, frm, group=host_group())]
    for req in reqs:
        if req is not None:
            req.wait()
