"""A language model at bare-loop speed: the char LM example's GPT at GPT-2 small's shape (12 layers × 768, 12 heads,
1024 tokens, a 50,304-token vocabulary), bf16 autocast, fused AdamW.

Each variant (eager, compiled) runs in its own process, ``python -m benchmarks.lm --one eager``, which holds two
copies of the model: one trained by a bare nanoGPT-style loop, one by the same loop on :class:`trainer.Session`
(``sess.wrap``, ``sess.steps``, ``sess.should_save``). They train in interleaved bursts, so each pair of bursts
shares the machine's state; the ratio of each pair is the trainer's cost. A compiled variant runs twice on one
inductor cache folder: the second start is what a requeued or recovered attempt pays. Tokens/s become MFU with the
estimate nanoGPT uses (6 N + 12 L d T FLOPs per token) over the GPU's dense bf16 peak.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, pairs

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}
"""Dense bf16 tensor-core peak (FLOP/s) by GPU name; MFU is shown only where the peak is known."""


def shape(tiny: bool) -> dict[str, int]:
    """GPT-2 small's shape, or a tiny one for the CPU."""
    if tiny:
        return {"block": 64, "vocab": 256, "layers": 2, "heads": 2, "dim": 64, "batch": 4}
    return {"block": 1024, "vocab": 50304, "layers": 12, "heads": 12, "dim": 768, "batch": 16}


MODEL_KEYS = ("block", "vocab", "layers", "heads", "dim")
"""The keys of a shape that make the model (``batch`` is the loop's)."""


def gpt(block: int = 1024, vocab: int = 50304, layers: int = 12, heads: int = 12, dim: int = 768) -> Any:
    """The char LM example's GPT at the shape given (GPT-2 small's by default); a ``model.target`` too."""
    folder = str(ROOT / "examples" / "char_lm")
    if folder not in sys.path:  # called once per model: one entry is enough
        sys.path.insert(0, folder)
    from model import GPT, GPTConfig

    return GPT(GPTConfig(block=block, vocab=vocab, layers=layers, heads=heads, dim=dim))


def gpt_of(s: dict[str, int]) -> Any:
    """:func:`gpt` at shape ``s``."""
    return gpt(**{k: s[k] for k in MODEL_KEYS})


def run_folder_cache_env() -> dict[str, str]:
    """This environment without a compile cache of its own: a session started with it keeps one in its run folder,
    as a user's job does."""
    return {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}


def flops_per_token(s: dict[str, int], params: int) -> float:
    """nanoGPT's estimate: 6 per parameter (forward + backward) plus the attention's 12·L·d·T."""
    return 6 * params + 12 * s["layers"] * s["dim"] * s["block"]


def peak(name: str) -> float | None:
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


class Loop:
    """One model, its optimizer and a fixed batch on the device: ``burst(n)`` trains n steps, returns tokens/s."""

    def __init__(self, model: Any, s: dict[str, int], device: Any, step_hook: Any = None) -> None:
        import torch

        self.torch, self.model, self.device, self.hook = torch, model, device, step_hook
        cuda = device.type == "cuda"
        self.opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
        g = torch.Generator().manual_seed(0)
        data = torch.randint(0, s["vocab"], (s["batch"], s["block"] + 1), generator=g).to(device)
        # Contiguous copies, as nanoGPT's get_batch stacks them (views of one tensor are strided: a handicap).
        self.x, self.y, self.tokens = data[:, :-1].contiguous(), data[:, 1:].contiguous(), s["batch"] * s["block"]
        self.amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext

    def step(self) -> None:
        if self.hook is not None:
            self.hook()
        with self.amp():
            loss = self.model(self.x, self.y)
        loss.backward()
        self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def burst(self, n: int) -> float:
        self.sync()
        t = time.perf_counter()
        for _ in range(n):
            self.step()
        self.sync()
        return n * self.tokens / (time.perf_counter() - t)


