"""The options of the callback and both strategies, declared once: name, type, default and description.

The keyword parameters and ``Args:`` of the callback and strategies are written from :data:`OPTIONS` by
``scripts/option_signatures.py``; ``tests/test_option_signatures.py`` fails when they drift.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

__all__ = [
    "AUTO",
    "DEFAULT_MAX_GRAPHS",
    "FAILURE_POLICIES",
    "FULL_ITERATION",
    "IMPLS",
    "MAX_CONFIRM_STEPS",
    "MAX_PARITY_TOL",
    "OPTIONS",
    "OPTION_DOCS",
    "SCOPES",
    "SHAPE_CHANGE_POLICIES",
    "TE_INSTALL",
    "Option",
    "Selector",
]

#: A way to find modules: a glob on the qualified name, a module class, or a predicate ``(name, module) -> bool``.
Selector = str | type | Callable[[str, nn.Module], bool]

FULL_ITERATION = "full_iteration"
AUTO = "auto"
SCOPES = ("full_iteration", "attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba", "layer")
IMPLS = ("none", "local", "transformer_engine")
SHAPE_CHANGE_POLICIES = ("eager", "recapture", "error")
FAILURE_POLICIES = ("eager", "raise")
TE_INSTALL = 'pip install --no-build-isolation "transformer_engine[pytorch]"'
#: Graph sets kept with ``on_shape_change="recapture"`` when ``max_graphs`` is not given.
DEFAULT_MAX_GRAPHS = 4
#: Largest ``parity_tol``: the check compares ``max|graphed - eager| / max|eager|``, and above this a forward that
#: is off by a sign or a factor of two could pass. FP8 (3 mantissa bits) needs 0.125.
MAX_PARITY_TOL = 0.25
#: Largest ``confirm_steps``: each confirmation step runs an extra eager forward per region, and under
#: ``scope="auto"`` every level confirms before the next is tried; beyond this a fit would stay in confirmation.
MAX_CONFIRM_STEPS = 100


@dataclass(frozen=True)
class Option:
    """One option as a user passes it.

    Attributes:
        name: The keyword.
        annotation: Its type, as written in the signatures (source text, resolved in the modules that use it).
        default: Its default, as a user would pass it.
        doc: Its description, written into the ``Args:`` of the callback and both strategies.
    """

    name: str
    annotation: str
    default: Any
    doc: str


OPTIONS: tuple[Option, ...] = (
    Option(
        "impl",
        'Literal["none", "local", "transformer_engine"]',
        "local",
        '``"local"`` (PyTorch graphs), ``"transformer_engine"`` (Transformer Engine graphs, FP8-aware) or ``"none"``'
        " (everything off: the fit trains eagerly, whatever the other options say).",
    ),
    Option(
        "scope",
        "str | Sequence[str]",
        AUTO,
        '``"auto"`` (try the levels from the widest down: with one of the package\'s strategies the whole step,'
        " then ``model``, ``layer``, ``attn+mlp`` and ``attn``; keep the first that works and is faster than eager"
        " training), or a list from"
        " ``full_iteration, attn, mlp, moe, moe_router, moe_preprocess, mamba, layer`` and the keys of ``modules`` (a"
        " comma-separated"
        ' string works too: ``"attn,mlp"``). ``full_iteration`` captures the whole training step and needs'
        " ``CUDAGraphStrategy`` or ``DDPCUDAGraphStrategy``.",
    ),
    Option(
        "warmup_steps",
        "int",
        3,
        "Eager optimizer steps before capture (at least one step always runs eagerly; at least 11 for"
        " ``full_iteration`` under DDP).",
    ),
    Option(
        "modules",
        "Mapping[str, Any] | None",
        None,
        "Per-scope selectors that override the built-in patterns, or define new scopes: a glob on qualified module"
        ' names (``"blocks.*.attn"``), an ``nn.Module`` subclass, or a predicate ``(name, module) -> bool``; or a'
        ' list of these. With a fixed ``scope``, every key must be one of its names; under ``scope="auto"`` a new'
        " key joins every level, and a key that looks like a misspelt built-in scope is refused.",
    ),
    Option(
        "on_shape_change",
        'Literal["eager", "recapture", "error"]',
        "eager",
        'What a batch of another shape does once graphs exist: ``"eager"`` (that step runs eagerly, counted),'
        ' ``"recapture"`` (the shape gets its own eager step, capture and confirmation; the ``max_graphs`` least'
        " recently used graph sets are kept, others evicted and captured again when their shape returns) or"
        ' ``"error"``. Pad batches to a few lengths (``lightning_cudagraph.PadToBucket``).',
    ),
    Option(
        "on_failure",
        'Literal["eager", "raise"]',
        "eager",
        '``"eager"`` (roll back and keep training eagerly, with a warning) or ``"raise"``.',
    ),
    Option(
        "max_graphs",
        "int | None",
        None,
        'Most graph sets (batch shapes) held with ``on_shape_change="recapture"`` (at least 2; 4 when not given).'
        ' Only with ``"recapture"``: the other policies keep one graph set.',
    ),
    Option(
        "confirm_steps",
        "int",
        2,
        f"Steps after capture that are checked before the graphs are trusted (1 to {MAX_CONFIRM_STEPS}).",
    ),
    Option(
        "parity_tol",
        "float | None",
        None,
        f"Largest relative difference allowed between graphed and eager forwards, at most {MAX_PARITY_TOL} (above"
        " that the check could not tell a wrong graph from a right one); by default 1e-4 in float32, 2e-2 under"
        " autocast and 0.125 under FP8.",
    ),
    Option("max_pool_mib", "float | None", None, "Memory budget of the graphs' pool in MiB (``None``: no limit)."),
    Option(
        "seal_after_steps",
        "int | None",
        None,
        "From this optimizer step on (at most ``Trainer(max_steps=...)``), the set of batch shapes is closed: a"
        " shape without graphs raises, naming it and the captured shapes (``None``: never;"
        " ``CUDAGraphCallback.seal()`` closes it by hand). A seal taken before the first"
        " capture (during the eager warmup steps) closes the set to the shape that warmup captures: that shape is"
        " still captured when warmup ends, and any other shape raises.",
    ),
    Option(
        "audit_every_n_steps",
        "int | None",
        1000,
        "The numerics guard: every this many replayed steps, the graphs are checked against eager on a real batch."
        " The whole step runs a shadow step (the graph replays, the state is put back, the step runs eagerly and is"
        " kept; loss and parameter update must agree); scoped graphs check one region's forward against eager"
        ' (round-robin). A failure rolls back (or raises with ``on_failure="raise"``); a region that fails is left'
        " eager. Every captured whole step is also shadow-checked on its capture step. ``None`` or 0: confirmation"
        " only. Each audit costs about one eager step.",
    ),
    Option(
        "eval_graphs",
        "bool",
        True,
        "Validation, test and predict steps on forward-only graphs too, whenever graphs are on: the whole evaluation"
        " step through the package's strategies, the trained level's regions through the callback alone (each"
        " graph checked against eager on its capture batch first). A loop that stays eager logs why. ``False``:"
        " evaluation always runs eagerly.",
    ),
    Option(
        "optimizer_graph",
        "bool",
        True,
        "Through the package's strategies, a scoped level replays the optimizer's update (with its learning-rate"
        " tensors) as a graph of its own after the eager backward, checked against the eager update first."
        " ``False`` keeps the update eager. The whole step holds the update in its own graph, and the callback"
        " alone cannot own the optimizer step: both ignore it.",
    ),
    Option(
        "compile",
        "bool | Mapping[str, Any]",
        False,
        "``False`` (no compilation), ``True`` (``torch.compile`` with inductor's defaults on what is about to be"
        " captured, compiled during the eager warmup steps, then held by the graphs) or a dict of ``torch.compile``"
        ' arguments: ``backend``, ``fullgraph``, ``mode`` (``"default"`` or ``"max-autotune-no-cudagraphs"``) or'
        ' ``options`` (inductor options, e.g. ``{"max_autotune": True}``), plus the package\'s ``regions``. The whole'
        " step and a region that holds the whole forward are compiled. Smaller scoped regions (``attn``, ``mlp``,"
        " ``layer``, ...) stay uncompiled, because their compiled kernels lost to plain graphs on an H100. A warning"
        ' says so. ``compile={"regions": True}`` compiles them anyway. Shapes are static. Needs a fixed'
        ' ``scope`` (not ``"auto"``), ``impl="local"`` and one device; inductor\'s own CUDA graphs'
        ' (``mode="reduce-overhead"``, ``options={"triton.cudagraphs": True}``) are refused: graphs in graphs.',
    ),
)

#: The description of every option by name (the ``doc`` of :data:`OPTIONS`).
OPTION_DOCS: dict[str, str] = {option.name: option.doc for option in OPTIONS}
