"""Two GPUs (issue 42): FSDP2 and DDP, eager Lightning against the package's graphs, in one torchrun launch.

    torchrun --standalone --nproc-per-node 2 benchmarks/multi_gpu.py --out benchmarks/results/multi_gpu
    torchrun --standalone --nproc-per-node 2 benchmarks/multi_gpu.py --out DIR --models gpt --precision bf16-mixed
    torchrun --standalone --nproc-per-node 2 benchmarks/multi_gpu.py --out DIR --check-release   # a launch of its own
    torchrun --standalone --nproc-per-node 2 benchmarks/multi_gpu.py --out DIR --stall           # a launch of its own
    torchrun --standalone --nproc-per-node 2 benchmarks/multi_gpu.py --out DIR --cpu-smoke  # plumbing only (gloo)

Per model (the small GPT with 8 layers; a Hugging Face Llama where transformers is installed), every rank trains
eager ``ModelParallelStrategy`` (FSDP2), ``fsdp2_cudagraph_full``, eager ``DDPStrategy``, ``ddp_cudagraph_full`` and
``ddp_cudagraph`` in alternated rounds: ms per step, speedup over the eager fit of the same family, loss and parameter
parity, peak memory per rank, both ranks' parameters equal, graphs released at fit end. Rank 0 writes
``DIR/multi_gpu_{precision}.json`` (``multi_gpu_cpu_smoke_...`` for the smoke run) and prints a Markdown table; the
fault launches write ``DIR/release_rank{r}.json`` or ``DIR/stall_rank{r}.json``. Without CUDA (and without
``--cpu-smoke``) it says so and exits with code 2. No figure exists yet: two GPUs were not lent.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import itertools
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from typing_extensions import override

from benchmarks.core import records
from benchmarks.core.figures import fastest_round, finite, ratio, spread
from benchmarks.core.models import CONFIGS, HF_SEQ_LEN, graph_callback, model_args, report_figures
from benchmarks.core.timing import failure_note, fresh_device, in_turns, progress_line
from lightning_cudagraph._backend import watchdog
from lightning_cudagraph._rollout.preflight import DDP_WHOLE_STEP_WARMUP_STEPS

#: Variant -> (family, how it trains: ``None`` eager, else a registered strategy name of the package).
VARIANTS: dict[str, tuple[str, str | None]] = {
    "fsdp2_eager": ("fsdp2", None),
    "fsdp2_full": ("fsdp2", "fsdp2_cudagraph_full"),
    "ddp_eager": ("ddp", None),
    "ddp_full": ("ddp", "ddp_cudagraph_full"),
    "ddp_auto": ("ddp", "ddp_cudagraph"),
}
EAGER = {"fsdp2": "fsdp2_eager", "ddp": "ddp_eager"}
MODELS = ("gpt", "llama")
#: The GPT of the issue's goal: width 256, 8 layers, micro-batch 8 (eager FSDP2 is launch-bound there).
GPT = {**CONFIGS["small"], "n_layer": 8}
LLAMA_BATCH_SIZE = 8
#: The CPU smoke run: tiny models, a few steps, one round.
SMOKE_GPT = {**CONFIGS["tiny"], "n_layer": 2}
SMOKE_LLAMA = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 4, "intermediate_size": 128, "max_position_embeddings": 64}  # fmt: skip
SMOKE_STEPS, SMOKE_TIMED = 4, 2
#: Goal of the issue: the FSDP2 whole step at least this much faster than eager FSDP2 on the small GPT.
GOAL = 2.0
#: Collectives of the benchmark fits give up after this long instead of hanging.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
#: ``--check-release`` and ``--stall``: the collective timeout, the replay watchdog's bound, and steps after capture.
FAULT_COLLECTIVE_TIMEOUT = timedelta(seconds=60)
RELEASE_TIMEOUT_S, STALL_TIMEOUT_S = 20.0, 10.0
STEPS_AFTER_CAPTURE = 6
#: How long rank 1 sleeps in ``--stall`` (rank 0's watchdog ends the launch long before).
STALL_S = 600.0
WATCHDOG_LOGGER = "lightning_cudagraph._backend.watchdog"


# ---------------------------------------------------------------------------------------------------- options
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options (exits with code 2 on a bad one)."""
    parser = records.timed_parser(__doc__, steps=200, timed=60, rounds=3)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated from {', '.join(MODELS)}")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated from {', '.join(VARIANTS)}")
    parser.add_argument("--precision", choices=("32-true", "bf16-mixed"), default="32-true")
    mode = parser.add_mutually_exclusive_group()
    graphed = [v for v, (_, name) in VARIANTS.items() if name is not None]
    mode.add_argument(
        "--check-release",
        nargs="?",
        const="fsdp2_full",
        choices=graphed,
        metavar="VARIANT",
        help="rank 1 raises mid-fit; check that every rank released its graphs (default: fsdp2_full)",
    )
    mode.add_argument("--stall", nargs="?", const="ddp_full", choices=graphed, metavar="VARIANT",
                      help=f"rank 1 stalls after capture; rank 0's replay watchdog ({STALL_TIMEOUT_S:.0f} s) must end"
                      " the launch with status 70 (default: ddp_full)")  # fmt: skip
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help=f"the plumbing on the CPU over gloo: tiny models, {SMOKE_STEPS} steps, one round",
    )
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        args.steps, args.timed, args.rounds = SMOKE_STEPS, SMOKE_TIMED, 1
    else:
        records.check_timed(parser, args, untimed=DDP_WHOLE_STEP_WARMUP_STEPS + 3)
    args.models = records.names(parser, "--models", args.models, MODELS)
    args.variants = records.names(parser, "--variants", args.variants, list(VARIANTS))
    return args


