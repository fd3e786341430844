"""A GPT whose MLPs are mixture-of-experts layers with static-shaped (capacity-padded) routing.

Every tensor in the router and the token dispatch has a shape fixed by the batch, the number of experts and the
capacity, and no step reads a value back to the host, so the ``moe_router`` and ``moe_preprocess`` scopes (and
``moe``, the whole layer) can be captured::

    python examples/moe.py fit --config examples/moe_small.yaml
    python examples/moe.py fit --config examples/moe_small.yaml \
        --trainer.strategy=lightning_cudagraph.CUDAGraphStrategy --trainer.strategy.scope=[moe]

Module names: ``blocks.N.moe`` (the layer), ``blocks.N.moe.router`` (scores tokens), ``blocks.N.moe.preprocess``
(builds the dispatch and combine tensors, GShard style, top-1 with a capacity per expert).
"""

from __future__ import annotations

import math
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples.gpt import GPT, Block, GPTModule, TokenDataModule


class Router(nn.Module):
    """Token-to-expert probabilities."""

    def __init__(self, width: int, experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(width, experts, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.gate(tokens).float(), dim=-1)


class Preprocess(nn.Module):
    """Top-1 routing with a fixed capacity per expert: dispatch mask and combine weights of shape [N, E, C]."""

    def __init__(self, capacity_factor: float) -> None:
        super().__init__()
        self.capacity_factor = capacity_factor

    def forward(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, experts = probs.shape
        capacity = max(1, math.ceil(tokens / experts * self.capacity_factor))
        expert = probs.argmax(dim=-1)
        chosen = F.one_hot(expert, experts).to(probs.dtype)  # [N, E]
        position = (torch.cumsum(chosen, dim=0) - 1) * chosen  # slot of each token in its expert's buffer
        kept = chosen * (position < capacity).to(probs.dtype)
        slot = F.one_hot(position.long().clamp(0, capacity - 1), capacity).to(probs.dtype)  # [N, E, C]
        dispatch = kept.unsqueeze(-1) * slot
        combine = (probs * kept).unsqueeze(-1) * slot
        return dispatch, combine


class Experts(nn.Module):
    """E feed-forward experts applied as batched matrix products over capacity-padded buffers."""

    def __init__(self, width: int, experts: int, hidden: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(experts, width, hidden) * 0.02)
        self.w_out = nn.Parameter(torch.randn(experts, hidden, width) * 0.02)

    def forward(self, buffers: torch.Tensor) -> torch.Tensor:
        return torch.bmm(F.gelu(torch.bmm(buffers, self.w_in)), self.w_out)


class MoE(nn.Module):
    """Router, preprocess, experts and combine; every shape is static."""

    def __init__(self, width: int, experts: int = 4, capacity_factor: float = 1.25) -> None:
        super().__init__()
        self.router = Router(width, experts)
        self.preprocess = Preprocess(capacity_factor)
        self.experts = Experts(width, experts, 2 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        tokens = x.reshape(batch * seq, width)
        dispatch, combine = self.preprocess(self.router(tokens))
        buffers = torch.einsum("nec,nd->ecd", dispatch.to(tokens.dtype), tokens)
        outputs = self.experts(buffers)
        return torch.einsum("nec,ecd->nd", combine.to(outputs.dtype), outputs).reshape(batch, seq, width)


class MoEBlock(Block):
    def __init__(self, width: int, heads: int, dropout: float, experts: int) -> None:
        super().__init__(width, heads, dropout)
        del self.mlp
        self.moe = MoE(width, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class MoEGPTModule(GPTModule):
    """The GPT of ``examples/gpt.py`` with an MoE layer in every block.

    Args:
        experts: Experts per MoE layer.
        **kwargs: As for :class:`examples.gpt.GPTModule`.
    """

    def __init__(self, experts: int = 4, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.hparams["experts"] = experts
        hp = self.hparams
        model: GPT = self.model
        model.blocks = nn.ModuleList(MoEBlock(hp.width, hp.heads, hp.dropout, experts) for _ in range(hp.n_layer))


def main() -> None:
    from lightning.pytorch.cli import LightningCLI

    LightningCLI(MoEGPTModule, TokenDataModule, seed_everything_default=0)


if __name__ == "__main__":
    main()
