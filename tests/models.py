"""Models and data written for the tests: a small decoder-only transformer, its MoE and Transformer Engine variants,
and learnable token sequences.

Module layout (what the package's built-in scopes look for)::

    model.blocks.N            layer            DecoderModule, MoEDecoderModule (TEDecoderModule: a TE TransformerLayer)
    model.blocks.N.attn       attn             causal self-attention (qkv, proj)
    model.blocks.N.mlp        mlp              fc, gelu, proj (DecoderModule only)
    model.blocks.N.moe        moe              MoEDecoderModule only, in place of the MLP
    model.blocks.N.moe.router      moe_router
    model.blocks.N.moe.preprocess  moe_preprocess

Initialization: normal(0, 0.02) for every Linear, Embedding and expert weight, zero biases, LayerNorm at (1, 0).
The GPU tests' tolerances were measured at the ``SMALL`` size with this scheme and seed 0, on the data of
:class:`TokenData`; keep both as they are.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

#: Model sizes. SMALL is the GPU tests' size (their figures rely on it); TINY keeps CPU fits to seconds.
SMALL = {"vocab_size": 1024, "seq_len": 128, "n_layer": 6, "width": 256, "heads": 4}
TINY = {"vocab_size": 64, "seq_len": 16, "n_layer": 2, "width": 32, "heads": 2}
#: Data for short CPU fits: 16 batches of 4 sequences per epoch.
TINY_DATA = {"batch_size": 4, "train_samples": 64}

Batch = tuple[torch.Tensor, torch.Tensor]


# =================================================================== the decoder
class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = (
            t.view(batch, seq, self.heads, width // self.heads).transpose(1, 2) for t in self.qkv(x).split(width, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(batch, seq, width)))


class MLP(nn.Module):
    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm block: ``x + attn(ln1(x))``, then ``x + ffn(ln2(x))``; the feed-forward is ``mlp`` or ``moe``."""

    def __init__(self, width: int, heads: int, dropout: float, experts: int = 0, capacity_factor: float = 1.25) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, dropout)
        if experts:
            self.moe = MoE(width, experts, capacity_factor)
        else:
            self.mlp = MLP(width, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        ffn = self.moe if "moe" in self._modules else self.mlp
        return x + ffn(self.ln2(x))


class Decoder(nn.Module):
    """Token and position embeddings, ``n_layer`` blocks, a final norm and an untied head."""

    def __init__(
        self, vocab_size: int, seq_len: int, n_layer: int, width: int, heads: int, dropout: float, **block: Any
    ) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, width)
        self.pos_emb = nn.Embedding(seq_len, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, dropout, **block) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.register_buffer("positions", torch.arange(seq_len), persistent=False)
        self.apply(init_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok_emb(idx) + self.pos_emb(self.positions[: idx.shape[1]]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def init_weights(module: nn.Module) -> None:
    """Normal(0, 0.02) weights and zero biases for Linear and Embedding (applied to the whole decoder)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class DecoderModule(pl.LightningModule):
    """Next-token prediction with AdamW (or SGD with momentum 0.9) and an optional step-wise StepLR.

    Args:
        vocab_size: Tokens in the vocabulary.
        seq_len: Context length.
        n_layer: Blocks.
        width: Model width.
        heads: Attention heads.
        dropout: Dropout inside attention, MLP and embeddings.
        lr: Learning rate.
        weight_decay: Weight decay.
        lr_step_size: Multiply the LR by ``lr_gamma`` every this many optimizer steps (0: constant LR).
        lr_gamma: Factor of each decay.
        optimizer: ``"adamw"`` or ``"sgd"`` (momentum 0.9).
        fused: Build the optimizer with ``fused=True``.
        capturable: Build AdamW with ``capturable=True``.
    """

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        n_layer: int,
        width: int,
        heads: int,
        dropout: float = 0.0,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        lr_step_size: int = 0,
        lr_gamma: float = 0.5,
        optimizer: str = "adamw",
        fused: bool = False,
        capturable: bool = False,
    ) -> None:
        super().__init__()
        if optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {optimizer!r}")
        self.save_hyperparameters()  # subclasses' own arguments land in hparams too
        self.model = Decoder(vocab_size, seq_len, n_layer, width, heads, dropout, **self.block_options())

    def block_options(self) -> dict[str, Any]:
        """Extra arguments of every :class:`Block` (a subclass swaps the MLP for an MoE layer here)."""
        return {}

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def loss(self, batch: Batch) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch))

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self.log("test_loss", self.loss(batch))

    def predict_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        options: dict[str, Any] = {"lr": hp.lr, "weight_decay": hp.weight_decay}
        if hp.fused:
            options["fused"] = True
        if hp.optimizer == "sgd":
            optimizer = torch.optim.SGD(self.parameters(), momentum=0.9, **options)
        else:
            if hp.capturable:
                options["capturable"] = True
            optimizer = torch.optim.AdamW(self.parameters(), **options)
        if not hp.lr_step_size:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=hp.lr_step_size, gamma=hp.lr_gamma)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# =================================================================== mixture of experts
class Router(nn.Module):
    """Token-to-expert probabilities (float32)."""

    def __init__(self, width: int, experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(width, experts, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.gate(tokens).float(), dim=-1)


class Preprocess(nn.Module):
    """Top-1 routing with a fixed capacity per expert: dispatch mask and combine weights, both ``[N, E, C]``.

    Every shape follows from the token count, the expert count and the capacity, and nothing is read back to the
    host, so the module can be captured. Tokens past an expert's capacity are dropped (their MoE output is zero).
    """

    def __init__(self, capacity_factor: float) -> None:
        super().__init__()
        self.capacity_factor = capacity_factor

    def forward(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, experts = probs.shape
        capacity = max(1, math.ceil(tokens / experts * self.capacity_factor))
        chosen = F.one_hot(probs.argmax(dim=-1), experts).to(probs.dtype)  # [N, E]
        position = (torch.cumsum(chosen, dim=0) - 1) * chosen  # each token's slot in its expert's buffer
        kept = chosen * (position < capacity).to(probs.dtype)
        slot = F.one_hot(position.long().clamp(0, capacity - 1), capacity).to(probs.dtype)  # [N, E, C]
        return kept.unsqueeze(-1) * slot, (probs * kept).unsqueeze(-1) * slot


class Experts(nn.Module):
    """``E`` feed-forward experts, applied as batched matrix products over the capacity-padded buffers."""

    def __init__(self, width: int, experts: int, hidden: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(nn.init.normal_(torch.empty(experts, width, hidden), std=0.02))
        self.w_out = nn.Parameter(nn.init.normal_(torch.empty(experts, hidden, width), std=0.02))

    def forward(self, buffers: torch.Tensor) -> torch.Tensor:
        return torch.bmm(F.gelu(torch.bmm(buffers, self.w_in)), self.w_out)


class MoE(nn.Module):
    """Router, preprocess (dispatch), experts and combine, every shape static."""

    def __init__(self, width: int, experts: int, capacity_factor: float) -> None:
        super().__init__()
        self.router = Router(width, experts)
        self.preprocess = Preprocess(capacity_factor)
        self.experts = Experts(width, experts, 2 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        tokens = x.reshape(batch * seq, width)
        dispatch, combine = self.preprocess(self.router(tokens))
        outputs = self.experts(torch.einsum("nec,nd->ecd", dispatch.to(tokens.dtype), tokens))
        return torch.einsum("nec,ecd->nd", combine.to(outputs.dtype), outputs).reshape(batch, seq, width)


class MoEDecoderModule(DecoderModule):
    """:class:`DecoderModule` with an MoE layer (``blocks.N.moe``) in place of every block's MLP.

    Args:
        experts: Experts per MoE layer.
        capacity_factor: Each expert's buffer holds ``ceil(tokens / experts * capacity_factor)`` tokens.
        **kwargs: As for :class:`DecoderModule`.
    """

    def __init__(self, experts: int = 4, capacity_factor: float = 1.25, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    def block_options(self) -> dict[str, Any]:
        return {"experts": self.hparams.experts, "capacity_factor": self.hparams.capacity_factor}


# =================================================================== Transformer Engine
class TEDecoderModule(DecoderModule):
    """:class:`DecoderModule` whose blocks are ``transformer_engine.pytorch.TransformerLayer`` s (on the GPU).

    Transformer Engine is imported on construction, so importing this module never needs it. The embeddings and
    head are built and initialized as in :class:`DecoderModule`, then the blocks are replaced (TE initializes its
    own layers).

    Args:
        **kwargs: As for :class:`DecoderModule`.
    """

    def __init__(self, **kwargs: Any) -> None:
        import transformer_engine.pytorch as te

        super().__init__(**kwargs)
        hp = self.hparams
        self.model.blocks = nn.ModuleList(
            te.TransformerLayer(
                hidden_size=hp.width,
                ffn_hidden_size=4 * hp.width,
                num_attention_heads=hp.heads,
                hidden_dropout=hp.dropout,
                attention_dropout=hp.dropout,
                self_attn_mask_type="causal",
                attn_input_format="bshd",
                layer_number=i + 1,
            )
            for i in range(hp.n_layer)
        )


# =================================================================== data
def markov_tokens(vocab_size: int, seq_len: int, samples: int, seed: int) -> torch.Tensor:
    """``[samples, seq_len + 1]`` int64 tokens walked on a seeded random Markov chain (four successors per token)."""
    generator = torch.Generator().manual_seed(seed)
    successors = torch.randint(vocab_size, (vocab_size, 4), generator=generator)
    choices = torch.randint(4, (samples, seq_len), generator=generator)
    tokens = torch.empty(samples, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab_size, (samples,), generator=generator)
    for t in range(seq_len):
        tokens[:, t + 1] = successors[tokens[:, t], choices[:, t]]
    return tokens


class TokenData(pl.LightningDataModule):
    """Next-token pairs ``(x, y)``, int64 ``[batch, seq_len]``, from :func:`markov_tokens`: learnable and fixed.

    Args:
        vocab_size: Tokens in the vocabulary (the model's).
        seq_len: Context length (the model's).
        batch_size: Sequences per batch.
        train_samples: Training sequences; not a multiple of ``batch_size`` gives a ragged last batch.
        val_samples: Validation sequences (also served for test and predict).
        drop_last: Drop the ragged last training batch.
        seed: Seed of the chain and the sampling (validation uses ``seed + 1``).
    """

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        batch_size: int = 8,
        train_samples: int = 4096,
        val_samples: int = 64,
        drop_last: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        hp = self.hparams
        train = markov_tokens(hp.vocab_size, hp.seq_len, hp.train_samples, hp.seed)
        val = markov_tokens(hp.vocab_size, hp.seq_len, hp.val_samples, hp.seed + 1)
        self.train_set = TensorDataset(train[:, :-1], train[:, 1:])
        self.val_set = TensorDataset(val[:, :-1], val[:, 1:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, drop_last=self.hparams.drop_last)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)

    test_dataloader = predict_dataloader = val_dataloader


# =================================================================== builder
def _arguments(cls: type) -> set[str]:
    names = set()
    for klass in cls.__mro__:
        if "__init__" in vars(klass) and issubclass(klass, (DecoderModule, TokenData)):
            params = inspect.signature(klass.__init__).parameters.values()
            names |= {p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD and p.name != "self"}
            names |= {p.name for p in params if p.kind is p.KEYWORD_ONLY}
    return names


class ShardedDecoder(DecoderModule):
    """The test decoder under FSDP2: each block, then the whole model, sharded over the data-parallel ranks."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard  # torch.distributed may be absent: imported when used

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)


def decoder(
    size: dict[str, Any], module: type[DecoderModule] = DecoderModule, **overrides: Any
) -> tuple[DecoderModule, TokenData]:
    """A model seeded with 0, and its data: ``size`` and ``overrides`` go to whichever takes that argument.

    ``vocab_size`` and ``seq_len`` go to both. ``module`` is :class:`DecoderModule` or a subclass (a test's own
    variant, :class:`MoEDecoderModule`, :class:`TEDecoderModule`).

    Example: ``model, data = decoder(SMALL, lr=3e-4, train_samples=8 * 4 + 5, drop_last=False)``.
    """
    model_args, data_args = _arguments(module), _arguments(TokenData)
    options = {**size, **overrides}
    unknown = sorted(set(options) - model_args - data_args)
    if unknown:
        raise TypeError(f"decoder(): {unknown} are arguments of neither {module.__name__} nor TokenData")
    pl.seed_everything(0, verbose=False)
    data = TokenData(**{k: v for k, v in options.items() if k in data_args})
    return module(**{k: v for k, v in options.items() if k in model_args}), data
