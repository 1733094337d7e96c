"""The replay audit (trainer/runtime/health/replay.py): a step computed again from what its rank captured gives the same
gradients bit for bit, a faulty rank's flipped gradient bit is found and that rank named, in-process for 20 seeds and
for real on 3 gloo ranks (TRAINER_FAULTS grad_flip_*)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from trainer.runtime.health.audit import EXIT_AUDIT
from trainer.runtime.health.replay import _cpu, _rng, digest, judge, recompute
from trainer.testing.faults import Faults

from .conftest import SMALL, faults, ok, result_of, run_trainer
from .test_audit import events, records, train


@pytest.mark.parametrize(("source", "replay", "third", "odd"), [
    ([1, 2], [1, 3], [1, 3], "source"), ([1, 2], [1, 3], [1, 2], "replay"), ([1, 2], [1, 3], [4, 4], "unknown"),
    ([1, 2], [1, 3], None, "unknown")])
def test_the_third_opinion_names_the_odd_one_out(source: list[int], replay: list[int], third: list[int] | None,
                                                 odd: str) -> None:
    assert judge(source, replay, third) == odd


def model_and_batch() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 3))
    return model, torch.randn(16, 6), torch.randint(0, 3, (16,))


def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
         flip: Faults | None = None) -> tuple[dict[str, Any], list[int]]:
    """One training step's capture and its local gradients' digests, as a source rank has them (``flip``: a faulty
    rank's gradients)."""
    params = list(model.parameters())
    rng = _rng(torch.device("cpu"))
    out = model(x)
    kept: list[torch.Tensor] = []
    out.register_hook(lambda g: kept.append(g.clone()))
    nn.functional.cross_entropy(out, y).backward()
    local = [p.grad for p in params if p.grad is not None]
    grads = [flip.flip_grad(g, i, len(local), 1, 5) if flip else g for i, g in enumerate(local)]
    return {"args": _cpu((x,)), "kwargs": {}, "rng": rng, "grad_out": kept[0]}, [digest([g]) for g in grads]


def test_a_replayed_step_gives_the_same_gradients_and_leaves_the_replayer_as_it_was() -> None:
    model, x, y = model_and_batch()
    capture, digests = step(model, x, y)
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    buffers = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    assert recompute(model, capture, torch.device("cpu")) == digests  # dropout and batch norm included
    assert all(p.grad is not None and torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    assert all(torch.equal(b, c) for b, c in zip(model.buffers(), buffers, strict=True))
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_faulty_ranks_flipped_gradient_bit_is_found_and_it_is_named_for_every_seed() -> None:
    """20 seeds: a bit of a different parameter, value and mantissa position each; the source's digests differ from
    the replay's and from a third rank's, which agree: the source is the odd one out (the goal: 19 of 20)."""
    named = 0
    for seed in range(20):
        model, x, y = model_and_batch()
        capture, flipped = step(model, x, y, Faults(grad_flip_from_step=0, grad_flip_rank=1, grad_flip_seed=seed))
        replay = recompute(model, capture, torch.device("cpu"))
        third = recompute(model, capture, torch.device("cpu"))
        named += judge(flipped, replay, third) == "source"
    assert named == 20


def test_the_fault_flips_one_bit_of_one_value_of_the_seeded_parameter() -> None:
    g = torch.randn(5, 4)
    f = Faults(grad_flip_from_step=3, grad_flip_rank=1, grad_flip_seed=7)
    index = __import__("random").Random(7).randrange(3)
    for i in range(3):
        out = f.flip_grad(g, i, 3, 1, 3)
        diff = (out.view(torch.int32) ^ g.view(torch.int32)).view(-1)
        assert (int(diff.count_nonzero()), bin(int(diff.abs().max())).count("1")) == ((1, 1) if i == index else (0, 0))
    assert f.flip_grad(g, index, 3, 0, 3) is g and f.flip_grad(g, index, 3, 1, 2) is g  # another rank, an earlier step


REPLAY = ["checkpoint.every_steps=10", "audit.replay_every_steps=10"]


def test_replays_change_nothing_in_a_clean_run(tmp_path: Path) -> None:
    ok(train(tmp_path / "plain", 3, ["checkpoint.every_steps=10"], {}, timeout=300))
    ok(train(tmp_path / "replayed", 3, REPLAY, {}, timeout=300))
    assert events(tmp_path / "replayed", "corruption") == []
    assert result_of(tmp_path / "replayed")["param_checksums"] == result_of(tmp_path / "plain")["param_checksums"]


def test_a_faulty_rank_is_found_at_the_next_replay_and_the_rerun_ends_as_if_it_never_computed(tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    ok(train(ref, 3, REPLAY, faults(preempt_at_step=9), timeout=300), 75)
    ok(train(ref, 3, REPLAY, {}, timeout=300))
    run = tmp_path / "run"
    ok(train(run, 3, REPLAY, faults(grad_flip_from_step=13, grad_flip_rank=1, grad_flip_seed=3), timeout=300),
       EXIT_AUDIT)
    found = events(run, "corruption")
    assert found and {e["step"] for e in found} == {20} and all(e["nodes"] == ["n2"] for e in found), found
    assert all(r["class"] == "infrastructure" and r["blame"] == ["n2"] for r in records(run))
    assert "rank 1 on n2 computed step 20's gradients wrongly" in records(run)[0]["cause"]
    saved = {p.name.split(".")[0] for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")}
    assert saved == {"step_00000010"}
    ok(train(run, 3, REPLAY, {}, timeout=300))
    assert result_of(run)["param_checksums"] == result_of(ref)["param_checksums"]


def test_with_two_ranks_a_disagreement_ends_the_attempt_without_blaming_a_node(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ok(train(run, 2, REPLAY, faults(grad_flip_from_step=13, grad_flip_rank=1)), EXIT_AUDIT)
    (found,) = events(run, "corruption")[:1]
    assert found["nodes"] == [] and "no third rank tells which is right" in found["cause"], found


def test_a_replay_on_one_process_is_refused_with_a_hint(tmp_path: Path) -> None:
    proc = run_trainer([*SMALL, "audit.replay_every_steps=10", f"run.dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 2 and "error: audit.replay_every_steps: needs DDP replicas" in proc.stderr, proc.stderr
    assert "HINT: run 2 or more processes" in proc.stderr


def test_an_own_loop_is_replayed_too(tmp_path: Path) -> None:
    """The char LM example (its model returns the loss; one micro-step per step): clean replays pass, a faulty rank is
    named."""
    from .conftest import spawn_ranks, wait_ranks
    from .test_audit import CHAR_LM, NODES

    def lm(run: Path, fault: dict[str, str]) -> Any:
        args = ["--max-steps", "24", "--eval-every", "24", "--max-bytes", "60000", "--batch-size", "8", "--accum", "1",
                "tracking.mode=disabled", "run.report=false", "audit.replay_every_steps=6", f"run.dir={run}"]
        return wait_ranks(spawn_ranks(args, tmp_path, 3, {"RUN_DIR": str(run), **fault}, script=CHAR_LM,
                                      nodes=NODES), args, 240)

    ok(lm(tmp_path / "clean", {}))
    assert events(tmp_path / "clean", "corruption") == []
    ok(lm(tmp_path / "faulty", faults(grad_flip_from_step=8, grad_flip_rank=2, grad_flip_seed=5)), EXIT_AUDIT)
    found = events(tmp_path / "faulty", "corruption")
    assert found and {e["step"] for e in found} == {12} and all(e["nodes"] == ["n3"] for e in found), found
