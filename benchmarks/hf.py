"""Measure CUDA graphs on Hugging Face models (transformers 5.x), every variant in one process.

    python benchmarks/hf.py --out DIR                        # fp32, 80 steps per variant, the first 20 untimed
    python benchmarks/hf.py --out DIR --precision bf16-mixed --steps 80 --skip 20 --models llama

The models are those of ``examples/hf_causal_lm.py`` at its defaults: a dense ``LlamaForCausalLM`` and a
``Qwen3MoeForCausalLM`` (4 experts, top-2, every layer sparse), 4 layers, width 256, 4 heads, vocabulary 1024,
sequence 128, batch 8, AdamW. Variants: eager Lightning; the scopes that apply (Llama: ``attn``, ``attn+mlp``,
``layer``; Qwen3-MoE: ``attn``, ``attn+moe_router``, ``layer``, whose graphs would hold the experts); and the whole
step (``strategy="cudagraph_full"``). Each is trained from the same seed with ``warmup_steps=3``.

Per variant: the median ms/step over the steps after ``--skip`` (a CUDA event at every batch start, read once at the
end: no host sync per step), the speedup over eager Lightning, peak memory, the final loss, the package's report
(stage, replays, fallbacks, rollback reason, graph pool MiB, capture ms) and loss parity: the largest per-step
difference from eager Lightning's loss over the first 20 steps. Writes ``DIR/hf_<precision>.json`` and ``DIR/HF.md``
(one table per model and precision, rebuilt from every ``hf_*.json`` in ``DIR``). On a machine without CUDA it says
so and exits with code 2.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl
import torch

from benchmarks.report import write_records_markdown
from benchmarks.run import environment as suite_environment
from benchmarks.variants import Result, StepClock, peak_memory, timing_trainer
from examples.gpt import TokenDataModule
from examples.hf_causal_lm import INSTALL, HFCausalLM
from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy

SCHEMA_VERSION = 1
NEEDS_CUDA = "benchmarks/hf.py measures CUDA graphs and needs a CUDA GPU; none is visible here."
NEEDS_TRANSFORMERS = f"benchmarks/hf.py trains Hugging Face models and needs transformers>=5: {INSTALL}"
MARKDOWN = "HF.md"

WARMUP_STEPS = 3
PARITY_STEPS = 20
SEQ_LEN, BATCH_SIZE = 128, 8
PRECISIONS = ("32-true", "bf16-mixed")
#: The variants of each model, in the order they run and appear.
MODELS = {
    "llama": ("eager", "attn", "attn+mlp", "layer", "full_iteration"),
    "qwen3_moe": ("eager", "attn", "attn+moe_router", "layer", "full_iteration"),
}
TITLES = {"llama": "Llama (dense)", "qwen3_moe": "Qwen3-MoE"}
#: Scoped variants: the scopes each captures.
SCOPES = {"attn": ["attn"], "attn+mlp": ["attn", "mlp"], "attn+moe_router": ["attn", "moe_router"], "layer": ["layer"]}
LABELS = {
    "eager": "eager Lightning",
    **{name: "`scope=[" + ", ".join(f'"{s}"' for s in scopes) + "]`" for name, scopes in SCOPES.items()},
    "full_iteration": '`strategy="cudagraph_full"`',
}


class LossClock(StepClock):
    """:class:`~benchmarks.variants.StepClock` that also keeps the first ``count`` losses on the device."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.count = count
        self.losses: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, idx)
        if len(self.losses) < self.count:
            self.losses.append(outputs["loss"].detach().clone())  # read after the fit: no host sync here


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the command line (exits with code 2 on a bad value)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="results directory (created if missing)")
    parser.add_argument("--steps", type=int, default=80, help="training steps per variant (default: 80)")
    parser.add_argument("--skip", type=int, default=20, help="steps left out of the timing (default: 20)")
    parser.add_argument("--precision", choices=PRECISIONS, default="32-true")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated from {', '.join(MODELS)}")
    args = parser.parse_args(argv)
    if not 0 <= args.skip < args.steps:
        parser.error(f"--skip must be at least 0 and below --steps (got {args.skip}, {args.steps})")
    if args.skip < WARMUP_STEPS + 2:
        print(f"note: --skip {args.skip} times the eager warmup and the capture step as well", flush=True)
    args.models = names(parser, "--models", "model", args.models, MODELS)
    return args


