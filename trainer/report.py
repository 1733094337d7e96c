"""``python -m trainer.report RUN_DIR``: what happened to a run, from its event log, as one HTML page with plots.

Written next to the log (``report.html``, ``report-*.png``; the HTML embeds the plots, no network needed) at the
end of every run (the session runs ``python -m trainer.report --end-of-run``), and on demand (``make report RUN=…``).
The figures (goodput and its parts) come from ``trainer.runtime.records.attempts``.
"""

from __future__ import annotations

import argparse
import base64
import html
import sys
from itertools import pairwise
from pathlib import Path
from typing import Any

from trainer.core.errors import EXIT_BAD_INPUT
from trainer.core.events import EVENTS
from trainer.runtime.records.attempts import Attempt, attempts, describe_recovery, figures

COLUMNS = (("attempt", "{}"), ("id", "{}"), ("job_id", "{}"), ("nodes", "{}"), ("processes", "{}"), ("exit", "{}"),
           ("ended", "{}"), ("blamed", "{}"),
           ("gap_before_s", "{:.1f}"), ("resumed_step", "{}"),
           ("last_step", "{}"),
           ("allocated_s", "{:.1f}"), ("startup_s", "{:.1f}"), ("training_s", "{:.1f}"), ("stall_s", "{:.2f}"),
           ("lost_steps", "{}"), ("productive_s", "{:.1f}"))


