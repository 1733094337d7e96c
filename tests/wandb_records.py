"""Read the records of an offline W&B run file (``run-<id>.wandb``); wandb 0.31 ships no reader for it.

Format: a 7-byte header (``:W&B``, magic 0xBEE1, version), then LevelDB-style records in 32 KiB blocks:
crc32 (4 bytes), length (2), type (1: full, 2: first, 3: middle, 4: last), each holding a piece of a
serialized ``wandb.proto.wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2 as pb

BLOCK = 32768
HEADER = struct.Struct("<4sHB")
RECORD = struct.Struct("<IHB")


def records(path: Path) -> list[Any]:
    """Every Record in the file, in order."""
    data = path.read_bytes()
    ident, magic, _ = HEADER.unpack_from(data)
    assert ident == b":W&B" and magic == 0xBEE1, f"{path} is not a W&B run file"
    out, pending, pos = [], b"", HEADER.size
    while pos + RECORD.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < RECORD.size:  # the rest of a block too small for a header is padding
            pos += left
            continue
        _, length, kind = RECORD.unpack_from(data, pos)
        if kind == 0:
            pos += left
            continue
        pending += data[pos + RECORD.size: pos + RECORD.size + length]
        pos += RECORD.size + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            out.append(rec)
            pending = b""
    return out


def _key(item: Any) -> str:
    return ".".join(item.nested_key) if item.nested_key else item.key


def summary(path: Path) -> dict[str, Any]:
    """Run id, config keys, logged history (step → metrics) and final summary of one run file."""
    import json

    run_id, config, history, final = None, {}, {}, {}
    for rec in records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run_id = rec.run.run_id
            config.update({_key(i): json.loads(i.value_json) for i in rec.run.config.update})
        elif kind == "config":
            config.update({_key(i): json.loads(i.value_json) for i in rec.config.update})
        elif kind == "history":
            history[rec.history.step.num] = {_key(i): json.loads(i.value_json) for i in rec.history.item}
        elif kind == "summary":
            final.update({_key(i): json.loads(i.value_json) for i in rec.summary.update if _key(i)})
    return {"run_id": run_id, "config": config, "history": history, "summary": final}
