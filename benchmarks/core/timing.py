"""Timing: a clock at every batch start, the timing Trainer, and variants compared in alternated rounds.

A step time is the GPU-timeline distance between consecutive batch starts (CUDA events, read once at the end): it
includes host overhead whenever the host paces the step, without a host sync per step.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from benchmarks.core.figures import fastest_round, finite


class StepClock(pl.Callback):
    """A CUDA event and the host clock at every batch start, and the first ``keep_losses`` losses on the device."""

    def __init__(self, keep_losses: int = 0) -> None:
        self.events: list[Any] = []
        self.host_starts: list[float] = []
        self.keep_losses = keep_losses
        self.losses: list[torch.Tensor] = []
        self.last_loss: torch.Tensor | None = None

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.host_starts.append(time.perf_counter())
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.append(event)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.last_loss = outputs["loss"]
        if len(self.losses) < self.keep_losses:
            self.losses.append(outputs["loss"].detach().clone())  # read after the fit: no host sync here

    def step_times(self, skip: int) -> list[float]:
        """Milliseconds between consecutive batch starts from step ``skip`` on (the last to the fit's end)."""
        return elapsed_ms([*self.events, recorded()], skip)

    def host_median_ms(self, skip: int) -> float | None:
        """The median host time between batch starts from step ``skip`` on (the step time where the host paces it)."""
        gaps = [(b - a) * 1e3 for a, b in itertools.pairwise(self.host_starts[skip:])]
        return round(statistics.median(gaps), 4) if gaps else None

    def first_losses(self) -> list[float]:
        """The kept losses as floats (one host read, after the fit)."""
        return torch.stack(self.losses).float().tolist() if self.losses else []


def recorded() -> Any:
    """A timing CUDA event recorded on the current stream now."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def elapsed_ms(events: Sequence[Any], skip: int) -> list[float]:
    """Milliseconds between consecutive events from event ``skip`` on (one sync, on the last event)."""
    events[-1].synchronize()
    return [a.elapsed_time(b) for a, b in zip(events[skip:-1], events[skip + 1 :], strict=True)]


def endless_batches(data: Any) -> Iterator[Any]:
    """A datamodule's training batches, epoch after epoch (for the plain PyTorch loops)."""
    data.setup("fit")
    loader = data.train_dataloader()
    return (batch for _ in iter(int, 1) for batch in loader)


def timing_trainer(
    steps: int, callbacks: list[pl.Callback], strategy: Any = "auto", precision: Any = "32-true"
) -> pl.Trainer:
    """A Trainer on one GPU that only trains: no logger, checkpoints, progress bar, summary or validation."""
    return pl.Trainer(accelerator="cuda", devices=1, strategy=strategy, precision=precision, max_steps=steps,
                      callbacks=callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)  # fmt: skip


@contextlib.contextmanager
def peak_memory() -> Iterator[Callable[[], float]]:
    """The peak allocated MiB inside the block (the returned function reads it)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    yield lambda: torch.cuda.max_memory_allocated() / 2**20


def fresh_device() -> None:
    """Forget compiled code and cached memory of the variant before (each variant compiles and allocates afresh)."""
    import gc

    torch.compiler.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.set_stream(torch.cuda.default_stream())
        torch.cuda.empty_cache()


def failure_note(err: BaseException) -> str:
    """The note of a variant that raised: one failing variant never hides the others' figures."""
    return f"failed: {type(err).__name__}: {str(err)[:200]}"


def alternate(
    variants: Sequence[str],
    rounds: int,
    measure: Callable[[str], dict[str, Any]],
    say: Callable[[str], None] = print,
    cold: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Measure every variant ``rounds`` times :func:`in_turns`, and keep each variant's fastest round.

    A variant that raises is noted (its ``median_ms`` is ``None``) and the others are still measured.

    Args:
        variants: The variants, in the order of the first round.
        rounds: How many rounds.
        measure: Measures one variant once; returns its figures (``median_ms``, ``losses``, ...).
        say: Where the progress lines go.
        cold: Figures taken from a variant's first round (compile times: later rounds find warm caches).

    Returns:
        Per variant, its fastest round with every round's median (``round_ms``), in ``variants`` order.
    """

    def noted(variant: str) -> dict[str, Any]:
        try:
            return measure(variant)
        except Exception as err:
            fresh_device()
            return {"variant": variant, "median_ms": None, "note": failure_note(err)}

    fits = in_turns(variants, rounds, noted, lambda index, fit: progress_line(fit, index - 1), say)
    return [fastest_round(fits[variant], cold) for variant in variants]


def in_turns(
    variants: Sequence[str],
    rounds: int,
    measure: Callable[[str], dict[str, Any]],
    line: Callable[[int, dict[str, Any]], str],
    say: Callable[[str], None] = print,
) -> dict[str, list[dict[str, Any]]]:
    """Measure every variant ``rounds`` times, round by round, the order reversed every other round.

    Round by round, a slow stretch of the host hits every variant alike; reversed, neither always goes first.

    Args:
        variants: The variants, in the order of the first round.
        rounds: How many rounds.
        measure: Trains one variant once; returns its figures, ``median_ms`` among them.
        line: The progress line of a fit, from its round (counted from 1) and its figures.
        say: Where the progress lines go.

    Returns:
        Per variant, every round's figures, in round order.
    """
    fits: dict[str, list[dict[str, Any]]] = {variant: [] for variant in variants}
    for index in range(rounds):
        for variant in variants if index % 2 == 0 else variants[::-1]:
            fresh_device()
            fits[variant].append(measure(variant))
            say(line(index + 1, fits[variant][-1]))
    return fits


def median_of_rounds(fits: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """Per variant, the median of its rounds' median step times."""
    return {variant: statistics.median(fit["median_ms"] for fit in got) for variant, got in fits.items()}


def round_ms(fits: dict[str, list[dict[str, Any]]]) -> dict[str, list[float]]:
    """Per variant, every round's median step time, in round order."""
    return {variant: [fit["median_ms"] for fit in got] for variant, got in fits.items()}


def ratio_per_round(fits: dict[str, list[dict[str, Any]]], reference: str, variant: str) -> list[float]:
    """Per round, ``reference`` 's median step time over ``variant`` 's (above 1: ``variant`` is faster)."""
    return [a["median_ms"] / b["median_ms"] for a, b in zip(fits[reference], fits[variant], strict=True)]


def progress_line(fit: dict[str, Any], round_index: int = 0) -> str:
    """One line per fit as it finishes: ms/step, the package's stage and level, why graphs are off."""
    report = fit.get("report") or {}
    ms = finite(fit.get("median_ms"))
    why = (report.get("rollback_reasons") or [report.get("reason") or ""])[0]
    level = f" level {report['level']}" if report.get("level") else ""
    text = f"[{round_index + 1}] {fit['variant']:>24}: {'n/a' if ms is None else f'{ms:8.3f}'} ms/step"
    return f"{text} {report.get('stage', '').lower()}{level} {why or ''} {fit.get('note', '')}".rstrip()