# ---------------------------------------------------------------------------------------------------- models
def build(model: str, smoke: bool) -> tuple[pl.LightningModule, Any]:
    """The seeded model (FSDP2-ready: ``configure_model`` shards each block, then the root) and its data."""
    from examples.gpt import GPTModule, TokenDataModule

    config = build_config(model, smoke)
    pl.seed_everything(0, verbose=False)
    if model == "gpt":
        module: pl.LightningModule = sharded(GPTModule, lambda m: m.model.blocks, lambda m: m)(**model_args(config))
        vocab = config["vocab_size"]
    else:
        from examples.hf_causal_lm import HFCausalLM

        options = {key: value for key, value in config.items() if key not in ("seq_len", "batch_size")}
        module = sharded(HFCausalLM, lambda m: m.model.model.layers, lambda m: m.model)(**options)
        vocab = module.hparams["vocab_size"]
    batch = config["batch_size"]
    data = TokenDataModule(vocab, config["seq_len"], batch_size=batch, train_samples=64 * batch, val_samples=8)
    return module, data


def build_config(model: str, smoke: bool) -> dict[str, Any]:
    """A model's constructor arguments, sequence length and micro-batch, as the record states them."""
    if model == "gpt":
        return dict(SMOKE_GPT if smoke else GPT)
    seq, batch = (32, 4) if smoke else (HF_SEQ_LEN, LLAMA_BATCH_SIZE)
    return {"kind": "llama", **(SMOKE_LLAMA if smoke else {}), "seq_len": seq, "batch_size": batch}


def sharded(
    cls: type[pl.LightningModule], blocks: Callable[[Any], Any], root: Callable[[Any], torch.nn.Module]
) -> type[pl.LightningModule]:
    """``cls`` with a ``configure_model`` that applies ``fully_shard`` under FSDP2 (a no-op under DDP).

    Each block is sharded, then ``root``: the module whose ``forward`` the training step calls (FSDP2 gathers the
    root's own parameters in that forward's hook). The GPT's step calls ``self(x)``, the Llama's ``self.model(...)``.
    """

    class Sharded(cls):  # type: ignore[misc, valid-type]
        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            if self.device_mesh is None or getattr(self, "_fsdp2_applied", False):
                return
            mesh = self.device_mesh["data_parallel"]
            for block in blocks(self):
                fully_shard(block, mesh=mesh)
            fully_shard(root(self), mesh=mesh)
            self._fsdp2_applied = True

    Sharded.__name__ = Sharded.__qualname__ = f"Sharded{cls.__name__}"
    return Sharded


def strategy_for(variant: str, smoke: bool, **graph_options: Any) -> Any:
    """The variant's strategy, with the collective timeout (and ``graph_options`` for a graphed one)."""
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, StrategyRegistry

    family, name = VARIANTS[variant]
    group: dict[str, Any] = {"process_group_backend": "gloo" if smoke else "nccl", "timeout": COLLECTIVE_TIMEOUT}
    if name is None:
        if family == "fsdp2":
            return ModelParallelStrategy(data_parallel_size=world_size(), tensor_parallel_size=1, **group)
        return DDPStrategy(**group)
    import lightning_cudagraph  # noqa: F401  (registers the names)

    entry = StrategyRegistry[name]
    return entry["strategy"](**{**entry["init_params"], **graph_options}, **group)


