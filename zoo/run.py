"""Train a zoo of real third-party models eagerly and through the package; flag every run that is off eager.

    PYTHONPATH=. python zoo/run.py --out DIR                          # the whole zoo on the GPU
    PYTHONPATH=. python zoo/run.py --only llama_clm_collator,gcn_fixed_graphs --variants full
    PYTHONPATH=. python zoo/run.py --device cpu --capture-backend fake --steps 12 --only lora_llama

Each entry of :mod:`zoo.models` is trained ``eager`` (the reference), ``noise`` (eager with the optimizer
in the whole step's form: the noise floor) and through the package (``cudagraph``, ``callback``, ``layer``,
``full``), every fit from the same weights on the same batches. A run is compared with eager on the per-batch loss,
the final parameters and buffers, torchmetrics states, a checksum of every batch ``training_step`` saw and, for a
dataset on the device, the dataset after the fit. "Off eager" is beyond ``max(10 x eager-vs-eager, floor)``. Each
run gets one class of :data:`CLASSES`; the exit code is 1 when a run has one of :data:`FAILURES`. Speed: the median
ms per step of windows of ``--window`` batches between two device syncs, over the last ``--timed`` batches.
``--capture-backend fake`` hands the package the CPU test double (for developing the zoo, never for a CUDA claim).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib.metadata
import itertools
import json
import logging
import math
import os
import shlex
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl
import torch
from typing_extensions import override

from benchmarks import report
from benchmarks.core.figures import finite
from benchmarks.core.models import report_figures
from benchmarks.core.zoo_summary import FAILURES, zoo_section
from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy, Stage
from zoo.models import BuildContext, Entry, ZooModule, checksum, entries_named, missing_libraries

SCHEMA_VERSION = 1
SEED = 1234
#: The package's variants, in the order they run and appear.
VARIANTS: dict[str, str] = {
    "cudagraph": 'strategy="cudagraph"',
    "callback": "CUDAGraphCallback()",
    "layer": 'CUDAGraphCallback(scope=["layer"])',
    "full": 'strategy="cudagraph_full"',
    "moe": 'CUDAGraphCallback(scope=["attn", "moe_router"])',
}
#: Variants that run only for the entries that declare them (``Entry.moe``).
MOE_VARIANTS = ("moe",)
BASELINES = ("eager", "noise")
CLASSES = ("graphs-ok", "graphs-WRONG", "eager-with-reason", "eager-SILENT", "state-WRONG", "refused", "error")
FLOOR_FP32, FLOOR_BF16 = 1e-5, 2e-2
#: Two batch checksums agree when within this relative difference (float64 sums of the same data are exact).
BATCH_TOL = 1e-9
NOISE_FACTOR = 10.0
#: The package announces itself with its component's name; messages without it are Lightning's own.
PACKAGE_WORDS = ("CUDAGraph", "cudagraph")
MAX_MESSAGES = 12
LIBRARIES = ("torch", "lightning", "transformers", "tokenizers", "timm", "torchvision", "torchaudio", "peft")
LIBRARIES += ("torch_geometric", "torchmetrics")


# ---------------------------------------------------------------------------------------------------- measuring
class Probe(pl.Callback):
    """Times windows of batches between CUDA syncs, and reads the package's report at the end of training.

    It must come before the package's callback in ``trainer.callbacks`` (the package releases its graphs in its own
    ``on_train_end``, which zeroes ``report.graphs``).
    """

    def __init__(self, total_batches: int, timed: int, window: int, sync: Callable[[], None]) -> None:
        window = max(1, min(window, total_batches // 2 or 1))
        timed = max(window, min(timed, total_batches // 2) // window * window)
        self.total, self.window, self.start = total_batches, window, total_batches - timed
        self.marks = {self.start + k * window for k in range(timed // window)}
        self.sync = sync
        self.batches = 0
        self.times: dict[int, float] = {}
        self.stage: Stage | None = None
        self.graphs = 0

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if self.batches in self.marks:
            self.sync()
            self.times[self.batches] = time.perf_counter()
        self.batches += 1

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        if self.batches == self.total:
            self.sync()
            self.times[self.total] = time.perf_counter()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        callback = package_callback(trainer)
        if callback is not None:
            self.stage, self.graphs = callback.report.stage, callback.report.graphs

    def ms_per_step(self) -> float:
        """The median ms per batch over the timed windows (``nan`` if the fit ended early)."""
        marks = [*sorted(self.marks), self.total]
        windows = [
            (self.times[b] - self.times[a]) * 1e3 / self.window
            for a, b in itertools.pairwise(marks)
            if a in self.times and b in self.times
        ]
        return statistics.median(windows) if windows else math.nan


def package_callback(trainer: pl.Trainer) -> CUDAGraphCallback | None:
    """The package's callback on ``trainer`` (given by the user or added by a strategy), if any."""
    return next((cb for cb in trainer.callbacks if isinstance(cb, CUDAGraphCallback)), None)


