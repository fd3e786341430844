"""What one audit of a whole-step graph costs the host, whatever the model's size (issue 50, item 5).

An audit (a shadow step) copies the training state, replays the graph, puts the state back, runs the step eagerly and
compares the two. The copies, the restore and the comparison run as fused operations over all the parameters, and the
verdict is one number read back to the host. These tests fit models of 4 and of 40 parameters through the strict
fake backend and count, per audit, the reads back to the host and the package's per-tensor operations: neither may
grow with the parameter count. They also check that the fused comparison weighs each parameter as the formula does.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader, TensorDataset

from lightning_cudagraph import CUDAGraphStrategy, Stage
from lightning_cudagraph._graphs import step_replay
from lightning_cudagraph._graphs.step_replay import StepReplays
from lightning_cudagraph._options.config import CUDAGraphConfig
from lightning_cudagraph._trust import fused
from lightning_cudagraph._trust.cadence import FIRST_INTERVAL, GraphChecks
from lightning_cudagraph._trust.snapshot import TrainingState
from lightning_cudagraph.health import CUDAGraphReport
from tests.fake_backend import FakeBackend
from tests.helpers import fit, graph_callback

CPU = {"accelerator": "cpu", "devices": 1}
#: Tensor calls that read a value back to the host (a device sync on CUDA).
HOST_READS = frozenset(
    {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "equal", "allclose", "is_nonzero"}
)
#: Tensor calls that launch a kernel per tensor: the per-parameter work the fused audit no longer does.
PER_TENSOR = frozenset(
    {"clone", "copy_", "sub", "__sub__", "norm", "linalg_vector_norm", "div", "__truediv__", "clamp_min", "add",
     "__add__", "__radd__", "mul", "__mul__", "__rmul__", "zeros_like", "full", "maximum"}
)  # fmt: skip


class Linears(pl.LightningModule):
    """``layers`` Linear layers (two parameters each), trained with AdamW."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(layers)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Calls(TorchFunctionMode):
    """Counts tensor calls by name while ``where`` is set (an audit, the package's part of it)."""

    def __init__(self) -> None:
        super().__init__()
        self.where: list[str] = []
        self.counts: Counter[tuple[str, str]] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        for where in set(self.where):
            self.counts[where, "host reads"] += name in HOST_READS
            self.counts[where, "per-tensor kernels"] += name in PER_TENSOR
        return func(*args, **(kwargs or {}))

    def wrap(self, function: Callable[..., Any], *where: str) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            for label in where:
                self.where.append(label)
            try:
                return function(*args, **kwargs)
            finally:
                del self.where[-len(where) :]

        return counted


def per_audit(layers: int) -> dict[str, float]:
    """Fit :class:`Linears` with dense audits; the counts per audit (a capture's shadow step included)."""
    calls = Calls()
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 8)), batch_size=4)
    strategy = CUDAGraphStrategy(scope=["full_iteration"], warmup_steps=2, audit_every_n_steps=4)
    strategy.capture_backend = FakeBackend()
    with pytest.MonkeyPatch.context() as patch, calls:
        # The audit as the driver runs it: the state copied, then the shadow step (replay, restore, eager step,
        # compare); the copy (``take``) is the package's, as are restore, the copies of the graph's step, compare.
        patch.setattr(TrainingState, "take", staticmethod(calls.wrap(TrainingState.take, "audit", "package")))
        patch.setattr(StepReplays, "shadow", calls.wrap(StepReplays.shadow, "audit"))
        for name in ("restore", "parameters_now", "gradients_now", "keep_gradient_buffers"):
            patch.setattr(TrainingState, name, calls.wrap(getattr(TrainingState, name), "package"))
        patch.setattr(step_replay, "compare", calls.wrap(step_replay.compare, "package"))
        run = fit(Linears(layers), data, 12, strategy=strategy, **CPU)
    report = graph_callback(run.trainer).report
    assert report.stage == Stage.REPLAYING and report.audits >= 3, report.reason
    assert len(list(run.model.parameters())) == 2 * layers
    # The replay (the fake runs each recorded operation) and the user's eager step work per tensor: left out.
    del calls.counts["audit", "per-tensor kernels"]
    return {f"{where}: {what}": count / report.audits for (where, what), count in calls.counts.items()}