def world_size() -> int:
    """The launch's process count (torchrun's ``WORLD_SIZE``)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def make_trainer(
    steps: int, callbacks: Sequence[pl.Callback], strategy: Any, precision: Any, smoke: bool
) -> pl.Trainer:
    """A Trainer over every rank of the launch that only trains (no logger, checkpoints, bar or validation)."""
    return pl.Trainer(accelerator="cpu" if smoke else "cuda", devices=world_size(), strategy=strategy,
                      precision=precision, max_steps=steps, callbacks=list(callbacks), logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0)  # fmt: skip


# ---------------------------------------------------------------------------------------------------- measuring
class Clock(pl.Callback):
    """A CUDA event (on a CPU, the host clock) at every batch start and at the end of training; every loss kept.

    Losses stay on the device until the fit ends (one host read then).
    """

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: list[Any] = []
        self.losses: list[torch.Tensor] = []

    def _mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, idx: int) -> None:
        self._mark()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.losses.append(outputs["loss"].detach().clone())

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._mark()

    def step_ms(self, skip: int) -> list[float]:
        """Milliseconds between consecutive batch starts from step ``skip`` on (the last to the end of training)."""
        marks = self.marks[skip:]
        if self.cuda:
            marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in itertools.pairwise(marks)]
        return [(b - a) * 1e3 for a, b in itertools.pairwise(marks)]

    def loss_values(self) -> list[float]:
        return torch.stack(self.losses).float().tolist() if self.losses else []


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor whole on this process: FSDP2's ``DTensor`` gathered (a collective on every rank)."""
    from torch.distributed.tensor import DTensor

    tensor = tensor.detach()
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, as a float32 CPU copy, by name (in the same order on every rank)."""
    return {name: whole(p).float().cpu().clone() for name, p in sorted(module.named_parameters())}


def fingerprint(params: dict[str, torch.Tensor]) -> str:
    """A digest of the parameters' names and bytes: equal on every rank when the ranks hold the same model."""
    digest = hashlib.sha256()
    for name, values in params.items():
        digest.update(name.encode())
        digest.update(values.contiguous().numpy().tobytes())
    return digest.hexdigest()


def graph_pool_bytes() -> int | None:
    """Bytes still allocated in private (graph) memory pools: zero once every graph is released (``None``: no CUDA)."""
    if not torch.cuda.is_available():
        return None
    return sum(
        block["size"]
        for segment in torch.cuda.memory_snapshot()
        if tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0)
        for block in segment["blocks"]
        if block["state"] == "active_allocated"
    )


