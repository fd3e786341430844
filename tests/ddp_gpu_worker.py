"""One rank of a two-GPU DDP fit (NCCL), with a fault injected on rank 1 only in some cases.

Run under torchelastic, which Lightning picks up (``TorchElasticEnvironment``), one process per GPU::

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/ddp_gpu_worker.py --case NAME --out DIR

Each rank builds the same model and data (``tests/models.py``, the ``SMALL`` decoder), trains it with
``Trainer(accelerator="gpu", devices=2)`` and the case's strategy, and writes ``DIR/rank{r}.json``: how the fit
ended (finished, or the error it raised), what the rollout decided (stage, reason, rollbacks, level, ladder,
exclusions), replay counters, how each step ran on this rank (graphed, eager, or neither), per-step losses, a
fingerprint of the final parameters, and what was left behind (patched forwards, graph pool bytes, the current
stream). Cases with a ``reference`` fit an eager DDP run of the same model and data first, in the same process
group, and add its losses and the largest parameter difference from it. ``tests/test_gpu_ddp2.py`` launches the
cases and compares the ranks' files.

Faults are injected on rank 1 only and decided at run time from ``trainer.global_rank``, so the worker runs the same
way under Lightning's own launcher. While it runs, each rank also keeps ``DIR/rank{r}.progress.json`` (the last
step started and ended) and ``DIR/rank{r}.stacks.txt`` (Python stacks of every thread, dumped by ``faulthandler`` on
SIGTERM, SIGABRT (NCCL's watchdog) or a crash): what a rank that never wrote its report was doing when it ended.
Everything that needs no GPU (cases, strategies, data slices, the report) is plain functions.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import math
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make ``tests`` and the package importable
    sys.path.insert(0, str(REPO_ROOT))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry  # noqa: E402
from torch.utils.data import DataLoader, Subset  # noqa: E402

from lightning_cudagraph import CUDAGraphReport, DDPCUDAGraphStrategy  # noqa: E402
from lightning_cudagraph._rollout.preflight import DDP_WHOLE_STEP_WARMUP_STEPS  # noqa: E402
from tests.dist_worker import COLLECTIVE_TIMEOUT, fingerprint, report_fields  # noqa: E402
from tests.helpers import (  # noqa: E402
    RaiseAtStep,
    RebindAt,
    graph_callbacks,
    graph_pool_bytes,
    max_param_diff,
    parameters_of,
    patched_forwards,
    trainer,
)
from tests.models import SMALL, DecoderModule, TokenData, decoder  # noqa: E402

#: Optimizer steps of the parity fits (eager, layer, full).
PARITY_STEPS = 20
#: Eager steps before the first capture of a scoped case.
WARMUP = 3
#: The whole step under DDP: NCCL's eager steps first (``ddp_cudagraph_full`` sets this).
FULL_WARMUP = DDP_WHOLE_STEP_WARMUP_STEPS
#: lr 3e-4: at 1e-3 the SMALL decoder spikes around step 9, which amplifies last-bit differences of nondeterministic
#: kernels beyond the parity tolerance (see tests/test_gpu_full.py).
LR = 3e-4
#: ``scope="auto"``: warmup, then up to four levels of capture, confirmation and up to 8 timed steps each.
AUTO_STEPS = 80
#: The package's health checks (non-finite counter, a pending rebind) run once per log interval.
LOG_EVERY = 5
#: Steps of the fault cases.
FAULT_STEPS = 24
#: ``nonfinite_rank1``: the step whose loss rank 1 sees as NaN: the whole step is captured at step 11 and confirmed
#: at the end of step 12, so this one replays; the health check at the end of step 14 (global step 15) reads it.
NONFINITE_STEP = FULL_WARMUP + 3
#: ``rebind_rank1``: rank 1 rebinds at the end of the step that makes ``global_step`` this, long after confirmation
#: (captured at step 3, confirmed at the end of step 4); the next health check is at global step 10.
REBIND_STEP = WARMUP + 4
REBIND_PARAMETER = "model.blocks.0.attn.qkv.weight"
#: ``raise_rank1``: rank 1 raises at the start of this step, while the graphs replay.
RAISE_STEP = WARMUP + 5
RAISE_MESSAGE = f"injected: rank 1 raised at step {RAISE_STEP}"
#: ``ragged_*``: batches per rank and epoch, and how many sequences rank 1's last batch lacks.
RAGGED_BATCHES, RAGGED_SHORT = 10, 3
BATCH_SIZE = 8
#: Written in the report's ``step_modes`` for each training step of this rank.
GRAPHED, EAGER, UNTRACKED = "graphed", "eager", "untracked"


# =================================================================== the model and the data of the cases
class InjectableDecoder(DecoderModule):
    """:class:`~tests.models.DecoderModule` whose loss carries a device scalar that a callback can make NaN.

    The scalar is added to the loss and holds no gradient, so a NaN there makes this rank's loss non-finite and
    leaves its gradients (and so the other rank's, through the all-reduce) as they were: the non-finite loss is
    seen by one rank alone. It is a plain attribute, not a buffer, so DDP does not broadcast it from rank 0, and it
    lives at one address, which a whole-step graph reads at every replay.
    """

    loss_offset: torch.Tensor | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        if self.loss_offset is None or self.loss_offset.device != loss.device:
            self.loss_offset = torch.zeros((), device=loss.device)  # the first (eager) step, before any capture
        loss = loss + self.loss_offset
        self.log("train_loss", loss)
        return loss


def rank_rows(rank: int, batches: int, batch_size: int, short_by: int) -> range:
    """The training rows of ``rank``: ``batches`` full batches each, rank 1's last ``short_by`` rows fewer.

    Example:
        >>> rank_rows(0, 10, 8, 3), rank_rows(1, 10, 8, 3)
        (range(0, 80), range(80, 157))
    """
    start = rank * batches * batch_size
    return range(start, start + batches * batch_size - (short_by if rank == 1 else 0))


class RaggedOnRank1(TokenData):
    """:class:`~tests.models.TokenData` split by hand: the same number of batches per rank, rank 1's last short.

    Needs ``Trainer(use_distributed_sampler=False)``: Lightning's ``DistributedSampler`` pads every rank to the same
    number of samples, so a ragged batch would come on every rank or none.
    """

    def train_dataloader(self) -> DataLoader:
        rows = rank_rows(self.trainer.global_rank, RAGGED_BATCHES, self.hparams.batch_size, RAGGED_SHORT)
        return DataLoader(Subset(self.train_set, rows), batch_size=self.hparams.batch_size, drop_last=False)


# =================================================================== callbacks
class OnRank(pl.Callback):
    """Forwards the training-batch hooks of ``inner`` on rank ``rank`` only."""

    def __init__(self, rank: int, inner: pl.Callback) -> None:
        self.rank, self.inner = rank, inner

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank:
            self.inner.on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == self.rank:
            self.inner.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


class NaNLossAt(pl.Callback):
    """Makes the loss of optimizer step ``step`` NaN (through :class:`InjectableDecoder`'s offset), then finite."""

    def __init__(self, step: int) -> None:
        self.step, self._armed = step, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            pl_module.loss_offset.fill_(math.nan)  # in place, on the stream the step runs on: a replay reads it
            self._armed = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._armed:
            pl_module.loss_offset.fill_(0.0)
            self._armed = False


class DeviceLosses(pl.Callback):
    """Per-step losses kept on the device (no host sync per step), read once the fit is over."""

    def __init__(self) -> None:
        self._losses: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._losses.append(outputs["loss"].detach().float().clone())

    def values(self) -> list[float]:
        return torch.stack(self._losses).tolist() if self._losses else []


class StepModes(pl.Callback):
    """How each training step ran on this rank, from the package's counters, and each step's batch size.

    The counters of a step are final once it ended; this callback runs before the package's own callback, so a
    step is read at the start of the next one (and the last at ``on_train_end``).
    """

    def __init__(self) -> None:
        self.modes: list[str] = []
        self.batch_sizes: list[int] = []
        self._counts = (0, 0)
        self._open = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._close(trainer)
        self.batch_sizes.append(int(batch[0].shape[0]))
        self._open = True

    def on_train_end(self, trainer, pl_module):
        self._close(trainer)

    def _close(self, trainer: pl.Trainer) -> None:
        if not self._open:
            return
        report = report_of(trainer)
        counts = (report.steps_replayed, report.steps_eager) if report is not None else (0, 0)
        self.modes.append(step_mode(self._counts, counts))
        self._counts, self._open = counts, False


def step_mode(before: tuple[int, int], after: tuple[int, int]) -> str:
    """One step's mode from ``(steps_replayed, steps_eager)`` before and after it.

    Example:
        >>> step_mode((3, 0), (4, 0)), step_mode((4, 0), (4, 1)), step_mode((0, 0), (0, 0))
        ('graphed', 'eager', 'untracked')
    """
    if after[0] > before[0]:
        return GRAPHED
    if after[1] > before[1]:
        return EAGER
    return UNTRACKED  # before the first capture, or after graphs were given up


class Progress(pl.Callback):
    """Keeps ``DIR/rank{r}.progress.json`` current: the last step started and ended on this rank, and its stage."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.state: dict[str, Any] = {"started": None, "ended": None}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._write(trainer, started=trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._write(trainer, ended=trainer.global_step - 1)

    def _write(self, trainer: pl.Trainer, **step: int) -> None:
        report = report_of(trainer)
        self.state.update(step, stage=int(report.stage) if report is not None else None, time=time.time())
        write_json(self.out / f"rank{trainer.global_rank}.progress.json", self.state)


class StacksOnSigterm(pl.Callback):
    """Dumps every thread's Python stack to ``file`` on SIGTERM during training, then lets Lightning's handler run.

    Registered at ``on_train_start``, after Lightning installed its own SIGTERM handler (``chain=True`` calls it),
    and removed at the end of training or on an exception, before Lightning puts the original handler back.
    ``faulthandler`` writes from the signal handler itself, so the dump shows where a rank stuck in a CUDA or NCCL
    wait was, which no Python handler could.
    """

    def __init__(self, file: IO[str] | None) -> None:
        self.file = file
        self._registered = False

    def on_train_start(self, trainer, pl_module):
        if self.file is not None and hasattr(signal, "SIGTERM"):
            faulthandler.register(signal.SIGTERM, file=self.file, all_threads=True, chain=True)
            self._registered = True

    def on_train_end(self, trainer, pl_module):
        self._unregister()

    def on_exception(self, trainer, pl_module, exception):
        self._unregister()

    def _unregister(self) -> None:
        if self._registered:
            faulthandler.unregister(signal.SIGTERM)
            self._registered = False


# =================================================================== the cases
@dataclass(frozen=True)
class GpuCase:
    """A two-GPU fit.

    Attributes:
        graphs: ``None`` (plain ``DDPStrategy``), a registered strategy name (``"ddp_cudagraph"``), or the options
            of :class:`~lightning_cudagraph.DDPCUDAGraphStrategy`.
        max_steps: Optimizer steps of the fit.
        reference: Fit an eager DDP reference first: ``"adamw"`` (the model's AdamW as built), ``"capturable"``
            (``AdamW(fused=True)``: the arithmetic the whole step runs, step for step), or ``None``.
        rank1: Callbacks of the fit on rank 1 only (built per fit).
        model: The LightningModule class.
        ragged: Rank 1's last batch of each epoch is short (:class:`RaggedOnRank1`).
        log_every_n_steps: The Trainer's log interval.
        expect_error: The fit is meant to raise (on some rank).
        notes: What the test needs to know of the injection (its step, ...), copied into the report.
    """

    graphs: str | dict[str, Any] | None
    max_steps: int = PARITY_STEPS
    reference: str | None = None
    rank1: Callable[[], list[pl.Callback]] = list
    model: type[DecoderModule] = DecoderModule
    ragged: bool = False
    log_every_n_steps: int = LOG_EVERY
    expect_error: bool = False
    notes: dict[str, Any] = field(default_factory=dict)


LAYER = {"scope": ["layer"], "warmup_steps": WARMUP}

CASES: dict[str, GpuCase] = {
    # Plain DDP: the harness itself, and what graphed DDP must equal.
    "eager": GpuCase(None),
    # Scoped layers: DDP's all-reduce stays outside the graphs.
    "layer": GpuCase(LAYER, reference="adamw"),
    # The whole step, DDP's all-reduce inside (NCCL's 11 eager steps first).
    "full": GpuCase("ddp_cudagraph_full", reference="capturable"),
    # scope="auto": each level timed by the slowest rank; both must settle on the same one.
    "auto": GpuCase("ddp_cudagraph", max_steps=AUTO_STEPS),
    # A loss that only rank 1 sees as NaN, in a replayed whole step: found by rank 1's in-graph counter at the next
    # health check, which must roll back both ranks (the step holds the all-reduce) or neither.
    "nonfinite_rank1": GpuCase(
        "ddp_cudagraph_full",
        max_steps=FAULT_STEPS,
        rank1=lambda: [NaNLossAt(NONFINITE_STEP)],
        model=InjectableDecoder,
        notes={"step": NONFINITE_STEP},
    ),
    # A parameter rebound on rank 1 only while scoped graphs replay (same values, new storage).
    "rebind_rank1": GpuCase(
        LAYER,
        max_steps=FAULT_STEPS,
        rank1=lambda: [RebindAt(REBIND_STEP, REBIND_PARAMETER)],
        notes={"step": REBIND_STEP, "parameter": REBIND_PARAMETER},
    ),
    # Rank 1 raises mid-fit while scoped graphs replay.
    "raise_rank1": GpuCase(
        LAYER,
        max_steps=FAULT_STEPS,
        rank1=lambda: [RaiseAtStep(RAISE_STEP, RAISE_MESSAGE)],
        expect_error=True,
        notes={"step": RAISE_STEP, "message": RAISE_MESSAGE},
    ),
    # A short last batch on rank 1 only, every epoch (steps 9 and 19): that step falls back on rank 1 alone.
    "ragged_rank1": GpuCase({**LAYER, "on_shape_change": "eager"}, max_steps=FAULT_STEPS, ragged=True),
    # The same with recapture: rank 1 alone records the short shape (step 9) and captures it (step 19).
    "ragged_recapture_rank1": GpuCase({**LAYER, "on_shape_change": "recapture"}, max_steps=FAULT_STEPS, ragged=True),
}


def make_strategy(graphs: str | dict[str, Any] | None) -> DDPStrategy:
    """The case's strategy with the worker's collective timeout (NCCL's default would wait 30 min on a hang).

    A registered name is built from Lightning's registry entry, so it gets exactly the registered options.

    Example:
        >>> make_strategy("ddp_cudagraph_full").cudagraph_config.warmup_steps
        11
    """
    if graphs is None:
        return DDPStrategy(timeout=COLLECTIVE_TIMEOUT)
    if isinstance(graphs, str):
        entry = StrategyRegistry[graphs]
        return entry["strategy"](**entry["init_params"], timeout=COLLECTIVE_TIMEOUT)
    return DDPCUDAGraphStrategy(**graphs, timeout=COLLECTIVE_TIMEOUT)


def model_and_data(case: GpuCase, capturable: bool = False) -> tuple[DecoderModule, TokenData]:
    """The SMALL decoder (seed 0) and its data, batch 8 per rank."""
    options: dict[str, Any] = {"lr": LR, "batch_size": BATCH_SIZE}
    if capturable:
        options["fused"] = True  # the form the whole step runs AdamW in
    model, data = decoder(SMALL, case.model, **options)
    if case.ragged:
        data = RaggedOnRank1(SMALL["vocab_size"], SMALL["seq_len"], batch_size=BATCH_SIZE)
    return model, data


def case_callbacks(case: GpuCase) -> list[pl.Callback]:
    """The case's injected callbacks, each acting on rank 1 only (``trainer.global_rank``, read at run time)."""
    return [OnRank(1, callback) for callback in case.rank1()]


def env_rank() -> int:
    """This process's rank from the launcher's environment (0 where none is set: Lightning's launcher, rank 0)."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


# =================================================================== fitting
@dataclass
class Fit:
    """A finished or failed fit and what was recorded on the way."""

    trainer: pl.Trainer
    model: DecoderModule
    losses: DeviceLosses
    modes: StepModes
    error: BaseException | None = None


def fit(
    case: GpuCase,
    graphs: str | dict[str, Any] | None,
    out: Path,
    stacks: IO[str] | None = None,
    inject: bool = True,
    capturable: bool = False,
) -> Fit:
    """One fit of the case on this rank; an exception is kept, not raised (the report says what it left).

    Args:
        case: The case.
        graphs: Its strategy (:func:`make_strategy`); ``None`` for the eager reference.
        out: Where progress is written.
        stacks: Where stacks are dumped on SIGTERM.
        inject: Add the case's rank-1 callbacks (not to the reference fit).
        capturable: Build AdamW in the form the whole step runs it in (``fused=True``).
    """
    module, data = model_and_data(case, capturable)
    losses, modes = DeviceLosses(), StepModes()
    callbacks: list[pl.Callback] = [losses, modes, Progress(out), StacksOnSigterm(stacks)]
    if inject:
        callbacks += case_callbacks(case)
    run = trainer(
        case.max_steps,
        callbacks,
        accelerator="gpu",
        devices=2,
        strategy=make_strategy(graphs),
        log_every_n_steps=case.log_every_n_steps,
        use_distributed_sampler=not case.ragged,
    )
    result = Fit(run, module, losses, modes)
    try:
        run.fit(module, datamodule=data)
    except BaseException as error:  # SIGTERMException is a SystemExit: record it as well
        result.error = error
    return result


def report_of(trainer: pl.Trainer) -> CUDAGraphReport | None:
    """The report of the Trainer's CUDAGraphCallback (``None`` under plain DDP)."""
    callbacks = graph_callbacks(trainer)
    return callbacks[0].report if callbacks else None


def left_behind(run: Fit) -> dict[str, Any]:
    """What the fit left on this rank: patched forwards, graph pool bytes, the stream, capturable optimizers.

    Read without a host sync (a rank whose NCCL work never completes must still answer). The pool is read here
    with the Trainer alive (what it still holds, logged values included, keeps pool memory); :func:`run_case`
    reads it again once every reference to the fits is gone (``graph_pool_bytes``, what the tests check).
    """
    gc.collect()
    probes: dict[str, Callable[[], Any]] = {
        "patched_forwards": lambda: leftover_forwards(run.model),
        "graph_pool_bytes_with_trainer": graph_pool_bytes,
        "on_default_stream": lambda: torch.cuda.current_stream() == torch.cuda.default_stream(),
        "capturable": lambda: [
            bool(group.get("capturable", False))
            for optimizer in run.trainer.optimizers
            for group in optimizer.param_groups
        ],
    }
    found: dict[str, Any] = {}
    for name, probe in probes.items():
        try:
            found[name] = probe()
        except Exception as error:  # one failed probe must not hide the others
            found[name] = f"unavailable: {type(error).__name__}: {error}"
    return found


def leftover_forwards(module: torch.nn.Module) -> list[str]:
    """:func:`~tests.helpers.patched_forwards` of the submodules: what the package patched and left behind.

    The LightningModule itself is never a target, and under DDP Lightning's forward redirection (``training_step``
    goes through DDP's ``forward``) leaves an instance ``forward`` on it: its own bound method after every step, and
    Lightning's redirect closure when a step raised inside DDP's forward (a failed collective), with plain DDP too.
    """
    return [name for name in patched_forwards(module) if name != "<root>"]


def describe_error(error: BaseException | None) -> dict[str, Any] | None:
    """An exception as JSON: its type, message and the last lines of its traceback."""
    if error is None:
        return None
    lines = traceback.format_exception(type(error), error, error.__traceback__)
    return {"type": type(error).__name__, "message": str(error), "traceback": "".join(lines)[-4000:]}


def fit_record(name: str, run: Fit) -> dict[str, Any]:
    """This rank's report of a fit; losses and parameters only when it finished (they need the device)."""
    trainer_ = run.trainer
    finished = run.error is None
    record: dict[str, Any] = {
        "case": name,
        "rank": trainer_.global_rank,
        "world_size": trainer_.world_size,
        "global_step": trainer_.global_step,
        "finished": bool(trainer_.state.finished),
        "status": str(trainer_.state.status.value),
        "error": describe_error(run.error),
        "step_modes": list(run.modes.modes),
        "batch_sizes": list(run.modes.batch_sizes),
        **report_fields(report_of(trainer_)),
        **left_behind(run),
    }
    if finished:
        record["losses"] = run.losses.values()
        record["params"] = fingerprint(run.model)
    return record


def run_case(name: str, out: Path, stacks: IO[str] | None = None) -> dict[str, Any]:
    """Fit the case on this rank (after its eager reference, if any) and return what the rank reports."""
    case = CASES[name]
    reference: Fit | None = None
    if case.reference is not None:
        reference = fit(case, None, out, stacks, inject=False, capturable=case.reference == "capturable")
        if reference.error is not None:
            record = {**fit_record(name, reference), "failed_in": "reference", "notes": case.notes}
            del reference
            return with_pool_bytes(record)
    run = fit(case, case.graphs, out, stacks)
    record = {**fit_record(name, run), "failed_in": None if run.error is None else "fit", "notes": case.notes}
    if reference is not None and run.error is None:
        record["eager_losses"] = reference.losses.values()
        record["max_param_diff_vs_eager"] = max_param_diff(parameters_of(reference.model), parameters_of(run.model))
    del reference, run
    return with_pool_bytes(record)


def with_pool_bytes(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with ``graph_pool_bytes``: read once the caller dropped its fits (Trainers, models, outputs), so
    what is left in graph pools is the package's."""
    gc.collect()
    try:
        record["graph_pool_bytes"] = graph_pool_bytes()
    except Exception as error:
        record["graph_pool_bytes"] = f"unavailable: {type(error).__name__}: {error}"
    return record


# =================================================================== output
def finite_or_none(value: float) -> float | None:
    """``None`` for NaN or infinity (strict JSON), the value otherwise."""
    return value if math.isfinite(value) else None


def write_json(path: Path, record: dict[str, Any]) -> None:
    """Write ``record`` atomically (a rank killed mid-write leaves the previous file or none, never half of one)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(record, indent=1, default=str))
    partial.replace(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", required=True, choices=sorted(CASES))
    parser.add_argument("--out", required=True, type=Path)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Fit the case, write ``OUT/rank{r}.json``; exit status 1 when the fit raised (the report is written first)."""
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rank = env_rank()
    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # before anything touches CUDA: never a context on GPU 0
    with (args.out / f"rank{rank}.stacks.txt").open("w") as stacks:
        faulthandler.enable(file=stacks, all_threads=True)  # SIGABRT (NCCL's watchdog), SIGSEGV, ...
        try:
            record = run_case(args.case, args.out, stacks)
        finally:
            faulthandler.disable()
    write_json(args.out / f"rank{record['rank']}.json", record)
    error = record["error"]
    if error is None and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # a local shutdown; left to exit, NCCL warns (or waits)
    status = f"error {error['type']}: {error['message'][:200]}" if error else "finished"
    print(f"[rank {record['rank']}] {args.case}: stage {record.get('stage')}, {status}", flush=True)
    return 0 if error is None else 1


if __name__ == "__main__":
    raise SystemExit(main())
