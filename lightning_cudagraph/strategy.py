"""The package's Lightning strategies: the graph options as Trainer flags, on one device or under DDP.

``Trainer(strategy="cudagraph_attn_mlp")`` (``--trainer.strategy=...`` in LightningCLI) picks a registered name.
Both strategies add :class:`~lightning_cudagraph.CUDAGraphCallback` when the user did not, and provide the
whole-step override points (:class:`~lightning_cudagraph.strategy_base.CUDAGraphStrategyBase`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_cudagraph._backend.capture import warn_on_grad_stream_mismatch
from lightning_cudagraph._lightning import single_device_root
from lightning_cudagraph._options.errors import config_error
from lightning_cudagraph._options.keywords import checks_keywords, config_from
from lightning_cudagraph._rollout.preflight import check_ddp_warmup
from lightning_cudagraph.strategy_base import CUDAGraphStrategyBase

__all__ = ["CUDAGraphStrategy", "DDPCUDAGraphStrategy"]


class CUDAGraphStrategy(CUDAGraphStrategyBase, SingleDeviceStrategy):
    """Single-device training with CUDA graphs; takes the options of ``CUDAGraphCallback``.

    Registered names pick the scope as a Trainer flag: ``cudagraph`` (``scope="auto"``), ``cudagraph_attn``,
    ``cudagraph_mlp``, ``cudagraph_attn_mlp``, ``cudagraph_layer`` and ``cudagraph_full`` (the whole training step).
    LightningCLI reads a registered name as a plain string, so it takes no options there: to change one, give the
    class with its options, e.g. ``--trainer.strategy=CUDAGraphStrategy --trainer.strategy.scope=[layer]
    --trainer.strategy.max_pool_mib=512``.

    Args:
        device: The device to train on; by default the one the Trainer's ``accelerator``/``devices`` resolve to.
        accelerator: As for Lightning's ``SingleDeviceStrategy``.
        checkpoint_io: As for Lightning's ``SingleDeviceStrategy``.
        precision_plugin: As for Lightning's ``SingleDeviceStrategy``.
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

    Example::

        >>> import lightning.pytorch as pl
        >>> import lightning_cudagraph
        >>> trainer = pl.Trainer(strategy="cudagraph_attn_mlp", accelerator="cpu", logger=False)
        >>> trainer.strategy.cudagraph_config.scope
        ('attn', 'mlp')
    """

    @checks_keywords
    def __init__(
        self,
        device: str | torch.device | int | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
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
        config = config_from(type(self).__name__, locals())
        super().__init__(
            device=device if device is not None else "cpu",
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        # Declared so that Lightning's accelerator connector fills in the device a string strategy resolves to.
        self.parallel_devices: list[torch.device] = [torch.device(device)] if device is not None else []
        self._init_graph_options(config)

    @property
    @override
    def root_device(self) -> torch.device:
        return self.parallel_devices[0] if self.parallel_devices else single_device_root(self)

    @override
    def connect(self, model: pl.LightningModule) -> None:
        if len(self.parallel_devices) > 1:  # Lightning would train on the first device alone, silently
            scope = "auto" if self.cudagraph_config.auto_scope else list(self.cudagraph_config.scope)
            raise config_error(
                type(self).__name__,
                "Trainer(devices=...)",
                len(self.parallel_devices),
                "one device (a single-device strategy); DDPCUDAGraphStrategy for several",
                f"pass strategy='ddp_cudagraph' (or DDPCUDAGraphStrategy(scope={scope!r})), or devices=1",
            )
        super().connect(model)


class DDPCUDAGraphStrategy(CUDAGraphStrategyBase, DDPStrategy):
    """DDP training with CUDA graphs (one process per GPU); takes the callback's options plus DDP's.

    Scoped graphs keep DDP's gradient all-reduce outside the graphs. With ``scope=["full_iteration"]`` the
    all-reduce is captured inside the step graph: DDP is built on the package's side stream, and at least 11 eager
    warmup steps are required (NCCL's requirement). Registered as ``ddp_cudagraph`` and ``ddp_cudagraph_full``; as
    for the single-device names, LightningCLI takes options with the class only, e.g.
    ``--trainer.strategy=DDPCUDAGraphStrategy --trainer.strategy.scope=[full_iteration]
    --trainer.strategy.warmup_steps=11 --trainer.strategy.replay_timeout_s=600``.

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
        replay_timeout_s: Seconds a replayed whole step may run before the replay watchdog names this rank and the
            step, aborts the process groups and ends the process (collectives inside a graph escape NCCL's own
            watchdog). ``None``: 100 eager steps, at least 2 minutes.
        **kwargs: Passed to Lightning's ``DDPStrategy`` (its own keywords, and those of
            ``torch.nn.parallel.DistributedDataParallel``); a keyword neither takes is refused here, with the closest
            name.

    Example::

        >>> from lightning_cudagraph import DDPCUDAGraphStrategy
        >>> DDPCUDAGraphStrategy(scope=["full_iteration"], warmup_steps=11).cudagraph_config.full_iteration
        True
    """

    @checks_keywords(
        passes_on=(DDPStrategy, DistributedDataParallel),
        reserved={
            "module": "drop it: Lightning wraps the LightningModule in DistributedDataParallel itself",
            "device_ids": "drop it: Lightning passes each process's device itself (Trainer(devices=...) picks them)",
        },
    )
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
        replay_timeout_s: float | None = None,
        **kwargs: Any,
    ) -> None:
        config = config_from(type(self).__name__, locals())
        super().__init__(**kwargs)
        self._init_graph_options(config, replay_timeout_s)
        check_ddp_warmup(config)

    @override
    def teardown(self) -> None:
        super().teardown()
        warn_on_grad_stream_mismatch(True)  # torch's default (it has no getter to read the previous value)

    @override
    def configure_ddp(self) -> None:
        backend = self.rollout.backend if self.rollout is not None else None
        if self.root_device.type != "cuda" or backend is None or backend.stream is None:
            super().configure_ddp()
            return
        warn_on_grad_stream_mismatch(False)  # DDP keeps eager steps' autograd nodes alive: expected, not a bug
        # Built on the stream training and capture run on, so DDP's retained autograd nodes never name another one.
        with backend.on_stream():
            super().configure_ddp()