class _Collect(logging.Handler):
    def __init__(self, sink: list[str]) -> None:
        super().__init__(logging.INFO)
        self.sink = sink

    @override
    def emit(self, record: logging.LogRecord) -> None:
        self.sink.append(record.getMessage())


@contextlib.contextmanager
def quiet_and_collected(sink: list[str] | None = None) -> Iterator[list[str]]:
    """Keep Lightning's and the package's messages off the console; collect the package's (infos and warnings).

    Args:
        sink: Where the package's messages go (also when the block raises); a new list if not given.
    """
    collected: list[str] = []
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    handler, level, propagate = _Collect(collected), logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    sink = [] if sink is None else sink
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                yield sink
            finally:
                collected.extend(str(w.message) for w in caught)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
        kept = [m for m in collected if any(word in m for word in PACKAGE_WORDS)]
        sink.extend(list(dict.fromkeys(kept))[:MAX_MESSAGES])


# ---------------------------------------------------------------------------------------------------- one fit
@dataclass
class Fit:
    """What one fit produced."""

    variant: str
    losses: list[float] = field(default_factory=list)
    batch_sums: list[float] = field(default_factory=list)
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    dataset_changed: bool | None = None
    ms_per_step: float = math.nan
    peak_mib: float = math.nan
    wall_s: float = 0.0
    batches_run: int = 0
    ended_on_graphs: bool = False
    rng_broken: str | None = None
    report: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    refused: bool = False
    traceback: str | None = None
    messages: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Settings:
    """The zoo's options, as parsed."""

    device: str = "cuda"
    capture_backend: str | None = None
    steps: int | None = None
    timed: int = 20
    window: int = 5
    floor_fp32: float = FLOOR_FP32
    floor_bf16: float = FLOOR_BF16
    seed: int = SEED

    def steps_for(self, entry: Entry) -> int:
        """Optimizer steps of a fit of ``entry`` (its own count, scaled by ``--steps`` against 64)."""
        if self.steps is None:
            return entry.steps
        return max(4, round(entry.steps * self.steps / 64))

    def floor_for(self, entry: Entry) -> float:
        """The smallest tolerance of ``entry``'s comparisons."""
        return self.floor_bf16 if "16" in entry.precision else self.floor_fp32


def graph_setup(variant: str, entry: Entry, settings: Settings) -> tuple[Any, list[pl.Callback]]:
    """The Trainer's ``strategy`` and extra callbacks of ``variant``, as a user writes them."""
    if variant == "eager":
        return "auto", []
    if variant == "noise":
        return "auto", [OptimizerAsPackaged()]
    backend = _fake_backend() if settings.capture_backend == "fake" else None
    if variant in ("cudagraph", "full"):
        if backend is None:
            return ("cudagraph" if variant == "cudagraph" else "cudagraph_full"), []
        strategy = CUDAGraphStrategy() if variant == "cudagraph" else CUDAGraphStrategy(scope=["full_iteration"])
        strategy.capture_backend = backend
        return strategy, []
    if variant == "callback":
        callback = CUDAGraphCallback()
    elif variant == "moe":
        # Megatron's MoE scopes; Hugging Face MoE blocks have no preprocess module of their own (the package refuses
        # 'moe_preprocess' there and says so).
        callback = CUDAGraphCallback(scope=["attn", "moe_router"])
    elif variant == "layer":
        modules = {"layer": entry.layer_modules} if entry.layer_modules else None
        callback = CUDAGraphCallback(scope=["layer"], modules=modules)
    else:
        raise ValueError(f"zoo/run.py: unknown variant {variant!r}; known: {[*BASELINES, *VARIANTS]}")
    callback.capture_backend = backend
    return "auto", [callback]


