"""The Lightning callback of the staged rollout.

Thin Lightning hooks that hand each event to the staged rollout (:mod:`lightning_cudagraph.rollout`).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_cudagraph.config import CUDAGraphConfig, config_error, takes_graph_options
from lightning_cudagraph.environment import ensure_graph_safe_allocator
from lightning_cudagraph.graphs.backend import CaptureBackend
from lightning_cudagraph.health import CUDAGraphReport
from lightning_cudagraph.rollout import Rollout


class CUDAGraphCallback(Callback):
    r"""Train with CUDA graphs, rolled out in stages so a graph is trusted only once it is shown to be right.

    After ``warmup_steps`` eager optimizer steps (which record every target's input signature and the eager step
    time), the target modules are captured into CUDA graphs in execution order, sharing one memory pool. The first
    ``confirm_steps`` steps after capture are checked: the graphs ran, a graphed forward matches the eager forward
    on the same inputs, parameters and buffers are still the tensors that were captured, the backward order fits
    the shared pool, losses are finite, the pool fits ``max_pool_mib``. Then the graphs replay with no host sync
    per step. Any failed check rolls back to eager training, loudly (``on_failure="eager"``), or raises
    (``on_failure="raise"``). Graphs are released on fit end, on early stopping and on every exception (Ctrl-C
    included), after which the model is exactly as it was.

    Logged Metrics (through every logger of the Trainer, every ``log_every_n_steps``, rank zero):
        ``cudagraph/stage`` (0 eager warmup, 1 confirming, 2 replaying, -1 rolled back or disabled),
        ``cudagraph/graphs``, ``cudagraph/replays``, ``cudagraph/fallbacks``, ``cudagraph/capture_ms``,
        ``cudagraph/pool_mib``, ``cudagraph/step_ms``, ``cudagraph/eager_step_ms``, ``cudagraph/speedup``,
        ``cudagraph/parity_err``, ``cudagraph/rollbacks``, ``cudagraph/captures``, ``cudagraph/evictions``,
        ``cudagraph/hit_rate``, ``cudagraph/capture_ms_total`` and, under ``scope="auto"``, ``cudagraph/level``.
        The same figures, the levels tried, and the reasons behind fallbacks, exclusions and rollbacks are in
        :attr:`report`.

    Args:
        impl: ``"local"`` (PyTorch graphs), ``"transformer_engine"`` (Transformer Engine graphs, FP8-aware) or
            ``"none"`` (everything off).
        scope: ``"auto"`` (try the levels ``attn``, ``attn+mlp``, ``layer`` and, with one of the package's
            strategies, the whole step; keep the fastest: :mod:`lightning_cudagraph.ladder`), or a list from
            ``full_iteration, attn, mlp, moe, moe_router, moe_preprocess, mamba, layer`` and the keys of
            ``modules``. ``full_iteration`` captures the whole training step and needs
            :class:`~lightning_cudagraph.CUDAGraphStrategy`.
        warmup_steps: Eager optimizer steps before capture (at least one step always runs eagerly).
        modules: Per-scope selectors that override the built-in patterns, or define new scopes: a glob on
            qualified module names (``"blocks.*.attn"``), an ``nn.Module`` subclass, or a predicate
            ``(name, module) -> bool``; or a list of these.
        on_shape_change: What a batch of another shape does once graphs exist: ``"eager"`` (that step runs eagerly,
            counted), ``"recapture"`` (the shape gets its own eager step, capture and confirmation; the
            ``max_graphs`` least recently used graph sets are kept, others evicted and captured again when their
            shape returns) or ``"error"``. Pad batches to a few lengths (:mod:`lightning_cudagraph.bucketing`).
        on_failure: ``"eager"`` (roll back and keep training eagerly, with a warning) or ``"raise"``.
        max_graphs: Most graph sets (batch shapes) held with ``on_shape_change="recapture"`` (at least 2; 4 when
            not given). Only with ``"recapture"``: the other policies keep one graph set.
        confirm_steps: Steps after capture that are checked before the graphs are trusted.
        parity_tol: Largest relative difference allowed between graphed and eager forwards, at most 0.25 (above
            that the check could not tell a wrong graph from a right one); by default 1e-4 in float32, 2e-2 under
            autocast and 0.125 under FP8.
        max_pool_mib: Memory budget of the graphs' pool in MiB (``None``: no limit).
        seal_after_steps: From this optimizer step on, the set of batch shapes is closed: a shape without graphs
            raises, naming it and the captured shapes (``None``: never; :meth:`seal` closes it by hand).

    Raises:
        ValueError: On an option or combination that cannot work, naming the value, what is allowed and the fix.

    Example::

        >>> import lightning.pytorch as pl
        >>> from lightning_cudagraph import CUDAGraphCallback
        >>> callback = CUDAGraphCallback(scope=["attn", "mlp"], warmup_steps=3)
        >>> trainer = pl.Trainer(callbacks=[callback], max_steps=10, logger=False, enable_checkpointing=False)
        >>> callback.report.stage  # after trainer.fit(...): Stage.REPLAYING on a GPU, Stage.DISABLED on a CPU
        <Stage.WARMUP: 0>
    """

    #: The capture backend for the next fit; ``None`` uses CUDA on a CUDA device. A test double or another
    #: accelerator's backend (:class:`~lightning_cudagraph.graphs.backend.CaptureBackend`) can be set here.
    capture_backend: CaptureBackend | None = None

    @takes_graph_options
    def __init__(self, config: CUDAGraphConfig) -> None:
        self.config = config
        #: Named in messages and errors: this class, or the strategy that added the callback.
        self.component = type(self).__name__
        if config.enabled:
            ensure_graph_safe_allocator(self.component)
        self.rollout = Rollout(config, self.component)

    def seal(self, self_check: bool = True) -> None:
        """Close the set of batch shapes now: from the next step on, a shape without graphs raises.

        Args:
            self_check: Confirm every captured shape once more on its next step (scoped graphs: a graphed forward
                against the eager forward on the same inputs), rolling back if one no longer agrees.
        """
        self.rollout.seal(self_check)

    @property
    def report(self) -> CUDAGraphReport:
        """What the rollout measured and decided (stage, counters, timings, reasons)."""
        return self.rollout.report

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(scope=list(self.config.scope), impl=self.config.impl)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            # Each fit starts fresh (resume restores the counters).
            self.rollout = Rollout(self.config, self.component, self.capture_backend)
            _refuse_a_second_callback(trainer, self)
            self.rollout.setup(trainer, pl_module)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rollout.fit_start(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rollout.train_start(trainer)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.rollout.batch_start(trainer, batch)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.rollout.batch_end(trainer, pl_module, outputs)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rollout.abandon_step()  # a batch skipped by ``on_train_batch_start`` returning -1 never ended

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rollout.abandon_step()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rollout.flush(trainer)
        self.rollout.release()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.rollout.release()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rollout.release()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.rollout.release()

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self.rollout.save_checkpoint(trainer, checkpoint)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"report": self.rollout.report.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rollout.report.load_state_dict(state_dict.get("report", {}))


def _refuse_a_second_callback(trainer: pl.Trainer, callback: CUDAGraphCallback) -> None:
    """Two rollouts on one Trainer would patch the same forwards and fight over the stream: refuse it."""
    others = [cb for cb in trainer.callbacks if isinstance(cb, CUDAGraphCallback) and cb is not callback]
    if others:
        raise config_error(
            type(callback).__name__,
            "Trainer(callbacks=...)",
            f"{len(others) + 1} CUDAGraphCallbacks",
            "one CUDAGraphCallback per Trainer (a cudagraph strategy adds one when there is none)",
            "pass a single CUDAGraphCallback with every scope in its scope list, e.g. scope=['attn', 'mlp']",
        )
