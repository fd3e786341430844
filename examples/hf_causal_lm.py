"""A Hugging Face causal LM (transformers 5.x) built from a small config, trained through LightningCLI with CUDA graphs.

Install with ``pip install -e ".[hf]"``. Run (graphs on a GPU; on a CPU the package says so and trains eagerly)::

    # dense Llama, one graph set per decoder layer and padded length (the yaml's strategy)
    python examples/hf_causal_lm.py fit --config examples/hf_small.yaml
    # dense Llama, the whole training step as one graph per padded length
    python examples/hf_causal_lm.py fit --config examples/hf_small.yaml --trainer.strategy.scope=[full_iteration]
    # Qwen3-MoE: graph the attention and the routers
    python examples/hf_causal_lm.py fit --config examples/hf_small.yaml --model.kind=qwen3_moe \
        --trainer.strategy=lightning_cudagraph.CUDAGraphStrategy --trainer.strategy.scope=[attn,moe_router]

What the built-in scopes find (``model.`` is this module's attribute holding the transformers model):
``model.model.layers.N.self_attn`` (``attn``), ``model.model.layers.N.mlp`` (``mlp`` on Llama; ``moe`` on
Qwen3-MoE, whose router ``mlp.gate`` is ``moe_router``) and ``model.model.layers.N`` (``layer``).

On Qwen3-MoE, keep the experts out of the graphs: their default implementation (``grouped_mm``) copies routing
results to the host, so a ``moe``, ``layer`` or whole-step capture fails, and the package rolls back to eager
training with a warning that says so (``cudagraph_layer`` from the yaml does exactly that on this model).

The data are the token sequences of ``examples/gpt.py``, cut to lengths drawn from ``min_len..seq_len`` and padded
per batch to a multiple of ``pad_to_multiple_of`` (``lightning_cudagraph.bucketing.PadToBucket``), so a few shapes
recur and each gets its graphs (``on_shape_change: recapture`` in the yaml). The model is given the input ids as
labels, with padded positions set to -100, and shifts them itself: the loss is the model's own ``.loss``.
``--model.vocab_size`` also sets the data's vocabulary.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lightning_cudagraph  # noqa: F401  (registers the cudagraph* strategy names)
from examples.gpt import TokenDataModule
from lightning_cudagraph.bucketing import PadToBucket

Kind = Literal["llama", "qwen3_moe"]
INSTALL = 'pip install -e ".[hf]"'


def build_config(
    kind: Kind,
    *,
    vocab_size: int,
    hidden_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
    num_experts: int,
    num_experts_per_tok: int,
    moe_intermediate_size: int,
    attn_implementation: str,
) -> Any:
    """The transformers config: no KV cache, no dropout; for Qwen3-MoE every layer sparse, top-k renormalized."""
    try:
        import transformers
    except ImportError as err:
        raise ImportError(f"examples/hf_causal_lm.py needs transformers>=5: {INSTALL}") from err

    common = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": hidden_size // num_attention_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "use_cache": False,
        "attention_dropout": 0.0,
        "attn_implementation": attn_implementation,
    }
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "qwen3_moe":
        moe = {
            "num_experts": num_experts,
            "num_experts_per_tok": num_experts_per_tok,
            "moe_intermediate_size": moe_intermediate_size,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
        return transformers.Qwen3MoeConfig(**common, **moe)
    raise ValueError(f"kind must be 'llama' or 'qwen3_moe', got {kind!r}")


class HFCausalLM(pl.LightningModule):
    """Next-token prediction with a transformers causal LM (``LlamaForCausalLM`` or ``Qwen3MoeForCausalLM``) and AdamW.

    Args:
        kind: ``"llama"`` (dense) or ``"qwen3_moe"`` (mixture of experts).
        vocab_size: Tokens in the vocabulary.
        hidden_size: Model width.
        num_hidden_layers: Decoder layers.
        num_attention_heads: Attention heads (head size ``hidden_size // num_attention_heads``).
        num_key_value_heads: Key/value heads (fewer than ``num_attention_heads``: grouped-query attention).
        intermediate_size: Width of the dense MLP (Llama).
        max_position_embeddings: Longest sequence the rotary embedding covers (at least the data's ``seq_len``).
        num_experts: Experts per MoE layer (Qwen3-MoE).
        num_experts_per_tok: Experts each token is routed to (Qwen3-MoE).
        moe_intermediate_size: Width of each expert (Qwen3-MoE).
        attn_implementation: ``"sdpa"`` (PyTorch's fused attention) or ``"eager"`` (plain matrix products).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
    """

    def __init__(
        self,
        kind: Kind = "llama",
        vocab_size: int = 1024,
        hidden_size: int = 256,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 4,
        intermediate_size: int = 512,
        max_position_embeddings: int = 256,
        num_experts: int = 4,
        num_experts_per_tok: int = 2,
        moe_intermediate_size: int = 256,
        attn_implementation: Literal["sdpa", "eager"] = "sdpa",
        lr: float = 1e-3,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        import transformers

        config = build_config(
            kind,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            intermediate_size=intermediate_size,
            max_position_embeddings=max_position_embeddings,
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=moe_intermediate_size,
            attn_implementation=attn_implementation,
        )
        self.model = transformers.AutoModelForCausalLM.from_config(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]``."""
        return self.model(input_ids=input_ids).logits

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        input_ids, targets = batch  # the model shifts its labels itself; padded positions are ignored
        labels = input_ids.masked_fill(targets == -100, -100)
        return self.model(input_ids=input_ids, labels=labels).loss

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


class _Truncated(Dataset):
    """``(tokens, targets)`` pairs of a dataset, each cut to its own length."""

    def __init__(self, dataset: Dataset, lengths: list[int]) -> None:
        self.dataset, self.lengths = dataset, lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, targets = self.dataset[index]
        return tokens[: self.lengths[index]], targets[: self.lengths[index]]


class BucketedTokens(TokenDataModule):
    """The token data of ``examples/gpt.py`` with lengths drawn from ``min_len..seq_len``, padded to a few lengths.

    Args:
        min_len: The shortest sample (``seq_len``: every sample full length, one shape).
        pad_to_multiple_of: Batches are padded to a multiple of this (targets with -100).
        **kwargs: As for ``TokenDataModule``.
    """

    def __init__(self, min_len: int = 16, pad_to_multiple_of: int = 32, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    def setup(self, stage: str) -> None:
        super().setup(stage)
        hp = self.hparams
        generator = torch.Generator().manual_seed(hp.seed)
        lengths = torch.randint(hp.min_len, hp.seq_len + 1, (len(self.train_set),), generator=generator).tolist()
        self.train_set = _Truncated(self.train_set, lengths)

    def train_dataloader(self) -> DataLoader:
        collate = PadToBucket(multiple=self.hparams.pad_to_multiple_of, pad_values={1: -100})
        return DataLoader(
            self.train_set, batch_size=self.hparams.batch_size, drop_last=self.hparams.drop_last, collate_fn=collate
        )


def main() -> None:
    from lightning.pytorch.cli import LightningCLI

    class CLI(LightningCLI):
        def add_arguments_to_parser(self, parser: Any) -> None:
            parser.link_arguments("model.vocab_size", "data.vocab_size")

    CLI(HFCausalLM, BucketedTokens, seed_everything_default=0)


if __name__ == "__main__":
    main()
