"""What ``compile=`` may be: its options, checked, and the refusal of graphs in graphs.

Inductor's own CUDA graphs cannot run inside a capture. Shapes are static: the package captures one graph per shape.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

__all__ = ["COMPILE_KEYS", "COMPILE_MODES", "CompileOptions", "inductor_graphs_in"]

#: The keys of a ``compile=`` mapping: ``torch.compile`` arguments, and the package's ``regions``.
COMPILE_KEYS = ("backend", "dynamic", "fullgraph", "mode", "options", "regions")
#: ``mode=`` values allowed: none of them runs inductor's own CUDA graphs.
COMPILE_MODES = (None, "default", "max-autotune-no-cudagraphs")
#: Inductor modes that capture CUDA graphs of their own (graphs in graphs).
GRAPHING_MODES = ("reduce-overhead", "max-autotune")
#: The inductor option that turns its CUDA graphs on.
INDUCTOR_GRAPHS = "triton.cudagraphs"


def _error(component: str, value: Any, allowed: str, fix: str) -> ValueError:
    return ValueError(f"{component}: `compile={value!r}` is not supported. Allowed: {allowed}. Fix: {fix}")


@dataclass(frozen=True)
class CompileOptions:
    """How ``torch.compile`` is called on what is captured (``dynamic`` is always ``False``).

    ``regions`` is the package's own key: ``True`` compiles scoped regions too small to gain from it (by default
    only the whole step and a region that holds the whole forward are compiled).
    """

    mode: str | None = None
    fullgraph: bool = False
    backend: str = "inductor"
    options: tuple[tuple[str, Any], ...] = ()
    regions: bool = False

    @classmethod
    def from_option(cls, component: str, value: Any) -> CompileOptions | None:
        """The options of ``compile=`` (``None`` when off); raise ``ValueError`` naming ``component`` if invalid."""
        if value is False or value is None:
            return None
        if value is True:
            return cls()
        if not isinstance(value, Mapping):
            raise _error(component, value, "False, True, or a dict of torch.compile arguments", "pass compile=True")
        unknown = sorted(set(value) - set(COMPILE_KEYS))
        if unknown:
            raise _error(
                component, value, f"keys {', '.join(COMPILE_KEYS)}", f"drop {', '.join(repr(k) for k in unknown)}"
            )
        mode = value.get("mode")
        if mode in GRAPHING_MODES:
            raise _error(
                component,
                value,
                f"mode in {COMPILE_MODES}",
                f"mode={mode!r} runs inductor's own CUDA graphs, which cannot run inside the package's graphs"
                " (graphs in graphs); drop mode (the package's graphs already take the launches off the host) or"
                " pass mode='max-autotune-no-cudagraphs'",
            )
        if mode not in COMPILE_MODES:
            raise _error(component, value, f"mode in {COMPILE_MODES}", "pass one of those modes")
        if value.get("dynamic", False) is not False:
            raise _error(
                component,
                value,
                "dynamic=False",
                "the package captures one graph per batch shape; drop dynamic (shapes that change are handled by"
                " on_shape_change=)",
            )
        options = value.get("options") or {}
        if not isinstance(options, Mapping):
            raise _error(component, value, "options as a dict of inductor options", "pass e.g. options={}")
        if options.get(INDUCTOR_GRAPHS):
            raise _error(
                component,
                value,
                f"options without {INDUCTOR_GRAPHS!r}",
                "inductor's CUDA graphs cannot run inside the package's graphs; drop that option",
            )
        if mode is not None and options:
            raise _error(component, value, "mode or options, not both (torch.compile)", "pass one of them")
        fullgraph, backend = value.get("fullgraph", False), value.get("backend", "inductor")
        if not isinstance(fullgraph, bool):
            raise _error(component, value, "fullgraph=True or False", "pass a bool")
        regions = value.get("regions", False)
        if not isinstance(regions, bool):
            raise _error(
                component,
                value,
                "regions=True or False",
                "pass regions=True to compile scoped regions too small to gain from it, or drop regions",
            )
        if backend == "cudagraphs":
            allowed = "a backend that does not capture CUDA graphs"
            raise _error(component, value, allowed, "pass backend='inductor' (graphs in graphs)")
        if not isinstance(backend, str) or (backend != "inductor" and backend not in _backends()):
            raise _error(component, value, f"backend in {_backends()}", "pass backend='inductor' (the default)")
        options_items = tuple(sorted(options.items()))
        return cls(mode=mode, fullgraph=fullgraph, backend=backend, options=options_items, regions=regions)

    def as_option(self) -> dict[str, Any]:
        """The options in the form a user passes them."""
        option: dict[str, Any] = {"backend": self.backend, "fullgraph": self.fullgraph, "dynamic": False}
        if self.mode is not None:
            option["mode"] = self.mode
        if self.options:
            option["options"] = dict(self.options)
        if self.regions:
            option["regions"] = True
        return option

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``torch.compile(fn)`` with these options."""
        return torch.compile(
            fn,
            mode=self.mode,
            fullgraph=self.fullgraph,
            dynamic=False,
            backend=self.backend,
            options=dict(self.options) or None,
        )


def _backends() -> list[str]:
    """Dynamo's registered backends (listing them imports every one: only asked for a backend other than inductor)."""
    import torch._dynamo

    return sorted(torch._dynamo.list_backends(exclude_tags=()))


def inductor_graphs_in(module: nn.Module) -> str | None:
    """Where inductor's own CUDA graphs are on in ``module`` (a submodule the user compiled so), or ``None``."""
    inductor = sys.modules.get("torch._inductor.config")
    if inductor is not None and inductor.triton.cudagraphs:
        return "torch._inductor.config.triton.cudagraphs is on (it applies to every compiled module); set it off"
    for name, child in module.named_modules():
        if _compiler_config(child).get(INDUCTOR_GRAPHS):
            return f"{name or 'the model'} is compiled with inductor's CUDA graphs (mode='reduce-overhead')"
    return None


def _compiler_config(module: nn.Module) -> Mapping[str, Any]:
    """The inductor options a module was compiled with: ``torch.compile(module)`` or ``module.compile()``."""
    get_compiler_config = getattr(module, "get_compiler_config", None)  # torch.compile(module): an OptimizedModule
    if callable(get_compiler_config):
        config = get_compiler_config()
        return config if isinstance(config, Mapping) else {}
    compiled = getattr(module, "_compiled_call_impl", None)  # module.compile(): the context is in its closure
    for cell in getattr(compiled, "__closure__", None) or ():
        config = getattr(cell.cell_contents, "compiler_config", None)
        if isinstance(config, Mapping):
            return config
    return {}
