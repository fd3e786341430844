"""A mutation check of the CPU suite: small realistic bugs, each applied alone in a temporary copy of the repository.

Every entry names a file of the package, an exact snippet, its replacement and what the bug does to a user. The
script copies the repository (never touching the real files), then for each entry writes the mutated file, runs
the tests that cover it (``-x``: the first failure ends the run), and restores the file. A mutation is *caught*
when a test fails (or the run hangs past its timeout), *survived* when every selected test passes, and *stale*
when its snippet is no longer in the file exactly once (the code moved: update the entry).

Run from the repository root (about 20 minutes on 2 cores)::

    python scripts/mutations.py --jobs 2
    python scripts/mutations.py --only 12,30 --jobs 1    # a few entries, by number
    python scripts/mutations.py --list                   # the entries and whether their snippets are found

The last line says ``N caught, M survived, K stale``; ``--markdown FILE`` also writes the table there. The exit
status is 1 when a mutation survived or is stale.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "lightning_cudagraph"
#: What a copy leaves out: history, caches, build metadata.
IGNORED = shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", ".benchmarks", ".pytest_cache", "*.pyc")
#: One mutation's test run; a run that takes longer has hung (a loop that never ends counts as caught).
RUN_TIMEOUT_S = 420
#: pytest-timeout's per-test limit inside a mutation run.
TEST_TIMEOUT_S = 240

S = "tests/test_strict_scenarios.py::"
P = "tests/test_step_python.py::"
W = "tests/test_watchdog.py::"
R = "tests/test_fsdp2_rules.py::"
G = "tests/test_guards.py::"
T = "tests/test_input_messages.py::"
M = "tests/test_manual_optimization.py::"
B = "tests/test_blind_spots.py::"
GEN = "tests/test_generators.py::"
X = "tests/test_moe_precision.py::"


@dataclass(frozen=True)
class Mutation:
    """A small bug: in ``file``, the one occurrence of ``find`` becomes ``replace``.

    Attributes:
        file: Path from the repository root.
        find: The exact snippet (it must occur exactly once).
        replace: What it becomes.
        description: What a user would suffer.
        tests: Test files or node ids to run, the one expected to catch it first.
    """

    file: str
    find: str
    replace: str
    description: str
    tests: tuple[str, ...]


def m(file: str, find: str, replace: str, description: str, *tests: str) -> Mutation:
    """An entry for ``file`` of the package."""
    return Mutation(f"{PACKAGE}/{file}", find, replace, description, tests)


MUTATIONS: list[Mutation] = [
    # ------------------------------------------------------------------ the whole step: logs, outputs, optimizer
    m(
        "_lightning.py",
        "results.update_metrics(feed.key, value.detach(), batch_size)",
        "pass",
        "stale logged loss: every replayed whole step logs the capture step's loss (monitors frozen)",
        S + "test_every_replayed_whole_step_logs_its_own_loss",
        "tests/test_lifecycle_full.py",
    ),
    m(
        "_lightning.py",
        "if metric is None or not metric.is_tensor or metric.meta.enable_graph:",
        "if metric is None or not metric.is_tensor:",
        "a graph-enabled self.log value is fed around self.log (Lightning would keep its autograd graph)",
        "tests/test_lifecycle_full.py::test_replayed_steps_log_every_kind_of_call_as_eager_training_does_across_epochs",
    ),
    m(
        "_graphs/step_replay.py",
        "        if steps:\n            self.optimizers.refresh()\n",
        "        if steps:\n            pass\n",
        "manual lr ignored: group['lr'] = x in user code has no effect on replayed whole steps",
        S + "test_a_learning_rate_assigned_as_a_number_takes_effect_on_replayed_steps",
        "tests/test_capturable_optimizer.py",
    ),
    m(
        "_backend/optimizers.py",
        '                lr.fill_(group["lr"])\n',
        "",
        "manual lr ignored: refresh puts the captured tensor back without the user's value",
        S + "test_a_learning_rate_assigned_as_a_number_takes_effect_on_replayed_steps",
        "tests/test_capturable_optimizer.py",
    ),
    m(
        "_backend/optimizers.py",
        '                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)',
        '                group["lr"] = float(group["lr"])',
        "lr stays a number: a whole-step graph bakes it in and LR schedules stop acting on replayed steps",
        S + "test_an_lr_schedule_acts_on_replayed_whole_steps",
        "tests/test_capturable_optimizer.py",
    ),
    m(
        "_backend/optimizers.py",
        '            if isinstance(group.get("lr"), Tensor) and not isinstance(saved["lr"], Tensor):\n'
        '                held = group["lr"].item()',
        '            if isinstance(group.get("lr"), Tensor) and not isinstance(saved["lr"], Tensor):\n'
        "                continue",
        "checkpoints carry device-tensor learning rates",
        S + "test_checkpoints_of_the_whole_step_hold_float_learning_rates_and_the_users_flags",
        "tests/test_capturable_optimizer.py",
    ),
    m(
        "_graphs/step_optimizers.py",
        "                prepared.plain_state_dict(state)",
        "                pass",
        "checkpoints of the whole step carry the capturable optimizer (tensor lr, fused, capturable flags)",
        S + "test_checkpoints_of_the_whole_step_hold_float_learning_rates_and_the_users_flags",
    ),
    m(
        "_rollout/rollout.py",
        "        self.driver.save_checkpoint(trainer.optimizers, checkpoint)",
        "        pass",
        "the rollout never asks the driver to clean checkpoints: device-tensor lr in every checkpoint",
        S + "test_checkpoints_of_the_whole_step_hold_float_learning_rates_and_the_users_flags",
    ),
    m(
        "_graphs/step_pieces.py",
        "        copy_into(self.static_batch, batch)",
        "        pass",
        "static batch never refreshed: every replayed step trains on the capture step's batch",
        "tests/test_lifecycle_full.py::test_whole_step_is_captured_confirmed_replayed_and_its_logs_stay_true",
        S + "test_every_replayed_whole_step_logs_its_own_loss",
    ),
    m(
        "_graphs/whole_step.py",
        "nonfinite_first_step=first if count else None)",
        "nonfinite_first_step=None)",
        "a NaN loss during whole-step confirmation is trusted (the in-graph count is read, then ignored)",
        S + "test_a_nan_during_whole_step_confirmation_rolls_back_at_its_end",
    ),
    m(
        "_graphs/step_pieces.py",
        "torch.where(bad & (self.first_step < 0), self.current_step, self.first_step)",
        "torch.where(bad, self.current_step, self.first_step)",
        "the report names the last non-finite step instead of the first",
        S + "test_a_nan_loss_of_a_replayed_whole_step_rolls_back_at_the_next_health_check",
    ),
    m(
        "_graphs/step_replay.py",
        "        self.flags.current_step.fill_(trainer.global_step)\n",
        "",
        "the in-graph non-finite check never learns the step number: the first NaN step is misreported",
        S + "test_a_nan_loss_of_a_replayed_whole_step_rolls_back_at_the_next_health_check",
    ),
    m(
        "_graphs/step_replay.py",
        "if self.machine.agreement.any_of([count > 0])[0]:",
        "if False:",
        "NaN losses of replayed whole steps never roll back",
        S + "test_a_nan_loss_of_a_replayed_whole_step_rolls_back_at_the_next_health_check",
        "tests/test_lifecycle_full.py",
    ),
    m(
        "_trust/shape_change.py",
        "            if self.policy is ShapeChange.ERROR:\n"
        "                raise shape_change_error(self.component, change)",
        "            if False:\n                raise shape_change_error(self.component, change)",
        "on_shape_change='error' ignored under the whole step (and the scoped driver: one shape decision serves both)",
        S + "test_on_shape_change_error_under_the_whole_step_raises_with_both_shapes",
        "tests/test_shape_change.py::test_on_shape_change_error_has_one_text_under_both_drivers",
        "tests/test_shape_change.py::test_error_raises_naming_both_shapes_and_the_fix",
    ),
    m(
        "_graphs/whole_step.py",
        "        self.steps.seal()",
        "        pass",
        "a sealed whole step captures new shapes anyway (its seal never closes the shape cache)",
        "tests/test_lifecycle_full.py::test_a_sealed_whole_step_raises_on_a_new_shape",
        S + "test_a_seal_holds_with_on_shape_change_eager[full_iteration]",
    ),
    m(
        "_trust/snapshot.py",
        "                targets.append(p)\n                sources.append(saved)\n",
        "",
        "a shadow step keeps the graph's update as well as the eager one: the audited step trains twice",
        "tests/test_lifecycle_full.py::test_whole_step_is_captured_confirmed_replayed_and_its_logs_stay_true",
    ),
    m(
        "_trust/snapshot.py",
        "        torch.set_rng_state(self.generators[0])\n",
        "",
        "a shadow step's graph replay advances the CPU generator: the kept eager step draws other dropout masks",
        S + "test_the_whole_step_with_dropout_trains_as_eager",
    ),
    m(
        "_trust/shadow.py",
        "        return self.error <= self.tolerance",
        "        return not self.error > self.tolerance",
        "NaN passing the whole step's shadow check: a graph whose step is NaN is trusted",
        S + "test_a_whole_step_shadow_step_that_gives_nan_fails_and_keeps_training_eager",
    ),
    m(
        "strategy_base.py",
        "            batch = rollout.plan_whole_step(trainer, batch)",
        "            rollout.plan_whole_step(trainer, batch)",
        "batch_to_device hands back the user's batch: replays read stale static buffers",
        "tests/test_lifecycle_full.py::test_whole_step_is_captured_confirmed_replayed_and_its_logs_stay_true",
    ),
    m(
        "strategy_base.py",
        "        rollout.on_training_step_output(output)",
        "        pass",
        "the captured training_step output is never kept: no loss for replayed steps, no in-graph NaN check",
        "tests/test_lifecycle_full.py::test_whole_step_is_captured_confirmed_replayed_and_its_logs_stay_true",
    ),
    m(
        "strategy_base.py",
        "if first_checkpoint is None else first_checkpoint, callback)",
        "if True else first_checkpoint, callback)",
        "the callback a strategy adds runs after ModelCheckpoint: checkpoints miss the rollout's state of their step",
        "tests/test_strategies.py::test_checkpoint_callbacks_stay_last",
        "tests/test_strategies.py",
    ),
    m(
        "strategy_base.py",
        "        return trainer.accumulate_grad_batches > 1 and not last_ready_batch(trainer)",
        "        return trainer.accumulate_grad_batches > 2 and not last_ready_batch(trainer)",
        "accumulate_grad_batches=2 under the whole step: Lightning keeps its micro-batches, which skip the graph",
        "tests/test_accumulation.py::test_every_micro_batch_replays_and_training_equals_eager[2]",
        "tests/test_accumulation.py",
    ),
    m(
        "_rollout/preflight.py",
        "    hooked = hooked_modules(trainer.lightning_module)\n    if hooked:",
        "    hooked = hooked_modules(trainer.lightning_module)\n    if False:",
        "module hooks accepted under the whole step (they run once, at capture)",
        "tests/test_lifecycle_full.py::test_module_hooks_are_refused_before_training",
    ),
    # ------------------------------------------------------------------ scoped: parity, confirmation, replay
    m(
        "_graphs/confirmation.py",
        "agreed = self.machine.agreement.any_of([not error <= tolerance for _, error in errors])",
        "agreed = self.machine.agreement.any_of([error > tolerance for _, error in errors])",
        "NaN passing parity: a graph that returns NaN is trusted",
        S + "test_a_graph_returning_nan_or_slightly_wrong_values_is_left_eager",
    ),
    m(
        "_trust/evidence.py",
        "    return torch.stack(errors).max() if errors else torch.zeros(())",
        "    return torch.stack(errors).nan_to_num(0.0).max() if errors else torch.zeros(())",
        "parity error 'guarded' against NaN: a graph that returns NaN measures 0",
        S + "test_a_graph_returning_nan_or_slightly_wrong_values_is_left_eager",
    ),
    m(
        "_trust/tolerance.py",
        'FORWARD_TOL = {"full": 1e-4,',
        'FORWARD_TOL = {"full": 1e-2,',
        "parity tolerance 100x looser: a forward wrong by 0.1% is trusted",
        S + "test_a_graph_returning_nan_or_slightly_wrong_values_is_left_eager",
    ),
    m(
        "_graphs/confirmation.py",
        "            self.machine.confirm_losses.observe(outputs)\n",
        "",
        "NaN in scoped confirmation trusted: confirmation never looks at the losses",
        S + "test_scoped_graphs_that_give_nan_losses_during_confirmation_roll_back",
    ),
    m(
        "_trust/stages.py",
        "finite = nonfinite_first_step is None and not self.confirm_losses.any_nonfinite()",
        "finite = nonfinite_first_step is None",
        "NaN in scoped confirmation trusted: the confirmation losses are never read",
        S + "test_scoped_graphs_that_give_nan_losses_during_confirmation_roll_back",
    ),
    m(
        "_graphs/confirmation.py",
        "if route.backward_order and route.backward_order != expected:",
        "if False:",
        "out-of-order backwards share one pool (the order check is skipped)",
        S + "test_backwards_out_of_reverse_forward_order_roll_back",
    ),
    m(
        "_graphs/routing.py",
        "            self._route.backward_order.append(region.name)",
        "            pass",
        "out-of-order backwards share one pool (backward order never recorded)",
        S + "test_backwards_out_of_reverse_forward_order_roll_back",
    ),
    m(
        "_graphs/routing.py",
        "        with self._preserved([forward.module]):\n",
        "        if True:\n",
        "the parity replay draws from the RNG: with dropout the eager forward sees other masks (parity fails)",
        S + "test_scoped_graphs_with_dropout_pass_parity_and_train_as_eager",
    ),
    m(
        "_backend/state.py",
        "        torch.set_rng_state(cpu_state)\n",
        "",
        "capture and parity leave the CPU generator advanced: dropout masks differ from eager training",
        S + "test_scoped_graphs_with_dropout_pass_parity_and_train_as_eager",
    ),
    m(
        "_backend/backend.py",
        "        return module_state_preserved(modules)",
        "        return contextlib.nullcontext()",
        "a backend's default capture guard restores nothing: warmup draws and buffer updates leak into training",
        S + "test_scoped_graphs_with_dropout_pass_parity_and_train_as_eager",
    ),
    m(
        "_graphs/routing.py",
        "    if signature.key is not None and module.training == signature.training:",
        "    if signature.key is not None:",
        "eval-mode replay: a region switched to eval mode still replays its training-mode graph",
        S + "test_a_region_switched_to_eval_mode_runs_eagerly_in_eval_mode",
    ),
    m(
        "_graphs/routing.py",
        "        if route.accumulating:\n            entry.region.detach_accumulated_grads()\n",
        "",
        "first micro-batch gradient overwritten with accumulate_grad_batches=2",
        S + "test_gradient_accumulation_keeps_the_first_micro_batch_gradient",
    ),
    m(
        "_graphs/scoped.py",
        "confirming, accumulates_across_steps(trainer))",
        "confirming, False)",
        "first micro-batch gradient overwritten: the router is never told the step accumulates",
        S + "test_gradient_accumulation_keeps_the_first_micro_batch_gradient",
    ),
    m(
        "_graphs/confirmation.py",
        "                entry.parity_checked = False\n",
        "                pass\n",
        "a seal's self-check never re-checks parity",
        "tests/test_lifecycle_scoped.py::test_sealing_checks_every_captured_shape_against_eager_once_more",
    ),
    m(
        "_graphs/scoped.py",
        "        self.graph_sets.seal()\n",
        "",
        "a sealed scoped set captures new shapes anyway (its seal never closes the shape cache)",
        "tests/test_lifecycle_scoped.py::test_a_sealed_set_of_shapes_raises_on_a_new_shape_and_names_the_captured_ones",
        S + "test_a_seal_holds_with_on_shape_change_eager[layer]",
    ),
    m(
        "_trust/evidence.py",
        '        if moved:\n            return f"address_changed',
        '        if False:\n            return f"address_changed',
        "a parameter rebound after confirmation is never noticed: graphs read the old storage",
        "tests/test_lifecycle_scoped.py::test_a_parameter_rebound_after_confirmation_rolls_back_before_the_next_replay",
        "tests/test_lifecycle_full.py::test_a_parameter_rebound_after_confirmation_rolls_back_before_the_next_replay",
    ),
    m(
        "_trust/evidence.py",
        "            if tensor.requires_grad is not trainable:\n",
        "            if False:\n",
        "an unfrozen parameter gets no gradient from the graphs, silently",
        "tests/test_lifecycle_scoped.py::test_a_failed_check_rolls_back_loudly_and_trains_on_eagerly",
    ),
    m(
        "_backend/local.py",
        "    return {name: tensor.data_ptr() for name, tensor in named}",
        "    return {name: id(tensor) for name, tensor in named}",
        "addresses by object identity: a .data swap during confirmation is not seen by the region that reads it",
        "tests/test_lifecycle_scoped.py::test_a_parameter_rebound_mid_step_is_caught_by_the_region_that_reads_it_before_it_replays",
    ),
    # ------------------------------------------------------------------ scopes, recording, hooks
    m(
        "_options/scopes.py",
        'enclosing = next((other for other in owner if name.startswith(other + ".")), None)',
        "enclosing = next((other for other in owner if name.startswith(other)), None)",
        "layers 10-19 uncaptured: blocks.10 is taken for a part of blocks.1",
        S + "test_a_model_of_more_than_ten_layers_has_every_layer_captured",
        "tests/test_scopes.py",
    ),
    m(
        "_options/layouts.py",
        "    return parts[-2] if len(parts) > 1 and parts[-1].isdigit() else None",
        '    return parts[-2] if len(parts) > 1 and parts[-1] in "0123456789" else None',
        "layers 10 and up are not layers (a one-digit index check)",
        S + "test_a_model_of_more_than_ten_layers_has_every_layer_captured",
        "tests/test_scopes.py",
    ),
    m(
        "_options/layouts.py",
        "    if _is_moe(site.name, site.tree):\n        return False\n    if site.attr in _MLP_NAMES",
        "    if site.attr in _MLP_NAMES",
        "an MoE block taken for an MLP",
        "tests/test_scopes_layouts.py::test_mlp_on_an_moe_model_is_refused_and_the_error_names_moe",
        "tests/test_scopes.py::test_mixtral_experts_are_not_taken_for_mlp_scope",
        "tests/test_scopes_layouts.py",
    ),
    m(
        "_trust/recording.py",
        "            if max(per_step) > 1:\n",
        "            if max(per_step) > 2:\n",
        "a target called twice per step is captured (one graph serves one call)",
        "tests/test_hooks_and_recording.py::test_targets_called_twice_or_not_at_all_are_skipped",
    ),
    m(
        "_trust/recording.py",
        "    return sample.requires_grad_(tensor.requires_grad)",
        "    return sample",
        "sample inputs lose requires_grad: captured regions compute no input gradient",
        "tests/test_hooks_and_recording.py::test_sample_inputs_are_detached_clones_that_keep_requires_grad",
    ),
    m(
        "_options/hooks.py",
        "        for owner, name, original in reversed(stashed):",
        "        for owner, name, original in stashed:",
        "overlapping regions' hooks come back in a dict their handles no longer remove from",
        S + "test_hooks_stashed_for_overlapping_regions_come_back_removable",
        "tests/test_hooks_and_recording.py",
    ),
    m(
        "_options/hooks.py",
        "            original.update(registered_meanwhile)",
        "            pass",
        "hooks registered during a capture are lost",
        "tests/test_hooks_and_recording.py",
    ),
    m(
        "_backend/signature.py",
        "    if len(args) > 1 and len({id(a) for a in args}) != len(args):\n        return None\n",
        "",
        "attn(x, x) replays a graph captured for attn(x, y)",
        "tests/test_signature.py",
    ),
    # ------------------------------------------------------------------ stages, agreement across ranks
    m(
        "_trust/stages.py",
        "        if self.agreement.all_ok(not self.warmup_losses.any_nonfinite()):",
        "        if not self.warmup_losses.any_nonfinite():",
        "one-rank NaN in warmup turns graphs off on that rank only (a hang under the whole step)",
        "tests/test_strict_ranks.py",
    ),
    m(
        "_trust/agreement.py",
        "        return [value > 0 for value in values]",
        "        return list(flags)",
        "every rank decides alone (exclusions, rollbacks, captures differ between ranks)",
        "tests/test_strict_ranks.py",
        "tests/test_rank_agreement.py",
    ),
    m(
        "_trust/failure.py",
        '        if self.on_failure == "raise":\n',
        "        if False:\n",
        "on_failure='raise' rolls back silently instead of raising",
        "tests/test_lifecycle_scoped.py::test_on_failure_raise_raises_on_a_failed_check_and_releases",
    ),
    # ------------------------------------------------------------------ capture passes, regions, shapes
    m(
        "_graphs/region_capture.py",
        "        for name in reasons.keys() - replaced:\n            self.regions.exclude(",
        "        for name in ():\n            self.regions.exclude(",
        "a region whose capture failed is retried forever (never excluded)",
        S + "test_when_every_region_fails_its_capture_the_fit_rolls_back_once_and_names_them",
        "tests/test_ladder.py",
        "tests/test_lifecycle_scoped.py",
    ),
    m(
        "_graphs/regions.py",
        "        return [t for t in self.targets if t.name in self.active and t.name not in self.excluded]",
        "        return [t for t in self.targets if t.name in self.active]",
        "an excluded region is captured again",
        S + "test_when_every_region_fails_its_capture_the_fit_rolls_back_once_and_names_them",
        "tests/test_ladder.py",
        "tests/test_scopes_layouts.py",
    ),
    m(
        "_trust/shape_cache.py",
        "            self._items.move_to_end(key)",
        "            pass",
        "the shape cache evicts the oldest capture, not the least recently used",
        "lightning_cudagraph/_trust/shape_cache.py",
        "tests/test_lifecycle_full.py::test_rotating_shapes_get_their_own_warmup_and_graphs_and_the_cache_evicts_the_least_recently_used",
    ),
    m(
        "_graphs/base.py",
        "        return 1 if self.captured_any else self.settings.first_eager_steps",
        "        return self.settings.first_eager_steps",
        "every new batch shape waits warmup_steps eager steps instead of one",
        "tests/test_lifecycle_full.py::test_rotating_shapes_get_their_own_warmup_and_graphs_and_the_cache_evicts_the_least_recently_used",
    ),
    m(
        "_graphs/base.py",
        "        if budget is not None and self.report.pool_mib > budget:",
        "        if budget is not None and self.report.pool_mib > 2 * budget:",
        "max_pool_mib enforced at twice its value",
        "tests/test_lifecycle_scoped.py::test_a_failed_check_rolls_back_loudly_and_trains_on_eagerly",
    ),
    m(
        "_graphs/te_scoped.py",
        "every_region_replayed = route.replays >= len(route.graph_set.entries) and route.fallbacks == 0",
        "every_region_replayed = True",
        "a fallback inside an FP8 accumulation window: the next micro-batch reuses weights nobody quantized",
        S + "test_a_fallback_inside_an_fp8_accumulation_window_quantizes_again",
        "tests/test_lifecycle_te.py",
    ),
    m(
        "_backend/te.py",
        "            self._quantized_at.pop(graph_key, None)",
        "            pass",
        "FP8 weights trusted after a micro-batch with a fallback",
        "tests/test_fp8_weight_cache.py",
    ),
    # ------------------------------------------------------------------ the ladder, health, config, the rest
    m(
        "_rollout/ladder.py",
        "if math.isnan(bar) or step_ms < bar:",
        "if math.isnan(bar) or step_ms < bar / (1 - MARGIN) * (1 + MARGIN):",
        "scope='auto' keeps a level that is slower than the best one",
        "lightning_cudagraph/_rollout/ladder.py",
        "tests/test_ladder.py",
    ),
    m(
        "_options/levels.py",
        "    return tried[::-1]",
        "    return tried",
        "scope='auto' walks narrowest-first instead of trying the widest level first",
        "tests/test_ladder.py",
    ),
    m(
        "_rollout/climb.py",
        "timing and fit.machine.stage == Stage.REPLAYING and not self.driver.in_reference_step",
        "timing and not self.driver.in_reference_step",
        "scope='auto' times confirming steps (with their eager parity forwards): levels look slower",
        "tests/test_ladder.py::test_confirming_steps_do_not_count_towards_a_levels_time",
        "tests/test_ladder.py",
    ),
    m(
        "health.py",
        "        return self.eager_step_ms / self.step_ms",
        "        return self.step_ms / self.eager_step_ms",
        "cudagraph/speedup inverted",
        "tests/test_health.py",
    ),
    m(
        "health.py",
        '        self.replays = int(state.get("replays", 0))',
        "        self.replays = 0",
        "a resumed fit forgets the replays counted before",
        "tests/test_health.py",
    ),
    m(
        "_options/validation.py",
        '    _check_int(config.component, "confirm_steps", config.confirm_steps, 1, "pass at least 1")',
        '    _check_int(config.component, "confirm_steps", config.confirm_steps, 0, "pass at least 1")',
        "confirm_steps=0 accepted: graphs trusted without one checked step",
        "tests/test_config.py::test_invalid_option_raises_readable_error[confirm-steps-zero]",
        "tests/test_config.py",
    ),
    m(
        "_options/environment.py",
        '    elif register != "0":',
        "    elif False:",
        "NCCL_GRAPH_REGISTER=1 with expandable segments accepted (illegal memory accesses under DDP)",
        "tests/test_config.py",
    ),
    m(
        "bucketing.py",
        "        index = bisect.bisect_left(buckets, length)",
        "        index = bisect.bisect_right(buckets, length)",
        "a sample exactly a bucket long is padded to the next bucket",
        "tests/test_bucketing.py",
    ),
    m(
        "callback.py",
        "exception: BaseException) -> None:\n        self.rollout.release()",
        "exception: BaseException) -> None:\n        pass",
        "an exception or Ctrl-C leaves forwards patched and graphs alive",
        "tests/test_lifecycle_scoped.py::test_every_way_a_fit_ends_releases_everything",
    ),
    m(
        "_backend/cuda.py",
        '    if device.type != "cuda" or not torch.cuda.is_available():\n        return None',
        '    if device.type == "meta":\n        return None',
        "a CPU fit picks the CUDA backend (no no_cuda fallback)",
        "tests/test_cpu_fit.py::test_cpu_fit_trains_eagerly_with_one_no_cuda_warning",
    ),
    m(
        "_backend/compiling.py",
        "                module._compiled_call_impl = compiled if on else None",
        "                module._compiled_call_impl = compiled",
        "validation runs the compiled training modules",
        "lightning_cudagraph/_backend/compiling.py",
    ),
    m(
        "_options/batches.py",
        "        buffer.copy_(value, non_blocking=True)",
        "        pass",
        "static batch buffers never take the next batch",
        "tests/test_lifecycle_full.py::test_whole_step_is_captured_confirmed_replayed_and_its_logs_stay_true",
    ),
    m(
        "__init__.py",
        "from lightning_cudagraph.strategy import CUDAGraphStrategy, DDPCUDAGraphStrategy",
        "from lightning_cudagraph.callback import CUDAGraphCallback as CUDAGraphStrategy\n"
        "from lightning_cudagraph.callback import CUDAGraphCallback as DDPCUDAGraphStrategy",
        "the strategies are not registered on import (Trainer(strategy='cudagraph') unknown)",
        "tests/test_strategies.py",
    ),
    # ------------------------------------------------------------------ the step's Python
    m(
        "_trust/reads.py",
        "            reads.setdefault(name, where)",
        "                pass",
        "a loss weight read from self.global_step is frozen at capture: the whole step trains on the capture's weight",
        P + "test_per_step_python_never_trains_off_eager",
    ),
    m(
        "_trust/reads.py",
        "            self._reads.setdefault(self._name, where)",
        "            pass",
        "a step that skips by batch_idx is captured whole: skipped batches replay as full updates",
        P + "test_per_step_python_never_trains_off_eager",
    ),
    m(
        "_trust/observation.py",
        "            seen.random = [name for name, state in random_states(modules).items()"
        " if draws.get(name) != state]",
        "            seen.random = []",
        "a ratio drawn from Python's random is frozen at capture",
        P + "test_per_step_python_never_trains_off_eager",
    ),
    m(
        "_trust/observation.py",
        '            found = seen.changes() or (f"launched other operations than before: {change}"',
        '            found = (f"launched other operations than before: {change}"',
        "a counter or an outputs list in training_step silently stops under the whole step",
        P + "test_per_step_python_never_trains_off_eager",
    ),
    m(
        "_rollout/step_python.py",
        "        return self.problem is None and self._epoch is not None and epoch != self._epoch",
        "        return False",
        "a branch on a settings object a callback flips at an epoch is replayed as captured (no re-check at epochs)",
        P + "test_per_step_python_never_trains_off_eager[settings_flag_flipped_at_epoch-cudagraph_full]",
    ),
    m(
        "_graphs/step_capture.py",
        "    if not manual and step_loss(whole.output) is None:",
        "    if False:",
        "a whole step captured on a skipped batch replays a step that trains nothing, reported as replaying",
        P + "test_a_whole_step_captured_on_a_skipped_batch_is_refused_at_capture",
    ),
    m(
        "_trust/evidence.py",
        "        if list(map(_TRAINING, self._inside)) == self._modes and sum(map(len, self._dicts)) == self._sizes:",
        "        if True:",
        "a hook or a mode switched inside the graphs mid-fit is ignored: replays run the module as captured",
        P + "test_per_step_python_never_trains_off_eager",
    ),
    m(
        "_graphs/routing.py",
        "        if again and entry is not None:",
        "        if False:",
        "a second call of a region in one step replays its graph again and overwrites the first call's activations",
        P + "test_a_second_call_of_a_region_in_one_step_runs_eagerly_and_says_why",
    ),
    m(
        "_trust/recording.py",
        "            if python is not None:",
        "            if False:",
        "a region whose forward draws from Python's random is captured: every replay takes the capture's branch",
        P + "test_a_region_whose_forward_draws_from_python_random_stays_eager_and_the_others_keep_graphs",
    ),
    m(
        "_graphs/step_optimizers.py",
        "            if step_hooks(optimizer) != self._hooks[id(optimizer)]:",
        "            if False:",
        "an optimizer step hook registered after capture never runs on replayed steps",
        P + "test_an_optimizer_step_hook_added_after_capture_rolls_back_before_a_replay_skips_it",
    ),
    m(
        "_trust/cadence.py",
        "        self._since, self._interval = 0, min(2 * self._interval, self._every)",
        "        self._since, self._interval = 0, self._every",
        "audits are not dense after capture: a wrong graph trains up to audit_every_n_steps steps before the check",
        "tests/test_trust.py::test_audits_start_dense_after_a_capture_and_thin_out_to_the_interval",
    ),
    m(
        "_graphs/optimizer_graph.py",
        "        if not self.machine.agreement.all_ok(value is None or value <= OPTIMIZER_TOL):",
        "        if False:",
        "a wrong optimizer graph passes its check: replayed updates train on a stale gradient or a frozen setting",
        "tests/test_optimizer_graph.py::test_a_wrong_optimizer_graph_rolls_back_at_its_first_check_and_never_trains",
    ),
    m(
        "_graphs/confirmation.py",
        "        graph_set.entries[indices[self._turn % len(indices)]].parity_checked = False",
        "        graph_set.entries[indices[0]].parity_checked = False",
        "the audits check the first region only: a later region gone wrong trains on until the fit ends",
        "tests/test_trust.py::test_every_region_takes_its_turn_in_the_audits_so_the_last_one_gone_wrong_is_caught",
    ),
    m(
        "_rollout/level_failure.py",
        "        return _step_down(ladder, reason, component)",
        "        return None",
        "scope='auto' settled on the whole step goes eager for the rest of the fit when an epoch changes the step",
        P + "test_auto_settled_on_the_whole_step_goes_down_a_level_when_an_epoch_changes_the_steps_python",
    ),
    # ------------------------------------------------------------------ the one lifecycle: failure, tolerance, rules
    m(
        "_trust/failure.py",
        '        return self.on_failure == "raise" and not self.auto_scope',
        '        return self.on_failure == "raise"',
        "under scope='auto' with on_failure='raise', one failed region raises instead of leaving the ladder to narrow",
        "tests/test_failure_and_tolerance.py::"
        "test_a_failed_part_stops_graphs_only_when_the_user_fixed_the_scope_and_asked_to_raise",
    ),
    m(
        "_trust/tolerance.py",
        '    return STEP_TOL["full" if full_precision(precision) else "reduced"]',
        '    return STEP_TOL["reduced"]',
        "fp32 whole steps checked at the autocast tolerance (50x looser)",
        "tests/test_failure_and_tolerance.py::test_full_precision_is_checked_tighter_than_reduced_precision",
    ),
    m(
        "_trust/evidence.py",
        "    return max(errors) if math.isnan(previous) else max(previous, *errors)",
        "    return max(errors)",
        "the reported parity error forgets the worst check so far",
        "lightning_cudagraph/_trust/evidence.py::lightning_cudagraph._trust.evidence.largest_so_far",
    ),
    m(
        "_backend/optimizers.py",
        "    if hooks is not None and not whole_step:",
        "    if False:",
        "the optimizer graph captures an optimizer whose step hooks a replay would never run",
        "tests/test_capturable_optimizer.py::"
        "test_an_optimizer_step_hook_keeps_the_optimizer_graph_eager_and_is_the_step_pythons_for_the_whole_step",
    ),
    m(
        "_rollout/step_python.py",
        "        known = known_cause(module) if not (seen.skipped or seen.random or seen.reads) else None",
        "        known = None",
        "eager MoE experts whose operations follow the routing are reported without the experts or the fix",
        "tests/test_capture_hints.py::"
        "test_eager_moe_experts_whose_operations_follow_the_routing_name_the_experts_and_the_fix",
    ),
    # ------------------------------------------------------------------ FSDP2 and the replay watchdog
    m(
        "_backend/watchdog.py",
        "    return max(MIN_BOUND_S, STEPS_IN_BOUND * eager_step_ms / 1000)",
        "    return min(MIN_BOUND_S, STEPS_IN_BOUND * eager_step_ms / 1000)",
        "the default bound is a fraction of a second on a fast model: healthy fits are ended",
        W + "test_the_default_bound_is_generous_and_replay_timeout_s_overrides_it",
    ),
    m(
        "_graphs/step_replay.py",
        "            if watchdog.fired is not None:  # the watchdog aborted",
        "            if watchdog.fired is None:  # the watchdog aborted",
        "training raises the aborted collective's raw error instead of the watchdog's rank and step",
        W + "test_training_that_raises_within_the_grace_period_keeps_the_process_and_gets_the_reason",
    ),
    m(
        "_options/hooks.py",
        '    return owner is not None and type(owner).__module__.startswith("torch.distributed.fsdp._fully_shard")',
        "    return True",
        "a user's hook on a sharded model is taken for FSDP2's own: it runs once at capture and never again",
        R + "test_a_users_hook_on_a_sharded_block_is_refused_under_the_fsdp2_whole_step",
    ),
    m(
        "_rollout/planning.py",
        "        if not (scoped or level.whole_step or level.unavailable):",
        "        if not (scoped or level.unavailable):",
        "scope='auto' under FSDP2 skips the whole step as well: graphs never come on",
        R + "test_auto_under_fsdp2_skips_every_scoped_level_and_keeps_the_whole_step",
    ),
    m(
        "_rollout/sharding.py",
        "    if trainer.accumulate_grad_batches > 1:\n        raise config_error(\n            config.component,\n"
        '            "Trainer(accumulate_grad_batches=...)",',
        "    if trainer.accumulate_grad_batches > 2:\n        raise config_error(\n            config.component,\n"
        '            "Trainer(accumulate_grad_batches=...)",',
        "two micro-batches under FSDP2 are captured with a reduce-scatter the first one must skip",
        R + "test_gradient_accumulation_is_refused_under_fsdp2_and_the_fix_trains",
    ),
    m(
        "_options/hooks.py",
        "            if key is not None and key in collector:",
        "            if False:",
        "a layer whose router logits transformers records by hook replays without them (the auxiliary loss fails)",
        "tests/test_capture_hints.py::"
        "test_a_layer_whose_router_logits_transformers_records_by_hook_stays_eager_and_trains_as_eager",
    ),
    # ------------------------------------------------------------------ the replay watchdog: floor, message, turns
    m(
        "_backend/watchdog.py",
        "while self._pending and self._pending[0].marker is not None and self._pending[0].marker.query():",
        "while self._pending and self._pending[0].marker is not None:",
        "a replay counts as finished once launched: a rank stuck in a replayed collective hangs every rank",
        W + "test_a_replay_that_never_finishes_names_the_rank_and_step_and_ends_the_process",
    ),
    m(
        "_backend/watchdog.py",
        "        self.bound_s = max(asked, floor)",
        "        self.bound_s = asked",
        "replay_timeout_s below one replayed step is kept: a healthy two-rank fit is ended with exit 70",
        W + "test_a_replay_timeout_below_one_replayed_step_leaves_a_healthy_two_rank_fit_alone",
    ),
    m(
        "_backend/watchdog.py",
        "    return max(MIN_FLOOR_S, STEPS_IN_FLOOR * step_ms / 1000)",
        "    return MIN_FLOOR_S",
        "the floor ignores the measured steps: a replay_timeout_s below a slow model's step ends healthy fits",
        W + "test_a_replay_timeout_below_the_measured_steps_is_raised_to_their_floor_with_one_warning",
        W + "test_the_floor_is_ten_measured_steps_and_at_least_a_second",
    ),
    m(
        "_backend/watchdog.py",
        "self._longest_call_ms = _longest(self._longest_call_ms, (now - last.launched) * 1000)",
        "self._longest_call_ms = self._longest_call_ms",
        "a replay call's host time is not measured: a replayed step slower than the eager one (gloo) trips the bound",
        W + "test_a_replay_timeout_below_the_measured_steps_is_raised_to_their_floor_with_one_warning",
    ),
    m(
        "_backend/watchdog.py",
        "        for ms in (self._times.eager_step_ms, self._times.step_ms, self._longest_call_ms):",
        "        for ms in (self._times.eager_step_ms, self._longest_call_ms):",
        "the replayed step time is not read: a replayed step slower than the eager one trips the bound",
        W + "test_a_replay_timeout_below_the_measured_steps_is_raised_to_their_floor_with_one_warning",
    ),
    m(
        "_backend/watchdog.py",
        "            self.step_ms = _longest(self.step_ms, ms)",
        "            self.step_ms = ms",
        "the floor follows the last time read, not the longest: a slow eager step is forgotten",
        W + "test_a_replay_timeout_below_the_measured_steps_is_raised_to_their_floor_with_one_warning",
    ),
    m(
        "_backend/watchdog.py",
        "        if self.timeout_s is not None and floor > asked and not self._warned:",
        "        if self.timeout_s is not None and floor > asked:",
        "the floor's warning repeats at every replay while replay_timeout_s is below it",
        W + "test_a_replay_timeout_below_the_measured_steps_is_raised_to_their_floor_with_one_warning",
    ),
    m(
        "_backend/watchdog.py",
        "        if self.timeout_s is not None and floor > asked and not self._warned:",
        "        if False:",
        "replay_timeout_s is raised to the floor silently: the user never learns the bound is not theirs",
        W + "test_a_replay_timeout_below_the_measured_steps_is_raised_to_their_floor_with_one_warning",
    ),
    m(
        "_backend/watchdog.py",
        "    if seconds < 1:\n        ms = seconds * 1000",
        "    if False:\n        ms = seconds * 1000",
        "a bound below a second is printed in seconds, not in ms",
        W + "test_the_message_names_the_bound_that_fired_and_gives_sub_second_values_in_ms",
        W + "test_a_replay_that_never_finishes_names_the_rank_and_step_and_ends_the_process",
    ),
    m(
        "_backend/watchdog.py",
        "        if self.bound_s > asked:",
        "        if False:",
        "a bound raised to the floor is reported as the user's replay_timeout_s",
        W + "test_the_message_names_the_bound_that_fired_and_gives_sub_second_values_in_ms",
    ),
    m(
        "_backend/watchdog.py",
        " (bound {duration(self.bound_s)}). The bound is {self.which}; it is at least",
        " (bound {duration(self.bound_s)}). The bound is at least",
        "the message does not say which bound fired (replay_timeout_s, the default or the floor)",
        W + "test_the_message_names_the_bound_that_fired_and_gives_sub_second_values_in_ms",
    ),
    m(
        "_backend/watchdog.py",
        "                    self._pending[0].turn = max(self._pending[0].turn, now)",
        "                    pass",
        "a replay waiting behind another is timed from its launch: a healthy pair of pending replays fires",
        W + "test_two_pending_replays_are_each_timed_from_their_turn_on_the_device",
    ),
    m(
        "_backend/watchdog.py",
        "            if self._pending and now - self._pending[0].turn > self.bound_s:",
        "            if self._pending and now - self._pending[0].launched > self.bound_s:",
        "the bound is checked from the launch, not the turn: a pause with two replays pending blames the second",
        W + "test_two_pending_replays_are_each_timed_from_their_turn_on_the_device",
    ),
    # ------------------------------------------------------------------ inputs: clear messages before any GPU work
    m(
        "bucketing.py",
        "        unknown = [key for key in self.pad_values if key != 0]",
        "        unknown = []",
        "pad_values={'labels': -100} for bare tensor samples is ignored again: labels padded with 0, trained on",
        T + "test_a_named_pad_value_for_bare_tensor_samples_is_refused_with_position_zero_as_the_fix",
    ),
    m(
        "bucketing.py",
        "    if value is None:\n        what =",
        "    if False:\n        what =",
        "a None field ends in torch's 'Could not infer dtype of NoneType' again, naming neither field nor sample",
        T + "test_a_none_field_is_named_with_its_sample",
    ),
    m(
        "bucketing.py",
        "        buckets, multiple = _plain_lengths(buckets), plain(multiple)\n        if pad_values",
        "        if pad_values",
        "PadToBucket(buckets=np.array([8, 16])) is refused again as if its lengths were not integers",
        T + "test_numpy_bucket_sizes_and_pad_values",
    ),
    m(
        "_options/activation_checkpoints.py",
        "            pending.append(current.func)",
        "            pass",
        "forward = partial(checkpoint, forward) set on an instance in a captured region is captured (recompute baked"
        " in)",
        T + "test_checkpointing_set_on_an_instances_forward_is_refused_however_it_is_bound",
    ),
    m(
        "_options/activation_checkpoints.py",
        "    pending = [forward]",
        "    pending = [inspect.unwrap(forward)]",
        "a functools.wraps wrapper that checkpoints, set on an instance, is skipped for what it wraps and captured",
        T + "test_checkpointing_set_on_an_instances_forward_is_refused_however_it_is_bound",
    ),
    m(
        "_options/activation_checkpoints.py",
        "            pending.append(type(current).__call__)",
        "            pass",
        "a callable object that checkpoints, set as an instance's forward, is captured (recompute baked in)",
        T + "test_checkpointing_set_on_an_instances_forward_is_refused_however_it_is_bound",
    ),
    m(
        "_options/hooks.py",
        "    if not hooks or not regions:",
        "    if True:",
        "a global module hook stops firing inside replayed regions with no warning",
        T + "test_global_hooks_are_named_with_how_they_were_registered",
        T + "test_a_global_forward_hook_is_named_before_regions_replay_without_it",
    ),
    m(
        "_options/keywords.py",
        "            open_ended = any(p.kind is p.VAR_KEYWORD for p in parameters)",
        "            open_ended = True",
        "DDPCUDAGraphStrategy(find_unused_paramters=True) is accepted, then DDP fails at fit with a TypeError",
        T + "test_a_misspelt_strategy_keyword_is_refused_at_construction_with_the_close_name",
    ),
    m(
        "_options/keywords.py",
        "p.name not in (*reserved, *accepted)",
        "p.name not in accepted",
        "DDPCUDAGraphStrategy(device_ids=[0]) is accepted, then DDP fails at fit (device_ids given twice)",
        T + "test_keywords_lightning_passes_itself_are_refused_and_the_others_still_reach_ddp",
    ),
    m(
        "_options/normalization.py",
        "        return value.tolist()",
        "        return value",
        "warmup_steps=np.int64(2) or max_pool_mib=np.float32(600) is refused as if it were not a number",
        T + "test_numpy_values_are_taken_as_the_python_values_they_hold",
    ),
    m(
        "strategy_base.py",
        "        replay_timeout_s = plain(replay_timeout_s)  # np.float32(600) as 600.0\n",
        "",
        "replay_timeout_s=np.float32(600) is refused as if it were not a number of seconds",
        T + "test_numpy_counts_and_seconds_of_the_strategies",
    ),
    m(
        "model_parallel.py",
        "        if compile is not False and compile is not None:",
        "        if compile is not False:",
        "compile=None, off for the other classes, is refused by the FSDP2 strategy",
        T + "test_compile_none_is_off_everywhere",
    ),
    # ------------------------------------------------------------------ manual optimization
    m(
        "_graphs/scoped.py",
        "return trainer.accumulate_grad_batches > 1 or not trainer.lightning_module.automatic_optimization",
        "return trainer.accumulate_grad_batches > 1",
        "manual accumulation (opt.step every N batches) under scoped graphs: each replayed backward rewrites the"
        " gradient buffer autograd adopted as param.grad, so gradients are doubled, not summed (silently off eager)",
        M + "test_a_layer_scope_trains_as_eager[accumulation]",
        M + "test_scope_auto_never_trains_a_wrong_step_on_its_climb[accumulation]",
    ),
    m(
        "_graphs/routing.py",
        "        if entry.parity_checked:\n            return self._replay(route, entry, args, kwargs)",
        "        if entry.parity_checked:\n            route.replays += 1\n            self.report.replays += 1\n"
        "            return entry.region(args, kwargs)",
        "a confirming or audited step replays the regions already checked without copying out accumulated"
        " gradients: under manual or Lightning accumulation those steps double a micro-batch's gradients",
        M + "test_a_layer_scope_trains_as_eager[accumulation]",
        "tests/test_accumulation.py",
    ),
    m(
        "_graphs/scoped.py",
        "self._begin_graphed_step(graph_set, trainer.global_step, confirming, accumulates_across_steps(trainer))",
        "self._begin_graphed_step(\n                graph_set, trainer.global_step, confirming,"
        " accumulates_across_steps(trainer) and not confirming\n            )",
        "confirming and audit steps forget that gradients carry over between steps: their replays rewrite the"
        " gradient a previous micro-batch left in param.grad",
        M + "test_a_layer_scope_trains_as_eager[accumulation]",
        "tests/test_accumulation.py",
    ),
    # ------------------------------------------------------------------ the suite's blind spots
    # blind spot, class 1: only the first parameter group's settings watched (several = parameter groups: automatic
    # optimization steps one optimizer)
    m(
        "_backend/optimizers.py",
        "for index, (old, new) in enumerate(zip(self.groups, now.groups, strict=True)):",
        "for index, (old, new) in enumerate(zip(self.groups[:1], now.groups[:1], strict=True)):",
        "a setting of the second parameter group moved after capture is never noticed: replays keep the old one",
        B + "test_a_setting_of_the_second_parameter_group_moved_after_capture_rolls_back_and_trains_as_eager",
    ),
    # blind spot, class 1: only the first parameter group's settings snapshotted
    m(
        "_backend/optimizers.py",
        "for group in optimizer.param_groups])",
        "for group in optimizer.param_groups[:1]])",
        "settings snapshots hold the first parameter group only: the others' settings move unseen",
        B + "test_a_setting_of_the_second_parameter_group_moved_after_capture_rolls_back_and_trains_as_eager",
    ),
    # blind spot, class 1: only the first parameter group's learning rate refreshed before a replay
    m(
        "_backend/optimizers.py",
        "for index, (group, lr) in enumerate(zip(self.groups, self.lrs, strict=True)):",
        "for index, (group, lr) in enumerate(zip(self.groups[:1], self.lrs[:1], strict=True)):",
        "a learning rate set by hand on the second parameter group has no effect on replayed whole steps",
        B + "test_a_learning_rate_of_the_second_parameter_group_set_by_hand_takes_effect_on_replayed_steps",
    ),
    # blind spot, class 2: the shadow step's tolerance 10x looser
    m(
        "_trust/shadow.py",
        "    tolerance = step_tolerance(trainer.precision)",
        "    tolerance = 10 * step_tolerance(trainer.precision)",
        "a whole-step graph off eager by up to 1% is trusted",
        B + "test_a_graph_just_outside_the_documented_tolerance_rolls_back_and_one_just_inside_is_kept",
    ),
    # blind spot, class 2: the step table's full-precision figure 10x looser (shadow step and optimizer graph)
    m(
        "_trust/tolerance.py",
        'STEP_TOL = {"full": 1e-3,',
        'STEP_TOL = {"full": 1e-2,',
        "whole-step and optimizer graphs off eager by up to 1% are trusted in float32",
        B + "test_a_graph_just_outside_the_documented_tolerance_rolls_back_and_one_just_inside_is_kept",
    ),
    # blind spot, class 2: the optimizer graph's tolerance 10x looser
    m(
        "_graphs/optimizer_graph.py",
        'OPTIMIZER_TOL = STEP_TOL["full"]',
        'OPTIMIZER_TOL = 10 * STEP_TOL["full"]',
        "an optimizer graph whose update is off eager by up to 1% is trusted",
        B + "test_a_graph_just_outside_the_documented_tolerance_rolls_back_and_one_just_inside_is_kept",
    ),
    # blind spot, class 3: the shadow step never compares the losses
    m(
        "_trust/shadow.py",
        "    if graph_loss is not None and eager_loss is not None:",
        "    if False:",
        "a whole-step graph whose loss is wrong (its update right) is trusted: every logged loss is off",
        B + "test_the_shadow_step_fails_a_graph_that_is_off_eager_in_one_thing_alone[loss-alone]",
    ),
    # blind spot, class 3: the shadow step never compares a micro-batch's gradients
    m(
        "_trust/shadow.py",
        "    if graph_grads is not None:",
        "    if False:",
        "a micro-batch graph that accumulates wrong gradients is trusted (accumulate_grad_batches > 1)",
        B + "test_the_shadow_step_fails_a_graph_that_is_off_eager_in_one_thing_alone[micro-batch-gradient-alone]",
    ),
    # blind spot, class 4: the replayed step's output handed over without a copy
    m(
        "_graphs/step_pieces.py",
        "        return pytree.tree_map(lambda v: v.detach().clone() if isinstance(v, Tensor) else v, self.output)",
        "        return self.output",
        "outputs a user keeps from replayed steps are the static buffers: every later replay rewrites them",
        B + "test_outputs_kept_from_replayed_steps_hold_each_steps_own_values_after_later_replays",
    ),
    # blind spot, class 6: the eager baseline includes the fit's first step
    m(
        "_rollout/step_times.py",
        "        return median(times[1:] if len(times) > 1 else times)",
        "        return median(times)",
        "the eager baseline counts the first step (kernel compilation, caches): speedups and the ladder's bar inflated",
        B + "test_the_report_and_the_logs_give_the_replayed_step_time_and_the_eager_one_without_the_first_step",
        B + "test_a_slow_first_step_does_not_make_a_level_slower_than_eager_look_faster_in_a_short_fit",
    ),
    # blind spot, class 6: cudagraph/step_ms logs the eager baseline
    m(
        "health.py",
        '            "step_ms": self.step_ms,',
        '            "step_ms": self.eager_step_ms,',
        "cudagraph/step_ms logs the eager baseline, not the replayed steps' time",
        B + "test_the_report_and_the_logs_give_the_replayed_step_time_and_the_eager_one_without_the_first_step",
    ),
    # blind spot, class 6: the interval's step time is its slowest step
    m(
        "_rollout/step_times.py",
        "            self.report.step_ms = median(times)",
        "            self.report.step_ms = max(times)",
        "report.step_ms is the slowest step of the interval (an audit's eager step), not its median",
        B + "test_the_report_and_the_logs_give_the_replayed_step_time_and_the_eager_one_without_the_first_step",
    ),
    # blind spot, class 7: the steady-state check compares with the eager time before capture, not eager steps beside
    # the level
    m(
        "_rollout/ladder.py",
        "        self.steady_eager_ms = self.eager_ms if math.isnan(eager_ms) else eager_ms",
        "        self.steady_eager_ms = self.eager_ms",
        "eager training that got faster after capture is never seen: the fit stays on a level slower than eager",
        B + "test_a_settled_level_is_checked_against_eager_steps_timed_beside_it_not_the_eager_time_before_capture",
    ),
    # blind spot, class 8: a settled whole step that fails with skipped_step rolls graphs off instead of stepping down
    m(
        "_rollout/level_failure.py",
        'PYTHON_REASONS = ("step_python", "skipped_step")',
        'PYTHON_REASONS = ("step_python",)',
        "a settled whole step whose capture hit a skipped batch turns graphs off for the rest of the fit",
        B + "test_a_settled_whole_step_whose_new_shape_is_captured_on_a_skipped_batch_goes_down_a_level_not_off",
    ),
    # blind spot, class 2: evaluation at full precision judged with the reduced-precision tolerance (2e-2, not 1e-4)
    m(
        "_rollout/evaluation.py",
        "tolerance = forward_tolerance(self.config.parity_tol, reduced=not full_precision(trainer.precision))",
        "tolerance = forward_tolerance(self.config.parity_tol, reduced=True)",
        "a float32 evaluation graph off eager by up to 2% is kept: val_loss, checkpoints and early stopping move",
        B + "test_an_evaluation_graph_just_outside_the_documented_float32_tolerance_is_dropped_and_one_inside_is_kept",
    ),
    # blind spot, class 9: an optimizer counts as fused when any one of its groups is
    m(
        "_backend/optimizers.py",
        'fused = all(group.get("fused") for group in optimizer.param_groups)',
        'fused = any(group.get("fused") for group in optimizer.param_groups)',
        "an optimizer the package cannot capture is taken into the whole step when one of its groups is fused",
        B + "test_an_optimizer_the_package_cannot_capture_is_refused_when_only_some_of_its_groups_are_fused",
    ),
    # blind spot, class 9: every group given back with the first group's flags
    m(
        "_backend/optimizers.py",
        "for group, saved, number in zip(groups, self._saved, self._numbers, strict=True):",
        "for group, saved, number in zip(groups, [self._saved[0]] * len(groups), self._numbers, strict=True):",
        "an optimizer fused in one group only is given back (and checkpointed) with every group's flags the first's",
        B + "test_an_optimizer_fused_in_one_group_trains_as_eager_and_is_given_back_group_by_group",
    ),
    # blind spot, class 10: a backward pre-hook added inside a captured module after capture is not seen
    m(
        "_trust/evidence.py",
        "        module._backward_pre_hooks,\n    ]",
        "        {},\n    ]",
        "a backward pre-hook added mid-fit inside a captured layer is skipped by every replay, silently",
        B + "test_a_backward_pre_hook_added_inside_a_captured_layer_after_capture_rolls_back_and_trains_as_eager",
    ),
    # blind spot, class 10: backward pre-hooks inside a region at its capture do not keep the region eager
    m(
        "_options/hooks.py",
        '_BACKWARD = ("_backward_pre_hooks", "_backward_hooks")',
        '_BACKWARD = ("_backward_hooks",)',
        "a backward pre-hook inside a captured layer stops firing on replays: the fit trains off eager",
        B + "test_a_layer_with_a_backward_pre_hook_inside_stays_eager_and_the_fit_trains_as_eager",
    ),
    # blind spot, class 5: a capture refused for a metric updated inside it is not undone (the metric counts the
    # capture's update)
    m(
        "_graphs/whole_step.py",
        "        if updated:\n            before.restore()\n",
        "        if updated:\n",
        "a metric updated in a captured step counts the capture's update too: update_count one ahead of eager",
        B + "test_a_metric_updated_in_a_captured_step_is_refused_and_counts_every_step_as_eager",
    ),
    # blind spot, class 7 (second test of entry 9's bug): the ladder's bar in a short fit includes the slow first step
    m(
        "_rollout/step_times.py",
        "        return median(times[1:] if len(times) > 1 else times)",
        "        return median(times)",
        "a short scope='auto' fit keeps a level slower than eager: the bar includes the first (slow) eager step",
        B + "test_a_slow_first_step_does_not_make_a_level_slower_than_eager_look_faster_in_a_short_fit",
    ),
    # ------------------------------------------------------------------ private generators: observed and put back
    m(
        "_trust/snapshot.py",
        "        for held, saved in self.held:\n            held.restore(saved)\n",
        "",
        "a capture or shadow step advances a generator kept on the module (self.rng): the fit's draws shift off eager",
        GEN + "test_a_layer_whose_forward_first_draws_at_its_capture_stays_eager_and_its_generator_as_eager",
        GEN + "test_training_state_puts_back_a_generator_on_a_submodule",
    ),
    m(
        "_trust/fingerprints.py",
        "    for held in held_generators(modules):\n        states.setdefault(held.name, held.fingerprint())\n",
        "",
        "a loss weight drawn from self.rng is frozen into the whole step (replays repeat the captured draw)",
        GEN + "test_a_generator_on_the_module_trains_as_eager_and_is_left_as_eager",
    ),
    m(
        "_trust/generators.py",
        "        return hash(state.numpy().tobytes())",
        "        return 0",
        "a draw from a CPU torch.Generator kept on the module goes unseen: the whole step freezes it",
        GEN + "test_a_generator_on_the_module_trains_as_eager_and_is_left_as_eager[torch-cudagraph_full]",
    ),
    m(
        "_trust/generators.py",
        '        yield from ((f"{name}[{i}]", item) for i, item in enumerate(value) if is_generator(item))',
        "        pass",
        "generators kept in a list attribute (self.rngs[0]) are neither watched nor put back",
        GEN + "test_a_span_names_a_draw_from_a_held_generator",
    ),
    m(
        "_graphs/region_capture.py",
        "        for name in self.drew.keys() - captured.failed.keys():",
        "        for name in ():",
        "a layer whose forward first draws at its capture is kept as a graph: every replay repeats the captured draw",
        GEN + "test_a_layer_whose_forward_first_draws_at_its_capture_stays_eager_and_its_generator_as_eager",
    ),
    m(
        "_graphs/step_capture.py",
        "    if drawn:\n        return (",
        "    if False:\n        return (",
        "a whole step that first draws from self.rng at its capture is kept: every replay repeats that draw",
        GEN + "test_a_whole_step_that_first_draws_at_its_capture_is_refused",
    ),
    # ------------------------------------------------------------------ MoE experts and the precision
    m(
        "_rollout/planning.py",
        "        check_experts_precision(config.component, module, trainer.precision)\n",
        "",
        "a fixed whole step on float32 grouped_mm experts is tried, and fails its capture on the host copy",
        X + "test_a_fixed_whole_step_on_float32_experts_is_refused_before_any_capture",
    ),
    m(
        "_rollout/planning.py",
        "            level = level if problem is None else Level(level.name, unavailable=problem)",
        "            level = level",
        "scope='auto' tries the layers holding float32 experts, whose capture fails on the host copy",
        X + "test_auto_skips_the_levels_holding_float32_experts_with_the_reason",
    ),
    m(
        "experts.py",
        "    if not torch.is_autocast_enabled(device):",
        "    if True:",
        "the autocast experts path runs float32 grouped GEMMs under bf16-mixed: the capture it promises fails",
        X + "test_under_autocast_the_path_is_grouped_mm_on_bfloat16_weights",
    ),
    m(
        "_trust/code_reads.py",
        "        if name in _LIVE:\n            continue\n",
        "",
        "a log override's counter is guarded although replays re-issue self.log: a healthy whole step rolls back",
        "tests/test_lifecycle_full.py::test_a_module_that_overrides_log_has_it_called_for_every_replayed_step",
    ),
    # ------------------------------------------------------------------ the guards and the fed learning rate
    m(
        "_rollout/step_python.py",
        "paused=True, others=callbacks) as seen:",
        "paused=True) as seen:",
        "a callback's counter in on_after_backward counts the captured step only: the whole step freezes its hook",
        P + "test_a_callback_that_counts_inside_the_step_counts_every_step_as_eager",
    ),
    m(
        "_backend/optimizers.py",
        'group["lr"] = number if number is not None and held == _in_float32(number) else held',
        'group["lr"] = held',
        "the learning rate given back after the fit is float32-rounded (0.0010000000474974513 for 1e-3)",
        "tests/test_capturable_optimizer.py::"
        "test_the_learning_rate_given_back_is_the_number_the_user_wrote_not_its_float32_rounding",
    ),
    m(
        "_graphs/whole_step.py",
        "        self.optimizers.refresh()  # a rate written as a number since the last step is the graph's input",
        "        pass  # a rate written as a number since the last step is the graph's input",
        "a hand-written warm-up freezes in the whole step: the capture bakes the number the user wrote",
        G + "test_a_learning_rate_written_by_hand_keeps_the_whole_step",
    ),
    m(
        "_graphs/optimizer_graph.py",
        "        self.optimizers.refresh()  # a rate written as a number since the last step is the graph's input",
        "        pass  # a rate written as a number since the last step is the graph's input",
        "a hand-written warm-up freezes in a scoped level's optimizer graph",
        G + "test_a_scoped_fit_under_the_callback_trains_the_warmup_as_eager",
    ),
    m(
        "_trust/evidence.py",
        "            return self._module_problem() or (self.guards.problem() if self.guards is not None else None)",
        "            return self._module_problem()",
        "no guard is checked before a replay: a value a callback changes trains wrong until an audit",
        G + "test_a_value_changed_between_steps_never_trains_a_wrong_step",
    ),
    m(
        "_trust/module_writes.py",
        "            log.written[(id(module), name)] = (module, name, _writer(sys._getframe(1)))",
        "            pass",
        "writes to module attributes go unnoticed: a temperature or flag a callback sets is frozen",
        G + "test_a_value_changed_between_steps_never_trains_a_wrong_step",
    ),
    m(
        "_trust/guards.py",
        "            self._guard_step(step, step_reads, clipping)",
        "            pass",
        "hparams and the Trainer's clipping value are not guarded in the whole step",
        G + "test_a_guard_names_the_value_and_the_line_that_read_it_before_the_replay",
    ),
    m(
        "_trust/guards.py",
        "        self._guard_user_code(code)",
        "        pass",
        "a module-level dict of settings the step reads is not guarded",
        G + "test_a_guard_names_the_value_and_the_line_that_read_it_before_the_replay",
    ),
    m(
        "_trust/guards.py",
        "            if isinstance(value, _MUTABLE):  # changed in place, which no write shows",
        "            if False:  # changed in place, which no write shows",
        "a list a module holds, changed in place, is not seen",
        G + "test_a_container_changed_in_place_is_a_change",
    ),
    m(
        "_trust/guards.py",
        "                if now is not then and now != then:",
        "                if True:",
        "a value written back unchanged rolls back a healthy fit",
        G + "test_a_value_written_back_unchanged_is_not_a_change",
    ),
    m(
        "_trust/code_reads.py",
        "                queue.extend(_methods(owner, loaded))",
        "                pass",
        "a value read in a method the step calls (not in training_step itself) is not guarded",
        G + "test_a_guard_names_the_value_and_the_line_that_read_it_before_the_replay",
    ),
    m(
        "_graphs/scoped_capture.py",
        '                GuardSet("the regions", inside, fix=GUARD_FIX),',
        "                None,",
        "a value a captured layer's forward reads is not guarded under scoped levels",
        G + "test_the_regions_guard_what_their_forward_reads_and_only_that",
    ),
    m(
        "_graphs/whole_step.py",
        "        self.binding.forget()\n        self.state.release()\n",
        "        self.binding.forget()\n",
        "nn.Module.__setattr__ stays patched after a whole-step fit",
        G + "test_the_write_log_is_gone_after_the_fit",
    ),
    m(
        "_graphs/step_replay.py",
        "            whole.updates.reissue()\n",
        "",
        "a replayed manual step does not tell Lightning's loop about its optimizer steps (global_step stands still)",
        "tests/test_manual_optimization.py::test_the_whole_step_holds_a_manual_step_and_trains_as_eager[control]",
    ),
    m(
        "_graphs/step_capture.py",
        "        toggles.restore()  # a capture that failed inside toggle_optimizer ... untoggle_optimizer\n",
        "",
        "a capture that fails between toggle_optimizer and untoggle_optimizer leaves parameters frozen",
        "tests/test_manual_optimization.py"
        "::test_a_whole_step_capture_that_fails_between_the_toggles_gives_the_parameters_back",
    ),
    m(
        "_graphs/step_capture.py",
        "        return found or (schedule_moved(self._moved, step) if self._moved is not None else None)\n",
        "        return found\n",
        "a scheduler stepped inside a captured manual step is not refused (the replays keep the captured rate)",
        "tests/test_manual_optimization.py"
        "::test_a_scheduler_stepped_inside_a_manual_step_is_refused_and_its_fix_replays_as_eager",
    ),
    m(
        "_graphs/step_capture.py",
        "    if manual and not whole.updates.calls:\n",
        "    if False:\n",
        "a captured manual step that stepped no optimizer is replayed (every replay trains nothing)",
        "tests/test_manual_optimization.py::test_a_manual_step_that_steps_no_optimizer_at_its_capture_is_refused",
    ),
    m(
        "_trust/fused.py",
        "    return torch.stack(offs) / torch.stack(steps).clamp_min(floor)\n",
        "    return torch.stack(offs) * 0\n",
        "the fused comparison sees no difference: every shadow step and audit passes a wrong graph",
        "tests/test_trust.py::test_the_audit_catches_a_graph_that_goes_wrong_in_the_steady_state",
    ),
]


# =================================================================== running
@dataclass
class Outcome:
    """What one mutation's run gave: ``caught``, ``survived`` or ``stale``, and the first failing test."""

    index: int
    mutation: Mutation
    result: str
    caught_by: str = ""
    seconds: float = 0.0


