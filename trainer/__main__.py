"""Entrypoint: parse → setup → fit → teardown. ``python -m trainer [config=FILE] [key=value ...]``."""

from __future__ import annotations

import sys
from typing import Any

from trainer.core import config as config_mod
from trainer.core.env import discover
from trainer.core.errors import exit_now, recorded


def run(args: list[str]) -> dict[str, Any]:
    """Train with ``key=value`` arguments in this process; return the summary (raises UserError on bad input)."""
    # Config and environment are checked before torch is even imported: bad input fails fast.
    cfg = config_mod.load(args)
    discover()
    from trainer.builtin.train import fit

    return fit(cfg)


def main(argv: list[str] | None = None) -> int:
    """Run one training process; return its exit code (0 done, 2 bad input, 75 saved for requeue)."""
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help", "help") for a in args):
        print(config_mod.help_text())
        return 0
    return recorded(lambda: int(run(args)["exit_code"]))


if __name__ == "__main__":
    exit_now(main())
