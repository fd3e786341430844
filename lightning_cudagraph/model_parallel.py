"""FSDP2 with CUDA graphs: Lightning's ``ModelParallelStrategy`` with the whole training step as one graph.

``configure_model`` applies ``fully_shard`` (and, if it likes, tensor parallelism) as it does for Lightning's own
strategy. The whole step (forward, backward, the optimizer) is then captured with FSDP2's all-gathers and
reduce-scatters inside it, as torchtitan does. Scoped graphs are refused under FSDP2: each region would hold its
own copy of the unsharded parameters it reads, which is the memory FSDP2 exists to save.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override

from lightning_cudagraph._options.errors import config_error
from lightning_cudagraph._options.keywords import checks_keywords, config_from
from lightning_cudagraph.strategy_base import CUDAGraphStrategyBase

__all__ = ["ModelParallelCUDAGraphStrategy"]


class ModelParallelCUDAGraphStrategy(CUDAGraphStrategyBase, ModelParallelStrategy):
    """FSDP2 (``fully_shard`` in ``configure_model``) with the whole training step as one CUDA graph.

    The whole step's graph holds FSDP2's all-gathers and reduce-scatters. Parameters are gathered inside the graph
    at every replay and stay sharded between steps; the graph's pool keeps what a step allocates on the way (not yet
    measured on GPUs). Gradients keep their storage from step to step. Scoped levels (``attn``, ``layer``, ...)
    are refused: each region would hold its own unsharded copy of the parameters it reads. ``scope="auto"``
    therefore tries the whole step alone and keeps it where it is faster than eager. Gradient accumulation is
    refused until FSDP2's gradient-sync toggles are captured. Registered as ``fsdp2_cudagraph`` (``scope="auto"``)
    and ``fsdp2_cudagraph_full``, both with every rank data-parallel (``tensor_parallel_size=1``). LightningCLI takes
    options with the class only (a registered name is a plain string there), e.g.
    ``--trainer.strategy=ModelParallelCUDAGraphStrategy --trainer.strategy.scope=[full_iteration]
    --trainer.strategy.tensor_parallel_size=1 --trainer.strategy.replay_timeout_s=600``.

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
        data_parallel_size: As for Lightning's ``ModelParallelStrategy``; ``"auto"`` with an integer
            ``tensor_parallel_size`` makes every other rank data-parallel.
        tensor_parallel_size: As for Lightning's ``ModelParallelStrategy``.
        replay_timeout_s: Seconds a replayed whole step may run before the replay watchdog names this rank and the
            step, aborts the process groups and ends the process (collectives inside a graph escape NCCL's own
            watchdog). ``None``: 100 eager steps, at least 2 minutes.
        **kwargs: Passed to Lightning's ``ModelParallelStrategy``; a keyword it does not take
            is refused here, with the closest name.

    Example::

        >>> from lightning_cudagraph import ModelParallelCUDAGraphStrategy
        >>> ModelParallelCUDAGraphStrategy(scope=["full_iteration"], tensor_parallel_size=1).cudagraph_config.scope
        ('full_iteration',)
    """

    supports_scoped_graphs = False

    @checks_keywords(passes_on=(ModelParallelStrategy,))
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
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        **kwargs: Any,
    ) -> None:
        # Refused before the options' own rules, which would offer scopes FSDP2 refuses; None is off, as everywhere.
        if compile is not False and compile is not None:
            raise config_error(
                type(self).__name__,
                "compile",
                compile,
                "compile= on one device",
                "not yet supported under FSDP2 (compiled autograd has not been tried inside a captured step); drop"
                " compile=, or compile the model yourself (default mode) and let the package capture it",
            )
        config = config_from(type(self).__name__, locals())
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size, **kwargs)
        self._init_graph_options(config, replay_timeout_s)

    @override
    def setup_environment(self) -> None:
        # Lightning reads "auto" as one data-parallel group per node; with the tensor-parallel size given, the ranks
        # left over are data-parallel (FSDP2 over every rank when it is 1).
        if self._data_parallel_size == "auto" and isinstance(self._tensor_parallel_size, int):
            world_size = self.num_processes * self.num_nodes
            self._data_parallel_size = max(1, world_size // self._tensor_parallel_size)
        super().setup_environment()
