"""The models the benchmarks train, their batches, and the variants: one way to build and to train each.

Models: the GPT configs of ``examples/gpt.py`` (``small``, ``medium``, ``tiny``; ``moe`` is the MoE GPT of
``examples/moe.py``) and the Hugging Face models of ``examples/hf_causal_lm.py`` (``llama``, ``qwen3_moe``). A variant
names how a model trains: eager Lightning, a fixed scope (``attn``, ``attn+mlp``, ``layer``, ...), the whole step
(``full_iteration``), ``scope="auto"`` (``auto-callback``, ``auto-strategy``), any of them with ``+compile``, a
hand-written capture, ``torch.compile``, or the Transformer Engine GPT.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from typing_extensions import override

from benchmarks.core.figures import finite, spread
from benchmarks.core.timing import StepClock, elapsed_ms, endless_batches, peak_memory, recorded, timing_trainer
from lightning_cudagraph import CUDAGraphCallback, CUDAGraphStrategy

CONFIGS: dict[str, dict[str, Any]] = {
    "small": {"vocab_size": 1024, "seq_len": 128, "n_layer": 6, "width": 256, "heads": 4, "batch_size": 8},
    "medium": {"vocab_size": 1024, "seq_len": 512, "n_layer": 6, "width": 1024, "heads": 16, "batch_size": 8},
    "tiny": {"vocab_size": 256, "seq_len": 64, "n_layer": 4, "width": 128, "heads": 4, "batch_size": 4},
    "moe": {"vocab_size": 1024, "seq_len": 128, "n_layer": 6, "width": 256, "heads": 4, "batch_size": 8, "experts": 4},
}
HF_MODELS = ("llama", "qwen3_moe")
HF_SEQ_LEN, HF_BATCH_SIZE = 128, 8
WARMUP_STEPS = 3
#: Fixed scopes: the scopes each variant captures.
SCOPES = {
    "attn": ["attn"],
    "mlp": ["mlp"],
    "attn+mlp": ["attn", "mlp"],
    "attn+moe_router": ["attn", "moe_router"],
    "layer": ["layer"],
    "moe_router+preprocess": ["moe_router", "moe_preprocess"],
}
PYTORCH_VARIANTS = ("pytorch_eager", "pytorch_block_graphs", "pytorch_full_graph")
TE_VARIANTS = ("te_eager", "te_layer")
OTHER_VARIANTS = ("eager", "full_iteration", "layer-strategy", "auto-callback", "auto-strategy", "handwritten_layer")
COMPILE_VARIANTS = ("compile_default", "compile_reduce_overhead")
KNOWN_VARIANTS = (*OTHER_VARIANTS, *SCOPES, *PYTORCH_VARIANTS, *TE_VARIANTS, *COMPILE_VARIANTS)
TE_SKIPPED = "skipped: Transformer Engine not installed"


def model_args(config: dict[str, Any]) -> dict[str, Any]:
    """A GPT config's constructor arguments (``experts`` only where the config has it)."""
    keys = ("vocab_size", "seq_len", "n_layer", "width", "heads", "experts")
    return {key: config[key] for key in keys if key in config}


def config_of(model: str, batch_size: int | None = None) -> dict[str, Any]:
    """What a model is: its constructor arguments, sequence and batch (``kind`` for the Hugging Face ones)."""
    if model in HF_MODELS:
        return {"kind": model, "seq_len": HF_SEQ_LEN, "batch_size": batch_size or HF_BATCH_SIZE}
    return {**CONFIGS[model], "batch_size": batch_size or CONFIGS[model]["batch_size"]}


def build(model: str, variant: str = "eager", batch_size: int | None = None) -> tuple[Any, Any]:
    """The seeded LightningModule and its data: the same weights and batches for every variant.

    Raises:
        ModuleNotFoundError: The Transformer Engine GPT without Transformer Engine (the variant is skipped).
    """
    from examples.gpt import TokenDataModule

    config = config_of(model, batch_size)
    pl.seed_everything(0, verbose=False)
    if model in HF_MODELS:
        from examples.hf_causal_lm import HFCausalLM

        module: Any = HFCausalLM(kind=model)  # type: ignore[arg-type]
        vocab = module.hparams.vocab_size
    else:
        module = module_class(model, variant)(**model_args(config))
        vocab = config["vocab_size"]
    batch = config["batch_size"]
    data = TokenDataModule(vocab, config["seq_len"], batch_size=batch, train_samples=64 * batch, val_samples=8)
    return module, data


