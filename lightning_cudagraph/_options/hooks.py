"""Stash and restore module hooks around a capture.

A hook run during capture would break it (a host sync) or be baked into every replay. Each hook dict is swapped for
an empty one and the original put back, because a ``RemovableHandle`` points at the original dict. A region's own
hooks still run eagerly around its replay; hooks inside it ran during eager warmup only.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch.nn as nn
from torch.nn.modules import module as module_globals

#: Per-module hook dictionaries that fire during forward or backward.
MODULE_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)
#: Process-wide hook dictionaries (``register_module_*_hook``); torch 2.4 lacks ``_global_forward_hooks_with_kwargs``.
GLOBAL_HOOK_DICTS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_forward_hooks_with_kwargs",
    "_global_forward_hooks_always_called",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
)


@contextmanager
def hooks_stashed(regions: Iterable[nn.Module], include_roots: bool = True) -> Iterator[None]:
    """Empty the hook dicts of the given modules, their submodules and the global hooks; refill them on exit.

    ``include_roots=False`` keeps the roots' own hooks (a capture calls their ``forward`` directly anyway).
    """
    stashed: list[tuple[object, str, OrderedDict]] = []
    try:
        for root in regions:
            for module in root.modules():
                if module is root and not include_roots:
                    continue
                stashed.extend(_swap_out(module, name) for name in MODULE_HOOK_DICTS if hasattr(module, name))
        stashed.extend(_swap_out(module_globals, name) for name in GLOBAL_HOOK_DICTS if hasattr(module_globals, name))
        yield
    finally:
        for owner, name, original in reversed(stashed):
            registered_meanwhile = getattr(owner, name)
            setattr(owner, name, original)
            original.update(registered_meanwhile)  # hooks added during the capture are kept, after the old ones


def _sharding(hook: object) -> bool:
    """Whether ``hook`` is FSDP2's own (``fully_shard``).

    A captured step holds its work (all-gather, reshard), and its Python leaves the same state after every step.
    """
    owner = getattr(hook, "__self__", None)
    if owner is None:  # a module of several FSDP2 modules wraps its hooks in closures over its state's methods
        cells = getattr(hook, "__closure__", None) or ()
        owner = next((getattr(c.cell_contents, "__self__", None) for c in cells if _is_state_method(c)), None)
    return owner is not None and type(owner).__module__.startswith("torch.distributed.fsdp._fully_shard")


def _is_state_method(cell: object) -> bool:
    try:
        return hasattr(cell.cell_contents, "__self__")  # type: ignore[attr-defined]
    except ValueError:  # an empty cell
        return False


#: The dicts whose hooks fire; the *_with_kwargs and *_always_called dicts only flag hooks that also sit in these.
_FIRING = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_BACKWARD = ("_backward_pre_hooks", "_backward_hooks")


def inner_hook_count(region: nn.Module) -> int:
    """Hooks on modules strictly inside ``region``: they do not fire while the region replays as a graph."""
    inner = [module for module in region.modules() if module is not region]
    return sum(len(getattr(module, name, ())) for module in inner for name in _FIRING)


def inner_backward_hooks(region: nn.Module) -> list[str]:
    """Names of the modules strictly inside ``region`` with backward hooks of their own (FSDP2's aside).

    A replayed region runs its backward as a graph: these hooks would not fire, and nothing compares a backward with
    eager the way forward parity does, so such a region stays eager.

    Example:
        >>> import torch
        >>> block = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> _ = block[0].register_full_backward_pre_hook(lambda module, grad: grad)
        >>> inner_backward_hooks(block)
        ['0']
    """
    return [
        name
        for name, module in region.named_modules()
        if module is not region
        and any(not _sharding(hook) for n in _BACKWARD for hook in getattr(module, n, {}).values())
    ]


def hooked_modules(root: nn.Module) -> list[str]:
    """Qualified names of the modules under ``root`` (itself included) that carry forward or backward hooks.

    FSDP2's own hooks do not count; ``"<global module hooks>"`` is added when hooks are registered for every module.
    """
    names = [
        name or "<root>"
        for name, module in root.named_modules()
        if any(not _sharding(hook) for n in _FIRING for hook in getattr(module, n, {}).values())
    ]
    if any(getattr(module_globals, "_global" + name, None) for name in _FIRING):
        names.append("<global module hooks>")
    return names


#: The process-wide hook dicts that fire, with the function that registers into each.
_GLOBAL_FIRING = {
    "_global_forward_pre_hooks": "register_module_forward_pre_hook",
    "_global_forward_hooks": "register_module_forward_hook",
    "_global_backward_pre_hooks": "register_module_full_backward_pre_hook",
    "_global_backward_hooks": "register_module_full_backward_hook",
}


def global_hooks() -> list[str]:
    """The process-wide module hooks registered now, each named with the function that registered it.

    Example:
        >>> import torch
        >>> def log_shapes(module, args, output): ...
        >>> handle = torch.nn.modules.module.register_module_forward_hook(log_shapes)
        >>> global_hooks()
        ['log_shapes (register_module_forward_hook)']
        >>> handle.remove()
    """
    return [
        f"{_hook_name(hook)} ({register})"
        for name, register in _GLOBAL_FIRING.items()
        for hook in getattr(module_globals, name, {}).values()
    ]


def global_hooks_warning(component: str, regions: Sequence[str]) -> str | None:
    """The warning for process-wide module hooks before scoped regions are captured, or ``None`` when there are none.

    A global hook fires for every module in eager steps; while a region replays as a graph, it fires for the region
    itself (its call still runs) but no longer for the modules inside it, and nothing else says so. Called with the
    names of the regions about to be captured, next to the warning for hooks on modules inside them.
    """
    hooks = global_hooks()
    if not hooks or not regions:
        return None
    shown = ", ".join(regions[:3]) + (f" and {len(regions) - 3} more" if len(regions) > 3 else "")
    return (
        f"{component}: the global module hook(s) {', '.join(hooks)} fire for every module in eager steps, but not for"
        f" the modules inside the captured regions ({shown}) while they replay as graphs; they still fire for each"
        " region itself. Fix: remove them for the fit (handle.remove()), register them on the modules they are for"
        " (module.register_forward_hook(...)) outside the captured regions, or pick a scope that leaves those"
        " modules out."
    )


def _hook_name(hook: object) -> str:
    function = getattr(hook, "func", hook)  # functools.partial
    name = getattr(function, "__qualname__", None) or type(function).__qualname__
    return name.replace(".<locals>", "")


def _swap_out(owner: object, name: str) -> tuple[object, str, OrderedDict]:
    original = getattr(owner, name)
    setattr(owner, name, OrderedDict())
    return owner, name, original


def recorded_outputs(region: nn.Module) -> list[str]:
    """What Hugging Face transformers records, in the forward running now, from hooks on modules inside ``region``.

    transformers 5 collects ``router_logits``, ``attentions`` or ``hidden_states`` with forward hooks on submodules.
    Inside a region they do not fire on replay, so the model would go without them. The region's own hooks are not
    counted (they fire around its replay).
    """
    capturing = sys.modules.get("transformers.utils.output_capturing")
    collector = getattr(getattr(capturing, "_active_collector", None), "get", lambda: None)()
    if not collector:
        return []
    found = []
    for name, module in region.named_modules():
        for hook in module._forward_hooks.values() if name else ():
            key = _recorded_key(hook)
            if key is not None and key in collector:
                found.append(f"{key} from {name}")
    return found


def _recorded_key(hook: object) -> str | None:
    """The output a transformers output-recording hook collects (``None`` for any other hook)."""
    code = getattr(hook, "__code__", None)
    if code is None or code.co_name != "output_capturing_hook":
        return None
    cells = dict(zip(code.co_freevars, getattr(hook, "__closure__", None) or (), strict=False))
    key = cells.get("key")
    return key.cell_contents if key is not None else None