def table(f: dict[str, Any]) -> str:
    """The terminal summary: one line per attempt, then the totals and goodput."""
    head = [c for c, _ in COLUMNS]
    body = [[fmt.format(r[c]) if r[c] is not None else "-" for c, fmt in COLUMNS] for r in f["attempts"]]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    lines = ["  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)).rstrip() for row in [head, *body]]
    lines.append(f"goodput {100 * f['goodput']:.1f} % ({f['productive_node_s']:.1f} productive of "
                 f"{f['allocated_node_s']:.1f} allocated node-seconds); {f['lost_steps']} steps recomputed after "
                 f"requeues; checkpoint stall {f['stall_s']:.2f} s; recovery {f['recovery_s']['preempted']:.1f} s "
                 f"from preemptions, {f['recovery_s']['failure']:.1f} s from failures")
    c = f.get("cadence")
    if c:  # did the cadence pay off: the loss it planned for against the loss seen
        seen = f"{c['measured_lost_s']:.1f} s measured over {c['interruptions']}" if c["interruptions"] else "none seen"
        lines.append(f"auto cadence: saving every {c['interval_s']:.0f} s; work lost per unannounced interruption: "
                     f"{c['expected_lost_s']:.1f} s expected, {seen}; {f['stall_s']:.2f} s spent saving")
    sizes = [str(r["processes"]) for r in f["attempts"] if r["processes"]]
    if len(set(sizes)) > 1:  # a job resumed on another number of processes (a node range, a manual resume)
        lines.append(f"processes per attempt: {' → '.join(sizes)}")
    lines += [f"attempt {r['attempt']}: {r['ended']}: {r['cause']}" for r in f["attempts"]
              if r["cause"] and r["ended"] != "finished"]
    lines += f.get("startup", []) + [describe_recovery(r) for r in f["recoveries"]] + f["audits"]
    return "\n".join(lines)


def plots(runs: list[Attempt], out: Path) -> dict[str, Path]:
    """PNG files: metrics by step, throughput over time, the attempts' timeline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: dict[str, Path] = {}
    t0 = runs[0].start
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for i, a in enumerate(runs):
        series: dict[str, list[tuple[int, float]]] = {}
        for e in a.times("metrics"):
            for k, v in e.get("values", {}).items():
                series.setdefault(k, []).append((e["step"], v))
        for k, pts in sorted(series.items()):
            if "loss" in k:
                ax.plot(*zip(*pts, strict=True), marker=".", label=f"{k} (attempt {i + 1})")
    made["loss"] = _save(fig, out / "report-loss.png", ("step", "loss", "Loss across attempts"))
    fig, ax = plt.subplots(figsize=(6, 3.0))
    for i, a in enumerate(runs):
        marks = [(e["t"], e["step"]) for e in a.events if e["event"] in ("first_step", "progress")]
        rate = [(t - t0, (s - s_prev) / (t - t_prev)) for (t_prev, s_prev), (t, s) in pairwise(marks) if t > t_prev]
        if rate:
            ax.plot(*zip(*rate, strict=True), marker=".", label=f"attempt {i + 1}")
    made["throughput"] = _save(fig, out / "report-throughput.png", ("seconds since the first start", "steps/s",
                                                                     "Throughput"))
    fig, ax = plt.subplots(figsize=(6, 0.6 + 0.45 * len(runs)))
    for i, a in enumerate(runs):
        y = len(runs) - i
        first = a.first_step_t or a.end
        ax.barh(y, first - a.start, left=a.start - t0, color="#bbbbbb", label="start-up" if i == 0 else None)
        ax.barh(y, a.end - first, left=first - t0, color="#4c9a5b", label="training" if i == 0 else None)
        for e in a.times("checkpoint"):
            ax.plot(e["t"] - t0, y, "k|", markersize=14)
        for e in a.times("signal"):
            ax.plot(e["t"] - t0, y, "rv")
    ax.set_yticks(range(1, len(runs) + 1), [f"attempt {len(runs) - j}" for j in range(len(runs))])
    ax.set_xlabel("seconds since the first start (| checkpoint, ▼ signal)")
    ax.legend(fontsize=7, loc="lower right")
    made["timeline"] = _save(fig, out / "report-timeline.png")
    return made


def _save(fig: Any, path: Path, labels: tuple[str, str, str] | None = None) -> Path:
    """Write ``fig`` as a PNG (``labels``: its one axes' x label, y label and title, with a legend for its lines)."""
    if labels:
        ax = fig.axes[0]
        ax.set_xlabel(labels[0])
        ax.set_ylabel(labels[1])
        ax.set_title(labels[2])
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def render(run_dir: Path) -> tuple[Path, str]:
    """Write report.html and the PNGs into ``run_dir``; return the HTML path and the terminal summary."""
    path, f = _render(run_dir)
    return path, table(f)


def _render(run_dir: Path) -> tuple[Path, dict[str, Any]]:
    """:func:`render`, returning the figures (read from the log once) instead of their table."""
    runs = attempts(run_dir)
    if not runs:
        raise ValueError(f"no {EVENTS} with an attempt in {run_dir}")
    f = figures(runs)
    try:
        pngs = plots(runs, run_dir)
    except ImportError:  # an image built without matplotlib: the table still tells the story
        pngs = {}
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(fmt.format(r[c]) if r[c] is not None else '-')}</td>"
                                    for c, fmt in COLUMNS) + "</tr>" for r in f["attempts"])
    imgs = "".join(f'<h2>{name}</h2><img alt="{name}" src="data:image/png;base64,'
                   f'{base64.b64encode(p.read_bytes()).decode()}">' for name, p in pngs.items())
    info = next((a.info for a in reversed(runs) if a.opened), runs[-1].info)  # a session's: its software
    page = (f"<!doctype html><meta charset='utf-8'><title>Run report: {html.escape(run_dir.name)}</title>"
            "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 8px;text-align:right}"
            "table{border-collapse:collapse}tr:nth-child(even){background:#f3f3f3}</style>"
            f"<h1>Run {html.escape(str(run_dir))}</h1>"
            f"<p>Goodput <b>{100 * f['goodput']:.1f} %</b>: {f['productive_node_s']:.1f} productive of "
            f"{f['allocated_node_s']:.1f} allocated node-seconds over {len(runs)} attempt(s); {f['lost_steps']} steps "
            f"recomputed after requeues; checkpoint stall {f['stall_s']:.2f} s in all.</p>"
            f"<p>torch {html.escape(str(info.get('torch')))}, CUDA {html.escape(str(info.get('cuda')))}, NCCL "
            f"{html.escape(str(info.get('nccl')))}, commit {html.escape(str(info.get('git')))}</p>"
            "<table><tr>" + "".join(f"<th>{c}</th>" for c, _ in COLUMNS) + f"</tr>{rows}</table>"
            + "".join(f"<p>attempt {r['attempt']}: {html.escape(str(r['ended']))}: {html.escape(str(r['cause']))}</p>"
                      for r in f["attempts"] if r["cause"] and r["ended"] != "finished")
            + "".join(f"<p>{html.escape(line)}</p>" for line in [*map(describe_recovery, f["recoveries"]), *f["audits"]])
            + imgs)
    out = run_dir / "report.html"
    out.write_text(page)
    return out, f


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.report", description=__doc__)
    parser.add_argument("run_dir", type=Path, help="a run folder (holds events.jsonl)")
    parser.add_argument("--end-of-run", action="store_true",
                        help="one line (the page and its goodput, or why there is none); never fails")
    ns = parser.parse_args(argv)
    try:
        path, f = _render(ns.run_dir)
    except Exception as exc:
        if ns.end_of_run:  # plotting must never cost a finished run its exit code
            print(f"note: no run report ({type(exc).__name__}: {exc})")
            return 0
        if not isinstance(exc, (ValueError, OSError)):
            raise
        print(f"error: RUN_DIR: {exc}\nHINT: pass a run folder written by this version (it holds {EVENTS})",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"report: {path} (goodput {100 * f['goodput']:.1f} %)" if ns.end_of_run else f"{table(f)}\nreport: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
