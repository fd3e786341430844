"""The levels of a fit: what each captures, found once at setup for a fixed scope and for ``scope="auto"`` alike.

A fixed scope is a one-level ladder. ``scope="auto"`` has :data:`LEVEL_SCOPES`, then ``model`` (the submodules
holding every trainable parameter, loss and optimizer eager: the widest the callback reaches, and the most a step
that reads the host gets on graphs), then ``full_iteration`` (only a strategy owns the step). Custom scopes of
``modules=`` join every scoped level. A level that finds no modules, or the same as the level before, is skipped.
The walk tries them the other way round, the widest first (:func:`walk_order`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch.nn as nn

from lightning_cudagraph._options.config import FULL_ITERATION, SCOPES, Selector
from lightning_cudagraph._options.scopes import Target, resolve_present

__all__ = [
    "LEVEL_SCOPES",
    "MODEL",
    "Level",
    "Plan",
    "build_levels",
    "model_targets",
    "replacement_parts",
    "scoped_targets",
    "walk_order",
]

#: The scoped levels of ``scope="auto"`` and the scopes each captures, narrowest first.
LEVEL_SCOPES: dict[str, tuple[str, ...]] = {
    "attn": ("attn", "mamba"),
    "attn+mlp": ("attn", "mamba", "mlp", "moe_router"),
    "layer": ("layer",),
}
#: The level of the model's own submodules, between ``layer`` and the whole step.
MODEL = "model"
#: What stands in for a layer whose capture fails: its dense parts (MoE experts stay eager).
PART_SCOPES = LEVEL_SCOPES["attn+mlp"]


@dataclass(frozen=True)
class Level:
    """An entry of the ladder: the regions it captures (none for the whole step), or why it is not tried."""

    name: str
    targets: tuple[Target, ...] = ()
    unavailable: str | None = None

    @property
    def whole_step(self) -> bool:
        """Whether this level captures the whole step."""
        return self.name == FULL_ITERATION

    @property
    def target_names(self) -> list[str]:
        """The qualified names of its targets, in model order."""
        return [target.name for target in self.targets]


@dataclass(frozen=True)
class Plan:
    """What preflight planned for a fit: its levels, and what the scoped drivers patch for all of them.

    Attributes:
        levels: In climbing order, skipped ones included (with their reason); a fixed scope has one.
        climbs: Whether the levels are walked and timed (``scope="auto"``).
        patched: Every target a scoped driver patches for the fit, parents before the parts that may replace them.
        parts: For each layer, the dense parts captured instead when the layer cannot be (``scope="auto"``).
        scopes: What each scope (or level) found, for the report.
        summary: One line said at setup, what will be captured; with no level to try, why graphs are off.
    """

    levels: tuple[Level, ...]
    climbs: bool
    patched: tuple[Target, ...] = ()
    parts: Mapping[str, tuple[Target, ...]] = field(default_factory=dict)
    scopes: Mapping[str, list[str]] = field(default_factory=dict)
    summary: str = ""


def build_levels(
    model: nn.Module,
    overrides: Mapping[str, Sequence[Selector]],
    whole_step_problem: str | None,
    model_problem: str | None = None,
) -> list[Level]:
    """The levels of ``scope="auto"`` for ``model``, in climbing order (skipped ones included, with their reason).

    ``overrides`` is the ``modules=`` option; ``whole_step_problem`` and ``model_problem`` say why those levels are
    not tried in this fit (``None``: they are).
    """
    custom = tuple(name for name in overrides if name not in SCOPES)
    levels: list[Level] = []
    previous: tuple[str, tuple[str, ...]] | None = None
    for name, scopes in LEVEL_SCOPES.items():
        targets = tuple(resolve_present(model, (*scopes, *custom), overrides).targets)
        names = tuple(target.name for target in targets)
        if not targets:
            levels.append(Level(name, unavailable=f"no {' or '.join(scopes)} modules"))
        elif previous is not None and names == previous[1]:
            levels.append(Level(name, unavailable=f"the same modules as {previous[0]!r}"))
        else:
            levels.append(Level(name, targets))
            previous = (name, names)
    found = model_targets(model)
    if model_problem is not None or isinstance(found, str):
        levels.append(Level(MODEL, unavailable=model_problem or str(found)))
    elif previous is not None and tuple(target.name for target in found) == previous[1]:
        levels.append(Level(MODEL, unavailable=f"the same modules as {previous[0]!r}"))
    else:
        levels.append(Level(MODEL, found))
    levels.append(Level(FULL_ITERATION, unavailable=whole_step_problem))
    return levels


def model_targets(model: nn.Module) -> tuple[Target, ...] | str:
    """The ``model`` level's regions: the module's children that hold its trainable parameters, or why there are none.

    A ``ModuleList`` or ``ModuleDict`` is never called, so it is no region. The level exists only when the regions
    hold every trainable parameter: otherwise it adds nothing to the narrower levels.
    """
    children = [
        Target(name, child, MODEL)
        for name, child in model.named_children()
        if not isinstance(child, (nn.ModuleList, nn.ModuleDict)) and any(p.requires_grad for p in child.parameters())
    ]
    held = {id(parameter) for target in children for parameter in target.module.parameters()}
    trained = ((name, parameter) for name, parameter in model.named_parameters() if parameter.requires_grad)
    loose = [name for name, parameter in trained if id(parameter) not in held]
    if loose:
        shown = ", ".join(loose[:1]) + (", ..." if len(loose) > 1 else "")
        return f"trainable parameters outside a called submodule of {type(model).__name__}: {shown}"
    if not children:
        return f"no submodule of {type(model).__name__} holds trainable parameters"
    return tuple(children)


def scoped_targets(levels: Sequence[Level]) -> list[Target]:
    """Every target of the levels that may be tried, each once, by name."""
    seen: dict[str, Target] = {}
    for level in levels:
        if level.unavailable is None:
            for target in level.targets:
                seen.setdefault(target.name, target)
    return list(seen.values())


def walk_order(levels: Sequence[Level]) -> list[Level]:
    """The levels that may be tried, in the order the ladder tries them: the widest first, then each narrower one.

    ``levels`` are in climbing order (narrowest first); those not tried (``unavailable``) are left out, so the walk
    starts at the widest level that is not refused. A wider level holds the work of the narrower ones in fewer
    launches: the first one confirmed faster than eager training is where the walk stops.

    Example:
        >>> levels = [Level("attn"), Level("layer"), Level("model"), Level("full_iteration", unavailable="a hook")]
        >>> [level.name for level in walk_order(levels)]
        ['model', 'layer', 'attn']
    """
    tried = [level for level in levels if level.unavailable is None]
    return tried[::-1]


def replacement_parts(
    model: nn.Module, targets: Sequence[Target], overrides: Mapping[str, Sequence[Selector]]
) -> dict[str, tuple[Target, ...]]:
    """For each layer among ``targets``, the dense parts that are captured instead when the layer cannot be."""
    layers = [target for target in targets if target.scope == "layer"]
    if not layers:
        return {}
    custom = tuple(name for name in overrides if name not in SCOPES)
    parts = resolve_present(model, (*PART_SCOPES, *custom), overrides).targets
    found = {layer.name: tuple(p for p in parts if p.name.startswith(layer.name + ".")) for layer in layers}
    return {name: inside for name, inside in found.items() if inside}
