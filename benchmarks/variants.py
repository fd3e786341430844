"""The ways to train the same model that the benchmark compares, each measured the same way.

Lightning variants run ``Trainer.fit`` with a clock callback that records a CUDA event at every batch start; plain
PyTorch variants run the same model, data and optimizer in a hand-written loop with the same clock. A step time is
the GPU-timeline distance between consecutive batch starts, so it includes host overhead whenever the host is the
bottleneck (the regime CUDA graphs address) without adding a host sync per step.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from benchmarks.report import TE_VARIANTS
from examples.gpt import GPTModule, TokenDataModule
from examples.moe import MoEGPTModule
from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy

CONFIGS = {
    "small": {"vocab_size": 1024, "seq_len": 128, "n_layer": 6, "width": 256, "heads": 4, "batch_size": 8},
    "medium": {"vocab_size": 1024, "seq_len": 512, "n_layer": 6, "width": 1024, "heads": 16, "batch_size": 8},
    "tiny": {"vocab_size": 256, "seq_len": 64, "n_layer": 4, "width": 128, "heads": 4, "batch_size": 4},
    # The MoE GPT of examples/moe.py (examples/moe_small.yaml): "experts" selects MoEGPTModule.
    "moe": {"vocab_size": 1024, "seq_len": 128, "n_layer": 6, "width": 256, "heads": 4, "batch_size": 8, "experts": 4},
}

#: Scoped Lightning variants: the scopes each one captures.
SCOPE_VARIANTS = {
    "attn": ["attn"],
    "mlp": ["mlp"],
    "attn+mlp": ["attn", "mlp"],
    "layer": ["layer"],
    "moe_router+preprocess": ["moe_router", "moe_preprocess"],
}

#: Where ``te_layer`` finds the Transformer Engine GPT (written separately; optional).
TE_EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "te_gpt.py")
TE_SKIPPED = "skipped: Transformer Engine not installed"


@dataclass
class Result:
    """One variant's measurements."""

    variant: str
    step_ms: list[float] = field(default_factory=list)
    peak_mib: float = float("nan")
    pool_mib: float = float("nan")
    capture_ms: float = float("nan")
    replays: int = 0
    fallbacks: int = 0
    final_loss: float = float("nan")
    note: str = ""

    @property
    def median_ms(self) -> float:
        return _quantile(self.step_ms, 0.5)

    @property
    def spread_ms(self) -> tuple[float, float]:
        return _quantile(self.step_ms, 0.25), _quantile(self.step_ms, 0.75)


def timing_trainer(
    steps: int, callbacks: list[pl.Callback], strategy: Any = "auto", precision: Any = "32-true", devices: int = 1
) -> pl.Trainer:
    """A Trainer on ``devices`` GPUs that only trains: no logger, checkpoints, progress bar, summary or validation."""
    return pl.Trainer(
        accelerator="cuda",
        devices=devices,
        strategy=strategy,
        precision=precision,
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )


def least(fits: list[dict[str, Any]], figure: str) -> dict[str, Any]:
    """The fit with the least ``figure`` among those that have it (the first fit where none has).

    Example:
        >>> least([{"ms": None}, {"ms": 2.0}, {"ms": 1.5}], "ms")
        {'ms': 1.5}
    """
    measured = [fit for fit in fits if fit[figure] is not None]
    return min(measured, key=lambda fit: fit[figure]) if measured else fits[0]


class StepClock(pl.Callback):
    """CUDA events (read once at the end) and the host's clock at every training batch start."""

    def __init__(self) -> None:
        self.events: list[torch.cuda.Event] = []
        self.host_starts: list[float] = []
        self.last_loss: torch.Tensor | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.host_starts.append(time.perf_counter())
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.append(event)

    def host_median_ms(self, skip: int) -> float | None:
        """The median host time between batch starts from step ``skip`` on: equal to the step time where the host
        paces the step (or waits for the GPU), below it where the host runs ahead (``None``: fewer than 2 starts)."""
        starts = self.host_starts[skip:]
        gaps = [(b - a) * 1e3 for a, b in itertools.pairwise(starts)]
        return round(statistics.median(gaps), 4) if gaps else None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.last_loss = outputs["loss"]

    def step_times(self, skip: int) -> list[float]:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        events = [*self.events, end]
        return [a.elapsed_time(b) for a, b in zip(events[skip:-1], events[skip + 1 :], strict=True)]


