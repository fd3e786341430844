"""Train Hugging Face models (``examples/hf_causal_lm.py``: Llama, Qwen3-MoE) eagerly and through each scope.

    PYTHONPATH=. python benchmarks/hf.py --out benchmarks/results/hf
    PYTHONPATH=. python benchmarks/hf.py --out DIR --precision bf16-mixed --models llama --rounds 2

Per variant: the median ms per step after ``--skip`` steps, the speedup over eager Lightning, and loss parity (the
largest per-step difference from eager's loss over the first 20 steps). Needs transformers>=5 and a CUDA GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import report
from benchmarks.core import records
from benchmarks.core.figures import add_relative
from benchmarks.core.models import HF_BATCH_SIZE, HF_SEQ_LEN, config_of, train
from benchmarks.core.timing import alternate

MODELS = {
    "llama": ("eager", "attn", "attn+mlp", "layer", "full_iteration"),
    "qwen3_moe": ("eager", "attn", "attn+moe_router", "layer", "full_iteration"),
}
PARITY_STEPS = 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="results directory (created if missing)")
    parser.add_argument("--steps", type=int, default=80, help="training steps per variant (default: 80)")
    parser.add_argument("--skip", type=int, default=20, help="steps left out of the timing (default: 20)")
    parser.add_argument("--rounds", type=int, default=1, help="alternated fits per variant (default: 1)")
    parser.add_argument("--precision", choices=("32-true", "bf16-mixed"), default="32-true")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated from {', '.join(MODELS)}")
    args = parser.parse_args(argv)
    if not 0 <= args.skip < args.steps or args.rounds < 1:
        parser.error(
            f"--skip must be at least 0 and below --steps, --rounds at least 1 (got {args.skip}, {args.steps})"
        )
    args.models = records.names(parser, "--models", args.models, list(MODELS))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if records.needs_cuda("hf.py"):
        return 2
    if importlib.util.find_spec("transformers") is None:
        print('benchmarks/hf.py trains Hugging Face models and needs transformers>=5: pip install -e ".[hf]"')
        return 2
    measured = {}
    for model in args.models:
        one_fit = partial(
            train, model, precision=args.precision, steps=args.steps, skip=args.skip, keep_losses=PARITY_STEPS
        )
        fits = alternate(MODELS[model], args.rounds, one_fit)
        add_relative(fits, {fit["variant"]: fit.pop("losses", []) for fit in fits})
        measured[model] = {"config": config_of(model), "results": fits}
    record = {
        "kind": "hf", "precision": args.precision, "steps": args.steps, "skip": args.skip, "rounds": args.rounds,
        "batch_size": HF_BATCH_SIZE, "seq_len": HF_SEQ_LEN, "environment": records.environment(), "models": measured,
    }  # fmt: skip
    report.publish(args.out, records.write(record, args.out / f"hf_{args.precision}.json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
