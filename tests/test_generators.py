"""Private random generators against the same fit without the package.

A user may keep a generator of their own on the module or a submodule (``self.rng = random.Random(0)``, a NumPy
``RandomState`` or ``Generator``, a CPU ``torch.Generator``) and draw from it in the step. A replay draws nothing, so
a graph holding the draw is refused, named by where the generator is kept; and the package's own extra runs of the
step's Python (captures, shadow steps) must leave the generator where eager leaves it. Each case trains eagerly and
through the package from the same weights on the same batches (strict fake backend) and compares losses,
parameters and the generator's next draw after the fit.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import numpy as np
import pytest
import torch

from lightning_cudagraph._trust.generators import HeldGenerator, held_generators
from lightning_cudagraph._trust.observation import Observer
from lightning_cudagraph._trust.snapshot import TrainingState
from lightning_cudagraph.health import Stage
from tests.models import DecoderModule
from tests.test_step_python import WARMUP, Case, assert_same_training, run_case

VARIANTS = ["cudagraph_full", "cudagraph", "layer"]


# =================================================================== one draw from each kind of generator
def _python() -> random.Random:
    return random.Random(0)


def _random_state() -> np.random.RandomState:
    return np.random.RandomState(0)


def _numpy_generator() -> np.random.Generator:
    return np.random.default_rng(0)


def _torch() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def draw(generator: Any) -> float:
    """One number in [0, 1) from ``generator``, the way a user of that kind draws it."""
    if isinstance(generator, torch.Generator):
        return float(torch.rand((), generator=generator))
    if isinstance(generator, np.random.RandomState):
        return float(generator.random_sample())
    return float(generator.random())


KINDS = {"python": _python, "numpy_random_state": _random_state, "numpy_generator": _numpy_generator, "torch": _torch}


# =================================================================== the users' modules
class WeightFromOwnGenerator(DecoderModule):
    """A loss weight drawn in ``training_step`` from a generator kept on the module (``make_generator`` set below)."""

    make_generator = staticmethod(_python)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rng = self.make_generator()

    def training_step(self, batch, batch_idx):
        # A tensor weight: the step launches the same operations whatever the draw, so only the draw itself shows.
        if isinstance(self.rng, torch.Generator):
            weight = 0.5 + torch.rand((), generator=self.rng)
        else:
            weight = 0.5 + torch.tensor(draw(self.rng))
        loss = self.loss(batch) * weight
        self.log("train_loss", loss)
        return loss


def own_generator_module(kind: str) -> type[DecoderModule]:
    make = KINDS[kind]
    return type(f"WeightFrom_{kind}", (WeightFromOwnGenerator,), {"make_generator": staticmethod(make)})


class Jittered(torch.nn.Module):
    """Scales what ``inner`` returns by a factor drawn from a generator of its own (kept on this submodule)."""

    def __init__(self, inner: torch.nn.Module, generator: Any) -> None:
        super().__init__()
        self.inner, self.rng = inner, generator

    def forward(self, x):
        if isinstance(self.rng, torch.Generator):
            return self.inner(x) * (0.5 + torch.rand((), generator=self.rng))
        return self.inner(x) * (0.5 + self.rng.random())


class JitteredLayer(DecoderModule):
    """The second block's MLP draws from its own generator: inside a layer that a scoped level captures."""

    make_generator = staticmethod(_python)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        block = self.model.blocks[1]
        block.mlp = Jittered(block.mlp, self.make_generator())


_LATE_CALLS = itertools.count()


class LateJitter(Jittered):
    """Draws only from the call after the warmup steps on, decided by a counter no watch sees (a module-level one)."""

    def forward(self, x):
        if next(_LATE_CALLS) < WARMUP:
            return self.inner(x)
        return super().forward(x)


class LateJitteredLayer(DecoderModule):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        block = self.model.blocks[1]
        block.mlp = LateJitter(block.mlp, _python())


def jittered_module(kind: str) -> type[DecoderModule]:
    return type(f"Jittered_{kind}", (JitteredLayer,), {"make_generator": staticmethod(KINDS[kind])})


def own_case(kind: str) -> Case:
    return Case(own_generator_module(kind), state=lambda model: draw(model.rng))


def jittered_case(kind: str) -> Case:
    return Case(jittered_module(kind), state=lambda model: draw(model.model.blocks[1].mlp.rng))


_EAGER: dict[tuple[str, str], Any] = {}


def eager(where: str, kind: str) -> Any:
    if (where, kind) not in _EAGER:
        _EAGER[where, kind] = run_case(own_case(kind) if where == "module" else jittered_case(kind), None)
    return _EAGER[where, kind]


