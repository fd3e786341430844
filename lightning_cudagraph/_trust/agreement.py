"""Decisions taken once for all ranks: one small collective at each decision point, never one per step.

A decision one rank took alone would leave it replaying a graph while another runs the step eagerly: a hang with a
captured all-reduce, different numerics with scoped graphs. Every rank reaches a decision point at the same step (it
depends on the step count and earlier agreed decisions only), so the collectives pair up. A level's step time is the
slowest rank's (DDP runs at the pace of its slowest rank).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


class RankAgreement:
    """Agrees decisions across the ranks of the default process group (a no-op in a single process).

    Args:
        device: Where the collective's tensor lives under NCCL (gloo's is on the CPU).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @property
    def world_size(self) -> int:
        """Ranks taking part (1 without an initialized process group)."""
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
        return 1

    def all_ok(self, ok: bool) -> bool:
        """Whether every rank says ``ok`` (one collective)."""
        return not self.any_of([not ok])[0]

    def any_of(self, flags: Sequence[bool]) -> list[bool]:
        """Element-wise: whether any rank raised each flag (one collective; every rank passes as many flags)."""
        if self.world_size == 1 or not flags:
            return list(flags)
        values = self._max([1.0 if flag else 0.0 for flag in flags])
        return [value > 0 for value in values]

    def slowest(self, *values: float) -> list[float]:
        """Element-wise, the largest of each value over the ranks, e.g. step times (one collective)."""
        if self.world_size == 1:
            return list(values)
        return self._max(list(values))

    def _max(self, values: list[float]) -> list[float]:
        backend = dist.get_backend()
        device = self.device if backend == "nccl" else torch.device("cpu")
        tensor = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.tolist()
