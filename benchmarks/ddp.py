"""Measure CUDA graphs under DDP on two GPUs against eager DDP, every variant in one torchrun launch.

    python benchmarks/ddp.py --out DIR                               # fp32, 200 steps per variant, the last 100 timed
    python benchmarks/ddp.py --out DIR --precision bf16-mixed --variants eager,layer --steps 200 --timed 100

The model is the GPT of ``examples/gpt.py`` with 8 layers, width 256, 4 heads, vocabulary 1024 and sequence 128,
batch 8 per rank (16 over the two ranks), AdamW at lr 1e-3, every variant from the same seed. Variants, in this
order: eager DDP (``DDPStrategy``), ``DDPCUDAGraphStrategy(scope=["layer"], warmup_steps=3)`` (DDP's all-reduce
outside the graphs), ``strategy="ddp_cudagraph_full"`` (the whole step, DDP's all-reduce inside, 11 eager steps
first) and ``strategy="ddp_cudagraph"`` (``scope="auto"``: its ladder of levels, each timed by the slowest rank).

``main()`` checks that two CUDA GPUs are visible (otherwise it says so and exits with code 2), then runs
``torch.distributed.run --standalone --nproc-per-node 2`` on this file with ``--worker``: both ranks train every
variant with ``Trainer(accelerator="gpu", devices=2)`` (Lightning's ``TorchElasticEnvironment``, NCCL), and rank 0
measures. Per variant: the median ms/step over the last ``--timed`` steps on rank 0 (a CUDA event at every batch
start, read once at the end: no host sync per step from the benchmark), p25/p75, the speedup over eager DDP, peak
memory on rank 0, whether the final parameters are bit for bit the same on both ranks, whether both ranks ended in
the same stage and level, the package's report on rank 0, and loss parity: the largest difference of rank 0's first
20 losses from eager DDP's (the whole step runs AdamW in its capturable form, so it differs from eager DDP in the
last bits). For ``auto`` the step at which its ladder had decided is recorded; a timed window that starts earlier is
noted. Writes ``DIR/ddp_<precision>.json`` and ``DIR/DDP.md`` (rebuilt from every ``ddp_*.json`` in ``DIR``).

A variant that fails on one rank only can leave the ranks' collectives out of step: the launch then ends at the
collective timeout (2 min) or ``--timeout``, and the output says which variant it was on.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from benchmarks.hf import LossClock, _finite_or_none, _fmt, _ratio, report_core, result_note
from benchmarks.report import write_records_markdown
from benchmarks.run import environment as suite_environment
from benchmarks.variants import CONFIGS, Result, model_args, peak_memory, timing_trainer
from examples.gpt import GPTModule, TokenDataModule
from lightning_cudagraph import CUDAGraphCallback, CUDAGraphReport, DDPCUDAGraphStrategy

SCHEMA_VERSION = 1
WORLD_SIZE = 2
NEEDS_TWO_GPUS = (
    "benchmarks/ddp.py measures CUDA graphs under DDP on two GPUs (nvidia-h200-x2) and needs two CUDA GPUs;"
    " {visible} visible here."
)
MARKDOWN = "DDP.md"
#: The small GPT of benchmarks/variants.py with 8 layers: width 256, 4 heads, vocabulary 1024, sequence 128, batch 8.
CONFIG = {**CONFIGS["small"], "n_layer": 8}
WARMUP_STEPS = 3
PARITY_STEPS = 20
PRECISIONS = ("32-true", "bf16-mixed")
VARIANTS = ("eager", "layer", "full_iteration", "auto")
LABELS = {
    "eager": "eager DDP",
    "layer": '`DDPCUDAGraphStrategy(scope=["layer"])`',
    "full_iteration": '`strategy="ddp_cudagraph_full"`',
    "auto": '`strategy="ddp_cudagraph"` (auto)',
}
#: A collective that waits longer raises (NCCL's watchdog) instead of holding both GPUs for Lightning's 30 min.
COLLECTIVE_TIMEOUT = timedelta(minutes=2)
#: ``auto``: steps after its ladder decided before the kept level runs on graphs (a capture, or the whole step's
#: eager step and capture).
SETTLE_MARGIN = 4
#: The launching command line, handed to the workers for the record.
COMMAND_VARIABLE = "LIGHTNING_CUDAGRAPH_DDP_BENCHMARK_COMMAND"
#: What a launch inherits from a shell that itself runs under a launcher would make the workers join that job.
LAUNCHER_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the command line (exits with code 2 on a bad value)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="results directory (created if missing)")
    parser.add_argument("--steps", type=int, default=200, help="training steps per variant (default: 200)")
    parser.add_argument("--timed", type=int, default=100, help="last steps of each variant timed (default: 100)")
    parser.add_argument("--precision", choices=PRECISIONS, default="32-true")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated from {', '.join(VARIANTS)}")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds before the launch is ended (default: 1800)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # set by main() for torchrun
    args = parser.parse_args(argv)
    if not 0 < args.timed < args.steps:
        parser.error(f"--timed must be at least 1 and below --steps (got {args.timed}, {args.steps})")
    if args.steps < PARITY_STEPS:
        parser.error(f"--steps must be at least {PARITY_STEPS} (loss parity is taken over the first {PARITY_STEPS})")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown or not args.variants:
        parser.error(f"unknown variant(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(VARIANTS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible < WORLD_SIZE:
        print(NEEDS_TWO_GPUS.format(visible=visible))
        return 2
    if args.worker:
        return worker(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    return launch(args)


# =================================================================== the launch (main process)
def launch(args: argparse.Namespace) -> int:
    """Run this file on two GPUs under torchrun; print the table rank 0 wrote."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD_SIZE)]
    command += [os.path.abspath(__file__), "--worker", "--out", str(args.out), "--steps", str(args.steps)]
    command += ["--timed", str(args.timed), "--precision", args.precision, "--variants", ",".join(args.variants)]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith("TORCHELASTIC_")}
    env[COMMAND_VARIABLE] = shlex.join(sys.orig_argv)
    started = time.perf_counter()
    process = subprocess.Popen(command, env=env, start_new_session=True)  # its own group: ended as one on a hang
    try:
        returncode = process.wait(timeout=args.timeout)
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as stop:
        end_launch(process)
        if isinstance(stop, KeyboardInterrupt):
            raise
        print(f"benchmarks/ddp.py: the launch did not end within --timeout {args.timeout} s and was ended")
        return 1
    if returncode != 0:
        print(f"benchmarks/ddp.py: the torchrun launch failed (exit status {returncode}); see its output above")
        return returncode
    path = Path(args.out) / f"ddp_{args.precision}.json"
    record = json.loads(path.read_text())
    print(section(record), f"wrote {path}", f"wrote {Path(args.out) / MARKDOWN}", sep="\n")
    print(f"finished in {(time.perf_counter() - started) / 60:.1f} min")
    return 0