class OptimizerAsPackaged(pl.Callback):
    """The noise run: eager training with the optimizer in the form the whole step runs it (fused, tensor lr).

    Same arithmetic as the user's optimizer, other kernels: how far rounding alone carries a fit from eager. A
    model whose gradients are pure noise for some parameters (an attention key bias, whose gradient is zero in
    exact arithmetic) moves those far under Adam, eagerly too; the zoo's tolerance starts from this.
    """

    def __init__(self) -> None:
        self._switched: list[Any] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_cudagraph._backend.optimizers import CapturableOptimizer

        device = trainer.strategy.root_device
        self._switched = [CapturableOptimizer(optimizer, device) for optimizer in trainer.optimizers]

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for switched in self._switched:
            switched.restore()
        self._switched = []


def _fake_backend() -> Any:
    from tests.fake_backend import FakeBackend

    return FakeBackend()


def run_fit(entry: Entry, variant: str, initial: Mapping[str, torch.Tensor], settings: Settings) -> Fit:
    """Build ``entry`` afresh, load ``initial``, train it as ``variant``; every exception is caught and recorded."""
    fit = Fit(variant)
    cuda = settings.device == "cuda"
    rng_state = torch.cuda.get_rng_state() if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    try:
        _train(fit, entry, initial, settings)
    finally:
        fit.wall_s = time.perf_counter() - started
        if rng_state is not None:
            fit.rng_broken = _repair_cuda_rng(rng_state)
        if cuda:
            with contextlib.suppress(Exception):
                fit.peak_mib = torch.cuda.max_memory_allocated() / 2**20
        gc.collect()  # the fit's module, trainer and graphs are gone with ``_train``'s frame
        if cuda:
            with contextlib.suppress(Exception):
                torch.cuda.empty_cache()
    return fit


def _repair_cuda_rng(state: torch.Tensor) -> str | None:
    """Whether the fit left the CUDA generator unusable (a failed capture can); if so, restore it for the next fit."""
    try:
        torch.randn(1, device="cuda")
    except Exception as err:
        with contextlib.suppress(Exception):
            torch.cuda.set_rng_state(state)
        return f"{type(err).__name__}: {_first_line(str(err))}"
    return None


def cuda_lost() -> str | None:
    """Why this process can no longer run CUDA work (a sticky error), or ``None`` while it can."""
    try:
        torch.ones(1, device="cuda").add(1).cpu()
        torch.cuda.synchronize()
    except Exception as err:
        return f"{type(err).__name__}: {_first_line(str(err))}"
    return None


def _train(fit: Fit, entry: Entry, initial: Mapping[str, torch.Tensor], settings: Settings) -> None:
    steps = settings.steps_for(entry)
    ctx = BuildContext(torch.device(settings.device), steps, steps * entry.accumulate, settings.seed)
    sync = torch.cuda.synchronize if settings.device == "cuda" else (lambda: None)
    probe = Probe(ctx.batches, settings.timed, settings.window, sync)
    try:
        with quiet_and_collected(fit.messages):
            built = entry.build(ctx)
            module = built.module
            module.load_state_dict(initial)
            dataset_before = checksum(built.dataset_tensors).item() if built.dataset_tensors else None
            strategy, callbacks = graph_setup(fit.variant, entry, settings)
            trainer = pl.Trainer(
                accelerator=settings.device,
                devices=1,
                strategy=strategy,
                precision=entry.precision,
                max_steps=steps,
                max_epochs=-1,
                accumulate_grad_batches=entry.accumulate,
                gradient_clip_val=entry.clip,
                callbacks=[probe, *built.callbacks, *callbacks],  # the probe first: it reads the report first
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                num_sanity_val_steps=0,
                limit_val_batches=0,
            )
            pl.seed_everything(settings.seed, workers=True, verbose=False)
            trainer.fit(module, train_dataloaders=built.loader)
        _collect(fit, module, trainer, probe)
        if dataset_before is not None:
            fit.dataset_changed = checksum(built.dataset_tensors).item() != dataset_before
    except Exception as err:  # one failure must not stop the zoo
        fit.error = f"{type(err).__name__}: {_first_line(str(err))}"
        fit.refused = isinstance(err, ValueError) and probe.batches == 0
        fit.traceback = traceback.format_exc()[-3000:]
    finally:
        fit.batches_run = probe.batches


