"""Per-step host cost of scoped graphs: the package's routed replay against a bare call of the same regions.

    PYTHONPATH=. python benchmarks/host_cost.py                       # CPU: the fake backend's thin regions
    PYTHONPATH=. python benchmarks/host_cost.py --device cuda         # GPU: real graphs (CUDABackend)
    PYTHONPATH=. python benchmarks/host_cost.py --shapes gpt8,llama4 --steps 120 --rounds 3

Three fits per model shape, alternated in turns: ``eager`` (no package), ``bare`` (the same backend captures
the layers once after warmup and each layer's ``forward`` becomes a direct call of its region: no routing, no
checks) and ``package`` (``CUDAGraphCallback(scope=["layer"])``). On a CPU the regions are thin: a replay runs the
module's original forward, so ``bare`` costs what eager costs plus one call, and ``package - bare`` is the
package's own Python per step. On CUDA the regions are real graphs. A step's host time is the host clock between
consecutive batch starts (median over the steady steps; on CUDA a small model's step is paced by the host).
Shapes: the test decoder with 4, 8 and 16 layers called positionally (``gpt*``), one whose layers are called with
keywords (``gpt8_kw``), and a Hugging Face Llama whose layers take many keyword arguments (``llama4``).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

# Appended, not prepended: ``PYTHONPATH=OTHER:.`` measures another copy of the package (an older commit's) the same way.
sys.path.append(str(Path(__file__).resolve().parent.parent))

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_cudagraph import CUDAGraphCallback
from lightning_cudagraph._backend.backend import CaptureBackend, CapturePassResult, RecordedCall
from lightning_cudagraph._options.scopes import Target
from lightning_cudagraph._trust.recording import WarmupRecorder
from tests.fake_backend import FakeBackend
from tests.models import Block, Decoder, DecoderModule, decoder

WARMUP = 3
VARIANTS = ("eager", "bare", "package")
CPU_SIZE = {"vocab_size": 32, "seq_len": 8, "width": 16, "heads": 2}
CUDA_SIZE = {"vocab_size": 256, "seq_len": 32, "width": 64, "heads": 2}
SHAPES = ("gpt4", "gpt8", "gpt16", "gpt8_kw", "llama4")


class ThinRegion:
    """A region that runs the module's original forward (the CPU stand-in of a graph: no copies, no hooks)."""

    def __init__(self, call: RecordedCall) -> None:
        self.name, self.module, self.signature, self._forward = call.name, call.module, call.signature, call.forward
        self.addresses = {n: t.data_ptr() for n, t in [*call.module.named_parameters(), *call.module.named_buffers()]}
        self.on_backward = None

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self._forward(*args, **kwargs)

    def replay_forward_detached(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        with torch.no_grad():
            out = self._forward(*args, **kwargs)
        return [leaf.detach() for leaf in torch.utils._pytree.tree_leaves(out) if isinstance(leaf, torch.Tensor)]

    def detach_accumulated_grads(self) -> None:
        """Nothing is adopted: gradients are autograd's own."""

    def reset(self) -> None:
        """Nothing is held."""


class ThinBackend(FakeBackend):
    """The fake backend with thin regions: what a replay costs on the host is the package's Python alone."""

    def capture_regions(self, calls: Any, warmup_iters: int, capture: Any = None) -> CapturePassResult:
        return CapturePassResult([ThinRegion(call) for call in calls])


class KeywordBlock(Block):
    """A block called with keywords and constants, as many real layers are."""

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
        return super().forward(x) * scale


class KeywordDecoder(Decoder):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok_emb(idx) + self.pos_emb(self.positions[: idx.shape[1]]))
        for block in self.blocks:
            x = block(x=x, mask=None, scale=1.0)
        return self.head(self.ln_f(x))


class KeywordModule(DecoderModule):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model.__class__ = KeywordDecoder
        for block in self.model.blocks:
            block.__class__ = KeywordBlock