def end_launch(process: subprocess.Popen) -> None:
    """SIGTERM to the launch's process group (torchrun ends its workers), SIGKILL to what is left after 30 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


# =================================================================== one rank (under torchrun)
class SettleWatch(pl.Callback):
    """The first training step that started with ``scope="auto"`` 's ladder decided (``None``: never, or no ladder)."""

    def __init__(self) -> None:
        self.at: int | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, idx: int) -> None:
        report = graph_report(trainer)
        if self.at is None and report is not None and ladder_decided(report):
            self.at = trainer.global_step


def ladder_decided(report: CUDAGraphReport) -> bool:
    """Whether every level of the ladder is kept, slower, failed or skipped (none planned or being tried)."""
    return bool(report.ladder) and all(row.status not in ("trying", "planned") for row in report.ladder)


def graph_report(trainer: pl.Trainer) -> CUDAGraphReport | None:
    """The report of the Trainer's CUDAGraphCallback (``None`` under plain DDP)."""
    return next((cb.report for cb in trainer.callbacks if isinstance(cb, CUDAGraphCallback)), None)


def make_strategy(variant: str) -> DDPStrategy:
    """The variant's strategy, with :data:`COLLECTIVE_TIMEOUT`; registered names get their registered options."""
    if variant == "eager":
        return DDPStrategy(timeout=COLLECTIVE_TIMEOUT)
    if variant == "layer":
        return DDPCUDAGraphStrategy(scope=["layer"], warmup_steps=WARMUP_STEPS, timeout=COLLECTIVE_TIMEOUT)
    entry = StrategyRegistry[{"full_iteration": "ddp_cudagraph_full", "auto": "ddp_cudagraph"}[variant]]
    return entry["strategy"](**entry["init_params"], timeout=COLLECTIVE_TIMEOUT)