def names(parser: argparse.ArgumentParser, option: str, what: str, text: str, known: Sequence[str]) -> list[str]:
    """The comma-separated names of ``option``, each once; an unknown or empty list is the parser's error."""
    given = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in given if n not in known]
    if unknown or not given:
        parser.error(f"{option}: unknown {what}(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(known)}")
    return given


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(NEEDS_CUDA)
        return 2
    try:
        import transformers  # noqa: F401
    except ImportError:
        print(NEEDS_TRANSFORMERS)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    models = {}
    for model in args.models:
        print(f"{model} {args.precision}: {len(MODELS[model])} variants, {args.steps} steps ({args.skip} untimed)")
        models[model] = measure_model(model, args.precision, args.steps, args.skip)
    record = {
        "schema": SCHEMA_VERSION,
        "kind": "hf",
        "precision": args.precision,
        "steps": args.steps,
        "skip": args.skip,
        "warmup_steps": WARMUP_STEPS,
        "parity_steps": min(PARITY_STEPS, args.steps),
        "batch_size": BATCH_SIZE,
        "seq_len": SEQ_LEN,
        "wall_s": round(time.perf_counter() - started, 1),
        "environment": environment(),
        "models": models,
    }
    path = out / f"hf_{args.precision}.json"
    with path.open("w") as handle:
        json.dump(record, handle, indent=2, allow_nan=False)
        handle.write("\n")
    markdown = write_markdown(out)
    print(section(record), f"wrote {path}", f"wrote {markdown}", sep="\n")
    print(f"finished in {(time.perf_counter() - started) / 60:.1f} min")
    return 0


def measure_model(model: str, precision: str, steps: int, skip: int) -> dict[str, Any]:
    """Every variant of one model; figures relative to eager Lightning (its first variant)."""
    results, losses = [], {}
    for variant in MODELS[model]:
        result, first_losses = run_variant(model, variant, precision, steps, skip)
        losses[variant] = first_losses
        results.append(result)
        print(progress_line(result), flush=True)
    eager = results[0]
    for result in results:
        result["speedup"] = _finite_or_none(_ratio(eager["median_ms"], result["median_ms"]))
        result["loss_max_abs_diff"] = _finite_or_none(max_abs_diff(losses["eager"], losses[result["variant"]]))
    return {"config": model_config(model), "results": results}


def model_config(model: str) -> dict[str, Any]:
    """The model's constructor arguments (the example's defaults with ``kind``)."""
    params = inspect.signature(HFCausalLM.__init__).parameters.values()
    return {**{p.name: p.default for p in params if p.name != "self"}, "kind": model}


def run_variant(model: str, variant: str, precision: str, steps: int, skip: int) -> tuple[dict[str, Any], list[float]]:
    """Train one variant and measure it; a failure is reported in its note, never hides the other variants."""
    gc.collect()
    torch.cuda.empty_cache()
    try:
        return measure(model, variant, precision, steps, skip)
    except Exception as err:
        torch.cuda.set_stream(torch.cuda.default_stream())
        failed = as_dict(Result(variant, note=f"failed: {type(err).__name__}: {str(err)[:200]}"))
        return failed, []


def measure(model: str, variant: str, precision: str, steps: int, skip: int) -> tuple[dict[str, Any], list[float]]:
    pl.seed_everything(0, verbose=False)
    module = HFCausalLM(kind=model)
    data = TokenDataModule(
        module.hparams.vocab_size, SEQ_LEN, batch_size=BATCH_SIZE, train_samples=64 * BATCH_SIZE, val_samples=8
    )
    clock = LossClock(min(PARITY_STEPS, steps))
    callbacks: list[pl.Callback] = [clock]
    strategy: Any = "auto"
    if variant in SCOPES:
        callbacks.append(CUDAGraphCallback(scope=SCOPES[variant], warmup_steps=WARMUP_STEPS))
    elif variant == "full_iteration":
        strategy = CUDAGraphStrategy(scope=["full_iteration"], warmup_steps=WARMUP_STEPS)
    elif variant != "eager":
        raise ValueError(f"unknown variant {variant!r}")
    trainer = timing_trainer(steps, callbacks, strategy, precision)
    with peak_memory() as peak:
        trainer.fit(module, data)
    result = Result(variant, clock.step_times(skip), peak_mib=peak(), final_loss=float(clock.last_loss))
    losses = torch.stack(clock.losses).float().tolist() if clock.losses else []
    graph = next((cb for cb in trainer.callbacks if isinstance(cb, CUDAGraphCallback)), None)
    return as_dict(result, graph), losses


def as_dict(result: Result, graph: CUDAGraphCallback | None = None) -> dict[str, Any]:
    """A variant's figures as JSON-ready values (non-finite ones as ``None``), with the package's report."""
    low, high = result.spread_ms
    figures: dict[str, Any] = {
        "variant": result.variant,
        "median_ms": _finite_or_none(result.median_ms),
        "p25_ms": _finite_or_none(low),
        "p75_ms": _finite_or_none(high),
        "steps_timed": len(result.step_ms),
        "peak_mib": _finite_or_none(result.peak_mib),
        "final_loss": _finite_or_none(result.final_loss),
        "note": result.note,
    }
    if graph is not None:
        report = graph.report
        figures["report"] = {
            **report_core(report),
            "scopes": {scope: len(names) for scope, names in report.scopes.items()},
            "parity_err": _finite_or_none(report.parity_err),
        }
    return figures


