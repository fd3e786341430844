"""The levels of a fit, planned once in preflight: a fixed scope's one level, or the ladder of ``scope="auto"``.

Levels a capture cannot hold (activation checkpointing, a whole step the Trainer rules out) are skipped with the reason.
"""

from __future__ import annotations

import dataclasses

import lightning.pytorch as pl

from lightning_cudagraph._options.activation_checkpoints import check_targets
from lightning_cudagraph._options.config import FULL_ITERATION, CUDAGraphConfig
from lightning_cudagraph._options.levels import Level, Plan, build_levels, replacement_parts, scoped_targets, walk_order
from lightning_cudagraph._options.scopes import Target, candidate_names, resolve_scopes
from lightning_cudagraph._rollout.moe_precision import (
    check_experts_precision,
    experts_precision_problem,
    warn_experts_precision,
)
from lightning_cudagraph._rollout.preflight import DDP_WHOLE_STEP_WARMUP_STEPS, check_trainer, check_whole_step_hooks
from lightning_cudagraph._rollout.sharding import SCOPED_UNDER_FSDP2, scoped_graphs

__all__ = ["plan"]


def plan(config: CUDAGraphConfig, trainer: pl.Trainer, module: pl.LightningModule) -> Plan:
    """Plan every level of the fit: a fixed scope's one level, or the ladder of ``scope="auto"``.

    Raises:
        ValueError: A scope or override matches nothing, or a fixed scope's region uses activation checkpointing.
    """
    if config.auto_scope:
        return _auto_plan(config, trainer, module)
    if config.full_iteration:
        check_experts_precision(config.component, module, trainer.precision)
        return Plan(
            (Level(FULL_ITERATION),),
            climbs=False,
            scopes={FULL_ITERATION: ["<training step>"]},
            summary="the whole step is captured as one graph",
        )
    resolution = resolve_scopes(module, config.scope, config.modules, config.component)
    check_targets(resolution.targets, config.component)
    regions = [target.module for target in resolution.targets]
    warn_experts_precision(config.component, module, trainer.precision, regions)
    level = Level("+".join(config.scope), tuple(resolution.targets))
    return Plan((level,), climbs=False, patched=level.targets, scopes=resolution.matched, summary=resolution.summary())


def _auto_plan(config: CUDAGraphConfig, trainer: pl.Trainer, module: pl.LightningModule) -> Plan:
    """``scope="auto"``: every level the model has, those a capture cannot hold skipped with the reason."""
    for name in config.modules:  # every override must find modules (custom scopes join every level)
        resolve_scopes(module, [name], config.modules, config.component)
    levels = []
    whole_model = None if config.impl == "local" else f"impl={config.impl!r} captures layers at most"
    scoped = scoped_graphs(trainer)
    for level in build_levels(module, config.modules, _whole_step_problem(config, trainer), whole_model):
        try:
            check_targets(level.targets, "scope='auto'")
        except ValueError as error:  # activation checkpointing: this level is skipped, not the fit refused
            level = Level(level.name, unavailable=str(error))
        if not (level.whole_step or level.unavailable):  # MoE experts a graph cannot hold in this precision
            regions = [target.module for target in level.targets]
            problem = experts_precision_problem(module, trainer.precision, regions)
            level = level if problem is None else Level(level.name, unavailable=problem)
        if not (scoped or level.whole_step or level.unavailable):
            level = Level(level.name, unavailable=SCOPED_UNDER_FSDP2)
        levels.append(level)
    targets = scoped_targets(levels)
    parts = replacement_parts(module, targets, config.modules) if config.impl == "local" else {}  # TE: no parts
    walk = walk_order(levels)
    found = "; ".join(
        f"{level.name}: {(level.unavailable and f'skipped ({level.unavailable})') or 'planned'}" for level in levels
    )
    if walk:
        summary = f"scope='auto' will try {found}"
    elif not scoped:
        summary = f"scope='auto' under FSDP2 tries the whole step alone, and it cannot be captured here ({found})"
    else:
        summary = (
            f"scope='auto' found no attention, MLP or layer modules and cannot capture the whole step ({found});"
            f" modules include {candidate_names(module)}. Pass scope=[...] with modules={{...}} to choose some"
        )
    return Plan(
        tuple(levels),
        climbs=True,
        patched=tuple(_with_parts(targets, parts)),
        parts=parts,
        scopes={level.name: level.target_names for level in walk},
        summary=summary,
    )


def _with_parts(targets: list[Target], parts: dict[str, tuple[Target, ...]]) -> list[Target]:
    """The targets and the parts that may replace them, each once, parents before their parts."""
    patched: dict[str, Target] = {}
    for target in targets:
        patched.setdefault(target.name, target)
        for part in parts.get(target.name, ()):
            patched.setdefault(part.name, part)
    return list(patched.values())


def _whole_step_problem(config: CUDAGraphConfig, trainer: pl.Trainer) -> str | None:
    """Under ``scope="auto"``: why the whole step cannot be one of the levels of this fit, or ``None``.

    The rules of ``scope=["full_iteration"]`` apply, except the eager steps DDP needs: the level runner makes the
    whole step, the walk's first level, wait for them.
    """
    if not getattr(trainer.strategy, "supports_full_iteration", False):
        return "only the package's strategies capture the whole step: Trainer(strategy='cudagraph')"
    whole = dataclasses.replace(
        config, scope=(FULL_ITERATION,), warmup_steps=DDP_WHOLE_STEP_WARMUP_STEPS, component="scope='auto'"
    )
    module = trainer.lightning_module
    try:
        check_trainer(whole, trainer, module)
        check_whole_step_hooks(whole, trainer)
    except ValueError as error:
        return str(error)
    problem = experts_precision_problem(module, trainer.precision)
    if problem is not None:
        return problem
    if config.impl != "local":
        return f"impl={config.impl!r} captures scoped regions only"
    return None