def _collect(fit: Fit, module: ZooModule, trainer: pl.Trainer, probe: Probe) -> None:
    fit.losses = module.losses()
    fit.batch_sums = module.seen_batch_sums()
    fit.state = {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
    for name, metric in module.zoo_metrics.items():
        for key, value in getattr(metric, "metric_state", {}).items():
            tensors = value if isinstance(value, list) else [value]
            if tensors and all(isinstance(t, torch.Tensor) for t in tensors):
                fit.metrics[f"{name}.{key}"] = torch.cat([t.reshape(-1) for t in tensors]).detach().cpu()
    fit.ms_per_step = probe.ms_per_step()
    callback = package_callback(trainer)
    if callback is not None:
        fit.report = report_fields(callback)
        fit.report["stage_at_end"] = probe.stage.name if probe.stage is not None else None
        fit.report["graphs_at_end"] = probe.graphs
        fit.ended_on_graphs = probe.stage in (Stage.CONFIRMING, Stage.REPLAYING) and probe.graphs > 0


def report_fields(callback: CUDAGraphCallback) -> dict[str, Any]:
    """The report's figures that the zoo records (JSON-ready)."""
    report = callback.report
    fields = report_figures(callback) or {}
    return {**fields, "graphs": report.graphs, "fallback_reasons": dict(report.fallback_reasons)}


# ---------------------------------------------------------------------------------------------------- comparing
@dataclass
class Diff:
    """How far a fit is from eager's: loss (relative per batch), parameters and metrics (relative per tensor)."""

    loss: float = 0.0
    params: float = 0.0
    params_worst: str | None = None
    metrics: float = 0.0
    batch_mismatches: int = 0
    first_bad_batch: int | None = None


def relative_error(ours: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]) -> tuple[float, str | None]:
    """The largest ``max|a - b| / max|b|`` over the tensors of ``reference`` (``inf`` for a missing or reshaped one)."""
    worst, name = 0.0, None
    for key, expected in reference.items():
        got = ours.get(key)
        if got is None or got.shape != expected.shape:
            return math.inf, key
        if expected.numel() == 0:
            continue
        a, b = got.double(), expected.double()
        if not torch.equal(a.isnan(), b.isnan()):
            return math.inf, key
        a, b = a.nan_to_num(0.0), b.nan_to_num(0.0)
        diff = (a - b).abs().max().item()
        scale = b.abs().max().item()
        error = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
        if error > worst:
            worst, name = error, key
    return worst, name


def loss_error(ours: Sequence[float], reference: Sequence[float]) -> float:
    """The largest per-batch ``|a - b| / max(|b|, 1e-6)`` (``inf`` if the counts differ or one is not finite)."""
    if len(ours) != len(reference):
        return math.inf
    worst = 0.0
    for a, b in zip(ours, reference, strict=True):
        if math.isfinite(a) != math.isfinite(b):
            return math.inf
        if math.isfinite(b):
            worst = max(worst, abs(a - b) / max(abs(b), 1e-6))
    return worst


def batch_mismatches(ours: Sequence[float], reference: Sequence[float]) -> tuple[int, int | None]:
    """How many batch checksums differ from eager's, and the first that does."""
    bad = [
        i
        for i in range(max(len(ours), len(reference)))
        if i >= len(ours) or i >= len(reference) or not _same_sum(ours[i], reference[i])
    ]
    return len(bad), (bad[0] if bad else None)


