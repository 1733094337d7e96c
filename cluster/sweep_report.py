"""A sweep's page: the metric against each swept parameter (``sweep.png``) and every trial with a link to its own
run report (``sweep.html``, the plot embedded: it opens without network). Written by `make sweep-status` and at the
end of `make sweep WAIT=1`."""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

from cluster.trials import Row, fmt, is_number


def plot(rows: list[Row], keys: list[str], metric: str, path: Path) -> Path:
    """One panel per parameter: each trial with a metric as a point (numbers on a numeric axis, else categories)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, max(1, len(keys)), figsize=(3.2 * max(1, len(keys)), 3), squeeze=False)
    scored = [r for r in rows if r.value is not None]
    for ax, key in zip(axes[0], keys, strict=False):
        values: list[Any] = [r.overrides.get(key) for r in scored]
        if values and all(is_number(v) for v in values):
            ax.plot(values, [r.value for r in scored], "o")
            if min(values) > 0 and max(values) / min(values) >= 100:
                ax.set_xscale("log")
        else:
            labels = sorted({fmt(v) for v in values})
            ax.plot([labels.index(fmt(v)) for v in values], [r.value for r in scored], "o")
            ax.set_xticks(range(len(labels)), labels)
        ax.set_xlabel(key)
        ax.set_ylabel(metric)
    fig.suptitle(f"{metric} by parameter ({len(scored)} of {len(rows)} trials scored)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write(sweep_dir: Path, data: dict[str, Any], rows: list[Row]) -> Path:
    """sweep.png and sweep.html in ``sweep_dir``."""
    metric, keys = data["spec"]["metric"], list(data["spec"]["parameters"])
    png = plot(rows, keys, metric, sweep_dir / "sweep.png")
    body = []
    for r in sorted(rows, key=lambda r: r.index):
        report = r.run_dir / "report.html"
        href = report.relative_to(sweep_dir) if report.is_relative_to(sweep_dir) else report
        link = f'<a href="{html.escape(str(href))}">report</a>' if report.exists() else "-"
        cells = [str(r.index), *(fmt(r.overrides.get(k)) for k in keys), r.state,
                 "-" if r.value is None else f"{r.value:.4g}"]
        body.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + f"<td>{link}</td></tr>")
    page = (f"<!doctype html><meta charset='utf-8'><title>Sweep {html.escape(data['sweep_id'])}</title>"
            "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 8px}</style>"
            f"<h1>Sweep {html.escape(data['sweep_id'])}</h1><p>ranked by {html.escape(metric)} "
            f"({html.escape(data['spec']['mode'])})</p><table><tr>"
            + "".join(f"<th>{html.escape(c)}</th>" for c in ["trial", *keys, "state", metric, "run report"])
            + "</tr>" + "".join(body) + f"</table><img alt='{html.escape(metric)} by parameter' "
            f"src='data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()}'>")
    out = sweep_dir / "sweep.html"
    out.write_text(page)
    return out
