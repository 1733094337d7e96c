"""Run a test selection again and again beside CPU-burning processes, as a busy CI machine would run it.

``python -m tests.stress --runs 10 --burners 2 -k "straggler or cadence"``: each run is a fresh ``pytest`` of the
selection (with ``make test``'s workers) while ``--burners`` processes spin at 100 % of a core each; prints one line a
run and a summary, exits 1 if any run failed. Only the standard library: no ``stress`` package needed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SELECTION = "straggler or audit or cadence or deadline or heartbeat or storm or hang or placement"


def _burn() -> None:
    """Spin forever (the parent terminates it)."""
    x = 0
    while True:
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--burners", type=int, default=2)
    p.add_argument("-k", dest="keyword", default=SELECTION, help="pytest's -k selection")
    p.add_argument("--workers", default=str((os.cpu_count() or 1) + 1), help="pytest -n (make test's default)")
    a = p.parse_args(argv)
    burners = [mp.Process(target=_burn, daemon=True) for _ in range(a.burners)]
    for b in burners:
        b.start()
    failed = 0
    try:
        for run in range(1, a.runs + 1):
            began = time.monotonic()
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", a.workers, "--dist", "loadgroup",
                                   "-p", "no:cacheprovider", "-o", "addopts=-ra", "-k", a.keyword],
                                  cwd=ROOT, capture_output=True, text=True)
            tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-300:]
            failed += proc.returncode != 0
            print(f"run {run}/{a.runs} ({a.burners} burners): exit {proc.returncode} in "
                  f"{time.monotonic() - began:.0f} s: {tail}", flush=True)
            if proc.returncode:
                print("\n".join(line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))))
    finally:
        for b in burners:
            b.terminate()
    print(f"{a.runs - failed} of {a.runs} runs passed with {a.burners} CPU-burning processes beside them")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