def occurrences(mutation: Mutation, root: Path) -> int:
    """How often the snippet occurs in the file under ``root`` (0 when the file is gone)."""
    path = root / mutation.file
    return path.read_text().count(mutation.find) if path.exists() else 0


def copy_repository(destination: Path) -> Path:
    """A copy of the repository's working tree (what the tests import) under ``destination``."""
    target = destination / "repo"
    shutil.copytree(REPO, target, ignore=IGNORED)
    return target


def pytest_command(tests: tuple[str, ...]) -> list[str]:
    """One quiet pytest run of ``tests`` that stops at the first failure."""
    return [
        sys.executable,
        "-m",
        "pytest",
        "-x",
        "-q",
        "-n",
        "0",
        "-p",
        "no:randomly",
        f"--timeout={TEST_TIMEOUT_S}",
        *tests,
    ]


def environment(root: Path) -> dict[str, str]:
    """The environment of a run in the copy at ``root`` (its package first on the path, no stale bytecode)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    env["PYTHONHASHSEED"] = "0"
    return env


def first_failure(output: str) -> str:
    """The first failing test of a pytest run's short summary (or the first error line)."""
    match = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.MULTILINE)
    if match:
        return match.group(1)
    match = re.search(r"^E\s+(.{0,100})", output, re.MULTILINE)
    return f"(error) {match.group(1)}" if match else "(a failure outside a test)"