def worker(args: argparse.Namespace) -> int:
    """Every rank trains every variant; rank 0 writes the record and the Markdown."""
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # before any CUDA work: no context on another GPU
    rank = int(os.environ["RANK"])
    started = time.perf_counter()
    results, losses = [], {}
    for variant in args.variants:
        if rank == 0:
            print(f"{variant}: {args.steps} steps ({args.timed} timed), {args.precision}", flush=True)
        result, first_losses = run_variant(variant, args.precision, args.steps, args.timed)
        results.append(result)
        losses[variant] = first_losses
        if rank == 0:
            print(progress_line(result), flush=True)
    if rank != 0:
        return 0
    eager = next((r for r in results if r["variant"] == "eager"), None)
    for result in results:
        result["speedup"] = _finite_or_none(_ratio(eager and eager["median_ms"], result["median_ms"]))
        diff = max_abs_diff(losses.get("eager", []), losses[result["variant"]])
        result["loss_max_abs_diff"] = _finite_or_none(diff)
    record = {
        "schema": SCHEMA_VERSION,
        "kind": "ddp",
        "precision": args.precision,
        "world_size": WORLD_SIZE,
        "steps": args.steps,
        "timed": args.timed,
        "warmup_steps": WARMUP_STEPS,
        "parity_steps": PARITY_STEPS,
        "batch_size_per_rank": CONFIG["batch_size"],
        "model": model_args(CONFIG),
        "wall_s": round(time.perf_counter() - started, 1),
        "environment": environment(),
        "results": results,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"ddp_{args.precision}.json"
    with path.open("w") as handle:
        json.dump(record, handle, indent=2, allow_nan=False)
        handle.write("\n")
    write_markdown(out)
    return 0


def run_variant(variant: str, precision: str, steps: int, timed: int) -> tuple[dict[str, Any], list[float]]:
    """Train one variant on this rank and measure it; a failure is reported in its note."""
    gc.collect()
    torch.cuda.empty_cache()
    try:
        return measure(variant, precision, steps, timed)
    except Exception as err:
        torch.cuda.set_stream(torch.cuda.default_stream())
        failed = as_dict(Result(variant, note=f"failed: {type(err).__name__}: {str(err)[:200]}"), None, [], None)
        return failed, []


def measure(variant: str, precision: str, steps: int, timed: int) -> tuple[dict[str, Any], list[float]]:
    pl.seed_everything(0, verbose=False)
    model = GPTModule(**model_args(CONFIG))
    batch = CONFIG["batch_size"]
    # One epoch per rank covers every step: no epoch boundary inside the timed window.
    data = TokenDataModule(
        CONFIG["vocab_size"], CONFIG["seq_len"], batch_size=batch, train_samples=WORLD_SIZE * batch * (steps + 8)
    )
    clock, settle = LossClock(PARITY_STEPS), SettleWatch()
    trainer = timing_trainer(steps, [clock, settle], make_strategy(variant), precision, devices=WORLD_SIZE)
    with peak_memory() as peak:
        trainer.fit(model, data)
    result = Result(variant, clock.step_times(steps - timed), peak_mib=peak(), final_loss=float(clock.last_loss))
    losses = torch.stack(clock.losses).float().tolist() if clock.losses else []
    report = graph_report(trainer)
    mine = {"digest": parameter_digest(model), **rank_summary(report)}
    ranks: list[Any] = [None] * WORLD_SIZE
    dist.all_gather_object(ranks, mine)
    if settle.at is not None and settle.at + SETTLE_MARGIN > steps - timed:
        result.note = f"the timed window starts at step {steps - timed}, before the ladder decided (step {settle.at})"
    return as_dict(result, report, ranks, settle.at), losses


def parameter_digest(module: torch.nn.Module) -> str:
    """SHA-256 of every parameter's name and bytes: equal on two ranks exactly when their parameters are."""
    digest = hashlib.sha256()
    for name, parameter in sorted(module.named_parameters()):
        digest.update(name.encode())
        digest.update(parameter.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def rank_summary(report: CUDAGraphReport | None) -> dict[str, Any]:
    """What must agree across ranks: stage, level, rollbacks (empty under plain DDP)."""
    if report is None:
        return {}
    return {"stage": report.stage.name, "level": report.level, "rollbacks": report.rollbacks}


def as_dict(
    result: Result, report: CUDAGraphReport | None, ranks: list[dict[str, Any]], settled_at: int | None
) -> dict[str, Any]:
    """A variant's figures as JSON-ready values (non-finite ones as ``None``), with rank 0's report."""
    low, high = result.spread_ms
    figures: dict[str, Any] = {
        "variant": result.variant,
        "median_ms": _finite_or_none(result.median_ms),
        "p25_ms": _finite_or_none(low),
        "p75_ms": _finite_or_none(high),
        "steps_timed": len(result.step_ms),
        "peak_mib": _finite_or_none(result.peak_mib),
        "final_loss": _finite_or_none(result.final_loss),
        # None where the variant failed before the ranks compared (no figures to compare)
        "params_equal_across_ranks": len({r["digest"] for r in ranks}) == 1 if ranks else None,
        "ranks_agree": all(_state(r) == _state(ranks[0]) for r in ranks) if ranks else None,
        "ranks": ranks,
        "settled_at": settled_at,
        "note": result.note,
    }
    if report is not None:
        figures["report"] = {
            **report_core(report),
            "level": report.level,
            "ladder": [
                {"level": row.level, "status": row.status, "step_ms": _finite_or_none(row.step_ms)}
                for row in report.ladder
            ],
            "steps_replayed": report.steps_replayed,
            "steps_eager": report.steps_eager,
            "parity_err": _finite_or_none(report.parity_err),
        }
    return figures


def _state(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k != "digest"}


def max_abs_diff(reference: list[float], other: list[float]) -> float:
    """Largest per-step difference over the steps both runs have (``nan`` if either has none)."""
    pairs = list(zip(reference, other, strict=False))
    return max((abs(a - b) for a, b in pairs), default=math.nan)


def progress_line(result: dict[str, Any]) -> str:
    report = result.get("report") or {}
    level = f" at {report['level']}" if report.get("level") else ""
    why = f" ({report['rollback_reasons'][0][:100]})" if report.get("rollback_reasons") else ""
    same = {True: "; params equal across ranks", False: "; PARAMS DIFFER ACROSS RANKS"}.get(
        result["params_equal_across_ranks"], ""
    )
    stage = report.get("stage", "")
    ms = _fmt(result["median_ms"], 3)
    return f"{result['variant']:>15}: {ms:>8} ms/step  {stage}{level}{why}{same} {result['note']}"


def environment() -> dict[str, str]:
    """The benchmark suite's record (GPU, versions, date), the launching command, NCCL and its settings."""
    try:
        nccl: Any = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):  # a build without NCCL
        nccl = "unknown"
    return {
        **suite_environment(),
        "gpu": f"{WORLD_SIZE}x {torch.cuda.get_device_name()}",
        "command": os.environ.get(COMMAND_VARIABLE, shlex.join(sys.orig_argv)),
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
        "NCCL_GRAPH_REGISTER": os.environ.get("NCCL_GRAPH_REGISTER", "unset"),
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "unset"),
    }


