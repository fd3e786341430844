"""The Lightning callback of the staged rollout.

Thin Lightning hooks that hand each event to the staged rollout (:mod:`lightning_cudagraph._rollout.rollout`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_cudagraph._backend.backend_setting import HoldsCaptureBackend
from lightning_cudagraph._lightning import trainer_callbacks
from lightning_cudagraph._options.environment import ensure_graph_safe_allocator
from lightning_cudagraph._options.errors import Verbatim, config_error
from lightning_cudagraph._options.keywords import checks_keywords, config_from
from lightning_cudagraph._rollout.rollout import Rollout
from lightning_cudagraph.health import CUDAGraphReport


class CUDAGraphCallback(HoldsCaptureBackend, Callback):
    r"""Train with CUDA graphs, rolled out in stages so a graph is trusted only once it is shown to be right.

    After ``warmup_steps`` eager optimizer steps (which record every target's input signature and the eager step
    time), the target modules are captured into CUDA graphs in execution order, sharing one memory pool. The first
    ``confirm_steps`` steps after capture are checked: the graphs ran, a graphed forward matches the eager forward
    on the same inputs, parameters and buffers are still the tensors that were captured, the backward order fits
    the shared pool, losses are finite, the pool fits ``max_pool_mib``. Then the graphs replay with no host sync
    per step. Any failed check rolls back to eager training, loudly (``on_failure="eager"``), or raises
    (``on_failure="raise"``). Graphs are released on fit end, on early stopping and on every exception (Ctrl-C
    included), after which the model is exactly as it was.

    Logged Metrics (through Lightning's ``log_dict`` every ``log_every_n_steps``: in the rows of your own metrics,
    in ``trainer.logged_metrics`` and ``callback_metrics``; nothing when graphs are off from the start):
        ``cudagraph/stage`` (0 eager warmup, 1 confirming, 2 replaying, -1 rolled back or disabled),
        ``cudagraph/graphs``, ``cudagraph/replays``, ``cudagraph/fallbacks``, ``cudagraph/capture_ms``,
        ``cudagraph/pool_mib``, ``cudagraph/step_ms``, ``cudagraph/eager_step_ms``, ``cudagraph/speedup``,
        ``cudagraph/parity_err``, ``cudagraph/rollbacks``, ``cudagraph/captures``, ``cudagraph/evictions``,
        ``cudagraph/hit_rate``, ``cudagraph/capture_ms_total``; under ``scope="auto"``, ``cudagraph/level``; with
        ``compile=``, ``cudagraph/compile_s`` and ``cudagraph/recompiles``; for a scoped level's optimizer graph
        (through the package's strategies), ``cudagraph/optimizer_graph`` (numbered like the stage).
        The same figures, the levels tried, and the reasons behind fallbacks, exclusions and rollbacks are in
        ``report``.

    One per Trainer: a second ``CUDAGraphCallback`` is refused (the strategies add one only when there is none).

    Args:
        impl: ``"local"`` (PyTorch graphs), ``"transformer_engine"`` (Transformer Engine graphs, FP8-aware) or
            ``"none"`` (everything off: the fit trains eagerly, whatever the other options say).
        scope: ``"auto"`` (try the levels from the widest down: with one of the package's strategies the whole step,
            then ``model``, ``layer``, ``attn+mlp`` and ``attn``; keep the first that works and is faster than eager
            training), or a list from ``full_iteration, attn, mlp, moe, moe_router, moe_preprocess, mamba, layer`` and
            the keys of ``modules`` (a comma-separated string works too: ``"attn,mlp"``). ``full_iteration`` captures
            the whole training step and needs ``CUDAGraphStrategy`` or ``DDPCUDAGraphStrategy``.
        warmup_steps: Eager optimizer steps before capture (at least one step always runs eagerly; at least 11 for
            ``full_iteration`` under DDP).
        modules: Per-scope selectors that override the built-in patterns, or define new scopes: a glob on qualified
            module names (``"blocks.*.attn"``), an ``nn.Module`` subclass, or a predicate ``(name, module) -> bool``; or
            a list of these. With a fixed ``scope``, every key must be one of its names; under ``scope="auto"`` a new
            key joins every level, and a key that looks like a misspelt built-in scope is refused.
        on_shape_change: What a batch of another shape does once graphs exist: ``"eager"`` (that step runs eagerly,
            counted), ``"recapture"`` (the shape gets its own eager step, capture and confirmation; the ``max_graphs``
            least recently used graph sets are kept, others evicted and captured again when their shape returns) or
            ``"error"``. Pad batches to a few lengths (``lightning_cudagraph.PadToBucket``).
        on_failure: ``"eager"`` (roll back and keep training eagerly, with a warning) or ``"raise"``.
        max_graphs: Most graph sets (batch shapes) held with ``on_shape_change="recapture"`` (at least 2; 4 when not
            given). Only with ``"recapture"``: the other policies keep one graph set.
        confirm_steps: Steps after capture that are checked before the graphs are trusted (1 to 100).
        parity_tol: Largest relative difference allowed between graphed and eager forwards, at most 0.25 (above that the
            check could not tell a wrong graph from a right one); by default 1e-4 in float32, 2e-2 under autocast and
            0.125 under FP8.
        max_pool_mib: Memory budget of the graphs' pool in MiB (``None``: no limit).
        seal_after_steps: From this optimizer step on (at most ``Trainer(max_steps=...)``), the set of batch shapes is
            closed: a shape without graphs raises, naming it and the captured shapes (``None``: never;
            ``CUDAGraphCallback.seal()`` closes it by hand). A seal taken before the first capture (during the eager
            warmup steps) closes the set to the shape that warmup captures: that shape is still captured when warmup
            ends, and any other shape raises.
        audit_every_n_steps: The numerics guard: every this many replayed steps, the graphs are checked against eager on
            a real batch. The whole step runs a shadow step (the graph replays, the state is put back, the step runs
            eagerly and is kept; loss and parameter update must agree); scoped graphs check one region's forward against
            eager (round-robin). A failure rolls back (or raises with ``on_failure="raise"``); a region that fails is
            left eager. Every captured whole step is also shadow-checked on its capture step. ``None`` or 0:
            confirmation only. Each audit costs about one eager step.
        eval_graphs: Validation, test and predict steps on forward-only graphs too, whenever graphs are on: the whole
            evaluation step through the package's strategies, the trained level's regions through the callback alone
            (each graph checked against eager on its capture batch first). A loop that stays eager logs why. ``False``:
            evaluation always runs eagerly.
        optimizer_graph: Through the package's strategies, a scoped level replays the optimizer's update (with its
            learning-rate tensors) as a graph of its own after the eager backward, checked against the eager update
            first. ``False`` keeps the update eager. The whole step holds the update in its own graph, and the callback
            alone cannot own the optimizer step: both ignore it.
        compile: ``False`` (no compilation), ``True`` (``torch.compile`` with inductor's defaults on what is about to be
            captured, compiled during the eager warmup steps, then held by the graphs) or a dict of ``torch.compile``
            arguments: ``backend``, ``fullgraph``, ``mode`` (``"default"`` or ``"max-autotune-no-cudagraphs"``) or
            ``options`` (inductor options, e.g. ``{"max_autotune": True}``), plus the package's ``regions``. The whole
            step and a region that holds the whole forward are compiled. Smaller scoped regions (``attn``, ``mlp``,
            ``layer``, ...) stay uncompiled, because their compiled kernels lost to plain graphs on an H100. A warning
            says so. ``compile={"regions": True}`` compiles them anyway. Shapes are static. Needs a fixed ``scope`` (not
            ``"auto"``), ``impl="local"`` and one device; inductor's own CUDA graphs (``mode="reduce-overhead"``,
            ``options={"triton.cudagraphs": True}``) are refused: graphs in graphs.

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

    @checks_keywords
    def __init__(
        self,
        *,
        # options: written by scripts/option_signatures.py
        impl: Literal["none", "local", "transformer_engine"] = "local",
        scope: str | Sequence[str] = "auto",
        warmup_steps: int = 3,
        modules: Mapping[str, Any] | None = None,
        on_shape_change: Literal["eager", "recapture", "error"] = "eager",
        on_failure: Literal["eager", "raise"] = "eager",
        max_graphs: int | None = None,
        confirm_steps: int = 2,
        parity_tol: float | None = None,
        max_pool_mib: float | None = None,
        seal_after_steps: int | None = None,
        audit_every_n_steps: int | None = 1000,
        eval_graphs: bool = True,
        optimizer_graph: bool = True,
        compile: bool | Mapping[str, Any] = False,
        # end of options
    ) -> None:
        #: The options; their ``component`` (named in messages) is this class, or the strategy that added the callback.
        self.config = config = config_from(type(self).__name__, locals())
        if config.enabled:
            ensure_graph_safe_allocator(config.component)
        self.rollout = Rollout(config)
        self._state_key: str | None = None

    def seal(self, self_check: bool = True) -> None:
        """Close the set of batch shapes now: from the next step on, a shape without graphs raises.

        Called before the first capture (during the eager warmup steps), it closes the set to the shape that warmup
        captures: that shape is still captured when warmup ends, and any other shape raises.

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
        _refuse_duplicates_in_trainer_init(self)
        # Lightning reads it around every hook call (its profiler's action names): built once, from frozen options.
        if self._state_key is None:
            self._state_key = self._generate_state_key(scope=list(self.config.scope), impl=self.config.impl)
        return self._state_key

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            # Each fit starts fresh (resume restores the counters).
            self.rollout = Rollout(self.config, self.capture_backend)
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
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.rollout.before_optimizer_step()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rollout.abandon_step()  # a batch skipped by ``on_train_batch_start`` returning -1 never ended

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rollout.abandon_step()
        self.rollout.evaluation_start(trainer, self.capture_backend)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rollout.evaluation_end()

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rollout.evaluation_start(trainer, self.capture_backend)

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rollout.evaluation_end()

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rollout.evaluation_start(trainer, self.capture_backend)

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rollout.evaluation_end()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rollout.train_end(trainer)

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
    refuse_more_than_one(trainer_callbacks(trainer), callback)


def _refuse_duplicates_in_trainer_init(callback: CUDAGraphCallback) -> None:
    """Refuse two CUDAGraphCallbacks in ``Trainer(...)``, before Lightning's state-key check does less clearly.

    Lightning reads every callback's ``state_key`` in ``Trainer.__init__`` (``_validate_callbacks_list``) and raises
    a generic ``RuntimeError`` for two equal keys, before any hook of the package runs. When that validator is the
    reader, its list is checked here first; anywhere else (or if Lightning renames it) this does nothing, and
    :func:`_refuse_a_second_callback` refuses the second callback at setup.
    """
    reader = sys._getframe(2)  # this function <- state_key <- its reader
    if reader.f_code.co_name == "_validate_callbacks_list":
        refuse_more_than_one(reader.f_locals.get("callbacks") or [], callback)


def refuse_more_than_one(callbacks: list[Any], callback: CUDAGraphCallback) -> None:
    """Raise the package's refusal when ``callbacks`` holds more than one CUDAGraphCallback."""
    graphs = [cb for cb in callbacks if isinstance(cb, CUDAGraphCallback)]
    if len(graphs) > 1:
        given = ", ".join(f"CUDAGraphCallback(scope={list(cb.config.scope)!r})" for cb in graphs)
        scopes = list(dict.fromkeys(s for cb in graphs for s in cb.config.scope if s != "auto"))
        single = f"CUDAGraphCallback(scope={scopes!r})" if scopes else "CUDAGraphCallback()"
        raise config_error(
            type(callback).__name__,
            "Trainer(callbacks=...)",
            Verbatim(f"[{given}]"),
            f"one CUDAGraphCallback per Trainer ({len(graphs)} CUDAGraphCallbacks given; a cudagraph strategy adds"
            " one when there is none)",
            f"pass a single CUDAGraphCallback with every scope in its scope list: Trainer(callbacks=[{single}])",
        )
