"""What the guards cost per replayed whole step, and what a learning rate written by hand costs, in alternated rounds.

    PYTHONPATH=. python benchmarks/guards_cost.py --out benchmarks/results/guards --steps 200 --rounds 3

Per model (the small and the medium GPT, and a 45-block GPT of about 500 modules), each round fits the whole step
three ways from the same weights on the same batches:

- ``guarded``: the package as it ships, its guard set checked before every replay;
- ``unguarded``: the same fit with no guard set;
- ``warmup``: guarded, with a callback that writes every param group's ``lr`` as a number before every step.

Step times are CUDA-event distances between batch starts from step ``--skip`` on (no host sync per step). Each ratio
is taken per round (``unguarded / guarded``, ``guarded / warmup``), then the median of the rounds, with its range.

``--host`` needs no GPU: per model, the host time of one check of the guard set before a replay (nothing written,
and one guarded attribute written since the last check), and the time to build the set at capture.

    PYTHONPATH=. python benchmarks/guards_cost.py --host --out benchmarks/results/guards
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning.pytorch as pl
import torch
from typing_extensions import override

from benchmarks import report
from benchmarks.core import records
from benchmarks.core.models import build, graph_callback
from benchmarks.core.timing import StepClock, fresh_device, in_turns, timing_trainer
from lightning_cudagraph import CUDAGraphStrategy
from lightning_cudagraph._graphs import whole_step

VARIANTS = ("guarded", "unguarded", "warmup")
#: The models: the GPT configs of ``examples/gpt.py``, and a deep narrow one of about 500 modules.
MODELS: dict[str, dict[str, Any]] = {
    "small": {},
    "medium": {},
    "deep": {"vocab_size": 1024, "seq_len": 64, "n_layer": 45, "width": 64, "heads": 2, "batch_size": 4},
}


class WrittenRate(pl.Callback):
    """Writes every param group's ``lr`` as a number before each step, as a hand-written warm-up does."""

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        for group in trainer.optimizers[0].param_groups:
            group["lr"] = 1e-3 * min(1.0, (trainer.global_step + 1) / 10_000)


class _NoGuards:
    """Stands in for the guard set: nothing held, nothing checked."""

    size = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def problem(self) -> None:
        return None

    def release(self) -> None:
        pass


#: The sizes of the guard sets built in the current fit.
SIZES: list[int] = []


