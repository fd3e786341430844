"""The staged rollout: one state machine, and the only place that decides what happens next.

Stages (``cudagraph/stage``): ``WARMUP`` (0) eager steps that record input signatures and the eager step time;
``CONFIRMING`` (1) the first replays, checked; ``REPLAYING`` (2) steady state; ``DISABLED`` (-1) never enabled or
rolled back. The callback and the strategy report Lightning events here; graph mechanics live in
:mod:`lightning_cudagraph.graphs`, counters and logging in :mod:`lightning_cudagraph.health`.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_cudagraph import preflight
from lightning_cudagraph._lightning import set_closure_result
from lightning_cudagraph.config import CUDAGraphConfig
from lightning_cudagraph.graphs.full import step_loss
from lightning_cudagraph.graphs.local import capture_regions
from lightning_cudagraph.graphs.manager import GraphManager, StepState
from lightning_cudagraph.health import CUDAGraphReport, Stage, StepTimer, log_to_loggers, median
from lightning_cudagraph.hooks import inner_hook_count
from lightning_cudagraph.recording import WarmupRecorder
from lightning_cudagraph.scopes import ScopeResolution, candidate_names, resolve_scopes
from lightning_cudagraph.signature import batch_key, describe_batch_key

#: Relative parity tolerances when ``parity_tol`` is not given: full precision, autocast, FP8 (E4M3: 3 mantissa bits).
DEFAULT_PARITY_TOL = 1e-4
REDUCED_PRECISION_PARITY_TOL = 2e-2
FP8_PARITY_TOL = 0.125


class Rollout:
    """Drives one fit through the stages, for a :class:`~lightning_cudagraph.config.CUDAGraphConfig`."""

    def __init__(self, config: CUDAGraphConfig, component: str) -> None:
        self.config = config
        self.component = component
        self.report = CUDAGraphReport()
        self.resolution = ScopeResolution()
        self.manager: GraphManager | None = None
        self._recorder: WarmupRecorder | None = None
        self._timer = StepTimer(use_cuda=False)
        self._eager_times: list[float] = []
        self._capture_step = 0
        self._confirm_until = 0
        self._replays_at_capture = 0
        self._confirm_nonfinite: torch.Tensor | None = None
        self._full_plan: tuple[str, Any] | None = None
        self._full_problem: str | None = None
        self._seen_batches: set[tuple[Any, ...]] = set()
        self._last_logged = -1
        self._last_nonfinite_check = 0
        self._fp8 = False
        self._autocast = False
        self._weight_cache: Any = None
        self._warmup_nonfinite: torch.Tensor | None = None
        self._replay_step_seen = False
        self._uncapturable: set[tuple[Any, ...]] = set()
        self._microbatch_start: tuple[int, int, int] = (0, 0, 0)  # replays, fallbacks, regions expected

    @property
    def stage(self) -> Stage:
        """The current stage."""
        return self.report.stage

    @property
    def active(self) -> bool:
        """Whether graphs may still be captured or replayed in this fit."""
        return self.stage != Stage.DISABLED and self.manager is not None

    # =================================================================== preflight
    def setup(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """Validate against the Trainer and resolve scopes to modules (no CUDA work)."""
        if not self.config.enabled:
            self._disable("impl_none", warn=False)
            return
        preflight.check_trainer(self.config, trainer, module, self.component)
        if self.config.full_iteration:
            self.report.scopes = {"full_iteration": ["<training step>"]}
            return
        self.resolution = resolve_scopes(module, self.config.scope, self.config.modules, self.component)
        self.report.scopes = self.resolution.matched
        if not self.resolution.targets:
            self._disable(
                "no_targets",
                detail="scope='auto' found no attention, MLP or layer modules; modules include"
                f" {candidate_names(module)}. Pass scope=[...] with modules={{...}} to choose some",
            )
            return
        preflight.check_targets(self.resolution.targets, self.component)
        rank_zero_info(f"{self.component}: {self.resolution.summary()}")

    def fit_start(self, trainer: pl.Trainer) -> None:
        """Check the optimizers, and turn graphs off with a notice when the Trainer has no CUDA device."""
        device = trainer.strategy.root_device
        self._timer = StepTimer(use_cuda=device.type == "cuda")
        if self.stage == Stage.DISABLED:
            return
        if device.type != "cuda" or not torch.cuda.is_available():
            self._disable(
                "no_cuda",
                detail=f"CUDA graphs need a CUDA device, but this Trainer runs on {device.type}; training runs"
                " eagerly, exactly as without the package",
            )
            return
        preflight.check_optimizers(self.config, trainer, self.component)
        capture: Callable[..., list[Any]] = capture_regions
        if self.config.impl == "transformer_engine":
            from lightning_cudagraph.graphs.te import capture_te_regions, fp8_recipe_of

            recipe = fp8_recipe_of(trainer.precision_plugin)
            self._fp8 = recipe is not None
            self._weight_cache = _fp8_weight_cache(trainer, recipe, self.component)
            capture = functools.partial(capture_te_regions, fp8_recipe=recipe, weight_cache=self._weight_cache)
        self.manager = GraphManager(
            self.resolution.targets,
            self.report,
            device,
            strict_shapes=self.config.on_shape_change == "error",
            capture=capture,
        )
        self.report.stage = Stage.WARMUP

    def train_start(self, trainer: pl.Trainer) -> None:
        """Move training onto the side stream and start eager stabilization."""
        if not self.active:
            return
        self.manager.enter_stream()
        self._capture_step = trainer.global_step + self.config.capture_after
        self._last_nonfinite_check = trainer.global_step
        if self.config.full_iteration:
            self.manager.full_iteration().prepare_optimizers(trainer.optimizers)
        else:
            self.manager.install()
            self._recorder = WarmupRecorder(self.resolution.targets)

    # =================================================================== scoped steps
    def batch_start(self, trainer: pl.Trainer, batch: Any) -> None:
        """Decide what this training batch does: record, capture, replay or fall back."""
        if self.active and not self.config.full_iteration:
            self._begin_scoped_step(trainer, batch)
        self._timer.start()

    def batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any) -> None:
        """Close the step: confirmation checks, stage changes, metrics."""
        self._timer.stop()
        state = self.manager.end_step() if self.manager is not None else None
        if state is not None and state.recorder is not None:
            state.recorder.end_step()
        if self._weight_cache is not None:
            replays, fallbacks, regions = self._microbatch_start
            every_region_replayed = self.report.replays - replays >= regions and self.report.fallbacks == fallbacks
            self._weight_cache.end_microbatch(every_region_replayed)
        if self.active and self.stage == Stage.WARMUP:
            self._warmup_nonfinite = _or_nonfinite(self._warmup_nonfinite, outputs)
        if self.active and state is not None and (state.confirming or state.problem is not None):
            self._confirm_scoped_step(state, outputs)
        if self.active and self.config.full_iteration and self.stage == Stage.CONFIRMING:
            self._confirm_full_step()
        if self.active and self.stage == Stage.CONFIRMING and trainer.global_step >= self._confirm_until:
            self._finish_confirmation_once_replayed()
        self._maybe_log(trainer, module)

    def abandon_step(self) -> None:
        """Close a training batch that never reached ``on_train_batch_end`` (``on_train_batch_start`` returned -1)."""
        state = self.manager.end_step() if self.manager is not None else None
        if state is not None and state.recorder is not None:
            state.recorder.discard_step()

    def _begin_scoped_step(self, trainer: pl.Trainer, batch: Any) -> None:
        step, key = trainer.global_step, batch_key(batch)
        accumulating = trainer.accumulate_grad_batches > 1
        if self.stage == Stage.WARMUP and step < self._capture_step:
            keep = step >= self._capture_step - 1
            self._recorder.begin_step(key, keep_samples=keep)
            self.manager.begin_step(StepState(recorder=self._recorder))
            return
        if self.stage == Stage.WARMUP:
            if not self._warmup_was_finite():
                return
            plan = self._recorder.plan(excluded=set())
            if plan.unstable is not None:
                detail = f"input signatures moved during warmup: {plan.unstable}"
                self._disable(f"shape_unstable: {plan.unstable}", detail=detail)
                return
            if not plan.calls:
                self._disable("no_targets", detail="no target module ran in a training step: " + str(plan.skipped))
                return
            self._note_skipped(plan.skipped)
            if not self._capture(plan.batch, plan.calls, step):
                return
            self.manager.watch_trainable(
                (f"{target.name}.{name}", param)
                for target in self.resolution.targets
                for name, param in target.module.named_parameters()
            )
        graph_set = self.manager.sets.get(key)
        confirming = self.stage == Stage.CONFIRMING
        if graph_set is None:
            graph_set = self._graph_set_for_new_shape(key)
            confirming = confirming or graph_set is not None
        if graph_set is None:
            return
        if self._weight_cache is not None:
            self._weight_cache.begin_microbatch(graph_set.batch, step)
            self._microbatch_start = (self.report.replays, self.report.fallbacks, len(graph_set.regions))
        self.manager.begin_step(StepState(graph_set=graph_set, confirming=confirming, accumulating=accumulating))

    def _graph_set_for_new_shape(self, key: tuple[Any, ...]) -> Any:
        captured = ", ".join(describe_batch_key(k) for k in self.manager.sets) or "nothing yet"
        change = f"batch shape {describe_batch_key(key)} differs from the captured {captured}"
        policy = self.config.on_shape_change
        if key in self._uncapturable:
            self.manager.begin_step(StepState(fallback_reason=f"{change}; it cannot be captured"))
            return None
        if policy == "error":
            raise RuntimeError(
                f"{self.component}(on_shape_change='error'): {change}. Fix: keep batch shapes fixed (e.g."
                " DataLoader(drop_last=True)), or pass on_shape_change='eager' or 'recapture'."
            )
        if policy == "recapture" and len(self.manager.sets) < self.config.max_graphs:
            if self._recorder.last_step_for(key) is not None:
                plan = self._recorder.plan(excluded=set(), batch=key)
                if plan.unstable is None and plan.calls and self._capture(key, plan.calls, self._capture_step):
                    return self.manager.sets.get(key)
                if self.active:  # not a failed capture (that rolled back loudly): this shape stays eager, counted
                    why = f"its input signatures moved: {plan.unstable}" if plan.unstable else "no target ran in it"
                    rank_zero_warn(f"{self.component}: batch shape {describe_batch_key(key)} stays eager: {why}")
                    self._uncapturable.add(key)
                    self.manager.begin_step(StepState(fallback_reason=f"{change}; it cannot be captured: {why}"))
                return None
            self._recorder.begin_step(key, keep_samples=True)
            self.manager.begin_step(StepState(recorder=self._recorder, fallback_reason=change))
            return None
        self.manager.begin_step(StepState(fallback_reason=change))
        return None

    def _capture(self, key: tuple[Any, ...], calls: list[Any], step: int) -> bool:
        """Capture a graph set for ``key``; on failure roll back (or raise). Returns whether it worked."""
        first = self.stage == Stage.WARMUP
        if first:
            self._note_eager_time()
        self._autocast = self._autocast or any(call.signature.autocast[0] for call in calls)
        try:
            self.manager.capture(key, calls)
        except Exception as err:  # a failed capture must not end training silently, nor leak anything
            self._rollback(f"capture_failed: {type(err).__name__}: {err}", err)
            return False
        if self._over_memory_budget():
            return False
        if first:
            self._enter_confirmation(step)
        rank_zero_info(
            f"{self.component}: captured {len(calls)} region(s) for batch {describe_batch_key(key)} in"
            f" {self.report.capture_ms:.0f} ms; graphs hold {self.report.pool_mib:.1f} MiB"
        )
        return True

    def _confirm_scoped_step(self, state: StepState, outputs: Any) -> None:
        if state.problem is not None:
            self._rollback(state.problem)
            return
        if state.parity:
            error = max(float(e) for e in state.parity)
            self.report.parity_err = error if math.isnan(self.report.parity_err) else max(self.report.parity_err, error)
            tolerance = self._parity_tolerance(state)
            if not error <= tolerance:
                self._rollback(f"parity: graphed forward differs from eager by {error:.3g} (tolerance {tolerance:g})")
                return
        expected = [name for name in reversed(state.forward_order) if name in set(state.backward_order)]
        if state.backward_order and state.backward_order != expected:
            self._rollback(
                "backward_order: regions ran backward in another order than the reverse of their forward"
                f" ({state.backward_order} vs {expected}); they cannot share one memory pool"
            )
            return
        if self.stage == Stage.CONFIRMING:
            self._confirm_nonfinite = _or_nonfinite(self._confirm_nonfinite, outputs)
            self._replay_step_seen = self._replay_step_seen or (bool(state.forward_order) and not state.parity)

    def _parity_tolerance(self, state: StepState) -> float:
        if self.config.parity_tol is not None:
            return self.config.parity_tol
        if self._fp8:
            return FP8_PARITY_TOL
        return REDUCED_PRECISION_PARITY_TOL if self._autocast else DEFAULT_PARITY_TOL

    # =================================================================== full iteration (called by the strategy)
    def plan_full_step(self, trainer: pl.Trainer, batch: Any) -> Any:
        """Before a training step: pick eager, capture or replay, and return the batch the step should use."""
        self._full_plan = None
        if not (self.active and self.config.full_iteration and trainer.training) or trainer.sanity_checking:
            return batch
        full, key, step = self.manager.full_iteration(), batch_key(batch), trainer.global_step
        if self.stage == Stage.WARMUP:
            if step < self._capture_step or not self._warmup_was_finite():
                return batch
            self._full_plan = ("capture", key)
            return full.adopt(key, batch)
        if key in full.graphs:
            self._full_plan = ("replay", key)
            return full.stage(key, batch)
        captured = ", ".join(describe_batch_key(k) for k in full.graphs)
        change = f"batch shape {describe_batch_key(key)} differs from the captured {captured}"
        if self.config.on_shape_change == "error":
            raise RuntimeError(
                f"{self.component}(on_shape_change='error'): {change}. Fix: keep batch shapes fixed (e.g."
                " DataLoader(drop_last=True)), or pass on_shape_change='eager' or 'recapture'."
            )
        if (
            self.config.on_shape_change == "recapture"
            and key in self._seen_batches
            and len(full.graphs) < self.config.max_graphs
        ):
            self._full_plan = ("capture", key)
            return full.adopt(key, batch)
        self._seen_batches.add(key)
        self._full_plan = ("eager", change)
        return batch

    def run_full_step(self, trainer: pl.Trainer, closure: Any, optimizer: Any, run_step: Callable[[], Any]) -> Any:
        """Run the optimizer step as planned: eagerly, or captured then replayed."""
        plan, self._full_plan = self._full_plan, None
        if plan is None or not self.active:
            return _eager(run_step)
        kind, key = plan
        if kind == "eager":
            self.report.count_fallback(key)
            return _eager(run_step)
        module = trainer.lightning_module
        full = self.manager.full_iteration()
        if kind == "capture":
            first = self.stage == Stage.WARMUP
            if first:
                self._note_eager_time()
            try:
                full.capture(key, optimizer, run_step, module)
            except Exception as err:  # roll back loudly (or raise), then run this step eagerly
                self._rollback(f"capture_failed: {type(err).__name__}: {err}", err)
                return _eager(run_step)
            if self._over_memory_budget():
                return _eager(run_step)
            self.manager.watch_trainable(module.named_parameters())
            rank_zero_info(f"{self.component}: captured the training step for batch {describe_batch_key(key)}")
            if first:
                self._enter_confirmation(trainer.global_step)
        elif not self._trainable_unchanged():
            return _eager(run_step)
        output = full.replay(key, trainer.global_step)
        set_closure_result(closure, output, trainer.accumulate_grad_batches)
        full.relog(key, module)
        if self.stage == Stage.CONFIRMING and full.addresses_moved(key, module):
            self._full_problem = "address_changed: a parameter is not the tensor the step graph was captured with"
        return output

    def on_training_step_output(self, output: Any) -> None:
        """``training_step`` returned (while capturing, this is the captured output)."""
        if self.manager is not None and self.manager.full is not None:
            self.manager.full.on_training_step_output(output)

    @property
    def capturing_full_step(self) -> bool:
        """Whether the strategy's hooks are running inside a whole-step capture."""
        return self.manager is not None and self.manager.full is not None and self.manager.full.capturing

    def _confirm_full_step(self) -> None:
        if self._full_problem is not None:
            problem, self._full_problem = self._full_problem, None
            self._rollback(problem)

    # =================================================================== confirmation and failure
    def _enter_confirmation(self, step: int) -> None:
        self.report.stage = Stage.CONFIRMING
        self._replays_at_capture = self.report.replays
        self._confirm_until = step + self.config.confirm_steps
        self._confirm_nonfinite = None
        self._replay_step_seen = self.config.full_iteration  # a whole-step graph replays from its first step on

    def _finish_confirmation_once_replayed(self) -> None:
        """End confirmation once a step has run on graphs, forward and backward.

        Parity calls train on the eager output; a confirmation that saw only those gets one more step.
        """
        if self._replay_step_seen or self.report.replays == self._replays_at_capture:
            self._finish_confirmation()

    def _finish_confirmation(self) -> None:
        if self.report.replays == self._replays_at_capture:
            self._rollback("not_replayed: no graph replayed during confirmation (the targets were bypassed)")
            return
        if self.config.full_iteration:
            count, first = self.manager.full_iteration().flags.read_and_clear()
            bad = count > 0
        else:
            bad = self._confirm_nonfinite is not None and bool(self._confirm_nonfinite)
            first = -1
        if bad:
            self._rollback(f"nonfinite_loss: a loss was not finite during confirmation (first at step {first})")
            return
        self.report.stage = Stage.REPLAYING
        rank_zero_info(f"{self.component}: replays confirmed; {self.report.graphs} graph(s) in steady state")

    def _warmup_was_finite(self) -> bool:
        """Stage 2's one host sync: were the eager warmup losses finite? If not, stay eager (no capture)."""
        flag, self._warmup_nonfinite = self._warmup_nonfinite, None
        if flag is None or not bool(flag):
            return True
        self._disable(
            "nonfinite_warmup",
            detail="a loss was not finite during the eager warmup steps; graphs are not captured over an unstable"
            " start (raise warmup_steps, or fix the divergence first)",
        )
        return False

    def _trainable_unchanged(self) -> bool:
        """Graphs compute gradients for the parameters that were trainable at capture: roll back if that changed."""
        problem = self.manager.trainable_problem()
        if problem is not None:
            self._rollback(problem)
        return problem is None

    def _over_memory_budget(self) -> bool:
        if self.config.max_pool_mib is None or self.report.pool_mib <= self.config.max_pool_mib:
            return False
        self._rollback(f"memory_budget: graphs hold {self.report.pool_mib:.1f} MiB > {self.config.max_pool_mib} MiB")
        return True

    def _rollback(self, reason: str, error: BaseException | None = None) -> None:
        self.report.rollbacks += 1
        self.report.rollback_reasons.append(reason)
        self._disable(f"rollback: {reason}", warn=False)
        if self.config.on_failure == "raise":
            raise RuntimeError(f"{self.component}(on_failure='raise'): CUDA graphs failed: {reason}") from error
        rank_zero_warn(
            f"{self.component}: rolled back to eager training: {reason}. Graphs, pool and patched forwards are"
            " released; training continues eagerly (cudagraph/stage=-1). Pass on_failure='raise' to stop instead."
        )

    def _disable(self, reason: str, detail: str | None = None, warn: bool = True) -> None:
        self.report.stage = Stage.DISABLED
        self.report.reason = reason
        if warn:
            rank_zero_warn(f"{self.component}: CUDA graphs off ({reason}): {detail or reason}.")
        self.release()

    def save_checkpoint(self, trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
        """Keep checkpoints free of the package: optimizers are saved in the form the user built them."""
        if self.manager is not None and self.manager.full is not None:
            self.manager.full.plain_checkpoint(checkpoint, trainer.optimizers)

    def release(self) -> None:
        """Free every graph and restore everything patched (idempotent; called on every exit path)."""
        if self.manager is not None:
            self.manager.release()
        self._recorder = None  # its sample inputs are device tensors
        self._confirm_nonfinite = self._warmup_nonfinite = None

    def check_nonfinite(self, trainer: pl.Trainer) -> None:
        """full_iteration: read the in-graph non-finite counter (one host sync per log interval)."""
        if not (self.active and self.config.full_iteration and self.manager.full is not None):
            return
        count, first = self.manager.full.flags.read_and_clear()
        since, self._last_nonfinite_check = self._last_nonfinite_check, trainer.global_step
        if count:
            self.report.nonfinite.append((first, count))
            self._rollback(
                f"nonfinite_loss: {count} non-finite loss(es) in steps {since}-{trainer.global_step - 1},"
                f" first at step {first}"
            )

    # =================================================================== timing and logging
    def _note_eager_time(self) -> None:
        self._eager_times.extend(self._timer.read())
        times = self._eager_times[1:] if len(self._eager_times) > 1 else self._eager_times
        self.report.eager_step_ms = median(times)

    def _maybe_log(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        step = trainer.global_step
        if step == self._last_logged or (step % max(trainer.log_every_n_steps, 1) and not trainer.should_stop):
            return
        self._last_logged = step
        self.check_nonfinite(trainer)
        self.flush(trainer, step)
        if trainer.progress_bar_callback is not None:
            bar = {"cudagraph/stage": float(self.stage)}
            if not math.isnan(self.report.speedup):
                bar["cudagraph/speedup"] = round(self.report.speedup, 2)
            module.log_dict({k: torch.tensor(v) for k, v in bar.items()}, prog_bar=True, logger=False)

    def flush(self, trainer: pl.Trainer, step: int | None = None) -> None:
        """Read step times and send the metrics to the Trainer's loggers (once per step)."""
        if step is None:
            if trainer.global_step == self._last_logged:
                return
            self._last_logged = step = trainer.global_step
        times = self._timer.read()
        if self.stage == Stage.WARMUP:
            self._eager_times.extend(times)
        elif times:
            self.report.step_ms = median(times)
        log_to_loggers(trainer, self.report.metrics(), step=max(step - 1, 0))

    def _note_skipped(self, skipped: dict[str, str]) -> None:
        for name, why in skipped.items():
            rank_zero_info(f"{self.component}: {name} stays eager: {why}")
        for target in self.resolution.targets:
            hooks = inner_hook_count(target.module)
            if hooks:
                rank_zero_warn(
                    f"{self.component}: {hooks} hook(s) on modules inside {target.name} fire during eager steps only,"
                    " not while it replays as a graph (hooks on the region itself keep firing)."
                )


def _eager(run_step: Callable[[], Any]) -> Any:
    """Run an optimizer step eagerly; the optimizer is capturable, which PyTorch would warn about on every fit."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*capturable=True.*")
        return run_step()


def _or_nonfinite(flag: torch.Tensor | None, outputs: Any) -> torch.Tensor | None:
    """``flag | ~isfinite(loss)`` on the device (no host sync); ``flag`` when the step returned no loss tensor."""
    loss = step_loss(outputs)
    if loss is None:
        return flag
    bad = ~torch.isfinite(loss.detach())
    return bad if flag is None else flag | bad


def _fp8_weight_cache(trainer: pl.Trainer, fp8_recipe: Any, component: str) -> Any:
    """A weight cache for TE graphs when FP8 weights can be quantized once per optimizer step, else ``None``."""
    if fp8_recipe is None or trainer.accumulate_grad_batches <= 1:
        return None
    if not trainer.lightning_module.automatic_optimization:
        return None  # manual optimization steps whenever it likes: the window is unknown
    from lightning_cudagraph.graphs.te import FP8WeightCache

    rank_zero_info(
        f"{component}: FP8 weights are quantized once per optimizer step and reused by the other"
        f" {trainer.accumulate_grad_batches - 1} micro-batch(es) of each accumulation window"
    )
    return FP8WeightCache()
