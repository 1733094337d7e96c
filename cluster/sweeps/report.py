"""A sweep's page, ``sweep.html``: every trial with a link to its own run report, and Optuna's plots of the study
(the optimisation history, each trial's intermediate values with pruned trials cut short, the parameters'
importances), embedded as PNG: it opens without network. Written by `make sweep-status` and `make sweep WAIT=1`."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

from cluster.sweeps.folder import SweepFile
from cluster.sweeps.trials import Row, show


def _png(ax: Any) -> str:
    fig = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
    fig.set_size_inches(6.4, 3.6)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def plots(study: Any) -> list[tuple[str, str]]:
    """(title, base64 PNG) of each plot the study has data for; one that cannot be drawn yet is left out."""
    import matplotlib

    matplotlib.use("Agg")
    from optuna.visualization import matplotlib as vis

    done = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    wanted: list[tuple[str, Any]] = [("optimisation history", vis.plot_optimization_history)]
    if any(t.intermediate_values for t in study.get_trials(deepcopy=False)):
        wanted.append(("intermediate values (pruned trials end early)", vis.plot_intermediate_values))
    if len(done) >= 2 and any(len({str(t.params.get(k)) for t in done}) > 1 for k in done[0].params):
        wanted.append(("parameter importances", vis.plot_param_importances))
    out = []
    for title, draw in wanted:
        try:
            out.append((title, _png(draw(study))))
        except (ValueError, RuntimeError, ZeroDivisionError):  # too few trials for this plot yet
            continue
    return out


def write(sweep_dir: Path, data: SweepFile, rows: list[Row], study: Any) -> Path:
    """sweep.html in ``sweep_dir``."""
    spec = data.settings
    metric, keys = spec.metric, list(spec.parameters)
    body = []
    for r in sorted(rows, key=lambda r: r.index):
        report = r.run_dir / "report.html"
        href = report.relative_to(sweep_dir) if report.is_relative_to(sweep_dir) else report
        link = f'<a href="{html.escape(str(href))}">report</a>' if report.exists() else "-"
        cells = [str(r.index), *(show(r.overrides.get(k)) for k in keys), r.state, str(r.steps),
                 "-" if r.value is None else f"{r.value:.4g}"]
        body.append(f"<tr class='{r.state}'>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells)
                    + f"<td>{link}</td></tr>")
    figures = "".join(f"<h2>{html.escape(title)}</h2><img alt='{html.escape(title)}' src='data:image/png;base64,{png}'>"
                      for title, png in plots(study))
    name = html.escape(data.sweep_id)
    page = (f"<!doctype html><meta charset='utf-8'><title>Sweep {name}</title>"
            "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 8px}tr.pruned{color:#888}"
            "tr.failed{color:#b00}</style>"
            f"<h1>Sweep {name}</h1><p>{html.escape(spec.method)} sampler, pruner "
            f"{html.escape(spec.pruner)}; ranked by {html.escape(metric)} ({html.escape(spec.mode)})"
            "</p><table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in ["trial", *keys, "state", "steps", metric,
                                                                               "run report"])
            + "</tr>" + "".join(body) + "</table>" + figures)
    out = sweep_dir / "sweep.html"
    out.write_text(page)
    return out
