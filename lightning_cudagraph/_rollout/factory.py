"""The driver factory of a fit: a driver for each level the ladder reaches, with its settings and compiled stand-in.

The factory owns ``compile=`` for the fit: the watch on dynamo's compilations, one set of compiled forwards shared by
every scoped level that compiles, and compiled modules for each whole-step driver (given back when it is released).
It decides who is compiled: the whole step and a region holding the whole forward (the ``model`` level); a scoped
level of smaller regions runs them uncompiled unless ``compile={"regions": True}``, and says so once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch.nn as nn
from typing_extensions import override

from lightning_cudagraph._backend.backend import CaptureBackend
from lightning_cudagraph._backend.compiling import (
    SMALL_REGIONS,
    CompiledForwards,
    CompiledModules,
    CompileWatch,
    holds_the_forward,
)
from lightning_cudagraph._graphs.base import Driver, LevelSettings
from lightning_cudagraph._graphs.regions import RegionSet
from lightning_cudagraph._graphs.scoped import ScopedDriver
from lightning_cudagraph._graphs.whole_step import WholeStepDriver
from lightning_cudagraph._options.config import CUDAGraphConfig
from lightning_cudagraph._options.levels import MODEL, Level, Plan
from lightning_cudagraph._trust.observation import Observer
from lightning_cudagraph._trust.shape_cache import ShapeCache
from lightning_cudagraph._trust.stages import StageMachine
from lightning_cudagraph._warnings import warn_user

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
        #: The scoped levels whose regions ``compile=`` leaves uncompiled, with the reason.
        self.uncompiled = _uncompiled_levels(config, plan, trainer.lightning_module)
        if self.uncompiled:
            machine.report.compile_exclusions.update(self.uncompiled)
            _say_uncompiled(config.component, list(self.uncompiled))
        compiles = any(level.name not in self.uncompiled for level in plan.levels if level.unavailable is None)
        if config.compile is not None and compiles:
            self.compile_watch = CompileWatch(machine.report, config.component)
            self.compile_watch.install()
            self._forwards = CompiledForwards(config.compile)

    def __call__(self, level: Level, settings: LevelSettings, before_first_capture: Callable[[], None]) -> Driver:
        """A driver for ``level`` with ``settings``; ``before_first_capture`` runs right before its first capture."""
        config = self.config
        if level.name in self.uncompiled:  # its regions run as built: checked as plain graphs, to plain tolerances
            config = dataclasses.replace(config, compile=None)
        collaborators = (config, self.backend, self.machine, settings)
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
                forwards = None if config.compile is None else self._forwards
                driver = ScopedDriver(regions, *collaborators, compiled=forwards, observer=self._observer)

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


def _uncompiled_levels(config: CUDAGraphConfig, plan: Plan, module: nn.Module) -> dict[str, str]:
    """The planned scoped levels ``compile=`` leaves uncompiled, by name, with the reason (none without it).

    The whole step and a region holding the whole forward fuse enough to gain; smaller regions do not, unless
    ``compile={"regions": True}`` asks for them.
    """
    if config.compile is None or config.compile.regions:
        return {}
    return {
        level.name: f"{SMALL_REGIONS}; compile={{'regions': True}} compiles them anyway"
        for level in plan.levels
        if level.unavailable is None
        and not level.whole_step
        and level.name != MODEL
        and not holds_the_forward([target.module for target in level.targets], module)
    }


def _say_uncompiled(component: str, levels: list[str]) -> None:
    """Say once, at fit start, which levels run uncompiled under ``compile=``, why, and how to compile them anyway."""
    named = ", ".join(repr(name) for name in levels)
    warn_user(
        f"{component}: compile= leaves the regions of level {named} uncompiled; they are captured as plain graphs."
        f" Reason: {SMALL_REGIONS}. compile= compiles the whole step (scope=['full_iteration'] through"
        " CUDAGraphStrategy) and a region that holds the whole forward. Pass compile={'regions': True} to compile"
        " these regions anyway, or drop compile= to silence this."
    )


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