def one(variant: str, n_pairs: int, burst: int, warmup: int, tiny: bool, started: float, run_dir: Path
        ) -> dict[str, Any]:
    """The measurement of one variant in this process (see the module's docstring)."""
    import torch

    import trainer

    phases = {"imported": time.time() - started}
    s = shape(tiny)
    with trainer.Session([f"run.dir={run_dir}", "tracking.mode=disabled", "checkpoint.resume=never"]) as sess:
        phases["session"] = time.time() - started
        torch.manual_seed(0)
        bare_model: Any = gpt_of(s).to(sess.device)
        torch.manual_seed(0)
        wrapped: Any = sess.wrap(gpt_of(s))
        phases["models"] = time.time() - started
        params = sum(p.numel() for p in bare_model.parameters()) - s["block"] * s["dim"]  # nanoGPT leaves positions out
        if variant == "compiled":
            bare_model, wrapped = torch.compile(bare_model), torch.compile(wrapped)
        steps = sess.steps(0, 10**9)
        step = [0]

        def on_session() -> None:  # what an own loop on Session does each step
            step[0] = next(steps)
            sess.should_save(step[0])

        bare, ours = Loop(bare_model, s, sess.device), Loop(wrapped, s, sess.device, on_session)
        sess.restore(model=wrapped, optimizer=ours.opt)
        t = time.perf_counter()
        bare.burst(1)
        first_bare_s = time.perf_counter() - t
        t = time.perf_counter()
        ours.burst(1)
        first_session_s, launch_s = time.perf_counter() - t, time.time() - started
        bare.burst(warmup)
        ours.burst(warmup)
        rows = pairs(n_pairs, lambda: bare.burst(burst), lambda: ours.burst(burst))
        sess.finish()
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"variant": variant, "device": name, "shape": s, "params": params, "launch_s": launch_s, "phases_s": phases,
            "first_step_s": first_bare_s, "first_session_step_s": first_session_s,
            "flops_per_token": flops_per_token(s, params), "peak_flops": peak(name),
            "bare_tokens_per_s": [r[0] for r in rows], "session_tokens_per_s": [r[1] for r in rows]}


def child(variant: str, n_pairs: int, burst: int, warmup: int, tiny: bool, run_dir: Path) -> dict[str, Any]:
    """``one`` in a fresh interpreter (its launch counted), its JSON line read back. The compile cache is the
    session's own (in the run folder), as a user gets it."""
    started = time.time()
    cmd = [sys.executable, "-m", "benchmarks.lm", "--one", variant, "--pairs", str(n_pairs), "--burst", str(burst),
           "--warmup", str(warmup), "--started", repr(started), "--run-dir", str(run_dir)] + (["--tiny"] if tiny else [])
    p = subprocess.run(cmd, cwd=ROOT, env=run_folder_cache_env(), capture_output=True, text=True, timeout=900)
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr[-2000:]}")
    return json.loads(lines[-1])


def lm_rows(n_pairs: int, smoke: bool, out: Path | None = None) -> dict[str, Any]:
    """Eager and compiled, each with its pairs; the compiled one started again in the same run folder (a second
    attempt: the compile cache the session keeps there). Each row is printed, and kept in ``out``, as it ends (a run
    cut short keeps what it measured)."""
    burst, warmup = (3, 1) if smoke else (20, 10)
    res: dict[str, Any] = {"rows": []}
    rows = res["rows"]

    def row(variant: str, n: int, run_dir: Path) -> dict[str, Any]:
        r = child(variant, n, burst, warmup, smoke, run_dir)
        r["trainer_vs_bare"] = [b and o / b for b, o in zip(r["bare_tokens_per_s"], r["session_tokens_per_s"],
                                                            strict=True)]
        return r

    def kept() -> None:
        print(summary(rows[-1]), flush=True)
        if out:
            out.write_text(json.dumps(res, indent=1) + "\n")

    with tempfile.TemporaryDirectory() as runs:
        rows.append(row("eager", n_pairs, Path(runs) / "eager"))
        kept()
        if not smoke:  # inductor on the CPU needs a compiler and minutes: the smoke run keeps to eager
            rows.append(row("compiled", n_pairs, Path(runs) / "compiled"))
            kept()
            again = row("compiled", 1, Path(runs) / "compiled")
            rows[-1].update(warm_cache_first_step_s=again["first_step_s"], warm_cache_launch_s=again["launch_s"])
            kept()
    return res