def fit_once(model: str, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """Train one variant once on this rank: step times, losses, whole parameters, peak memory, the report."""
    cuda = not args.cpu_smoke
    module, data = build(model, args.cpu_smoke)
    clock = Clock(cuda)
    trainer = make_trainer(args.steps, [clock], strategy_for(variant, args.cpu_smoke), args.precision, args.cpu_smoke)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(module, data)
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    callback = graph_callback(trainer)
    report = report_figures(callback)
    params = parameters(module)
    return {
        "variant": variant,
        **spread(clock.step_ms(args.steps - args.timed)),
        "peak_mib": finite(peak),
        "losses": clock.loss_values(),
        "params": params,
        "fingerprint": fingerprint(params),
        "report": report,
        "graphs_at_fit_end": None if callback is None else callback.report.graphs,
        "note": "",
    }


def measured(model: str, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """:func:`fit_once`, then what the fit left in graph pools; a variant that raises is noted, not raised."""
    try:
        fit = fit_once(model, variant, args)
    except Exception as err:
        fit = {"variant": variant, "median_ms": None, "note": failure_note(err)}
    fresh_device()
    fit["graph_pool_bytes_after"] = graph_pool_bytes()
    return fit


def parity(reference: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Largest per-step loss difference and largest relative parameter difference of ``other`` against ``reference``."""
    if "params" not in reference or "params" not in other:
        return {"max_loss_diff": None, "max_rel_param_diff": None, "worst_param": None}
    loss = max((abs(a - b) for a, b in zip(reference["losses"], other["losses"], strict=True)), default=None)
    relative = {
        name: float((other["params"][name] - p).norm() / p.norm().clamp_min(1e-12))
        for name, p in reference["params"].items()
    }
    worst = max(relative, key=relative.__getitem__)
    return {"max_loss_diff": finite(loss), "max_rel_param_diff": finite(relative[worst]), "worst_param": worst}


def measure_model(model: str, args: argparse.Namespace, rank: int) -> dict[str, Any]:
    """This rank's figures of every variant of one model: fastest round, speedup, parity, memory, release."""
    say = print if rank == 0 else (lambda line: None)
    say(f"[{model}] {', '.join(args.variants)}: {args.rounds} round(s) of {args.steps} steps")
    fits = in_turns(
        args.variants,
        args.rounds,
        lambda variant: measured(model, variant, args),
        lambda index, fit: f"[{model}]" + progress_line(fit, index - 1),
        say,
    )
    first = {variant: got[0] for variant, got in fits.items()}
    results = []
    for variant in args.variants:
        family = VARIANTS[variant][0]
        best = fastest_round(fits[variant])
        eager = EAGER[family]
        eager_best = fastest_round(fits[eager]) if eager in fits else {}
        eager_fsdp2 = first.get("fsdp2_eager", {}).get("peak_mib")
        results.append({
            "variant": variant, "family": family, "strategy": VARIANTS[variant][1] or f"eager {family}",
            **{key: best.get(key) for key in ("median_ms", "p25_ms", "p75_ms", "steps_timed", "round_ms", "note")},
            "speedup": ratio(eager_best.get("median_ms"), best.get("median_ms")),
            **(parity(first[eager], first[variant]) if eager in first else parity({}, {})),
            "peak_mib": first[variant].get("peak_mib"),
            "memory_vs_eager_fsdp2": ratio(first[variant].get("peak_mib"), eager_fsdp2),
            "fingerprint": first[variant].get("fingerprint"),
            "report": first[variant].get("report"),
            "graphs_at_fit_end": first[variant].get("graphs_at_fit_end"),
            "graph_pool_bytes_after": first[variant].get("graph_pool_bytes_after"),
        })  # fmt: skip
    return {"rank": rank, "results": results}


def merged(model: str, config: dict[str, Any], ranks: list[dict[str, Any]], smoke: bool) -> dict[str, Any]:
    """One model's record from every rank's figures: rank 0's times, per-rank memory and reports, rank agreement."""
    rows = []
    for index, row in enumerate(ranks[0]["results"]):
        per_rank = [got["results"][index] for got in ranks]
        prints = {got.get("fingerprint") for got in per_rank}
        released = [  # None: the fit failed
            None
            if got.get("fingerprint") is None
            else got.get("graphs_at_fit_end") in (0, None) and got.get("graph_pool_bytes_after") in (0, None)
            for got in per_rank
        ]
        losses = [got.get("max_loss_diff") for got in per_rank]
        params = [got.get("max_rel_param_diff") for got in per_rank]
        rows.append({
            "variant": row["variant"], "family": row["family"], "strategy": row["strategy"],
            **{key: row[key] for key in ("median_ms", "p25_ms", "p75_ms", "steps_timed", "round_ms", "speedup")},
            "median_ms_per_rank": [got.get("median_ms") for got in per_rank],
            "speedup_per_rank": [got.get("speedup") for got in per_rank],
            "max_loss_diff": max((x for x in losses if x is not None), default=None),
            "max_rel_param_diff": max((x for x in params if x is not None), default=None),
            "peak_mib_per_rank": [got.get("peak_mib") for got in per_rank],
            "memory_vs_eager_fsdp2_per_rank": [got.get("memory_vs_eager_fsdp2") for got in per_rank],
            "ranks_equal": None if None in prints else len(prints) == 1,
            "fingerprints": [got.get("fingerprint") for got in per_rank],
            "released_at_fit_end": None if None in released else all(released), "released_per_rank": released,
            "reports": [got.get("report") for got in per_rank],
            "note": "; ".join(dict.fromkeys(got.get("note") or "" for got in per_rank)).strip("; "),
        })  # fmt: skip
    record: dict[str, Any] = {"config": config, "results": rows}
    found = {row["variant"]: row for row in rows}
    if model == "gpt" and not smoke and "fsdp2_full" in found:
        speedup = found["fsdp2_full"]["speedup"]
        record["goal"] = {"speedup": GOAL, "got": speedup, "met": None if speedup is None else speedup >= GOAL}
    return record


def table(models: dict[str, dict[str, Any]]) -> str:
    """The Markdown table of a record's models and variants."""
    head = (
        "| model | variant | ms/step (rank 0) | speedup vs eager | max loss diff | max rel param diff |"
        " peak MiB per rank | memory vs eager FSDP2 | ranks equal | stage, level | replays | released |"
    )
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    number = lambda x, spec, unit="": "n/a" if x is None else format(x, spec) + unit  # noqa: E731
    notes = []
    for model, got in models.items():
        for row in got["results"]:
            report = (row["reports"] or [None])[0] or {}
            stage = f"{report.get('stage', 'n/a').lower()}{', ' + report['level'] if report.get('level') else ''}"
            if not report:
                stage = "eager" if VARIANTS[row["variant"]][1] is None else "n/a"
            if row["note"]:
                notes.append(f"- {model} {row['variant']}: {row['note']}")
            peaks = " / ".join(number(x, ".0f") for x in row["peak_mib_per_rank"])
            memory = " / ".join(number(x, ".2f") for x in row["memory_vs_eager_fsdp2_per_rank"])
            lines.append(
                f"| {model} | {row['variant']} | {number(row['median_ms'], '.3f')}"
                f" | {number(row['speedup'], '.2f', 'x')}"
                f" | {number(row['max_loss_diff'], '.2e')} | {number(row['max_rel_param_diff'], '.2e')} | {peaks}"
                f" | {memory} | {row['ranks_equal']} | {stage}"
                f" | {report.get('replays', 'n/a')} | {row['released_at_fit_end']} |"
            )
    return "\n".join([*lines, *(["", *notes] if notes else [])])


def benchmark(args: argparse.Namespace, rank: int) -> int:
    """Every model and variant; rank 0 writes the JSON and prints the table."""
    models: dict[str, dict[str, Any]] = {}
    for model in args.models:
        if model == "llama" and not has_transformers():
            if rank == 0:
                print("[llama] skipped: transformers is not installed")
            continue
        mine = measure_model(model, args, rank)
        ranks: list[Any] = [None] * world_size()
        dist.all_gather_object(ranks, mine)
        models[model] = merged(model, build_config(model, args.cpu_smoke), ranks, args.cpu_smoke)
    if rank == 0:
        record = {
            "kind": "multi_gpu", "cpu_smoke": args.cpu_smoke, "world_size": world_size(),
            "precision": args.precision, "steps": args.steps, "timed": args.timed, "rounds": args.rounds,
            "variants": list(args.variants), "goal": GOAL, "environment": records.environment(), "models": models,
        }  # fmt: skip
        stem = f"multi_gpu{'_cpu_smoke' if args.cpu_smoke else ''}_{args.precision}"
        path = records.write(record, args.out / f"{stem}.json")
        print(table(models))
        if args.cpu_smoke:
            print("--cpu-smoke: the plumbing only (graphs are off on a CPU); its times are no figures")
        print(f"wrote {path}")
    return 0


def has_transformers() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None


# ---------------------------------------------------------------------------------------------------- faults
class RaiseAt(pl.Callback):
    """Rank 1 raises at the start of step ``step`` (on the host, before that step's replay is launched)."""

    MESSAGE = "injected by benchmarks/multi_gpu.py: rank 1 raises"

    def __init__(self, step: int) -> None:
        self.step = step
        self.raised_at: float | None = None

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, idx: int) -> None:
        if trainer.global_rank == 1 and trainer.global_step == self.step:
            self.raised_at = time.time()
            raise RuntimeError(f"{self.MESSAGE} at step {self.step}")


class StallAt(pl.Callback):
    """Rank 1 sleeps on the host at the start of step ``step``, so it never launches that step's replay.

    While it sleeps it watches rank 0's process; when rank 0 has ended (or the launcher sends SIGTERM), it writes
    ``DIR/stall_rank1.json``: how long after the stall rank 0 ended, and whether rank 0's log holds the watchdog's
    message. Then it ends its own process.
    """

    def __init__(self, step: int, out: Path, rank0_pid: int, bound_s: float) -> None:
        self.step, self.out, self.rank0_pid, self.bound_s = step, out, rank0_pid, bound_s

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, idx: int) -> None:
        if trainer.global_rank != 1 or trainer.global_step != self.step:
            return
        report = graph_callback(trainer)
        stage = None if report is None else report.report.stage.name
        terminated: list[int] = []
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: terminated.append(signum))
        started = time.time()
        print(f"[rank 1] stalls at step {self.step} (stage {stage}) for up to {STALL_S:.0f} s", flush=True)
        while time.time() - started < STALL_S and not terminated and alive(self.rank0_pid):
            time.sleep(0.2)
        waited = time.time() - started
        signal.signal(signal.SIGTERM, previous)
        log = self.out / "stall_rank0.log"
        text = log.read_text() if log.exists() else ""
        limit = self.bound_s + watchdog.GRACE_S + 5.0
        record = {
            "rank": 1, "step": self.step, "stage_at_stall": stage, "stalled_at": started,
            "rank0_ended_after_s": None if alive(self.rank0_pid) else round(waited, 2),
            "sigterm_after_s": round(waited, 2) if terminated else None,
            "watchdog_message_in_rank0_log": "replay watchdog: rank 0" in text,
            "within_bound_and_grace": waited <= limit, "limit_s": limit,
        }  # fmt: skip
        write_json(self.out / "stall_rank1.json", record)
        print(f"[rank 1] {json.dumps(record)}", flush=True)
        os._exit(0)


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, ended but not yet reaped, counts as ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    status = Path(f"/proc/{pid}/status")
    try:
        return "\nState:\tZ" not in status.read_text()
    except OSError:
        return True