def run_mutation(index: int, mutation: Mutation, root: Path, missing: frozenset[str] = frozenset()) -> Outcome:
    """Apply one mutation in the copy at ``root``, run its tests, put the file back."""
    gone = [test for test in mutation.tests if test in missing]
    if gone:
        return Outcome(index, mutation, "stale", f"no such test: {gone[0]}")
    path = root / mutation.file
    original = path.read_text() if path.exists() else ""
    if original.count(mutation.find) != 1:
        return Outcome(index, mutation, "stale", f"snippet found {original.count(mutation.find)} times")
    started = time.perf_counter()
    mutated = original.replace(mutation.find, mutation.replace, 1)
    try:
        compile(mutated, str(path), "exec")
    except SyntaxError as error:  # a test would fail for the wrong reason
        return Outcome(index, mutation, "stale", f"the mutated file does not compile: {error}")
    path.write_text(mutated)
    try:
        done = subprocess.run(  # noqa: S603 (our own pytest command)
            pytest_command(mutation.tests),
            cwd=root,
            env=environment(root),
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return Outcome(
            index, mutation, "caught", f"(hang: no result in {RUN_TIMEOUT_S} s)", time.perf_counter() - started
        )
    finally:
        path.write_text(original)
    seconds = time.perf_counter() - started
    if done.returncode == 0:
        return Outcome(index, mutation, "survived", "", seconds)
    if done.returncode in (4, 5):  # usage error or no tests collected: the entry's test names are wrong
        return Outcome(index, mutation, "stale", f"pytest exit {done.returncode}: {done.stdout[-200:]}", seconds)
    return Outcome(index, mutation, "caught", first_failure(done.stdout + done.stderr), seconds)


def missing_tests(tests: list[str], root: Path) -> set[str]:
    """The test ids (or files) among ``tests`` that pytest cannot find (renamed or removed)."""
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly", *tests]
    done = subprocess.run(command, cwd=root, env=environment(root), capture_output=True, text=True)  # noqa: S603
    output = done.stdout + done.stderr
    lost = [line for line in output.splitlines() if "not found:" in line]
    return {test for test in tests if any(line.endswith(test) for line in lost)}


def baseline(tests: list[str], roots: list[Path]) -> list[str]:
    """The selected tests that fail without any mutation (their entries would be caught for nothing).

    The tests are split over the copies, which run at once.
    """
    chunks = [tests[j :: len(roots)] for j in range(len(roots))]

    def run(chunk: list[str], root: Path) -> list[str]:
        if not chunk:
            return []
        command = [arg for arg in pytest_command(tuple(chunk)) if arg != "-x"]
        done = subprocess.run(command, cwd=root, env=environment(root), capture_output=True, text=True)  # noqa: S603
        return re.findall(r"^(?:FAILED|ERROR) (\S+)", done.stdout, re.MULTILINE)

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(roots)) as pool:
        return [test for failed in pool.map(run, chunks, roots) for test in failed]


