"""``python -m trainer.report RUN_DIR``: what happened to a run, from its event log, as one HTML page with plots.

Written next to the log (``report.html``, ``report-*.png``; the HTML embeds the plots, no network needed) at the
end of every run, and on demand (``make report RUN=…``). Goodput is productive node-time over allocated node-time:
allocated is each attempt's lifetime (from its batch script's start when known, else its process's) × nodes;
productive is its training time less checkpoint stalls and less the steps the next attempt had to compute again
(those after the last checkpoint it resumed from). ``gap_before_s``: time between attempts (queued, restarting).
"""

from __future__ import annotations

import argparse
import base64
import html
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from trainer.errors import EXIT_BAD_INPUT
from trainer.events import EVENTS, read


@dataclass
class Attempt:
    """One start of the job (a requeue or a restart begins the next)."""

    start: float
    info: dict[str, Any]
    events: list[dict[str, Any]] = field(default_factory=list)

    def times(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == kind]

    @property
    def end(self) -> float:
        """The exit event's time, or the last event's (an attempt killed without one)."""
        return max([self.start, *(e["t"] for e in self.events)])

    @property
    def exit_code(self) -> Any:
        """The loop's exit code, else the batch script's view of the tasks' (job_end), else "killed"."""
        exits = self.times("exit") or self.times("job_end")
        return exits[0]["code"] if exits else "killed"

    @property
    def first_step_t(self) -> float | None:
        first = self.times("first_step")
        return first[0]["t"] if first else None

    @property
    def last_step(self) -> int:
        steps = [e["step"] for e in self.events if isinstance(e.get("step"), int)]
        return max([int(self.info.get("resumed_step") or 0), *steps])

    @property
    def stall_s(self) -> float:
        return sum(float(e.get("stall_s", 0.0)) for e in self.times("checkpoint"))


def attempts(run_dir: Path) -> list[Attempt]:
    """The run's attempts in order, each with its events: the session's (``attempt``), or for a command that does
    not use it, the batch script's (``job_start``/``job_end``). An attempt starts when its batch script did, if known."""
    events = list(read(run_dir))
    session = any(e["event"] == "attempt" for e in events)
    out: list[Attempt] = []
    batch_start: float | None = None
    for e in events:
        if e["event"] == "job_start":
            batch_start = e["t"]
            if not session:
                out.append(Attempt(e["t"], {**e, "resumed_step": None}))
        elif e["event"] == "attempt":
            started = float(e.get("started", e["t"]))
            out.append(Attempt(min(started, batch_start) if batch_start else started, e))
            batch_start = None
        elif out:
            out[-1].events.append(e)
    return out


def figures(runs: list[Attempt]) -> dict[str, Any]:
    """The report's table as numbers (see the module docstring for the arithmetic)."""
    rows, alloc, productive = [], 0.0, 0.0
    for i, a in enumerate(runs):
        nodes = int(a.info.get("nodes") or 1)
        allocated = a.end - a.start
        startup = (a.first_step_t - a.start) if a.first_step_t else allocated
        training = (a.end - a.first_step_t) if a.first_step_t else 0.0
        done = a.last_step - int(a.info.get("resumed_step") or 0)
        step_s = training / done if done > 0 else 0.0
        resumed_next = int(runs[i + 1].info.get("resumed_step") or 0) if i + 1 < len(runs) else a.last_step
        lost = max(0, a.last_step - resumed_next)
        useful = max(0.0, training - a.stall_s - lost * step_s)
        alloc += allocated * nodes
        productive += useful * nodes
        rows.append({"attempt": i + 1, "job_id": a.info.get("job_id"), "restart": a.info.get("restart"),
                     "nodes": nodes, "processes": a.info.get("processes"), "resumed_step": a.info.get("resumed_step"),
                     "last_step": a.last_step, "exit": a.exit_code, "allocated_s": allocated, "startup_s": startup,
                     "training_s": training, "stall_s": a.stall_s, "lost_steps": lost, "lost_s": lost * step_s,
                     "productive_s": useful, "gap_before_s": a.start - runs[i - 1].end if i else 0.0})
    return {"attempts": rows, "allocated_node_s": alloc, "productive_node_s": productive,
            "goodput": productive / alloc if alloc > 0 else 0.0, "lost_steps": sum(r["lost_steps"] for r in rows),
            "stall_s": sum(r["stall_s"] for r in rows)}