class HandwrittenBlockGraphs(pl.Callback):
    """The reference a user would write by hand: graph the blocks with ``make_graphed_callables`` after warmup."""

    def __init__(self, warmup_steps: int) -> None:
        self.warmup_steps = warmup_steps
        self.capture_ms = float("nan")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, idx: int) -> None:
        if trainer.global_step != self.warmup_steps:
            return
        blocks = tuple(pl_module.model.blocks)
        config = pl_module.hparams
        shape = (batch[0].shape[0], config.seq_len, config.width)
        samples = block_samples(len(blocks), shape, pl_module.device)
        started = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False, enabled=_autocast_on(trainer)):
            torch.cuda.make_graphed_callables(blocks, samples)
        self.capture_ms = (time.perf_counter() - started) * 1e3


def block_samples(count: int, shape: tuple[int, ...], device: torch.device) -> tuple[tuple[torch.Tensor], ...]:
    """One sample input per block for ``make_graphed_callables``.

    Each must be its own tensor: it becomes that block's static input, which the backward graph reads. One tensor
    shared by every block would be overwritten by the later blocks' inputs before the first block's backward runs,
    and training would silently go wrong.
    """
    return tuple((torch.randn(*shape, device=device, requires_grad=True),) for _ in range(count))


def _autocast_on(trainer: pl.Trainer) -> bool:
    return str(trainer.precision).startswith("bf16")


def lightning_variant(name: str, config: dict[str, Any], precision: str, steps: int, skip: int) -> Result:
    """Run one Lightning variant and measure it."""
    model, data = _model_and_data(config, name)
    clock = StepClock()
    callbacks: list[pl.Callback] = [clock]
    strategy: Any = "auto"
    graph_callback: CUDAGraphCallback | None = None
    handwritten: HandwrittenBlockGraphs | None = None
    if name in SCOPE_VARIANTS:
        graph_callback = CUDAGraphCallback(scope=SCOPE_VARIANTS[name], warmup_steps=3)
        callbacks.append(graph_callback)
    elif name == "full_iteration":
        graph_callback = CUDAGraphCallback(scope=["full_iteration"], warmup_steps=3)
        callbacks.append(graph_callback)
        strategy = CUDAGraphStrategy(scope=["full_iteration"])
    elif name == "te_layer":
        graph_callback = CUDAGraphCallback(impl="transformer_engine", scope=["layer"], warmup_steps=3)
        callbacks.append(graph_callback)
    elif name == "te_eager":
        pass  # the Transformer Engine GPT without graphs (module_class picks it)
    elif name == "handwritten_layer":
        handwritten = HandwrittenBlockGraphs(warmup_steps=3)
        callbacks.append(handwritten)
    elif name == "compile_reduce_overhead":
        model.model = torch.compile(model.model, mode="reduce-overhead")
    elif name == "compile_default":
        model.model = torch.compile(model.model)
    elif name != "eager":
        raise ValueError(f"unknown Lightning variant {name!r}")
    trainer = timing_trainer(steps, callbacks, strategy, precision)
    with peak_memory() as peak:
        trainer.fit(model, data)
    result = Result(name, clock.step_times(skip), peak_mib=peak())
    result.final_loss = float(clock.last_loss)
    if graph_callback is not None:
        report = graph_callback.report
        result.pool_mib, result.capture_ms = report.pool_mib, report.capture_ms
        result.replays, result.fallbacks = report.replays, report.fallbacks
        result.note = f"stage {int(report.stage)}" + (f" ({report.reason})" if report.reason else "")
    if handwritten is not None:
        result.capture_ms = handwritten.capture_ms
    return result