def test_an_audit_reads_the_host_and_launches_per_tensor_work_no_more_often_for_more_parameters():
    small, large = per_audit(2), per_audit(20)
    assert small["audit: host reads"] > 0, "the count saw none of the audit's reads"
    assert large == small, f"4 parameters: {small}; 40 parameters: {large}"


@pytest.mark.parametrize("chunk", [1 << 18, 40], ids=["one-pass", "many-passes"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_comparison_weighs_each_parameter_as_the_formula_does(monkeypatch, chunk, dtype):
    """|theirs - now| / max(|now - before|, 1e-7 |before| + 1e-12), each in float32, from zero when no ``before``."""
    monkeypatch.setattr(fused, "CHUNK", chunk)
    torch.manual_seed(0)
    shapes = [(3, 5), (7,), (0,), (16, 4), (1,), (2, 2, 2)]
    before = [torch.randn(shape).to(dtype) for shape in shapes]
    now = [b + 1e-2 * torch.randn_like(b) for b in before]
    theirs = [n + scale * torch.randn_like(n) for n, scale in zip(now, (0, 1e-4, 1, 1e-1, 0, 1e-3), strict=True)]
    theirs[4] = now[4].clone()  # no difference
    before[4] = now[4].clone()  # no step: the floor is the scale

    def formula(n: torch.Tensor, b: torch.Tensor | None, t: torch.Tensor) -> float:
        n, t = n.float(), t.float()
        b = torch.zeros_like(n) if b is None else b.float()
        return float((t - n).norm() / (n - b).norm().clamp_min(1e-7 * b.norm() + 1e-12))

    got = fused.off_by_each(now, before, theirs)
    assert got is not None
    want = [formula(n, b, t) for n, b, t in zip(now, before, theirs, strict=True)]
    assert got.tolist() == pytest.approx(want, rel=1e-5, abs=1e-6)
    from_zero = fused.off_by_each(now, None, theirs)
    assert from_zero is not None
    want = [formula(n, None, t) for n, t in zip(now, theirs, strict=True)]
    assert from_zero.tolist() == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert fused.off_by_each([], [], []) is None


def test_a_state_put_back_after_a_step_holds_every_tensor_as_it_was():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2).double())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step() -> None:
        optimizer.zero_grad(set_to_none=False)
        x = torch.randn(8, 4)
        model[2](model[1](model[0](x)).double()).sum().backward()
        optimizer.step()

    step()
    tensors = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters())]
    tensors += [t for entry in optimizer.state.values() for t in entry.values() if isinstance(t, torch.Tensor)]
    expected = [t.detach().clone() for t in tensors]
    state = TrainingState.take(model, [optimizer])
    assert state.names == [name for name, _ in model.named_parameters()]
    step()
    assert any(not torch.equal(t, e) for t, e in zip(tensors, expected, strict=True))
    state.restore()
    for tensor, want in zip(tensors, expected, strict=True):
        assert torch.equal(tensor, want)


def test_the_documented_audit_schedule_is_the_packages():
    """``docs/benchmarks.md`` says when the audits run from the held-out record: it must be the package's schedule."""
    repo = Path(__file__).resolve().parent.parent
    record = json.loads((repo / "benchmarks" / "results" / "audit" / "held_out.json").read_text())
    cadence = record["cadence"]
    assert cadence == {"first_interval": FIRST_INTERVAL, "audit_every_n_steps": CUDAGraphConfig().audit_every_n_steps}
    checks = GraphChecks(confirm_steps=1, audit_every=cadence["audit_every_n_steps"], report=CUDAGraphReport())
    due = [step for step in range(1, record["steps"] + 1) if checks.audit_due()]
    said = f"holds up to {len(due)} audits, after {', '.join(map(str, due[:-1]))} and {due[-1]} replayed steps"
    assert said in (repo / "docs" / "benchmarks.md").read_text()
