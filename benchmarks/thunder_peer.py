"""Lightning Thunder as a peer of the benchmarks: the GPT of ``benchmarks/variants.py`` compiled by ``thunder.jit``.

Optional: install it offline with ``bash .whl/thunder/install.sh`` (lightning-thunder 0.2.6 and the dependencies it
adds to a torch image). Nothing here imports thunder until :func:`thunder_variant` runs, so the module imports, and
:func:`thunder_available` answers, without it.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.variants import Result, _cycle, _model_and_data, peak_memory

THUNDER_SKIPPED = "skipped: lightning-thunder not installed"
#: The variant's name in the results.
VARIANT = "thunder"
#: ``thunder.jit``'s executors, by their registered names: PyTorch's SDPA kernels for the attention, torch.compile
#: (Inductor) for every other fusible region; thunder always adds its ``torch`` and ``python`` executors after these.
EXECUTORS = ("sdpa", "torchcompile")
#: Untimed steps before the timed loop, as in ``pytorch_variant``; the first of them traces, compiles and captures.
WARMUP_STEPS = 3
#: Losses kept from the first steps (warmup included), for loss parity with eager Lightning.
PARITY_STEPS = 100
PRECISIONS = ("32-true", "bf16-mixed")


@dataclass
class ThunderResult(Result):
    """:class:`~benchmarks.variants.Result` with Thunder's extra figures.

    Attributes:
        losses: The losses of the first steps (at most ``parity_steps``), warmup steps included: step ``i`` trains
            on batch ``i``, as in a Lightning fit, so they compare with eager Lightning's first losses.
        first_step_s: Wall time of step 1 (tracing, Inductor compiling, CUDA graph capture, the step itself), between
            a sync at its start and one at its end; also in ``capture_ms`` (in ms).
    """

    losses: list[float] = field(default_factory=list)
    first_step_s: float = float("nan")


def thunder_available() -> bool:
    """Whether lightning-thunder is importable (the ``thunder`` variant is skipped without it)."""
    return importlib.util.find_spec("thunder") is not None


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The dtype ``torch.autocast`` runs forward and loss in at ``precision`` (``None``: no autocast).

    Raises:
        ValueError: A precision other than ``32-true`` and ``bf16-mixed``.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return torch.bfloat16 if precision == "bf16-mixed" else None


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss of ``GPTModule.training_step``: cross entropy over every position's next token."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def thunder_variant(
    config: dict[str, Any], precision: str, steps: int, skip: int, parity_steps: int = PARITY_STEPS
) -> ThunderResult:
    """Train the GPT of ``config`` with Thunder in a plain PyTorch loop and measure it like ``pytorch_variant``.

    The model, weights (seed 0) and batches are those of ``pytorch_variant`` (``_model_and_data``); the model is
    compiled by ``thunder.jit(gpt, executors=["sdpa", "torchcompile"], transforms=[CUDAGraphTransform()])``
    (``thunder.transforms.cudagraph.CUDAGraphTransform``: the forward's and the backward's fused regions replayed as
    CUDA graphs, parameters as static inputs). The loss is computed outside the jitted module, as
    ``GPTModule.training_step`` does, and ``loss.backward()`` runs thunder's backward. The optimizer runs eagerly:
    AdamW with ``GPTModule``'s own ``lr`` and ``weight_decay`` (0.0), so the losses compare with eager Lightning's.

    bf16-mixed: ``torch.autocast("cuda", dtype=torch.bfloat16)`` around forward and loss, as Lightning's
    bf16-mixed does. ``thunder.jit`` honours an enclosing autocast (thunder 0.2.6, ``populate_cache_info`` in
    ``thunder/__init__.py`` and ``maybe_apply_autocast`` in ``thunder/transforms/autocast.py``): it reads the autocast
    state at each call, keys its cache on it, and traces linear, matmul and SDPA in bf16, the casts inside the trace;
    the cross entropy outside runs in fp32 under torch's own autocast.

    Timing: ``WARMUP_STEPS`` untimed steps (the first one traces, compiles and captures), then ``steps`` steps with a
    CUDA event at each step start and one at the end, read once at the end (no host sync per step); the step times
    after the first ``skip`` of those are returned. Each step takes the next batch (warmup steps included). The wall
    time of step 1 is in ``first_step_s`` and, in ms, in ``capture_ms``. The note says how many traces thunder made
    (cache misses) and how many CUDA graphs it captured.

    Raises:
        ValueError: An MoE config (``experts``) or an unknown precision, before thunder is imported.
        ImportError: lightning-thunder is not installed.
    """
    if "experts" in config:
        raise ValueError("the thunder peer trains the dense GPT only (the config has 'experts')")
    dtype = autocast_dtype(precision)
    import thunder  # lazy: optional
    from thunder.transforms.cudagraph import CUDAGraphTransform

    model, data = _model_and_data(config)
    device = torch.device("cuda")
    gpt = model.model.to(device)
    data.setup("fit")
    batches = _cycle(data.train_dataloader())
    hp = model.hparams
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
    graphs = CUDAGraphTransform()
    compiled = thunder.jit(gpt, executors=list(EXECUTORS), transforms=[graphs])
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype is not None, cache_enabled=False)

    def step() -> torch.Tensor:
        x, y = _on_device(batches, device)
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = next_token_loss(compiled(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    events: list[torch.cuda.Event] = []
    losses: list[torch.Tensor] = []
    with peak_memory() as peak:
        torch.cuda.synchronize()
        started = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        first_step_s = time.perf_counter() - started
        losses.append(loss)
        for _ in range(WARMUP_STEPS - 1):
            loss = step()
            losses.append(loss)
        for _ in range(steps):
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            events.append(event)
            loss = step()
            if len(losses) < parity_steps:
                losses.append(loss)  # read after the loop: no host sync here
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
    events.append(end)
    times = [a.elapsed_time(b) for a, b in zip(events[skip:-1], events[skip + 1 :], strict=True)]
    kept = losses[:parity_steps]
    captured = len(graphs.cuda_graph_runner.cuda_graph_cache)
    return ThunderResult(
        VARIANT,
        times,
        peak_mib=peak(),
        capture_ms=first_step_s * 1e3,
        final_loss=float(loss),
        note=f"{thunder.cache_misses(compiled)} trace(s), {captured} CUDA graph(s)",
        losses=torch.stack(kept).float().tolist() if kept else [],
        first_step_s=first_step_s,
    )


def _on_device(batches: Iterator[Any], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = next(batches)
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)