COLUMNS = (("attempt", "{}"), ("job_id", "{}"), ("exit", "{}"), ("gap_before_s", "{:.1f}"), ("resumed_step", "{}"),
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
                 f"requeues; checkpoint stall {f['stall_s']:.2f} s")
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
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Loss across attempts")
    if ax.lines:
        ax.legend(fontsize=7)
    made["loss"] = _save(fig, out / "report-loss.png")
    fig, ax = plt.subplots(figsize=(6, 3.0))
    for i, a in enumerate(runs):
        marks = [(e["t"], e["step"]) for e in a.events if e["event"] in ("first_step", "progress")]
        rate = [(t - t0, (s - s_prev) / (t - t_prev)) for (t_prev, s_prev), (t, s) in pairwise(marks) if t > t_prev]
        if rate:
            ax.plot(*zip(*rate, strict=True), marker=".", label=f"attempt {i + 1}")
    ax.set_xlabel("seconds since the first start")
    ax.set_ylabel("steps/s")
    ax.set_title("Throughput")
    if ax.lines:
        ax.legend(fontsize=7)
    made["throughput"] = _save(fig, out / "report-throughput.png")
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


def _save(fig: Any, path: Path) -> Path:
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
    info = runs[-1].info
    page = (f"<!doctype html><meta charset='utf-8'><title>Run report: {html.escape(run_dir.name)}</title>"
            "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 8px;text-align:right}"
            "table{border-collapse:collapse}tr:nth-child(even){background:#f3f3f3}</style>"
            f"<h1>Run {html.escape(str(run_dir))}</h1>"
            f"<p>Goodput <b>{100 * f['goodput']:.1f} %</b>: {f['productive_node_s']:.1f} productive of "
            f"{f['allocated_node_s']:.1f} allocated node-seconds over {len(runs)} attempt(s); {f['lost_steps']} steps "
            f"recomputed after requeues; checkpoint stall {f['stall_s']:.2f} s in all.</p>"
            f"<p>torch {html.escape(str(info.get('torch')))}, CUDA {html.escape(str(info.get('cuda')))}, NCCL "
            f"{html.escape(str(info.get('nccl')))}, commit {html.escape(str(info.get('git')))}</p>"
            "<table><tr>" + "".join(f"<th>{c}</th>" for c, _ in COLUMNS) + f"</tr>{rows}</table>{imgs}")
    out = run_dir / "report.html"
    out.write_text(page)
    return out, f


def write_report(run_dir: Path, say: Callable[[str], None]) -> dict[str, float]:
    """At the end of a run (rank 0): the report, or one line saying why not; never fails the run. Returns the
    goodput figures for the W&B summary."""
    try:
        path, f = _render(run_dir)
        say(f"report: {path} (goodput {100 * f['goodput']:.1f} %)")
        return {"goodput": f["goodput"], "productive_node_s": f["productive_node_s"],
                "allocated_node_s": f["allocated_node_s"], "lost_steps": f["lost_steps"], "checkpoint_stall_s": f["stall_s"]}
    except Exception as exc:  # plotting must never cost a finished run its exit code
        say(f"note: no run report ({type(exc).__name__}: {exc})")
        return {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.report", description=__doc__)
    parser.add_argument("run_dir", type=Path, help="a run folder (holds events.jsonl)")
    ns = parser.parse_args(argv)
    try:
        path, summary = render(ns.run_dir)
    except (ValueError, OSError) as exc:
        print(f"error: RUN_DIR: {exc}\nHINT: pass a run folder written by this version (it holds {EVENTS})",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    print(summary)
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