def module_class(model: str, variant: str = "eager") -> type[pl.LightningModule]:
    """The GPT a variant trains: the MoE GPT for ``moe``, the Transformer Engine GPT for the ``te_*`` variants."""
    from examples.gpt import GPTModule

    if variant in TE_VARIANTS:
        if importlib.util.find_spec("transformer_engine") is None:
            raise ModuleNotFoundError("No module named 'transformer_engine'", name="transformer_engine")
        from examples.te_gpt import TEGPTModule

        return TEGPTModule
    if "experts" in CONFIGS.get(model, {}):
        from examples.moe import MoEGPTModule

        return MoEGPTModule
    return GPTModule


def setup(variant: str) -> tuple[dict[str, Any] | None, Any]:
    """How a Lightning variant trains: the ``CUDAGraphCallback`` options (``None``: none) and the strategy.

    Raises:
        ValueError: A variant that is not a Lightning variant of the package or eager.
    """
    base, compiled = variant.removesuffix("+compile"), variant.endswith("+compile")
    # Regions stay uncompiled under compile=True (they lost to plain graphs): a compiled level opts its regions in.
    extra: dict[str, Any] = {"compile": True if base == "full_iteration" else {"regions": True}} if compiled else {}
    if compiled and base not in SCOPES and base not in ("full_iteration", "layer-strategy"):
        raise ValueError(f"{variant!r}: only a fixed scope or the whole step takes +compile")
    if base in ("eager", "te_eager", "handwritten_layer", *COMPILE_VARIANTS):
        return None, "auto"
    if base in SCOPES:
        return {"scope": SCOPES[base], "warmup_steps": WARMUP_STEPS, **extra}, "auto"
    if base == "te_layer":
        return {"impl": "transformer_engine", "scope": ["layer"], "warmup_steps": WARMUP_STEPS}, "auto"
    if base == "full_iteration":
        return None, CUDAGraphStrategy(scope=["full_iteration"], warmup_steps=WARMUP_STEPS, **extra)
    if base == "layer-strategy":
        return None, CUDAGraphStrategy(scope=["layer"], warmup_steps=WARMUP_STEPS, **extra)
    if base == "auto-callback":
        return {}, "auto"
    if base == "auto-strategy":
        return None, "cudagraph"
    raise ValueError(f"unknown variant {variant!r}; known: {', '.join(KNOWN_VARIANTS)} (scoped ones with +compile)")


def graph_callback(trainer: pl.Trainer) -> CUDAGraphCallback | None:
    """The Trainer's ``CUDAGraphCallback`` (the one a strategy adds included), or ``None``."""
    callbacks: list[pl.Callback] = trainer.callbacks  # type: ignore[attr-defined]
    return next((cb for cb in callbacks if isinstance(cb, CUDAGraphCallback)), None)


def report_figures(callback: CUDAGraphCallback | None) -> dict[str, Any] | None:
    """What the benchmarks keep of the package's report, JSON-ready (``None`` without the package)."""
    if callback is None:
        return None
    report = callback.report
    counts = ("captures", "replays", "steps_replayed", "fallbacks", "rollbacks", "recompiles", "audits")
    figures = ("pool_mib", "capture_ms", "capture_ms_total", "parity_err", "compile_s")
    return {
        "stage": report.stage.name, "reason": report.reason, "level": report.level,
        "scopes": {scope: len(found) for scope, found in report.scopes.items()},
        **{name: getattr(report, name) for name in counts}, **{name: finite(getattr(report, name)) for name in figures},
        "rollback_reasons": list(report.rollback_reasons), "exclusions": dict(report.exclusions),
        "ladder": [{"level": row.level, "status": row.status, "step_ms": finite(row.step_ms),
                    "capture_ms": finite(row.capture_ms), "steps": row.steps, "reason": row.reason}
                   for row in report.ladder],
    }  # fmt: skip


class HandwrittenBlockGraphs(pl.Callback):
    """The reference a user writes by hand: the blocks graphed with ``make_graphed_callables`` after warmup."""

    def __init__(self) -> None:
        self.capture_ms: float | None = None

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, idx: int) -> None:
        if trainer.global_step != WARMUP_STEPS:
            return
        blocks, config = tuple(pl_module.model.blocks), pl_module.hparams
        samples = block_samples(len(blocks), (batch[0].shape[0], config.seq_len, config.width))
        started = time.perf_counter()
        bf16 = str(trainer.precision).startswith("bf16")
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False, enabled=bf16):
            torch.cuda.make_graphed_callables(blocks, samples)
        self.capture_ms = (time.perf_counter() - started) * 1e3


