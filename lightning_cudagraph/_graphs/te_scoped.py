"""The scoped driver with Transformer Engine's capture: FP8 recipes, and FP8 weights cached across micro-batches."""

from __future__ import annotations

import functools
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_cudagraph._graphs.routing import GraphSet, StepRoute
from lightning_cudagraph._graphs.scoped import ScopedDriver
from lightning_cudagraph._trust.tolerance import forward_tolerance


class TEScopedDriver(ScopedDriver):
    """Scoped graphs captured by ``transformer_engine.pytorch.make_graphed_callables``.

    With FP8 and gradient accumulation (automatic optimization), weights are quantized once per optimizer step:
    an :class:`~lightning_cudagraph._backend.te.FP8WeightCache` tells each micro-batch whether it starts the window.
    """

    def __init__(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from lightning_cudagraph._backend.te import FP8WeightCache, capture_te_regions, fp8_recipe_of

        recipe = fp8_recipe_of(trainer.precision_plugin)
        self.fp8 = recipe is not None
        cache_weights = (
            self.fp8 and trainer.accumulate_grad_batches > 1 and trainer.lightning_module.automatic_optimization
        )
        self.weight_cache = FP8WeightCache() if cache_weights else None
        if self.weight_cache is not None:
            rank_zero_info(
                f"{self.component}: FP8 weights are quantized once per optimizer step and reused by the other"
                f" {trainer.accumulate_grad_batches - 1} micro-batch(es) of each accumulation window"
            )
        self.capture_method = functools.partial(capture_te_regions, fp8_recipe=recipe, weight_cache=self.weight_cache)

    def _begin_graphed_step(self, graph_set: GraphSet, step: int, confirming: bool, accumulating: bool) -> None:
        if self.weight_cache is not None:
            self.weight_cache.begin_microbatch(graph_set.batch, step)
        super()._begin_graphed_step(graph_set, step, confirming, accumulating)

    def _after_step(self, route: StepRoute) -> None:
        # Cached FP8 weights are trusted only after a micro-batch on which every region replayed.
        if self.weight_cache is not None and route.graph_set is not None:
            every_region_replayed = route.replays >= len(route.graph_set.entries) and route.fallbacks == 0
            self.weight_cache.end_microbatch(every_region_replayed)

    def parity_tolerance(self) -> float:
        """FP8's tolerance when FP8 is on and ``parity_tol`` was not given."""
        if self.fp8:  # E4M3 keeps 3 mantissa bits
            return forward_tolerance(self.config.parity_tol, reduced=True, fp8=True)
        return super().parity_tolerance()