def table(outcomes: list[Outcome]) -> str:
    """The outcomes as a markdown table."""
    rows = ["| # | file | mutation | result | caught by | s |", "|---|---|---|---|---|---|"]
    for o in outcomes:
        file = o.mutation.file.removeprefix(PACKAGE + "/")
        rows.append(f"| {o.index} | {file} | {o.mutation.description} | {o.result} | {o.caught_by} | {o.seconds:.0f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Run the chosen mutations; 1 when one survived or is stale."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2, help="mutations run at once (one repository copy each)")
    parser.add_argument("--only", default="", help="comma-separated entry numbers (1-based)")
    parser.add_argument("--list", action="store_true", help="list the entries and whether their snippets are found")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the catching tests")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)

    chosen = [(i, mutation) for i, mutation in enumerate(MUTATIONS, 1)]
    if args.only:
        wanted = {int(n) for n in args.only.split(",")}
        chosen = [(i, mutation) for i, mutation in chosen if i in wanted]
    modules = {path.relative_to(REPO).as_posix() for path in (REPO / PACKAGE).rglob("*.py")}
    untouched = sorted(modules - {mutation.file for mutation in MUTATIONS})
    if args.list:
        for i, mutation in chosen:
            print(f"{i:3d} {occurrences(mutation, REPO)}x {mutation.file}: {mutation.description}")
        print(f"{len(MUTATIONS)} entries; modules without one: {', '.join(untouched) or 'none'}")
        return 0

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mutations-") as scratch:
        roots = [copy_repository(Path(scratch) / f"job{j}") for j in range(max(1, args.jobs))]
        missing = missing_tests(sorted({test for _, mutation in chosen for test in mutation.tests}), roots[0])
        if missing:
            print(f"tests that no longer exist (their entries are stale): {sorted(missing)}", flush=True)
        if not args.no_baseline:
            first_tests = sorted({mutation.tests[0] for _, mutation in chosen} - missing)
            broken = baseline(first_tests, roots)
            if broken:
                print(f"unmutated failures (their entries cannot be trusted): {broken}", flush=True)
        free = list(roots)
        outcomes: list[Outcome] = []
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(roots)) as pool:
            pending = {}
            queue = list(chosen)
            while queue or pending:
                while queue and free:
                    index, mutation = queue.pop(0)
                    root = free.pop()
                    pending[pool.submit(run_mutation, index, mutation, root, frozenset(missing))] = root
                done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in done:
                    free.append(pending.pop(future))
                    outcome = future.result()
                    outcomes.append(outcome)
                    print(
                        f"[{len(outcomes)}/{len(chosen)}] #{outcome.index} {outcome.result:8s} {outcome.seconds:5.0f}s"
                        f" {outcome.mutation.file}: {outcome.mutation.description} -> {outcome.caught_by}",
                        flush=True,
                    )
    outcomes.sort(key=lambda o: o.index)
    text = table(outcomes)
    print()
    print(text)
    if args.markdown is not None:
        args.markdown.write_text(text + "\n")
    counts = {result: sum(o.result == result for o in outcomes) for result in ("caught", "survived", "stale")}
    minutes = (time.perf_counter() - started) / 60
    print(f"\nmodules without an entry: {', '.join(untouched) or 'none'}; {minutes:.1f} min")
    print(f"{counts['caught']} caught, {counts['survived']} survived, {counts['stale']} stale")
    return 0 if counts["survived"] == counts["stale"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