# =================================================================== fits against eager
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_generator_on_the_module_trains_as_eager_and_is_left_as_eager(kind, variant):
    outcome = run_case(own_case(kind), variant)
    assert_same_training(eager("module", kind), outcome)
    report = outcome.report
    if variant == "cudagraph_full":
        # Seen in the observed steps before any capture ("draws from"), not only refused at the capture ("drew from").
        assert report.stage == Stage.DISABLED and "draws from self.rng" in report.reason, report.reason
    else:
        assert report.stage == Stage.REPLAYING, report.reason


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", ["python", "torch"])
def test_a_generator_inside_a_captured_layer_trains_as_eager_and_is_left_as_eager(kind, variant):
    outcome = run_case(jittered_case(kind), variant)
    assert_same_training(eager("layer", kind), outcome)
    report = outcome.report
    if variant == "cudagraph_full":
        assert report.stage == Stage.DISABLED and "model.blocks.1.mlp.rng" in report.reason, report.reason
    elif variant == "layer":
        assert report.stage == Stage.REPLAYING, report.reason
        assert "mlp.rng" in report.exclusions.get("model.blocks.1", ""), report.exclusions
    else:
        assert report.stage == Stage.REPLAYING, report.reason


def test_a_layer_whose_forward_first_draws_at_its_capture_stays_eager_and_its_generator_as_eager():
    global _LATE_CALLS
    case = Case(LateJitteredLayer, state=lambda model: draw(model.model.blocks[1].mlp.rng))
    _LATE_CALLS = itertools.count()
    expected = run_case(case, None)
    _LATE_CALLS = itertools.count()
    outcome = run_case(case, "layer")
    assert_same_training(expected, outcome)
    assert outcome.report.stage == Stage.REPLAYING, outcome.report.reason
    assert "drew from mlp.rng" in outcome.report.exclusions.get("model.blocks.1", ""), outcome.report.exclusions


class LateWeight(DecoderModule):
    """Draws a loss weight from ``self.rng`` from the step after the warmup steps on, by a counter no watch sees."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rng = _python()

    def training_step(self, batch, batch_idx):
        weight = 0.5 + torch.tensor(draw(self.rng)) if next(_LATE_CALLS) >= WARMUP else 1.0
        loss = self.loss(batch) * weight
        self.log("train_loss", loss)
        return loss


def test_a_whole_step_that_first_draws_at_its_capture_is_refused():
    global _LATE_CALLS
    case = Case(LateWeight, state=lambda model: draw(model.rng))
    _LATE_CALLS = itertools.count()
    expected = run_case(case, None)
    _LATE_CALLS = itertools.count()
    outcome = run_case(case, "cudagraph_full")
    assert_same_training(expected, outcome)
    assert outcome.report.stage == Stage.DISABLED and "self.rng" in outcome.report.reason, outcome.report.reason


# =================================================================== the pieces
@pytest.mark.parametrize("kind", list(KINDS))
def test_training_state_puts_back_a_generator_on_a_submodule(kind):
    net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    net[0].rng = KINDS[kind]()
    state = TrainingState.take(net)
    first = draw(net[0].rng)
    draw(net[0].rng)
    state.restore()
    assert draw(net[0].rng) == first


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_span_names_a_draw_from_a_held_generator(kind):
    net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    net.rng, net[0].rngs = KINDS[kind](), [KINDS[kind]()]
    observer = Observer(trace=False)
    with observer.span([net]) as seen:
        draw(net[0].rngs[0])
    assert seen.random == ["0.rngs[0]"]
    with observer.span([net]) as seen:
        net[0](torch.ones(1, 2))
    assert seen.random == []
    with observer.span([net]) as seen:
        draw(net.rng)
    assert seen.random == ["self.rng"] and "self.rng" in (seen.depends() or "")


def test_training_state_names_the_held_generators_that_drew():
    net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    net.rng, net[0].gen = _python(), _torch()
    state = TrainingState.take(net)
    assert state.drawn() == []
    draw(net[0].gen)
    assert state.drawn() == ["0.gen"]


def test_held_generators_finds_each_kind_once_and_leaves_a_cuda_generator_out():
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    shared = _python()
    net[0].a, net[1].b, net[1].table = shared, shared, {"x": _torch(), "y": 3}
    net.kinds = tuple(make() for make in KINDS.values())
    found = held_generators([net])
    assert [held.name for held in found] == [*(f"self.kinds[{i}]" for i in range(4)), "0.a", "1.table['x']"]
    assert all(isinstance(held, HeldGenerator) for held in found)