def report_core(report: Any) -> dict[str, Any]:
    """The fields of the package's report every benchmark keeps, as JSON-ready values."""
    return {
        "stage": report.stage.name,
        "reason": report.reason,
        "captures": report.captures,
        "replays": report.replays,
        "fallbacks": report.fallbacks,
        "rollbacks": report.rollbacks,
        "rollback_reasons": list(report.rollback_reasons),
        "pool_mib": _finite_or_none(report.pool_mib),
        "capture_ms": _finite_or_none(report.capture_ms),
    }


def max_abs_diff(reference: list[float], other: list[float]) -> float:
    """Largest per-step difference over the steps both runs have (``nan`` if either has none)."""
    pairs = list(zip(reference, other, strict=False))
    return max((abs(a - b) for a, b in pairs), default=math.nan)


def progress_line(result: dict[str, Any]) -> str:
    report = result.get("report") or {}
    stage = report.get("stage", "")
    reason = report.get("rollback_reasons") or ([report["reason"]] if report.get("reason") else [])
    why = f" ({reason[0][:100]})" if reason else ""
    return f"{result['variant']:>18}: {_fmt(result['median_ms'], 3):>8} ms/step  {stage}{why} {result['note']}"


# =================================================================== Markdown
def write_markdown(out: Path) -> Path:
    """``HF.md`` from every ``hf_*.json`` in ``out``: one table per model and precision."""
    return write_records_markdown(out / MARKDOWN, "hf", PRECISIONS, "CUDA graphs on Hugging Face models", section)


def section(record: dict[str, Any]) -> str:
    """The Markdown tables of one record (one per model)."""
    env = record["environment"]
    parts = []
    for model, measured in record["models"].items():
        config = measured["config"]
        sizes = (
            f"{config['num_hidden_layers']} layers, width {config['hidden_size']}, {config['num_attention_heads']}"
            f" heads ({config['num_key_value_heads']} KV), vocabulary {config['vocab_size']}"
        )
        if model == "qwen3_moe":
            sizes += f", {config['num_experts']} experts, top-{config['num_experts_per_tok']}"
        parts.append(
            f"## {TITLES.get(model, model)}, {record['precision']}\n\n"
            f"{sizes}; sequence {record['seq_len']}, batch {record['batch_size']}, AdamW, `warmup_steps="
            f"{record['warmup_steps']}`. Median ms per step over {record['steps'] - record['skip']} timed steps of"
            f" {record['steps']} (CUDA events, no host sync per step); loss parity: largest per-step difference from"
            f" eager Lightning over the first {record['parity_steps']} steps. {env['gpu']}, torch {env['torch']},"
            f" lightning {env['lightning']}, transformers {env['transformers']}, {env['date']}.\n\n"
            + table(measured["results"])
        )
    return "\n".join(parts)


def result_note(result: dict[str, Any]) -> str:
    """A variant's note, its rollbacks, and why graphs were off."""
    report = result.get("report") or {}
    reasons = report.get("rollback_reasons") or []
    note = "; ".join(filter(None, [result["note"], *(f"rolled back: {r}" for r in reasons)]))
    if not reasons and report.get("reason"):
        note = "; ".join(filter(None, [note, f"graphs off: {report['reason']}"]))
    return note


def table(results: list[dict[str, Any]]) -> str:
    header = (
        "| variant | ms/step | vs eager | peak MiB | pool MiB | capture ms | stage | replays | fallbacks"
        " | final loss | loss parity | note |\n"
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---|\n"
    )
    rows = []
    for result in results:
        report = result.get("report") or {}
        note = result_note(result)
        speedup = result.get("speedup")
        cells = [
            LABELS.get(result["variant"], result["variant"]),
            _fmt(result["median_ms"], 2),
            "" if speedup is None else f"{speedup:.2f}x",
            _fmt(result["peak_mib"], 0),
            _fmt(report.get("pool_mib"), 0),
            _fmt(report.get("capture_ms"), 0),
            report.get("stage", "").lower(),
            str(report["replays"]) if report else "",
            str(report["fallbacks"]) if report else "",
            _fmt(result["final_loss"], 4),
            "" if result["variant"] == "eager" else _fmt(result.get("loss_max_abs_diff"), None),
            _cell(note, 160),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return header + "\n".join(rows) + "\n"


# =================================================================== helpers
def environment() -> dict[str, str]:
    """The benchmark suite's record of GPU, versions, date and command line, with the transformers version."""
    import transformers

    return {**suite_environment(), "transformers": transformers.__version__}


def _ratio(numerator: float | None, denominator: float | None) -> float:
    if numerator is None or not denominator:
        return math.nan
    return numerator / denominator


def _finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _fmt(value: float | None, digits: int | None) -> str:
    if value is None:
        return ""
    return f"{value:.{digits}f}" if digits is not None else f"{value:.2g}"


def _cell(text: str, limit: int) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


if __name__ == "__main__":
    raise SystemExit(main())