class _Counted(whole_step.GuardSet):
    """The guard set as it ships, its size noted."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        SIZES.append(self.size)


@contextlib.contextmanager
def guards(on: bool) -> Iterator[None]:
    """The whole step with its guard set (sizes noted), or without one, as before the guards existed."""
    original = whole_step.GuardSet
    whole_step.GuardSet = _Counted if on else _NoGuards  # type: ignore[assignment, misc]
    SIZES.clear()
    try:
        yield
    finally:
        whole_step.GuardSet = original  # type: ignore[misc]


def build_model(name: str) -> tuple[Any, Any]:
    if not MODELS[name]:
        return build(name)
    from examples.gpt import GPTModule, TokenDataModule

    config = MODELS[name]
    pl.seed_everything(0, verbose=False)
    module = GPTModule(**{k: v for k, v in config.items() if k != "batch_size"})
    batch = config["batch_size"]
    data = TokenDataModule(config["vocab_size"], config["seq_len"], batch_size=batch, train_samples=64 * batch)
    return module, data


def fit(model: str, variant: str, steps: int, skip: int, precision: str) -> dict[str, Any]:
    module, data = build_model(model)
    clock = StepClock()
    callbacks: list[pl.Callback] = [clock, *([WrittenRate()] if variant == "warmup" else [])]
    strategy = CUDAGraphStrategy(scope=["full_iteration"], warmup_steps=3)
    trainer = timing_trainer(steps, callbacks, strategy, precision)
    with guards(on=variant != "unguarded"):
        trainer.fit(module, data)
    callback = graph_callback(trainer)
    assert callback is not None
    report_ = callback.report
    return {
        "variant": variant,
        "median_ms": statistics.median(clock.step_times(skip)),
        "stage": report_.stage.name,
        "rollbacks": report_.rollbacks,
        "modules": sum(1 for _ in module.modules()),
        "guarded_values": max(SIZES, default=0),
    }


def host_costs(model: str, repeats: int = 20_000) -> dict[str, Any]:
    """Host microseconds of one guard check (nothing written; one attribute written) and ms to build the set."""
    module, _ = build_model(model)
    started = time.perf_counter()
    guards = whole_step.GuardSet("the whole step", list(module.named_modules()), module, clipping=False)
    build_ms = (time.perf_counter() - started) * 1e3
    dropout = next((m for m in module.modules() if isinstance(m, torch.nn.Dropout)), None)
    try:
        started = time.perf_counter()
        for _ in range(repeats):
            guards.problem()
        quiet_us = (time.perf_counter() - started) / repeats * 1e6
        started = time.perf_counter()
        for _ in range(repeats):
            if dropout is not None:
                dropout.p = dropout.p  # a write of the same value: noted, compared, found unchanged
            guards.problem()
        written_us = (time.perf_counter() - started) / repeats * 1e6
    finally:
        guards.release()
    return {"model": model, "modules": sum(1 for _ in module.modules()), "guarded_values": guards.size,
            "build_ms": build_ms, "check_us": quiet_us, "check_after_a_write_us": written_us}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/guards"))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--skip", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--host", action="store_true", help="the host time of the checks alone (no GPU needed)")
    args = parser.parse_args(argv)
    if args.host:
        hosts = [host_costs(model) for model in args.models.split(",")]
        for row in hosts:
            print(
                f"{row['model']} ({row['modules']} modules, {row['guarded_values']} guarded values): check"
                f" {row['check_us']:.2f} us, after a write {row['check_after_a_write_us']:.2f} us;"
                f" built in {row['build_ms']:.1f} ms",
                flush=True,
            )
        record = {"kind": "guards_host", "environment": records.environment(), "models": hosts}
        records.write(record, args.out / "guards_host.json")
        return 0
    if records.needs_cuda("guards_cost.py"):
        return 2
    results = []
    for model in args.models.split(","):
        fit(model, "guarded", 20, 5, args.precision)  # allocator and kernels warm
        fresh_device()
        fits = in_turns(
            VARIANTS,
            args.rounds,
            lambda variant, model=model: fit(model, variant, args.steps, args.skip, args.precision),
            lambda index, got, model=model: f"[{index}] {model} {got['variant']}: {got['median_ms']:.4f} ms",
        )
        guard_ratio = [u["median_ms"] / g["median_ms"] for u, g in zip(fits["unguarded"], fits["guarded"], strict=True)]
        rate_ratio = [g["median_ms"] / w["median_ms"] for g, w in zip(fits["guarded"], fits["warmup"], strict=True)]
        entry = {
            "model": model,
            "modules": fits["guarded"][0]["modules"],
            "guarded_values": fits["guarded"][0]["guarded_values"],
            "ms": {variant: [got["median_ms"] for got in fits[variant]] for variant in VARIANTS},
            "stages": {variant: [got["stage"] for got in fits[variant]] for variant in VARIANTS},
            "unguarded_over_guarded": {"median": statistics.median(guard_ratio), "rounds": guard_ratio},
            "guarded_over_warmup": {"median": statistics.median(rate_ratio), "rounds": rate_ratio},
        }
        results.append(entry)
        print(
            f"{model} ({entry['modules']} modules, {entry['guarded_values']} guarded values): guards"
            f" {entry['unguarded_over_guarded']['median']:.4f}x (range {min(guard_ratio):.4f}-{max(guard_ratio):.4f});"
            f" warm-up {entry['guarded_over_warmup']['median']:.4f}x"
            f" (range {min(rate_ratio):.4f}-{max(rate_ratio):.4f})",
            flush=True,
        )
    record = {"kind": "guards", "steps": args.steps, "skip": args.skip, "rounds": args.rounds}
    record.update(precision=args.precision, environment=records.environment(), models=results)
    path = records.write(record, args.out / "guards.json")
    with contextlib.suppress(Exception):  # the record stands even where no page shows this kind yet
        report.publish(args.out, path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
