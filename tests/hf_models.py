"""Hugging Face causal LMs for the GPU tests: a dense Llama and a Qwen3-MoE, built from small configs.

transformers is imported when a model is built, never when this module is imported: test files that use it guard
themselves with ``pytest.importorskip("transformers")``.

Module layout inside :class:`HFCausalLM` (what the built-in scopes find; ``model.`` is the attribute that holds the
transformers model)::

    model.model.layers.N                 layer
    model.model.layers.N.self_attn       attn
    model.model.layers.N.mlp             mlp (Llama) / moe (Qwen3-MoE: Qwen3MoeSparseMoeBlock)
    model.model.layers.N.mlp.gate        moe_router (Qwen3-MoE)
    model.model.layers.N.mlp.experts     the experts (inside ``moe`` and ``layer``)
"""

from __future__ import annotations

import inspect
from typing import Any

import lightning.pytorch as pl
import torch

from tests.models import TokenData

KINDS = ("llama", "qwen3_moe")
#: Config fields of both kinds (the GPU tests' size).
DENSE = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 512,
    "max_position_embeddings": 256,
}
#: Qwen3-MoE on top of DENSE: 4 experts, top-2, every layer sparse, two KV heads (grouped-query attention).
MOE = {
    "num_key_value_heads": 2,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
SEQ_LEN, BATCH_SIZE = 128, 8
LAYERS = DENSE["num_hidden_layers"]


def hf_config(kind: str, **sizes: Any) -> Any:
    """The transformers config of ``kind``: DENSE (and MOE) with ``sizes`` on top; no KV cache, no dropout, SDPA."""
    import transformers

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    config_class = transformers.LlamaConfig if kind == "llama" else transformers.Qwen3MoeConfig
    options = {**DENSE, **(MOE if kind == "qwen3_moe" else {}), **sizes}
    options.setdefault("head_dim", options["hidden_size"] // options["num_attention_heads"])
    return config_class(**options, use_cache=False, attention_dropout=0.0, attn_implementation="sdpa")


class HFCausalLM(pl.LightningModule):
    """A transformers causal LM (``model``) trained on next-token prediction with AdamW.

    The batch is ``(x, y)`` of :class:`~tests.models.TokenData`; the model is given ``labels=x`` and shifts them
    itself, so the loss is the model's own ``.loss`` (over the ``seq_len - 1`` predictable positions).
    """

    def __init__(self, kind: str = "llama", lr: float = 1e-3, **sizes: Any) -> None:
        super().__init__()
        import transformers

        self.lr = lr
        self.model = transformers.AutoModelForCausalLM.from_config(hf_config(kind, **sizes))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, _ = batch
        loss = self.model(input_ids=x, labels=x).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def hf_causal_lm(kind: str, **overrides: Any) -> tuple[HFCausalLM, TokenData]:
    """A model of ``kind`` seeded with 0, and its data (sequence 128, batch 8).

    ``overrides`` go to :class:`~tests.models.TokenData` where it takes them (``vocab_size`` goes to both), to the
    model otherwise (``lr`` or any config field).
    """
    data_args = set(inspect.signature(TokenData.__init__).parameters) - {"self"}
    options = {"vocab_size": DENSE["vocab_size"], "seq_len": SEQ_LEN, "batch_size": BATCH_SIZE, **overrides}
    model_options = {k: v for k, v in options.items() if k not in data_args or k == "vocab_size"}
    pl.seed_everything(0, verbose=False)
    data = TokenData(**{k: v for k, v in options.items() if k in data_args})
    return HFCausalLM(kind, **model_options), data
