"""Optimizers in the form a captured step can run them in, and back.

A replay reads the values seen at capture, so step counts and learning rates must live in device memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim import optimizer as _optimizer_module

#: Optimizer classes whose capturable (or fused) step reads a tensor learning rate.
CAPTURABLE_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


class CapturableOptimizer:
    """An optimizer switched to its capturable form for the duration of the graphs.

    Learning rates become device tensors, which PyTorch's LR schedulers update in place (``fill_``). Adam, AdamW and
    SGD run fused where :func:`_to_fuse` allows, else capturable ``foreach`` (measured on the H200, a medium GPT's
    bf16 whole step: 8.35 ms capturable ``foreach``, 6.84 ms fused).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.optimizer = optimizer
        self._saved = [
            {key: group.get(key) for key in ("lr", "capturable", "fused", "foreach")} for group in self.groups
        ]
        self._steps_on_cpu = False
        for group in self.groups:
            if _to_fuse(group, device):
                group["fused"], group["foreach"] = True, False
            if "capturable" in group:
                group["capturable"] = True  # fused Adam checks the flag under capture as well
            if not isinstance(group["lr"], Tensor):
                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
        for state in optimizer.state.values():
            step = state.get("step")
            if isinstance(step, Tensor) and step.device != device:
                self._steps_on_cpu = True
                state["step"] = step.to(device)
        self.lrs = [group["lr"] for group in self.groups]
        #: The last learning rate of each group given as a number (at build, or by user code since).
        self._numbers = [saved["lr"] if not isinstance(saved["lr"], Tensor) else None for saved in self._saved]

    @property
    def groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups."""
        return self.optimizer.param_groups

    def refresh(self) -> None:
        """Take a learning rate that user code assigned as a number into the captured tensor (no host sync)."""
        for index, (group, lr) in enumerate(zip(self.groups, self.lrs, strict=True)):
            if group["lr"] is not lr:
                if not isinstance(group["lr"], Tensor):
                    self._numbers[index] = group["lr"]
                lr.fill_(group["lr"])
                group["lr"] = lr

    def plain_state_dict(self, state: dict[str, Any]) -> None:
        """Rewrite a saved ``optimizer.state_dict()`` into the form the user built, so checkpoints load anywhere."""
        self._plain_groups(state["param_groups"])
        if self._user_keeps_steps_on_cpu:
            for index, entry in list(state["state"].items()):
                if isinstance(entry.get("step"), Tensor):
                    state["state"][index] = {**entry, "step": entry["step"].cpu()}  # a copy: the live state stays

    def restore(self) -> None:
        """Put learning rates back as numbers and the optimizer flags as they were."""
        self._plain_groups(self.groups)
        if self._user_keeps_steps_on_cpu:  # else eager Adam would read a device step count on every step
            for state in self.optimizer.state.values():
                step = state.get("step")
                if isinstance(step, Tensor):
                    state["step"] = step.cpu()

    def _plain_groups(self, groups: list[dict[str, Any]]) -> None:
        for group, saved, number in zip(groups, self._saved, self._numbers, strict=True):
            if isinstance(group.get("lr"), Tensor) and not isinstance(saved["lr"], Tensor):
                held = group["lr"].item()
                # The tensor holds the rate in float32: give back the number the user wrote when that is what it holds.
                group["lr"] = number if number is not None and held == _in_float32(number) else held
            for key in ("capturable", "fused", "foreach"):
                if key in group:
                    group[key] = saved[key]

    @property
    def _user_keeps_steps_on_cpu(self) -> bool:
        """Whether the optimizer as built keeps its step counts on the CPU (neither capturable nor fused)."""
        return self._steps_on_cpu or not any(saved["capturable"] or saved["fused"] for saved in self._saved)


def _in_float32(number: float) -> float:
    """``number`` as a float32 tensor holds it."""
    return float(torch.tensor(float(number), dtype=torch.float32))


def _to_fuse(group: dict[str, Any], device: torch.device) -> bool:
    """Whether to switch ``group`` to its fused step.

    SGD always: its fused step is its capturable form. Adam and AdamW only at ``fused=None`` (``False`` is the user's
    choice) and when every parameter is floating point on the graphs' device.
    """
    if group.get("fused"):
        return False
    if "capturable" not in group:
        return True
    return (
        group.get("fused") is None
        and not group.get("differentiable")
        and all(torch.is_floating_point(p) and p.device.type == device.type for p in group["params"])
    )


#: Keys of a parameter group that a captured step does not bake in: the parameters themselves, the learning rate
#: (a device tensor the graph reads), and the flags the package itself switches.
_UNBAKED = frozenset({"params", "lr", "capturable", "fused", "foreach"})


class OptimizerSettings:
    """The host-side settings of an optimizer's parameter groups that a captured step bakes in.

    A replay would ignore a scheduler that moves ``betas`` or ``momentum`` (``OneCycleLR``, ``CyclicLR`` with
    ``cycle_momentum=True``) or a user who sets ``weight_decay``. Comparing two snapshots needs no device sync.
    """

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        self.groups = groups

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> OptimizerSettings:
        """The settings of ``optimizer`` now (tensors by identity: the graph reads them in place)."""
        return cls([{k: v for k, v in group.items() if k not in _UNBAKED} for group in optimizer.param_groups])

    def change(self, now: OptimizerSettings) -> str | None:
        """The first setting that differs in ``now``, described; ``None`` when none does."""
        if len(now.groups) != len(self.groups):
            return f"has {len(now.groups)} parameter groups instead of {len(self.groups)}"
        for index, (old, new) in enumerate(zip(self.groups, now.groups, strict=True)):
            if old.keys() == new.keys() and all(_same(value, new[key]) for key, value in old.items()):
                continue  # the common case, read every replayed step: no sorting, no message
            for key in sorted(set(old) | set(new)):
                a, b = old.get(key), new.get(key)
                if _same(a, b):
                    continue
                return f"param_groups[{index}][{key!r}] moved from {a!r} to {b!r}"
        return None


def _same(a: Any, b: Any) -> bool:
    """Whether a setting is unchanged: a tensor by identity (the graph reads it in place), anything else by value."""
    if a is b:
        return True
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return False
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):
        return False


def step_hooks(optimizer: torch.optim.Optimizer) -> tuple[int, int, int, int]:
    """How many step pre- and post-hooks ``optimizer`` runs, its own and global (a replay runs none of them)."""
    return (
        len(optimizer._optimizer_step_pre_hooks),
        len(optimizer._optimizer_step_post_hooks),
        len(_optimizer_module._global_optimizer_pre_hooks),
        len(_optimizer_module._global_optimizer_post_hooks),
    )


def describe_step_hooks(optimizer: torch.optim.Optimizer) -> str | None:
    """The step hooks a captured optimizer step would never run again, described; ``None`` without."""
    names = ("step pre-hook(s)", "step post-hook(s)", "global step pre-hook(s)", "global step post-hook(s)")
    found = [f"{count} {name}" for count, name in zip(step_hooks(optimizer), names, strict=True) if count]
    return f"{type(optimizer).__name__} has {', '.join(found)}" if found else None


@dataclass(frozen=True)
class Unfit:
    """Why an optimizer's step cannot run inside a graph: what is in the way, what would work, and the fix."""

    what: str
    allowed: str
    fix: str