def write_json(path: Path, record: dict[str, Any]) -> None:
    """Write ``record`` atomically (a rank ended mid-write leaves the previous file or none, never half of one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(record, indent=1, default=str))
    partial.replace(path)


def fault_steps(variant: str) -> int:
    """The step of a fault: after the variant's eager warmup, capture and confirmation."""
    warmup = DDP_WHOLE_STEP_WARMUP_STEPS if variant == "ddp_full" else 3
    return warmup + STEPS_AFTER_CAPTURE if variant != "ddp_auto" else 80


def check_release(args: argparse.Namespace, rank: int) -> int:
    """Rank 1 raises mid-fit; each rank checks that the package released its graphs and that its fit ended.

    Writes ``DIR/release_rank{r}.json`` on each rank. Rank 1 then waits (at most the watchdog's bound and grace and
    a minute) for rank 0's record, so that rank 0's replay watchdog, not the launcher, ends rank 0's wait.
    """
    variant, model = args.check_release, args.models[0]
    step = fault_steps(variant)
    raiser = RaiseAt(step)
    module, data = build(model, args.cpu_smoke)
    strategy = strategy_for(variant, args.cpu_smoke, replay_timeout_s=RELEASE_TIMEOUT_S)
    trainer = make_trainer(step + 10, [raiser], strategy, args.precision, args.cpu_smoke)
    if rank == 0:
        print(
            f"--check-release: {model}, {variant}; rank 1 raises at step {step}. Expected: rank 1's fit raises the"
            f" injected error and releases its graphs; rank 0 does not hang (its replay watchdog, bound"
            f" {RELEASE_TIMEOUT_S:.0f} s, or the collective timeout ends its wait) and releases too.",
            flush=True,
        )
    started, error = time.time(), None
    try:
        trainer.fit(module, data)
    except BaseException as err:  # a SystemExit too: record it
        error = err
    ended = time.time()
    callback = graph_callback(trainer)
    report = None if callback is None else callback.report
    del trainer, module
    gc.collect()
    pool = graph_pool_bytes()
    released = (report is None or report.graphs == 0) and pool in (0, None)
    record = {
        "rank": rank, "model": model, "variant": variant, "raise_step": step, "raised_at": raiser.raised_at,
        "started": started, "ended": ended, "fit_s": round(ended - started, 2),
        "error": None if error is None else f"{type(error).__name__}: {str(error)[:500]}",
        "stage": None if report is None else report.stage.name, "reason": None if report is None else report.reason,
        "replays": None if report is None else report.replays, "graphs_left": None if report is None else report.graphs,
        "graph_pool_bytes": pool, "released": released,
        "expected_error": rank != 1 or (error is not None and RaiseAt.MESSAGE in str(error)),
    }  # fmt: skip
    write_json(args.out / f"release_rank{rank}.json", record)
    print(f"[rank {rank}] release: {json.dumps(record)}", flush=True)
    if rank == 1:
        deadline = time.time() + RELEASE_TIMEOUT_S + watchdog.GRACE_S + 60
        while time.time() < deadline and not (args.out / "release_rank0.json").exists():
            time.sleep(0.5)
    ok = released and record["expected_error"]
    sys.stdout.flush()
    os._exit(0 if ok else 1)  # the process group may be aborted: no teardown that could wait on it