def summary(r: dict[str, Any]) -> str:
    """One line per variant, for the log."""
    med = statistics.median
    mfu = f", MFU {med(r['bare_tokens_per_s']) * r['flops_per_token'] / r['peak_flops']:.1%}" if r["peak_flops"] else ""
    return (f"{r['variant']}: bare {med(r['bare_tokens_per_s']):,.0f} tok/s, session {med(r['session_tokens_per_s']):,.0f}"
            f" ({med(r['trainer_vs_bare']):.3f}×, per pair {', '.join(f'{x:.3f}' for x in r['trainer_vs_bare'])}){mfu}; "
            f"first step {r['first_step_s']:.1f} s, launch→first step {r['launch_s']:.1f} s"
            + (f"; warm cache: first step {r['warm_cache_first_step_s']:.1f} s" if "warm_cache_first_step_s" in r else ""))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--one", choices=["eager", "compiled"], help="measure one variant in this process")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--burst", type=int, default=20)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="a tiny model (the CPU's smoke run)")
    p.add_argument("--started", type=float, default=0.0)
    p.add_argument("--run-dir", type=Path, help="the session's run folder (--one)")
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    a = p.parse_args()
    if a.one:
        with tempfile.TemporaryDirectory() as run:
            result = one(a.one, a.pairs, a.burst, a.warmup, a.tiny, a.started or time.time(), a.run_dir or Path(run))
        print(json.dumps(result), flush=True)
        return 0
    lm_rows(a.pairs, a.tiny, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def lm_section(r: dict[str, Any]) -> list[str]:
    """The LM rows of section 4 of docs/benchmarks.md."""
    if "skipped" in r:
        return [f"- GPT-2 small, trainer vs bare loop: skipped ({r['skipped']}).", ""]
    s = r["rows"][0]["shape"]
    out = [f"GPT-2 small's shape ({r['rows'][0]['params'] / 1e6:.1f} M parameters without positions; {s['layers']} "
           f"layers × {s['dim']}, {s['block']} tokens, batch {s['batch']}), bf16 autocast, fused AdamW, one process "
           "(`benchmarks/lm.py`): a bare nanoGPT-style loop against the same loop on `Session`, in interleaved bursts "
           "of 20 steps; MFU = tokens/s × (6 N + 12 L d T) ÷ the dense bf16 peak named. Launch → first step counts "
           "from the interpreter's start, two models built (one per loop).", "",
           "| variant | bare tokens/s | Session tokens/s | Session / bare | per pair | MFU (peak) | first step (s) "
           "| launch → first step (s) | first step, warm compile cache (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        bare = statistics.median(x["bare_tokens_per_s"])
        mfu = f"{bare * x['flops_per_token'] / x['peak_flops']:.1%} ({x['peak_flops'] / 1e12:.0f} TFLOP/s)" \
            if x["peak_flops"] else "peak unknown"
        warm = f"{x['warm_cache_first_step_s']:.1f}" if "warm_cache_first_step_s" in x else "–"
        out.append(f"| {x['variant']} | {bare:,.0f} | {statistics.median(x['session_tokens_per_s']):,.0f} | "
                   f"**{statistics.median(x['trainer_vs_bare']):.3f}×** | "
                   f"{', '.join(f'{v:.3f}' for v in x['trainer_vs_bare'])} | {mfu} | {x['first_step_s']:.1f} | "
                   f"{x['launch_s']:.1f} | {warm} |")
    return out + [""]