def unfit_optimizer(
    optimizer: torch.optim.Optimizer, *, automatic: bool, grad_scaler: bool, whole_step: bool
) -> Unfit | None:
    """The one rule for an optimizer step inside a graph: the whole step's, or the optimizer graph's of scoped levels.

    Only the whole step also takes any optimizer built with ``fused=True`` (its kernels read a device learning rate)
    and, when fused, a grad scaler (the fused step reads found-inf on the device). Step hooks keep the optimizer
    graph eager; the whole step leaves them to the step's Python observation.

    Args:
        optimizer: The optimizer as the user built it.
        automatic: Lightning's automatic optimization (the module's ``automatic_optimization``).
        grad_scaler: The precision plugin steps through a grad scaler (``16-mixed``).
        whole_step: For the whole step (else for the optimizer graph).
    """
    name = type(optimizer).__name__
    fused = all(group.get("fused") for group in optimizer.param_groups)
    known = ", ".join(cls.__name__ for cls in CAPTURABLE_OPTIMIZERS)
    if not automatic and not whole_step:
        fix = "let Lightning call the optimizer, or keep the optimizer step eager"
        return Unfit("manual optimization (training_step calls the optimizer itself)", "automatic optimization", fix)
    if grad_scaler and not (whole_step and fused):
        what = "16-mixed's GradScaler reads found_inf on the host in the step of a non-fused optimizer"
        allowed = "a fused optimizer under precision='16-mixed' with the whole step" if whole_step else "bf16-mixed"
        fix = "build it with fused=True (e.g. torch.optim.AdamW(..., fused=True)) or use precision='bf16-mixed'"
        return Unfit(what, allowed, fix)
    if not isinstance(optimizer, CAPTURABLE_OPTIMIZERS) and not (whole_step and fused):
        allowed = f"torch.optim.{known}"
        allowed += ", or any optimizer built with fused=True" if whole_step else ""
        fix = "use one of those in configure_optimizers, or a scoped level (the optimizer then stays eager)"
        return Unfit(f"{name} has no capturable form the package knows (it knows {known})", allowed, fix)
    if any(group.get("differentiable") for group in optimizer.param_groups):
        return Unfit("differentiable=True", "differentiable=False", "build the optimizer without it")
    hooks = describe_step_hooks(optimizer)
    if hooks is not None and not whole_step:
        return Unfit(f"{hooks}, which a replay would not run", "no step hooks", "remove the hooks for the fit")
    return None
