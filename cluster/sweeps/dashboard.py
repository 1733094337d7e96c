"""``python -m cluster sweep-dashboard``: Optuna's own dashboard on a sweep's study (its journal file or RDB URL),
bound to this machine only; from a laptop, forward the port (ssh -L 8080:localhost:8080 login-node)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from cluster.sweeps.status import newest_sweep, read_sweep
from cluster.sweeps.storage_url import connect_url
from cluster.sweeps.study import storage


def serve(sweep_dir: str | None, port: int, host: str = "127.0.0.1") -> int:
    """Serve optuna-dashboard for the sweep (default: the newest) until Ctrl-C."""
    from optuna_dashboard import run_server

    folder = Path(sweep_dir) if sweep_dir else newest_sweep(Path.cwd())
    record = read_sweep(folder)
    where = record.settings.storage
    print(f"optuna-dashboard for sweep {record.sweep_id} (study in {where}): http://{host}:{port}/dashboard/ "
          "(Ctrl-C stops it)", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        run_server(storage(connect_url(where, folder), folder), host=host, port=port)
    return 0
