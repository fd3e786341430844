"""What observing the step's Python costs: an observed eager step against a plain one, and the watch per replay.

    PYTHONPATH=. python benchmarks/observation_cost.py --out benchmarks/results/observation
    PYTHONPATH=. python benchmarks/observation_cost.py --fit --out benchmarks/results/observation   # a GPU

``--fit`` also trains the small GPT through ``strategy="cudagraph_full"`` with the module check before each replay
and without it (patched out), alternated round by round in one process: the replayed step's cost of the check.

The eager steps before the first capture (and one per epoch while the whole step replays) run observed
(:mod:`lightning_cudagraph._rollout.step_python`): per-step reads, random draws, attribute changes, and a trace of the
operations with their Python numbers. This times one training step of the example GPT (forward, loss, backward,
AdamW) plainly and observed, with the trace and without it (``compile=`` turns the trace off), alternated round by
round in one process. A replayed step runs none of the observation; what it does run is the check of the modules
inside the graphs (their modes, hooks and forwards), timed here per call against the step.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from benchmarks.core import records
from benchmarks.core.models import CONFIGS, model_args
from lightning_cudagraph._rollout.step_python import StepPython
from lightning_cudagraph._trust.evidence import StateWatch
from lightning_cudagraph._trust.observation import Observer

WAYS = ("plain", "observed", "observed_untraced")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/observation"))
    parser.add_argument("--models", default="tiny,small", help="comma-separated GPT configs")
    parser.add_argument("--steps", type=int, default=12, help="steps timed per way and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--fit", action="store_true", help="also time whole-step fits with and without the check")
    return parser.parse_args(argv)


def build(model: str, device: torch.device) -> tuple[Any, torch.optim.Optimizer, tuple[torch.Tensor, torch.Tensor]]:
    from examples.gpt import GPTModule

    torch.manual_seed(0)
    config = CONFIGS[model]
    module = GPTModule(**model_args(config)).to(device)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    tokens = torch.randint(config["vocab_size"], (config["batch_size"], config["seq_len"] + 1), device=device)
    return module, optimizer, (tokens[:, :-1], tokens[:, 1:])


def timed(run: Callable[[], Any], device: torch.device, steps: int) -> float:
    """Median milliseconds of ``steps`` runs, the device synced at both ends of each."""
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def measure(model: str, args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    module, optimizer, (x, y) = build(model, device)

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        python.observer.resume()  # where training_step starts in a fit
        logits = module(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        python.pause_trace()  # on_before_optimizer_step in a fit
        optimizer.step()
        return loss

    observers = {"observed": StepPython(Observer(trace=True)), "observed_untraced": StepPython(Observer(trace=False))}
    python = observers["observed"]
    ways: dict[str, Callable[[], Any]] = {"plain": step}
    for way, watched in observers.items():
        ways[way] = lambda watched=watched: watched.observe(("batch",), module, 0, step)
    for run in ways.values():  # warm every path (the first AdamW step makes its state)
        run()
    rounds: dict[str, list[float]] = {way: [] for way in WAYS}
    for index in range(args.rounds):
        for way in WAYS if index % 2 == 0 else WAYS[::-1]:
            if way != "plain":
                python = observers[way]
            rounds[way].append(timed(ways[way], device, args.steps))
    medians = {way: statistics.median(times) for way, times in rounds.items()}
    watch = StateWatch()
    watch.watch(
        (*module.named_parameters(), *module.named_buffers()),
        [(name, m, None) for name, m in module.named_modules() if name],
    )
    calls = 2000
    started = time.perf_counter()
    for _ in range(calls):
        watch.problem()
    watch_us = (time.perf_counter() - started) / calls * 1e6
    return {
        "model": model,
        "modules": sum(1 for _ in module.modules()),
        "ms": {way: round(value, 3) for way, value in medians.items()},
        "round_ms": {way: [round(v, 3) for v in times] for way, times in rounds.items()},
        "observed_ratio": round(medians["observed"] / medians["plain"], 3),
        "observed_untraced_ratio": round(medians["observed_untraced"] / medians["plain"], 3),
        "watch_us_per_replay": round(watch_us, 2),
        "watch_share_of_eager_step": round(watch_us / 1e3 / medians["plain"], 5),
    }


def fit_with_and_without_the_check(rounds: int, precision: str) -> dict[str, Any]:
    """Median replayed step of the small GPT's whole step, the module check on and patched out, alternated."""
    from unittest import mock

    from benchmarks.core.models import train
    from benchmarks.core.timing import alternate

    def measure(way: str) -> dict[str, Any]:
        unchecked = mock.patch.object(StateWatch, "_module_problem", return_value=None)
        with unchecked if way == "unchecked" else contextlib.nullcontext():
            fit = train("small", "full_iteration", precision, steps=160, skip=60)
        return {**fit, "variant": way}

    fits = {fit["variant"]: fit for fit in alternate(("checked", "unchecked"), rounds, measure)}
    checked, unchecked = fits["checked"]["median_ms"], fits["unchecked"]["median_ms"]
    return {
        "precision": precision,
        "checked_ms": checked,
        "unchecked_ms": unchecked,
        "round_ms": {way: fit["round_ms"] for way, fit in fits.items()},
        "ratio": round(checked / unchecked, 4) if checked and unchecked else None,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cases = []
    for model in args.models.split(","):
        case = measure(model, args)
        cases.append(case)
        print(
            f"{model}: plain {case['ms']['plain']:.2f} ms, observed {case['observed_ratio']:.2f}x, observed without"
            f" the trace {case['observed_untraced_ratio']:.2f}x; the module watch {case['watch_us_per_replay']:.1f} us"
            f" per replayed step ({case['modules']} modules)"
        )
    record = {"kind": "observation", "device": args.device, "steps": args.steps, "rounds": args.rounds}
    record.update(environment=records.environment(), cases=cases)
    if args.fit:
        fits = [fit_with_and_without_the_check(args.rounds, precision) for precision in ("32-true", "bf16-mixed")]
        for fit in fits:
            print(
                f"small GPT, cudagraph_full, {fit['precision']}: {fit['checked_ms']} ms/step with the module check,"
                f" {fit['unchecked_ms']} ms without ({fit['ratio']}x)"
            )
        record["fits"] = fits
    print(f"wrote {records.write(record, args.out / 'observation.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
