"""Shared test helpers: the example GPT at test sizes, and callbacks that observe training."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from examples.gpt import GPTModule, TokenDataModule

SMALL = {"vocab_size": 1024, "seq_len": 128, "n_layer": 6, "width": 256, "heads": 4}
TINY = {"vocab_size": 64, "seq_len": 16, "n_layer": 2, "width": 32, "heads": 2}


def gpt(size: dict, **overrides) -> tuple[GPTModule, TokenDataModule]:
    """A seeded GPT and its data module."""
    pl.seed_everything(0, verbose=False)
    model_args = {**size, **{k: v for k, v in overrides.items() if k in GPTModule.__init__.__code__.co_varnames}}
    data_args = {k: v for k, v in overrides.items() if k in TokenDataModule.__init__.__code__.co_varnames}
    data = TokenDataModule(vocab_size=size["vocab_size"], seq_len=size["seq_len"], **data_args)
    return GPTModule(**model_args), data


def trainer(max_steps: int, callbacks: list | None = None, **kwargs) -> pl.Trainer:
    """A quiet Trainer for tests."""
    options = {
        "max_steps": max_steps,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        "callbacks": callbacks or [],
    }
    options.update(kwargs)
    return pl.Trainer(**options)


class LossRecorder(pl.Callback):
    """Per-step training losses as Python floats (a host sync per step: fine in a test)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


class RaiseAtStep(pl.Callback):
    """Fails the fit at the start of optimizer step ``step``."""

    def __init__(self, step: int, message: str | None = None) -> None:
        self.step, self.message = step, message or f"user error at step {step}"

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError(self.message)


def parameters_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().float().cpu().clone() for name, p in module.named_parameters()}


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def patched_forwards(module: torch.nn.Module) -> list[str]:
    return [name for name, m in module.named_modules() if "forward" in m.__dict__]


def assert_losses_close(expected: list[float], actual: list[float], tolerance: float) -> None:
    """Per-step losses agree within ``tolerance``; on failure, show both runs step by step."""
    assert len(expected) == len(actual), (len(expected), len(actual))
    worst = max(abs(a - b) for a, b in zip(expected, actual, strict=True))
    rows = "\n".join(
        f"{i:3d} {a:.7f} {b:.7f} {a - b:+.2e}" for i, (a, b) in enumerate(zip(expected, actual, strict=True))
    )
    assert worst < tolerance, (
        f"largest per-step difference {worst:.3g} >= {tolerance:g}\nstep eager graphed diff\n{rows}"
    )


def settled_memory() -> int:
    """``memory_allocated()`` once garbage and library workspaces are cleared."""
    import gc

    gc.collect()
    torch.cuda.synchronize()
    if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
        torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def graph_pool_bytes() -> int:
    """Bytes still allocated in private (graph) memory pools: zero once every graph is released."""
    return sum(
        block["size"]
        for segment in torch.cuda.memory_snapshot()
        if tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0)
        for block in segment["blocks"]
        if block["state"] == "active_allocated"
    )