def _same_sum(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= BATCH_TOL * max(abs(b), 1.0)


def compare(fit: Fit, reference: Fit) -> Diff:
    """``fit`` against ``reference`` (eager) on every record."""
    diff = Diff()
    diff.loss = loss_error(fit.losses, reference.losses)
    diff.params, diff.params_worst = relative_error(fit.state, reference.state)
    diff.metrics, _ = relative_error(fit.metrics, reference.metrics)
    diff.batch_mismatches, diff.first_bad_batch = batch_mismatches(fit.batch_sums, reference.batch_sums)
    return diff


@dataclass(frozen=True)
class Tolerance:
    """What "off eager" means for one entry: ``max(10 x eager-vs-eager, floor)`` per record."""

    loss: float
    params: float
    metrics: float
    batch_mismatches: int

    @classmethod
    def from_noise(cls, noise: Diff, floor: float) -> Tolerance:
        """The tolerance from the eager-vs-eager difference ``noise``."""

        def scaled(value: float) -> float:
            return max(NOISE_FACTOR * value, floor) if math.isfinite(value) else math.inf

        return cls(scaled(noise.loss), scaled(noise.params), scaled(noise.metrics), noise.batch_mismatches)

    def off(self, diff: Diff, dataset_changed: bool | None) -> list[str]:
        """The records of ``diff`` beyond this tolerance."""
        off = []
        if not diff.loss <= self.loss:
            off.append("loss")
        if not diff.params <= self.params:
            off.append("params")
        if not diff.metrics <= self.metrics:
            off.append("metrics")
        if diff.batch_mismatches > self.batch_mismatches:
            off.append("batches")
        if dataset_changed:
            off.append("dataset")
        return off


def classify(*, error: str | None, refused: bool, ended_on_graphs: bool, reason: str | None, off: Sequence[str]) -> str:
    """The class of a package run (see the module docstring)."""
    if error is not None:
        return "refused" if refused else "error"
    if ended_on_graphs:
        return "graphs-WRONG" if off else "graphs-ok"
    if off:
        return "state-WRONG"
    return "eager-with-reason" if reason else "eager-SILENT"


def eager_reason(report: Mapping[str, Any]) -> str | None:
    """Why a run is not on graphs: the report's reason, else its rollback reasons (``None``: none given)."""
    if report.get("reason"):
        return str(report["reason"])
    reasons = [str(r) for r in report.get("rollback_reasons", []) if r]
    return "; ".join(reasons) if reasons else None


# ---------------------------------------------------------------------------------------------------- one entry
def run_entry(entry: Entry, variants: Sequence[str], settings: Settings, say: Callable[[str], None]) -> dict[str, Any]:
    """Every fit of one entry, compared and classified; a JSON-ready record."""
    started = time.perf_counter()
    steps = settings.steps_for(entry)
    record: dict[str, Any] = {
        "entry": entry.name,
        "patterns": entry.patterns,
        "precision": entry.precision,
        "accumulate": entry.accumulate,
        "steps": steps,
        "batches": steps * entry.accumulate,
        "runs": [],
    }
    missing = missing_libraries(entry)
    if missing:
        record["skipped"] = f"not installed: {', '.join(missing)}"
        say(f"[zoo] {entry.name}: skipped ({record['skipped']})")
        return record
    try:
        with quiet_and_collected():
            ctx = BuildContext(torch.device("cpu"), steps, steps * entry.accumulate, settings.seed)
            initial = copy.deepcopy(entry.build(ctx).module.state_dict())
    except Exception as err:  # an entry that cannot even be built (a library too old or too new)
        record["skipped"] = f"cannot build: {type(err).__name__}: {_first_line(str(err))}"
        say(f"[zoo] {entry.name}: skipped ({record['skipped']})")
        return record
    eager = run_fit(entry, "eager", initial, settings)
    if eager.error is not None:
        record["skipped"] = f"eager fit failed: {eager.error}"
        record["eager_traceback"] = eager.traceback
        say(f"[zoo] {entry.name}: eager fit failed ({eager.error}); its variants are not run")
        return record
    noise = compare(run_fit(entry, "noise", initial, settings), eager)
    tolerance = Tolerance.from_noise(noise, settings.floor_for(entry))
    record.update(eager_ms=finite(eager.ms_per_step), noise=asdict(noise), tolerance=asdict(tolerance))
    record["eager_dataset_changed"] = eager.dataset_changed
    for variant in [v for v in variants if entry.moe or v not in MOE_VARIANTS]:
        fit = run_fit(entry, variant, initial, settings)
        run = describe_run(entry, fit, eager, tolerance)
        record["runs"].append(run)
        say(
            f"[zoo] {entry.name:<24} {variant:<10} {run['class']:<18} speedup {_fmt(run['speedup'], 'x')}"
            f"  loss {_fmt(run['loss_err'])}  params {_fmt(run['param_err'])}  {run['reason'] or ''}"[:220]
        )
    record["elapsed_s"] = round(time.perf_counter() - started, 1)
    say(f"[zoo] {entry.name}: {record['elapsed_s']} s, eager {_fmt(record['eager_ms'])} ms/step")
    return record


def describe_run(entry: Entry, fit: Fit, eager: Fit, tolerance: Tolerance) -> dict[str, Any]:
    """One package run, compared with eager and classified (JSON-ready)."""
    run: dict[str, Any] = {"variant": fit.variant, "label": VARIANTS.get(fit.variant, fit.variant)}
    diff = compare(fit, eager) if fit.error is None else Diff(math.nan, math.nan, None, math.nan)
    off = tolerance.off(diff, fit.dataset_changed) if fit.error is None else []
    if fit.rng_broken:
        off.append("cuda-rng")
    reason = eager_reason(fit.report)
    run["class"] = classify(
        error=fit.error, refused=fit.refused, ended_on_graphs=fit.ended_on_graphs, reason=reason, off=off
    )
    run["off"] = off
    run["reason"] = fit.error if fit.error is not None else (_graph_note(fit.report) if fit.ended_on_graphs else reason)
    speedup = eager.ms_per_step / fit.ms_per_step if fit.ms_per_step > 0 else math.nan
    run.update(
        speedup=finite(speedup),
        ms_per_step=finite(fit.ms_per_step),
        loss_err=finite(diff.loss),
        param_err=finite(diff.params),
        param_worst=diff.params_worst,
        metric_err=finite(diff.metrics),
        batch_mismatches=diff.batch_mismatches,
        first_bad_batch=diff.first_bad_batch,
        dataset_changed=fit.dataset_changed,
        rng_broken=fit.rng_broken,
        batches_run=fit.batches_run,
        peak_mib=finite(fit.peak_mib),
        wall_s=round(fit.wall_s, 2),
        report=fit.report,
        messages=fit.messages,
        traceback=fit.traceback,
    )
    return run


def _graph_note(report: Mapping[str, Any]) -> str | None:
    """What a run on graphs says beside: its level, eager fallbacks and the rollbacks on the way."""
    notes = []
    if report.get("level"):
        notes.append(f"level {report['level']}")
    if report.get("fallbacks"):
        notes.append(f"{report['fallbacks']} fallbacks {dict(report.get('fallback_reasons', {}))}")
    if report.get("rollback_reasons"):
        notes.append("rolled back before: " + "; ".join(report["rollback_reasons"]))
    return ", ".join(notes) or None


# ---------------------------------------------------------------------------------------------------- output
def header_for(settings: Settings, command: str) -> dict[str, Any]:
    """Versions, device, date, commit and options of this run."""
    versions = {}
    for name in LIBRARIES:
        dist = {"torch_geometric": "torch-geometric"}.get(name, name)
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(dist)
    device_name = torch.cuda.get_device_name() if settings.device == "cuda" else "CPU"
    return {
        "schema": SCHEMA_VERSION,
        "device_name": device_name,
        "versions": versions,
        "command": command,
        "date": date.today().isoformat(),
        "capture_backend": settings.capture_backend or ("cuda" if settings.device == "cuda" else "none"),
        "floor_fp32": settings.floor_fp32,
        "floor_bf16": settings.floor_bf16,
        "settings": asdict(settings),
    }


def _fmt(value: float | None, suffix: str = "") -> str:
    if value is None or not math.isfinite(value):
        return "n/a"
    if suffix == "x":
        return f"{value:.2f}x"
    if value == 0:
        return "0"
    return f"{value:.3g}" if abs(value) >= 1e-3 else f"{value:.1e}"


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0][:400]