def build(shape: str, device: str) -> tuple[pl.LightningModule, Any, list[torch.nn.Module]]:
    """A model of ``shape``, its data, and its layers (what ``scope=["layer"]`` captures)."""
    size = CPU_SIZE if device == "cpu" else CUDA_SIZE
    samples = {"train_samples": 4 * 400, "batch_size": 4}
    if shape.startswith("llama"):
        from tests.hf_models import hf_causal_lm

        hf = {"hidden_size": size["width"], "intermediate_size": 2 * size["width"], "num_attention_heads": 2}
        hf.update(num_key_value_heads=2, head_dim=size["width"] // 2, num_hidden_layers=int(shape[5:]))
        module, data = hf_causal_lm("llama", vocab_size=size["vocab_size"], seq_len=size["seq_len"], **hf, **samples)
        return module, data, list(module.model.model.layers)
    layers = int(shape[3:].removesuffix("_kw"))
    cls = KeywordModule if shape.endswith("_kw") else DecoderModule
    module, data = decoder({**size, "n_layer": layers}, module=cls, **samples)
    return module, data, list(module.model.blocks)


class BareRegions(pl.Callback):
    """The thinnest wrapper: after warmup, each layer's ``forward`` is a direct call of its region.

    One eager step records the layers' calls (the package's recorder, for keyword and constant arguments); the
    backend captures them; nothing is checked or routed per call.
    """

    def __init__(self, backend: CaptureBackend, layers: list[torch.nn.Module]) -> None:
        self.backend, self.layers = backend, layers
        self.recorder = WarmupRecorder([Target(f"layer{i}", m, "layer") for i, m in enumerate(layers)])
        self.regions: list[Any] = []
        self._hooks: list[Any] = []

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.backend.enter()

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, idx: int) -> None:
        if trainer.global_step == WARMUP - 1:
            self.recorder.begin_step(("bare",), keep_samples=True)
            for index, layer in enumerate(self.layers):
                record = self.recorder.record
                hook = layer.register_forward_pre_hook(lambda m, a, k, i=index, r=record: r(i, a, k), with_kwargs=True)
                self._hooks.append(hook)
        elif trainer.global_step == WARMUP:
            plan = self.recorder.plan(set(), ("bare",))
            with self.backend.preserved(self.layers):
                result = self.backend.capture_regions(plan.calls, warmup_iters=3)
            if result.failed:
                raise RuntimeError(f"bare capture failed: {result.failed}")
            self.regions = result.regions
            for region in self.regions:
                region.module.forward = lambda *a, _r=region, **k: _r(a, k)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if self._hooks:
            self.recorder.end_step()
            for hook in self._hooks:
                hook.remove()
            self._hooks = []

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for region in self.regions:
            region.module.__dict__.pop("forward", None)
            region.reset()
        self.backend.leave()
        self.backend.release()


class HostClock(pl.Callback):
    """The host clock at every batch start (a device sync only at the first and last timed steps)."""

    def __init__(self, skip: int, steps: int) -> None:
        self.skip, self.steps, self.starts = skip, steps, []

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, idx: int) -> None:
        if trainer.global_step in (self.skip, self.steps - 1) and torch.cuda.is_available():
            torch.cuda.synchronize()
        self.starts.append(time.perf_counter() if torch.cuda.is_available() else time.thread_time())

    def step_us(self) -> float:
        gaps = [(b - a) * 1e6 for a, b in itertools.pairwise(self.starts[self.skip :])]
        return statistics.median(gaps)


def make_backend(device: str) -> CaptureBackend:
    if device == "cpu":
        return ThinBackend()
    from lightning_cudagraph._backend.cuda import CUDABackend

    return CUDABackend(torch.device("cuda"))


def fit_once(shape: str, variant: str, device: str, steps: int, skip: int) -> dict[str, Any]:
    module, data, layers = build(shape, device)
    clock = HostClock(skip, steps)
    callbacks: list[pl.Callback] = [clock]
    package = None
    if variant == "bare":
        callbacks.append(BareRegions(make_backend(device), layers))
    elif variant == "package":
        package = CUDAGraphCallback(scope=["layer"], warmup_steps=WARMUP)
        if device == "cpu":
            package.capture_backend = ThinBackend()
        callbacks.append(package)
    trainer = pl.Trainer(
        accelerator=device, devices=1, max_steps=steps, callbacks=callbacks, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        log_every_n_steps=50,
    )  # fmt: skip
    trainer.fit(module, data)
    figures = {"us": clock.step_us(), "layers": len(layers)}
    if package is not None:
        report = package.report
        figures.update(stage=report.stage.name, replays=report.replays, fallbacks=report.fallbacks)
        figures.update(capture_ms=report.capture_ms_total, graphs=report.graphs)
    return figures