# =================================================================== Markdown
def write_markdown(out: Path) -> Path:
    """``DDP.md`` from every ``ddp_*.json`` in ``out``: one table per precision."""
    return write_records_markdown(out / MARKDOWN, "ddp", PRECISIONS, "CUDA graphs under DDP on two GPUs", section)


def section(record: dict[str, Any]) -> str:
    """The Markdown table of one record."""
    env, model = record["environment"], record["model"]
    return (
        f"## {record['precision']}, {record['world_size']} GPUs\n\n"
        f"GPT, {model['n_layer']} layers, width {model['width']}, {model['heads']} heads, vocabulary"
        f" {model['vocab_size']}, sequence {model['seq_len']}; batch {record['batch_size_per_rank']} per rank, AdamW."
        f" Median ms per step on rank 0 over the last {record['timed']} of {record['steps']} steps (CUDA events at"
        f" batch starts, no host sync per step from the benchmark); loss parity: largest difference of rank 0's"
        f" first {record['parity_steps']} losses from eager DDP's. {env['gpu']}, torch {env['torch']}, lightning"
        f" {env['lightning']}, NCCL {env['nccl']}, {env['date']}.\n\n" + table(record["results"])
    )


def table(results: list[dict[str, Any]]) -> str:
    header = (
        "| variant | ms/step | vs eager DDP | p25-p75 ms | peak MiB | stage | level | replays | fallbacks"
        " | params equal across ranks | ranks agree | loss parity | note |\n"
        "|---|---:|---:|---:|---:|---|---|---:|---:|---|---|---:|---|\n"
    )
    rows = []
    for result in results:
        report = result.get("report") or {}
        note = result_note(result)
        if result.get("settled_at") is not None and "ladder decided" not in note:
            note = "; ".join(filter(None, [note, f"ladder decided at step {result['settled_at']}"]))
        speedup = result.get("speedup")
        spread = f"{_fmt(result['p25_ms'], 2)}-{_fmt(result['p75_ms'], 2)}" if result["p25_ms"] is not None else ""
        cells = [
            LABELS.get(result["variant"], result["variant"]),
            _fmt(result["median_ms"], 2),
            "" if speedup is None else f"{speedup:.2f}x",
            spread,
            _fmt(result["peak_mib"], 0),
            report.get("stage", "").lower(),
            report.get("level") or "",
            str(report["replays"]) if report else "",
            str(report["fallbacks"]) if report else "",
            _yes_no(result["params_equal_across_ranks"]),
            _yes_no(result["ranks_agree"]) if report else "",
            "" if result["variant"] == "eager" else _fmt(result.get("loss_max_abs_diff"), None),
            _cell(note, 200),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return header + "\n".join(rows) + "\n"


# =================================================================== helpers
def _yes_no(value: bool | None) -> str:
    return {True: "yes", False: "**no**"}.get(value, "")


def _cell(text: str, limit: int) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


if __name__ == "__main__":
    raise SystemExit(main())