# ---------------------------------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=None, help="write zoo.md and zoo.json here")
    parser.add_argument("--only", default=None, help="entries to run, comma-separated (default: all)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated from {list(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per fit (default: each entry's)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--capture-backend", choices=("cuda", "fake"), default=None, help="fake: the CPU test double")
    parser.add_argument("--timed", type=int, default=20, help="batches timed at the end of each fit")
    parser.add_argument("--window", type=int, default=5, help="batches per synchronized timing window")
    parser.add_argument("--floor-fp32", type=float, default=FLOOR_FP32)
    parser.add_argument("--floor-bf16", type=float, default=FLOOR_BF16)
    parser.add_argument("--seed", type=int, default=SEED)
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    """Validated settings; a bad combination raises ``ValueError`` with the fix."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "zoo/run.py: --device cuda, but no CUDA device is visible here. Run it on the GPU machine, or"
            " pass --device cpu --capture-backend fake to develop the zoo on a CPU."
        )
    if args.capture_backend == "cuda" and args.device != "cuda":
        raise ValueError("zoo/run.py: --capture-backend cuda needs --device cuda; on a CPU pass fake.")
    if args.steps is not None and args.steps < 4:
        raise ValueError(f"zoo/run.py: --steps {args.steps}: pass at least 4 (the package warms up first).")
    backend = None if args.capture_backend in (None, "cuda") else args.capture_backend
    return Settings(
        device=args.device,
        capture_backend=backend,
        steps=args.steps,
        timed=args.timed,
        window=args.window,
        floor_fp32=args.floor_fp32,
        floor_bf16=args.floor_bf16,
        seed=args.seed,
    )


def parse_variants(text: str) -> list[str]:
    """The ``--variants`` list, in zoo order; an unknown name raises ``ValueError`` naming the known ones."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown or not names:
        raise ValueError(
            f"zoo/run.py: --variants got {unknown or text!r}; allowed: {list(VARIANTS)} (comma-separated)."
        )
    return [name for name in VARIANTS if name in names]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the zoo; exit code 1 when a run breaks the package's promise (see :data:`FAILURES`)."""
    args = parse_args(argv)
    try:
        settings = settings_from(args)
        variants = parse_variants(args.variants)
        entries = entries_named(args.only.split(",") if args.only else None)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    command = shlex.join(sys.orig_argv) if argv is None else shlex.join(["zoo/run.py", *argv])
    header = header_for(settings, command)
    started = time.perf_counter()
    records: list[dict[str, Any]] = []
    lost: str | None = None
    for entry in entries:
        if lost is not None:  # every later fit would fail for the same reason: say so, and how to run the rest
            records.append({"entry": entry.name, "patterns": entry.patterns, "runs": [], "skipped": lost})
            continue
        records.append(run_entry(entry, variants, settings, lambda line: print(line, flush=True)))
        if settings.device == "cuda" and (why := cuda_lost()) is not None:
            rest = [e.name for e in entries[entries.index(entry) + 1 :]]
            lost = f"CUDA unusable after {entry.name} ({why}); rerun with --only {','.join(rest)}"
            print(f"[zoo] {lost}", flush=True)
    header["elapsed_s"] = round(time.perf_counter() - started, 1)
    print(zoo_section({**header, "kind": "zoo", "entries": records, "file": "zoo.json"}))
    print(f"[zoo] total {header['elapsed_s']} s", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "zoo.json").write_text(
            json.dumps({**header, "kind": "zoo", "entries": records}, indent=1, default=str)
        )
        report.publish(args.out)
    failed = any(run["class"] in FAILURES for record in records for run in record.get("runs", []))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
