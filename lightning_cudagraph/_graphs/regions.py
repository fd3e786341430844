"""Which targets a scoped driver captures: the active ones, less those excluded, and the parts that replace a layer.

Every target any level may capture is patched for the whole fit (one not captured runs its original forward). A region
whose capture or parity check fails stays eager while the others keep their graphs. A layer that cannot be captured is
replaced by its dense parts (attention, MLP, router), which were recorded alongside it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from lightning_cudagraph._options.scopes import Target
from lightning_cudagraph._warnings import warn_user
from lightning_cudagraph.health import CUDAGraphReport


class RegionSet:
    """The targets of a scoped driver and which of them the next capture takes.

    Args:
        targets: Every patched target, in model order (nested ones included).
        parts: Layer name -> the targets that stand in for it when it cannot be captured.
    """

    def __init__(
        self,
        targets: Sequence[Target],
        active: Iterable[str],
        parts: Mapping[str, Sequence[Target]],
        report: CUDAGraphReport,
        component: str,
    ) -> None:
        self.targets = list(targets)
        self.index = {target.name: i for i, target in enumerate(self.targets)}
        self.parts = {name: [p.name for p in inside] for name, inside in parts.items()}
        self.report, self.component = report, component
        self.excluded: dict[str, str] = {}
        self.active: set[str] = set()
        self.set_active(active)

    def set_active(self, names: Iterable[str]) -> None:
        """Capture these targets from the next capture on (exclusions stay: the same module fails again)."""
        self.active = {name for name in names if name in self.index}

    @property
    def active_targets(self) -> list[Target]:
        """The targets the next capture takes, in model order."""
        return [t for t in self.targets if t.name in self.active and t.name not in self.excluded]

    def left_out(self) -> set[int]:
        """Indices of the targets the next capture leaves out (inactive or excluded)."""
        return {i for i, t in enumerate(self.targets) if t.name not in self.active or t.name in self.excluded}

    def exclude(self, name: str, reason: str, warn: bool = True) -> None:
        """Leave one region eager from now on, and say why (``warn=False``: a rollback is about to say it)."""
        self.excluded[name] = reason
        self.report.exclusions[name] = reason
        if warn:
            warn_user(f"{self.component}: {name} stays eager, the other regions keep their graphs: {reason}")

    def replace_with_parts(self, name: str, reason: str) -> bool:
        """Swap a layer that cannot be captured for its parts; ``False`` if it has none left to try."""
        parts = [part for part in self.parts.get(name, ()) if part not in self.excluded]
        if not parts:
            return False
        self.active.discard(name)
        self.active.update(parts)
        self.exclude(name, f"{reason}; its parts are captured instead: {', '.join(parts)}")
        return True