def stall(args: argparse.Namespace, rank: int) -> int:
    """The replay watchdog over NCCL: rank 1 stops before a replay; rank 0's watchdog must end the launch.

    Rank 0 logs the watchdog to ``DIR/stall_rank0.log``; rank 1 writes ``DIR/stall_rank1.json`` when rank 0 ended.
    """
    variant, model = args.stall, args.models[0]
    step = fault_steps(variant)
    pids: list[Any] = [None] * world_size()
    dist.all_gather_object(pids, os.getpid())
    limit = STALL_TIMEOUT_S + watchdog.GRACE_S
    expect = (
        f"--stall: {model}, {variant} with replay_timeout_s={STALL_TIMEOUT_S:.0f}; rank 1 sleeps on the host at step"
        f" {step}, after capture. Expected: within {limit:.0f} s (bound + grace) rank 0 logs 'replay watchdog: rank 0"
        f" waited ...' (in {args.out / 'stall_rank0.log'} and on stderr) and exits with status {watchdog.EXIT_CODE};"
        f" torchrun reports 'exitcode: {watchdog.EXIT_CODE}' for local_rank 0 and ends rank 1, which writes"
        f" {args.out / 'stall_rank1.json'} first. If training raises on its own after the abort, rank 0 writes"
        f" {args.out / 'stall_rank0.json'} with the error and exits with status 1 instead."
    )
    if rank == 0:
        print(expect, flush=True)
        handler = logging.FileHandler(args.out / "stall_rank0.log")
        logging.getLogger(WATCHDOG_LOGGER).addHandler(handler)
    write_json(args.out / f"stall_rank{rank}.json", {"rank": rank, "status": "started", "expect": expect})
    module, data = build(model, args.cpu_smoke)
    strategy = strategy_for(variant, args.cpu_smoke, replay_timeout_s=STALL_TIMEOUT_S)
    callbacks = [StallAt(step, args.out, pids[0], STALL_TIMEOUT_S)]
    trainer = make_trainer(step + 10, callbacks, strategy, args.precision, args.cpu_smoke)
    error = None
    try:
        trainer.fit(module, data)
    except BaseException as err:
        error = err
    callback = graph_callback(trainer)
    record = {
        "rank": rank, "status": "fit ended", "error": None if error is None else f"{type(error).__name__}: {error}",
        "stage": None if callback is None else callback.report.stage.name, "expect": expect,
    }  # fmt: skip
    write_json(args.out / f"stall_rank{rank}.json", record)
    print(f"[rank {rank}] stall: {json.dumps(record)[:1000]}", flush=True)
    os._exit(1)  # reached only where the watchdog did not end the process


# ---------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.cpu_smoke and records.needs_cuda("multi_gpu.py"):
        return 2
    if world_size() < 2 or "LOCAL_RANK" not in os.environ:
        print("benchmarks/multi_gpu.py runs one process per device: torchrun --standalone --nproc-per-node 2 ...")
        return 2
    if not args.cpu_smoke and torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", world_size())):
        print(f"benchmarks/multi_gpu.py needs one CUDA GPU per process; {torch.cuda.device_count()} visible.")
        return 2
    if args.cpu_smoke:
        logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    else:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # before anything touches CUDA: no context on GPU 0
    args.out.mkdir(parents=True, exist_ok=True)
    faulty = args.check_release or args.stall
    dist.init_process_group(  # Lightning finds it initialized and uses it
        "gloo" if args.cpu_smoke else "nccl", timeout=FAULT_COLLECTIVE_TIMEOUT if faulty else COLLECTIVE_TIMEOUT
    )
    rank = dist.get_rank()
    if args.check_release:
        return check_release(args, rank)
    if args.stall:
        return stall(args, rank)
    code = benchmark(args, rank)
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    raise SystemExit(main())
