"""Measure ``compile=True`` (torch.compile kernels inside the package's graphs) against the alternatives.

    PYTHONPATH=. python benchmarks/compile.py --out benchmarks/results/compile
    PYTHONPATH=. python benchmarks/compile.py --out DIR --models small --precisions bf16-mixed --rounds 1

Variants, alternated in turns in one process (``torch.compiler.reset()`` before each): eager Lightning,
``torch.compile(mode="reduce-overhead")``, the whole step, ``scope=["layer"]`` through the callback and through
``CUDAGraphStrategy`` (which replays the optimizer step as a graph too, so the host paces it less), each with and
without compiled kernels (``compile=True`` for the whole step, ``compile={"regions": True}`` for the layers), the
hand-written whole-step capture, and Thunder (``thunder.jit`` with ``CUDAGraphTransform``,
skipped where lightning-thunder is missing). Each package variant also gets a 10-step kernel profile before the
timed steps: kernel ms per step and the floor (GEMM, attention and optimizer kernels, which ``compile=`` leaves as
they are). A missed goal names what alone takes longer than the step it needs: the floor, the compiled kernels, or
the host. ``compile_s`` is the package's report; for reduce-overhead and Thunder, the wall time of the first step.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from typing_extensions import override

from benchmarks import report
from benchmarks.core import records
from benchmarks.core.figures import add_relative, finite, ratio, spread
from benchmarks.core.kernels import KernelWindow
from benchmarks.core.models import CONFIGS, WARMUP_STEPS, build, train
from benchmarks.core.timing import alternate, elapsed_ms, endless_batches, peak_memory, recorded

PACKAGE = (
    "full_iteration",
    "full_iteration+compile",
    "layer",
    "layer+compile",
    "layer-strategy",
    "layer-strategy+compile",
)
VARIANTS = ("eager", "compile_reduce_overhead", *PACKAGE, "pytorch_full_graph", "thunder")
#: (variant, reference, least ratio wanted: per precision, or ``None``).
GOALS: tuple[tuple[str, str, dict[str, float] | None], ...] = (
    ("full_iteration+compile", "full_iteration", {"32-true": 1.3, "bf16-mixed": 1.8}),
    ("full_iteration+compile", "compile_reduce_overhead", {"32-true": 2.5, "bf16-mixed": 2.5}),
    ("full_iteration+compile", "thunder", {"32-true": 1.25, "bf16-mixed": 1.25}),
    ("layer+compile", "layer", {"32-true": 1.2, "bf16-mixed": 1.2}),
    ("layer-strategy+compile", "layer-strategy", {"32-true": 1.1, "bf16-mixed": 1.1}),
    ("full_iteration+compile", "pytorch_full_graph", None),
)
PARITY_STEPS, KERNEL_STEPS, KERNEL_GAP = 100, 10, 5
THUNDER_SKIPPED = "skipped: lightning-thunder not installed"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = records.timed_parser(__doc__, steps=160, timed=60, rounds=2)
    parser.add_argument("--models", default="small,medium", help="comma-separated from small, medium, tiny")
    parser.add_argument("--precisions", default="32-true,bf16-mixed", help="comma-separated (default: both)")
    args = parser.parse_args(argv)
    records.check_timed(parser, args, untimed=WARMUP_STEPS + 2)
    args.models = records.names(parser, "--models", args.models, ["small", "medium", "tiny"])
    args.precisions = records.names(parser, "--precisions", args.precisions, ["32-true", "bf16-mixed"])
    return args


def limit_of(needed: float | None, floor: float | None, kernel: float | None, host: float | None) -> str | None:
    """What alone takes longer than the step a goal needs, the hardest first: the floor, the kernels, the host.

    Example:
        >>> limit_of(needed=1.0, floor=0.5, kernel=1.2, host=0.8)
        'kernels'
    """
    if needed is None:
        return None
    for limit, ms in (("floor", floor), ("kernels", kernel)):
        if ms is not None and ms > needed:
            return limit
    return "host" if kernel is not None and host is not None and host > needed else None


def ratios(results: list[dict[str, Any]], precision: str) -> list[dict[str, Any]]:
    """The speed ratios with their goals, and for a missed goal what limits it."""
    found = {r["variant"]: r for r in results}
    entries = []
    for variant, reference, goals in GOALS:
        side, other = found.get(variant, {}), found.get(reference, {})
        value = ratio(other.get("median_ms"), side.get("median_ms"))
        goal = None if goals is None else goals[precision]
        met = None if goal is None or value is None else value >= goal
        kernels: dict[str, Any] = side.get("kernels") or {}
        needed = None if goal is None or other.get("median_ms") is None else round(other["median_ms"] / goal, 4)
        entry: dict[str, Any] = {"variant": variant, "reference": reference, "ratio": value, "goal": goal, "met": met,
                 "needed_ms": needed, "floor_ms": kernels.get("floor_ms"), "kernel_ms": kernels.get("kernel_ms"),
                 "host_ms": side.get("host_ms")}  # fmt: skip
        entry["limit"] = (
            None if met is not False else limit_of(needed, entry["floor_ms"], entry["kernel_ms"], entry["host_ms"])
        )
        entries.append(entry)
    return entries


class FirstStep(pl.Callback):
    """The wall time of step 1 (a sync at its start and at its end, none later): where torch.compile compiles."""

    def __init__(self) -> None:
        self.started, self.seconds = 0.0, cast(float | None, None)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_step in (0, 1) and self.seconds is None:
            torch.cuda.synchronize()
            if trainer.global_step == 0:
                self.started = time.perf_counter()
            else:
                self.seconds = time.perf_counter() - self.started


def measure(model: str, variant: str, *, precision: str, steps: int, skip: int) -> dict[str, Any]:
    """One fit of one variant, with its kernel profile and compile time."""
    if variant == "thunder":
        return thunder(model, precision, steps, skip)
    start = skip - KERNEL_GAP - KERNEL_STEPS
    window = KernelWindow(start, KERNEL_STEPS) if variant in PACKAGE and start > WARMUP_STEPS + 1 else None
    first = FirstStep()
    extra = (first,) if window is None else (first, window)
    fit = train(model, variant, precision, steps, skip, PARITY_STEPS, callbacks=extra)
    fit["kernels"] = None if window is None else window.summary
    fit["first_step_s"] = first.seconds
    compiled = (fit.get("report") or {}).get("compile_s")
    fit["compile_s"] = (
        compiled if variant.endswith("+compile") else first.seconds if variant == "compile_reduce_overhead" else None
    )
    fit["compile_source"] = (
        "report" if variant.endswith("+compile") else "first step" if variant == "compile_reduce_overhead" else None
    )
    return fit


def thunder(model: str, precision: str, steps: int, skip: int) -> dict[str, Any]:
    """The GPT with Thunder in a plain loop: the same weights and batches, AdamW eager, the loss outside the jit."""
    if importlib.util.find_spec("thunder") is None:
        return {"variant": "thunder", "median_ms": None, "note": THUNDER_SKIPPED}
    import thunder as th  # type: ignore[import-not-found]
    from thunder.transforms.cudagraph import CUDAGraphTransform  # type: ignore[import-not-found]

    module, data = build(model)
    gpt: Any = module.model.cuda()
    batches = endless_batches(data)
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=module.hparams.lr, weight_decay=module.hparams.weight_decay)
    graphs = CUDAGraphTransform()
    jitted = th.jit(gpt, executors=["sdpa", "torchcompile"], transforms=[graphs])
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16-mixed", cache_enabled=False)

    def step() -> torch.Tensor:
        x, y = (t.cuda(non_blocking=True) for t in next(batches))
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            logits = jitted(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        optimizer.step()
        return loss.detach()

    events, losses = [], []
    with peak_memory() as peak:
        torch.cuda.synchronize()
        started = time.perf_counter()
        losses.append(step())
        torch.cuda.synchronize()
        first_step_s = time.perf_counter() - started
        for index in range(WARMUP_STEPS - 1 + steps):
            if index >= WARMUP_STEPS - 1:
                events.append(recorded())
            loss = step()
            if len(losses) < PARITY_STEPS:
                losses.append(loss)
        times = elapsed_ms([*events, recorded()], skip)
    return {
        "variant": "thunder", **spread(times), "peak_mib": finite(peak()), "final_loss": finite(float(loss)),
        "note": f"{th.cache_misses(jitted)} trace(s), {len(graphs.cuda_graph_runner.cuda_graph_cache)} CUDA graph(s)",
        "report": None, "first_step_s": first_step_s, "compile_s": first_step_s, "compile_source": "first step",
        "losses": torch.stack(losses).float().tolist(),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if records.needs_cuda("compile.py"):
        return 2
    skip = args.steps - args.timed
    for precision in args.precisions:
        measured = {}
        for model in args.models:
            one_fit = partial(measure, model, precision=precision, steps=args.steps, skip=skip)
            fits = alternate(VARIANTS, args.rounds, one_fit, cold=("compile_s", "compile_source", "first_step_s"))
            add_relative(fits, {fit["variant"]: fit.pop("losses", []) for fit in fits})
            measured[model] = {"config": CONFIGS[model], "results": fits, "ratios": ratios(fits, precision)}
        record = {"kind": "compile", "precision": precision, "steps": args.steps, "timed": args.timed}
        record.update(rounds=args.rounds, warmup_steps=WARMUP_STEPS, parity_steps=PARITY_STEPS, models=measured)
        record["environment"] = records.environment()
        print(f"wrote {records.write(record, args.out / f'compile_{precision}.json')}")
    report.publish(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
