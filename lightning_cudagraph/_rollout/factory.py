"""The driver factory of a fit: a driver for each level the ladder reaches, with its settings and compiled stand-in.

The factory owns ``compile=`` for the fit: the watch on dynamo's compilations, one set of compiled forwards shared by
every scoped level, and compiled modules for each whole-step driver (given back when it is released).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_cudagraph._backend.backend import CaptureBackend
from lightning_cudagraph._backend.compiling import CompiledForwards, CompiledModules, CompileWatch
from lightning_cudagraph._graphs.base import Driver, LevelSettings
from lightning_cudagraph._graphs.regions import RegionSet
from lightning_cudagraph._graphs.scoped import ScopedDriver
from lightning_cudagraph._graphs.whole_step import WholeStepDriver
from lightning_cudagraph._options.config import CUDAGraphConfig
from lightning_cudagraph._options.levels import Level, Plan
from lightning_cudagraph._trust.observation import Observer
from lightning_cudagraph._trust.shape_cache import ShapeCache
from lightning_cudagraph._trust.stages import StageMachine

__all__ = ["DriverFactory", "IdleDriver"]


class DriverFactory:
    """Builds the driver of a level, for one fit.

    ``trainer`` is read by Transformer Engine's driver (its precision plugin); ``plan`` says what every scoped driver
    patches; ``observer`` watches the Python of recorded region calls.
    """

    def __init__(
        self,
        config: CUDAGraphConfig,
        backend: CaptureBackend,
        machine: StageMachine,
        trainer: pl.Trainer,
        plan: Plan,
        observer: Observer,
    ) -> None:
        self.config, self.component, self.backend, self.machine = config, config.component, backend, machine
        self._trainer, self._plan, self._observer = trainer, plan, observer
        self.compile_watch: CompileWatch | None = None
        self._forwards: CompiledForwards | None = None
        if config.compile is not None:
            self.compile_watch = CompileWatch(machine.report, config.component)
            self.compile_watch.install()
            self._forwards = CompiledForwards(config.compile)

    def __call__(self, level: Level, settings: LevelSettings, before_first_capture: Callable[[], None]) -> Driver:
        """A driver for ``level`` with ``settings``; ``before_first_capture`` runs right before its first capture."""
        collaborators = (self.config, self.backend, self.machine, settings)
        driver: Driver
        if level.whole_step:
            compiled = CompiledModules(self.config.compile) if self.config.compile is not None else None
            driver = WholeStepDriver(*collaborators, compiled=compiled)
        else:
            report = self.machine.report
            regions = RegionSet(self._plan.patched, level.target_names, self._plan.parts, report, self.component)
            if self.config.impl == "transformer_engine":
                from lightning_cudagraph._graphs.te_scoped import TEScopedDriver

                driver = TEScopedDriver(self._trainer, regions, *collaborators, observer=self._observer)
            else:
                driver = ScopedDriver(regions, *collaborators, compiled=self._forwards, observer=self._observer)

        def first_capture() -> None:
            if self.compile_watch is not None:
                self.compile_watch.captured = True  # a compilation from now on is a recompile
            before_first_capture()

        driver.before_first_capture = first_capture
        return driver

    def release(self) -> None:
        """The fit ends: drop the compiled forwards, stop watching dynamo (idempotent)."""
        if self._forwards is not None:
            self._forwards.clear()
        if self.compile_watch is not None:
            self.compile_watch.remove()


class IdleDriver(Driver):
    """The driver of a fit that has none (before ``on_fit_start`` built one, or graphs were off before it).

    Every hook does nothing, as without the package. The base's flags keep their class defaults.
    """

    def __init__(self) -> None:  # the base's collaborators (backend, stage machine) do not exist here
        pass

    @override
    def start(self, trainer: pl.Trainer) -> None: ...
    @override
    def end_step(self, outputs: Any) -> None: ...
    @override
    def seal(self, self_check: bool) -> None: ...
    @override
    def release(self) -> None: ...

    @property
    @override
    def shape_cache(self) -> ShapeCache[Any]:
        raise RuntimeError("an idle driver captures nothing: it has no batch shapes")