def pytorch_variant(name: str, config: dict[str, Any], precision: str, steps: int, skip: int) -> Result:
    """The same model, data and optimizer in a plain PyTorch loop: eager, per-block graphs, or a whole-step graph."""
    model, data = _model_and_data(config)
    device = torch.device("cuda")
    gpt = model.model.to(device)
    data.setup("fit")
    batches = _cycle(data.train_dataloader())
    whole_step = name == "pytorch_full_graph"
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=1e-3, capturable=whole_step)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision.startswith("bf16"), cache_enabled=False)
    side = torch.cuda.Stream()
    torch.cuda.set_stream(side)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            logits = gpt(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        optimizer.step()
        return loss.detach()

    events: list[torch.cuda.Event] = []
    capture_ms, run = float("nan"), step
    with peak_memory() as peak:
        static_x, static_y = (t.to(device) for t in next(batches))
        for _ in range(3):
            loss = step(static_x, static_y)
        if name == "pytorch_block_graphs":
            samples = block_samples(len(gpt.blocks), (*static_x.shape, config["width"]), device)
            started = time.perf_counter()
            with autocast:
                torch.cuda.make_graphed_callables(tuple(gpt.blocks), samples)
            capture_ms = (time.perf_counter() - started) * 1e3
        elif whole_step:
            graph = torch.cuda.CUDAGraph()
            started = time.perf_counter()
            with torch.cuda.graph(graph, stream=side):
                static_loss = step(static_x, static_y)
            capture_ms = (time.perf_counter() - started) * 1e3

            def run(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                static_x.copy_(x, non_blocking=True)
                static_y.copy_(y, non_blocking=True)
                graph.replay()
                return static_loss.clone()

        for _ in range(steps):
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            events.append(event)
            x, y = (t.to(device, non_blocking=True) for t in next(batches))
            loss = run(x, y)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
    torch.cuda.set_stream(torch.cuda.default_stream())
    events.append(end)
    times = [a.elapsed_time(b) for a, b in zip(events[skip:-1], events[skip + 1 :], strict=True)]
    return Result(name, times, peak_mib=peak(), capture_ms=capture_ms, final_loss=float(loss))


LIGHTNING_VARIANTS = (
    "eager",
    "attn",
    "mlp",
    "attn+mlp",
    "layer",
    "full_iteration",
    "handwritten_layer",
    "compile_default",
    "compile_reduce_overhead",
    "te_layer",
    "te_eager",
)
PYTORCH_VARIANTS = ("pytorch_eager", "pytorch_block_graphs", "pytorch_full_graph")
#: The variants of the MoE config (its graph scopes are the router and the token dispatch).
MOE_VARIANTS = ("eager", "moe_router+preprocess", "layer", "full_iteration")


def te_available() -> bool:
    """Whether Transformer Engine is importable (``te_layer`` is skipped without it)."""
    return importlib.util.find_spec("transformer_engine") is not None


def variants_for(config: dict[str, Any]) -> tuple[str, ...]:
    """Every variant that applies to a config: the MoE ones for an MoE model, all the others otherwise."""
    if "experts" in config:
        return MOE_VARIANTS
    return (*LIGHTNING_VARIANTS, *PYTORCH_VARIANTS)


def run_variant(name: str, config: dict[str, Any], precision: str, steps: int, skip: int) -> Result:
    """Run any variant by name."""
    runner: Callable[..., Result] = pytorch_variant if name in PYTORCH_VARIANTS else lightning_variant
    torch.cuda.empty_cache()
    try:
        return runner(name, config, precision, steps, skip)
    except Exception as err:  # one failing variant must not hide the others' figures
        torch.cuda.set_stream(torch.cuda.default_stream())
        return Result(name, note=failure_note(name, err))


def failure_note(name: str, err: Exception) -> str:
    """The note of a variant that could not run: skipped (``te_layer`` without Transformer Engine) or failed."""
    if name in TE_VARIANTS and isinstance(err, ImportError):
        missing_te = (err.name or "").split(".")[0] == "transformer_engine"
        return TE_SKIPPED if missing_te else f"{TE_SKIPPED} ({type(err).__name__}: {str(err)[:120]})"
    return f"failed: {type(err).__name__}: {str(err)[:160]}"


def module_class(config: dict[str, Any], variant: str = "eager") -> type[GPTModule]:
    """The LightningModule a variant trains: the MoE GPT for a config with ``experts``, the TE GPT for ``te_layer``.

    Raises:
        ImportError: ``te_layer`` without Transformer Engine (the variant is reported as skipped).
    """
    if variant in TE_VARIANTS:
        return _te_module_class()
    return MoEGPTModule if "experts" in config else GPTModule


def _te_module_class() -> type[GPTModule]:
    """``examples.te_gpt.TEGPTModule`` when that example exists, else the plain GPT (graphed by TE's impl)."""
    if not te_available():
        raise ModuleNotFoundError("No module named 'transformer_engine'", name="transformer_engine")
    if not os.path.exists(TE_EXAMPLE):
        return GPTModule
    from examples.te_gpt import TEGPTModule  # lazy: it imports Transformer Engine

    return TEGPTModule


def model_args(config: dict[str, Any]) -> dict[str, Any]:
    """The model's constructor arguments in a config (``experts`` only where the config has it)."""
    keys = ("vocab_size", "seq_len", "n_layer", "width", "heads", "experts")
    return {k: config[k] for k in keys if k in config}


def _model_and_data(config: dict[str, Any], variant: str = "eager") -> tuple[GPTModule, TokenDataModule]:
    cls = module_class(config, variant)
    pl.seed_everything(0, verbose=False)
    model = cls(**model_args(config))
    data = TokenDataModule(
        config["vocab_size"],
        config["seq_len"],
        batch_size=config["batch_size"],
        train_samples=64 * config["batch_size"],
    )
    return model, data


def _cycle(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


@contextlib.contextmanager
def peak_memory() -> Iterator[Callable[[], float]]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    yield lambda: torch.cuda.max_memory_allocated() / 2**20


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