#: The GPT of ``examples/gpt.py`` at the small size (width 256, 4 heads, seq 128, batch 8) with 4, 8 and 16 layers.
GPT_LAYERS = {"gpt4": 4, "gpt8": 8, "gpt16": 16}
#: The package's ``scope=["layer"]`` through the callback and through the strategy, and the hand-written capture.
PACKAGE_LAYER, HANDWRITTEN = ("layer", "layer-strategy"), "handwritten_layer"


def versus_handwritten(rounds: int, steps: int, skip: int) -> dict[str, Any]:
    """``scope=["layer"]`` against a hand-written per-layer ``make_graphed_callables`` in Lightning, on the GPU.

    ``layer`` is ``CUDAGraphCallback(scope=["layer"])``: the same graphs as the hand-written capture, the optimizer
    step eager. ``layer-strategy`` is ``CUDAGraphStrategy(scope=["layer"])``, which also replays the optimizer step
    as a graph. Each round fits all three on each shape, the order reversed every other round; a round's ratio is a
    package variant's median over the hand-written one's (CUDA-event step times). Returns the record :func:`main`
    writes with ``--out``: per shape, every round's figures.
    """
    from benchmarks.core import models
    from benchmarks.core.figures import finite
    from benchmarks.core.timing import in_turns, median_of_rounds, ratio_per_round, round_ms

    for name, layers in GPT_LAYERS.items():
        models.CONFIGS[name] = {**models.CONFIGS["small"], "n_layer": layers}
    shapes: dict[str, dict[str, Any]] = {}
    for name in GPT_LAYERS:
        fits = in_turns(
            (*PACKAGE_LAYER, HANDWRITTEN),
            rounds,
            lambda variant, name=name: models.train(name, variant, "32-true", steps, skip),
            lambda index, fit, name=name: f"[{name} {index}] {fit['variant']}: {fit['median_ms']:.3f} ms/step",
        )
        captures = {variant: [fit["capture_ms"] or float("nan") for fit in got] for variant, got in fits.items()}
        # Step time against the hand-written capture's (under 1: the package's step is shorter).
        ratios = {variant: ratio_per_round(fits, variant, HANDWRITTEN) for variant in PACKAGE_LAYER}
        shapes[name] = {
            "layers": GPT_LAYERS[name], "round_ms": round_ms(fits), "median_ms": median_of_rounds(fits),
            "ratio": {variant: statistics.median(got) for variant, got in ratios.items()}, "ratios": ratios,
            "capture_ms": {variant: finite(statistics.median(got)) for variant, got in captures.items()},
            "stages": sorted({(fit["report"] or {}).get("stage", "?") for v in PACKAGE_LAYER for fit in fits[v]}),
        }  # fmt: skip
    print("| shape | variant | ms | handwritten ms | ratio (median) | rounds | capture ms (package, hand) |")
    print("|---|---|---|---|---|---|---|")
    for name, got in shapes.items():
        for variant in PACKAGE_LAYER:
            print(
                f"| {name} | {variant} | {got['median_ms'][variant]:.3f} | {got['median_ms'][HANDWRITTEN]:.3f} |"
                f" {got['ratio'][variant]:.3f}x | {' '.join(f'{r:.3f}' for r in got['ratios'][variant])} |"
                f" {got['capture_ms'][variant]}, {got['capture_ms'][HANDWRITTEN]} |"
            )
    return {"kind": "handwritten", "steps": steps, "timed": steps - skip, "rounds": rounds, "shapes": shapes}