def block_samples(count: int, shape: tuple[int, ...]) -> tuple[tuple[torch.Tensor], ...]:
    """One sample input per block: each becomes that block's static input, which its backward graph reads, so one
    tensor shared by every block would be overwritten by later blocks before the first block's backward runs."""
    return tuple((torch.randn(*shape, device="cuda", requires_grad=True),) for _ in range(count))


def train(
    model: str,
    variant: str,
    precision: str,
    steps: int,
    skip: int,
    keep_losses: int = 0,
    batch_size: int | None = None,
    callbacks: tuple[pl.Callback, ...] = (),
) -> dict[str, Any]:
    """Train one variant of one model and measure it: step times after ``skip``, memory, losses, the report.

    Args:
        model: A GPT config or a Hugging Face model.
        variant: How it trains (:data:`KNOWN_VARIANTS`).
        precision: Lightning's precision.
        steps: Training steps.
        skip: Steps left out of the timing (warmup, capture).
        keep_losses: How many first losses to keep for loss parity.
        batch_size: Another batch size than the model's.
        callbacks: More callbacks, after the clock and before the package's.
    """
    if variant in PYTORCH_VARIANTS:
        return pytorch_loop(model, variant, precision, steps, skip, batch_size)
    try:
        module, data = build(model, variant, batch_size)
    except ModuleNotFoundError as err:
        if variant in TE_VARIANTS and (err.name or "").startswith("transformer_engine"):
            return {"variant": variant, "median_ms": None, "note": TE_SKIPPED}
        raise
    if variant == "compile_reduce_overhead":
        module.model = torch.compile(module.model, mode="reduce-overhead")
    elif variant == "compile_default":
        module.model = torch.compile(module.model)
    options, strategy = setup(variant)
    clock = StepClock(keep_losses)
    handwritten = HandwrittenBlockGraphs() if variant == "handwritten_layer" else None
    extra = [cb for cb in (handwritten,) if cb is not None]
    graph = [] if options is None else [CUDAGraphCallback(**options)]
    trainer = timing_trainer(steps, [clock, *callbacks, *extra, *graph], strategy, precision)
    with peak_memory() as peak:
        trainer.fit(module, data)
    report = report_figures(graph_callback(trainer))
    return {
        "variant": variant,
        "batch_size": config_of(model, batch_size)["batch_size"],
        **spread(clock.step_times(skip)),
        "host_ms": clock.host_median_ms(skip),
        "peak_mib": finite(peak()),
        "final_loss": finite(float(clock.last_loss)) if clock.last_loss is not None else None,
        "pool_mib": None if report is None else report["pool_mib"],
        "capture_ms": handwritten.capture_ms if handwritten else (None if report is None else report["capture_ms"]),
        "note": "",
        "report": report,
        "losses": clock.first_losses(),
    }


def pytorch_loop(
    model: str, variant: str, precision: str, steps: int, skip: int, batch_size: int | None
) -> dict[str, Any]:
    """The same GPT, data and optimizer in a plain PyTorch loop: eager, per-block graphs, or a whole-step graph."""
    module, data = build(model, "eager", batch_size)
    gpt: Any = module.model.cuda()
    batches = endless_batches(data)
    whole_step = variant == "pytorch_full_graph"
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

    events, capture_ms, run = [], None, step
    try:
        with peak_memory() as peak:
            static_x, static_y = (t.cuda() for t in next(batches))
            for _ in range(WARMUP_STEPS):
                loss = step(static_x, static_y)
            started = time.perf_counter()
            if variant == "pytorch_block_graphs":
                samples = block_samples(len(gpt.blocks), (*static_x.shape, gpt.tok_emb.embedding_dim))
                with autocast:
                    torch.cuda.make_graphed_callables(tuple(gpt.blocks), samples)
            elif whole_step:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=side):
                    static_loss = step(static_x, static_y)

                def run(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                    static_x.copy_(x, non_blocking=True)
                    static_y.copy_(y, non_blocking=True)
                    graph.replay()
                    return static_loss.clone()

            if variant != "pytorch_eager":
                capture_ms = (time.perf_counter() - started) * 1e3
            for _ in range(steps):
                events.append(recorded())
                loss = run(*(t.cuda(non_blocking=True) for t in next(batches)))
            times = elapsed_ms([*events, recorded()], skip)
    finally:
        torch.cuda.set_stream(torch.cuda.default_stream())
    return {
        "variant": variant,
        "batch_size": config_of(model, batch_size)["batch_size"],
        **spread(times),
        "peak_mib": finite(peak()),
        "final_loss": finite(float(loss)),
        "capture_ms": capture_ms,
        "note": "",
        "losses": [],
    }
