"""``python -m trainer.export RUN_DIR|CHECKPOINT OUT.pt [--key model]``: one plain ``state_dict`` file for inference.

Reads the newest committed checkpoint of a run (or the given one), single file or sharded, on one process and
without the model's code: ``torch.load(OUT.pt)`` gives the parameter and buffer tensors by name, ready for
``model.load_state_dict`` on a fresh, unwrapped model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from trainer.core.errors import UserError, exit_code_of
from trainer.core.files import write_atomic


def _sharded(folder: Path, key: str) -> dict[str, torch.Tensor]:
    """The ``key`` entries of a DCP folder, assembled into whole tensors on this process (no process group)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=FileSystemReader(str(folder)), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    return _entries(folder, state, key)


def _entries(where: Path, state: dict[str, Any], key: str) -> dict[str, Any]:
    """``state[key]``, a restored object's state (a mapping); else a UserError naming the keys that are one."""
    objects = sorted(k for k, v in state.items() if isinstance(v, dict))
    if not isinstance(state.get(key), dict):
        what = f"holds no {key!r}" if key not in state else \
            f"holds {key!r}, but not as an object's state (it is {type(state[key]).__name__})"
        raise UserError("--key", f"{where} {what}", f"choose one of the objects it holds: {', '.join(objects)}")
    return dict(state[key])


def consolidated(target: Path, key: str = "model") -> tuple[Path, dict[str, torch.Tensor]]:
    """The checkpoint chosen under ``target`` and its ``key`` state as plain, whole tensors."""
    from trainer.checkpoint.layout import find_resumable

    try:
        found = find_resumable(target)
    except Exception as exc:
        raise UserError("RUN_DIR", f"cannot read {str(target)!r} ({exc})",
                        "pass a run folder, its checkpoints/ folder, a step_*.pt file or a step_* folder") from None
    if found is None:
        raise UserError("RUN_DIR", f"no committed checkpoint under {str(target)!r}",
                        "pass a run folder that holds checkpoints/ (python -m trainer writes them)")
    path, state = found
    if path.is_dir():
        return path, _sharded(path, key)
    return path, _entries(path, state, key)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="run folder (its newest committed checkpoint) or a checkpoint")
    parser.add_argument("out", type=Path, help="the file to write (torch.save of a plain state_dict)")
    parser.add_argument("--key", default="model", help="which restored object to export (default: model)")
    ns = parser.parse_args(argv)
    return exit_code_of(lambda: export(ns.source, ns.out, ns.key))


def export(source: Path, out: Path, key: str) -> int:
    """Write the restored object ``key`` of ``source``'s newest checkpoint to ``out`` as a plain state_dict."""
    path, state = consolidated(source, key)
    plain = {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, _serialized(plain))
    except OSError as exc:
        raise UserError("OUT", f"cannot write {str(out)!r} ({exc.strerror})", "choose a writable path") from None
    tensors = [v for v in plain.values() if isinstance(v, torch.Tensor)]
    others = f" and {len(plain) - len(tensors)} other entries" if len(plain) > len(tensors) else ""
    print(f"exported {key!r} of {path}: {len(tensors)} tensors ({sum(v.numel() for v in tensors):,} values){others} "
          f"→ {out}")
    return 0


def _serialized(obj: Any) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


if __name__ == "__main__":
    sys.exit(main())