def capture_times(rounds: int, steps: int) -> None:
    """Capture ms of the small GPT's ``layer`` level: the previous capture path against today's, alternated."""
    from benchmarks.core import models
    from benchmarks.core.timing import fresh_device
    from lightning_cudagraph._backend import capture
    from lightning_cudagraph._graphs import base

    figures: dict[str, list[tuple[float, str]]] = {"previous": [], "now": []}
    warmups = {"previous": 3, "now": base.CAPTURE_WARMUP_ITERS}
    for _ in range(rounds):
        for path in figures:
            previous = path == "previous"
            capture._PREVIOUS_CAPTURE, base.CAPTURE_WARMUP_ITERS = previous, warmups[path]
            fresh_device()
            try:
                fit = models.train("small", "layer", "32-true", steps, min(steps - 1, 10))
            finally:
                capture._PREVIOUS_CAPTURE, base.CAPTURE_WARMUP_ITERS = False, warmups["now"]
            report = fit["report"] or {}
            figures[path].append((report.get("capture_ms") or float("nan"), report.get("stage") or "?"))
    print("| capture path | capture ms (median of rounds) | regions | ms per region (fwd + bwd graph) | stage |")
    print("|---|---|---|---|---|")
    regions = models.CONFIGS["small"]["n_layer"]
    for path, rows in figures.items():
        ms = statistics.median(row[0] for row in rows)
        rounds_ms, stages = ", ".join(f"{r[0]:.1f}" for r in rows), ", ".join(sorted({str(r[1]) for r in rows}))
        print(f"| {path} | {ms:.1f} ({rounds_ms}) | {regions} | {ms / regions:.2f} | {stages} |")


def profile_steps(shape: str, device: str, steps: int, skip: int, top: int = 25) -> None:
    """cProfile of ``bare`` and ``package`` fits: the functions the package's fit spends more host time in, per step."""
    import cProfile
    import pstats

    per_step: dict[str, dict[tuple[str, int, str], float]] = {}
    for variant in ("bare", "package"):
        fit_once(shape, variant, device, skip, skip // 2)  # imports and first-use costs out of the profile
        profiler = cProfile.Profile()
        profiler.enable()
        fit_once(shape, variant, device, steps, skip)
        profiler.disable()
        stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
        per_step[variant] = {key: value[2] / steps * 1e6 for key, value in stats.items()}
    rows = sorted(((us - per_step["bare"].get(key, 0.0), key) for key, us in per_step["package"].items()), reverse=True)
    print(f"| function ({shape}, {device}) | package - bare, us/step of own time |")
    print("|---|---|")
    for extra, (file, line, name) in rows[:top]:
        print(f"| {file.split('site-packages/')[-1].split('/work/main/')[-1]}:{line}({name}) | {extra:+.1f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--handwritten", action="store_true", help="GPU: layer against a hand-written capture")
    parser.add_argument("--capture", action="store_true", help="GPU: capture ms, the previous path against today's")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="of the host-cost table")
    parser.add_argument("--profile", action="store_true", help="the functions the package adds host time in")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--skip", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, help="--handwritten: write handwritten.json into this directory")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("host_cost.py --device cuda needs CUDA")
        return 2
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        __import__("logging").getLogger(name).setLevel("ERROR")
    if args.device == "cpu":
        torch.set_num_threads(1)
    if args.handwritten or args.capture:
        if not torch.cuda.is_available():
            print("--handwritten and --capture need CUDA")
            return 2
        if args.handwritten:
            record = versus_handwritten(args.rounds, args.steps, args.skip)
            if args.out is not None:
                from benchmarks.core import records

                record["environment"] = records.environment()
                print(f"wrote {records.write(record, args.out / 'handwritten.json')}")
        if args.capture:
            capture_times(args.rounds, min(args.steps, 40))
        return 0
    variants = [v for v in args.variants.split(",") if v]
    if args.profile:
        for shape in args.shapes.split(","):
            profile_steps(shape, args.device, args.steps, args.skip)
        return 0
    shapes = [s for s in args.shapes.split(",") if s]
    print(f"package: {Path(sys.modules['lightning_cudagraph'].__file__).parent}")
    print("| shape | layers | eager us | bare us | package us | package - bare us/step | per call us | stage |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in shapes:
        rounds: dict[str, list[dict[str, Any]]] = {variant: [] for variant in variants}
        for _ in range(args.rounds):
            for variant in variants:
                rounds[variant].append(fit_once(shape, variant, args.device, args.steps, args.skip))
        us = {variant: statistics.median(fit["us"] for fit in fits) for variant, fits in rounds.items()}
        us.setdefault("eager", float("nan"))
        last = rounds["package"][-1]
        extra = us["package"] - us["bare"]
        layers = last["layers"]
        print(
            f"| {shape} | {layers} | {us['eager']:.0f} | {us['bare']:.0f} | {us['package']:.0f} | {extra:+.0f} |"
            f" {extra / layers:+.1f} | {last['stage']} replays={last['replays']} fallbacks={last['fallbacks']}"
            f" capture_ms={last['capture_ms']:.1f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
