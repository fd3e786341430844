"""A small GPT trained through LightningCLI, with CUDA graphs chosen by a Trainer flag.

Run (graphs on a GPU; on a CPU the package says so and trains eagerly)::

    python examples/gpt.py fit --config examples/gpt_small.yaml
    python examples/gpt.py fit --config examples/gpt_small.yaml --trainer.strategy=cudagraph_full
    python examples/gpt.py fit --config examples/gpt_small.yaml \
        --trainer.callbacks+=lightning_cudagraph.CUDAGraphCallback --trainer.callbacks.scope=[attn]

The module names follow the usual transformer layout (``blocks.N.attn``, ``blocks.N.mlp``), which is what the
built-in ``attn``, ``mlp`` and ``layer`` scopes look for.

Without CUDA the run is shortened so that it ends in about a minute (:data:`CPU_PRESET`: fewer steps of a smaller
GPT, on the same data); ``--cpu_preset=false`` runs the config as written. The last line printed says whether
graphs were on (and if not, why), the speedup they measured and where the logs are.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lightning_cudagraph import CUDAGraphCallback  # importing the package registers the cudagraph* strategy names

#: Without CUDA, these config values are capped (a smaller value given is kept): 40 steps of a 2-layer, 128-wide GPT
#: instead of 100 of the 6-layer, 256-wide one, validated every 20 steps; the data and the batches are the same.
CPU_PRESET = {"trainer.max_steps": 40, "trainer.val_check_interval": 20, "trainer.log_every_n_steps": 20,
              "model.n_layer": 2, "model.width": 128}  # fmt: skip


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
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
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, dropout)
        self.mlp = MLP(width, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final norm and an untied head."""

    def __init__(self, vocab: int, seq: int, layers: int, width: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, width)
        self.pos_emb = nn.Embedding(seq, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.register_buffer("positions", torch.arange(seq), persistent=False)
        self.apply(_init_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok_emb(idx) + self.pos_emb(self.positions[: idx.shape[1]]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class GPTModule(pl.LightningModule):
    """Next-token prediction with AdamW and an optional step-wise LR decay.

    Args:
        vocab_size: Tokens in the vocabulary.
        seq_len: Context length.
        n_layer: Transformer blocks.
        width: Model width.
        heads: Attention heads.
        dropout: Dropout inside attention, MLP and embeddings.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        lr_step_size: Decay the LR every this many optimizer steps (0: constant LR).
        lr_gamma: Factor of each decay.
        optimizer: ``"adamw"`` or ``"sgd"`` (with momentum 0.9).
        fused: Build the optimizer with ``fused=True``.
        capturable: Build AdamW with ``capturable=True`` (the form a whole-step graph runs it in).
    """

    def __init__(
        self,
        vocab_size: int = 1024,
        seq_len: int = 128,
        n_layer: int = 6,
        width: int = 256,
        heads: int = 4,
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
        self.save_hyperparameters()
        self.model = GPT(vocab_size, seq_len, n_layer, width, heads, dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def configure_model(self) -> None:
        """Under FSDP2 (``--trainer.strategy=fsdp2_cudagraph_full``): shard each block, then the whole model."""
        if not isinstance(self.trainer.strategy, ModelParallelStrategy) or hasattr(self, "_sharded"):
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)
        self._sharded = True

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self) -> object:
        hp = self.hparams
        fused = {"fused": True} if hp.fused else {}
        if hp.optimizer == "sgd":
            optimizer = torch.optim.SGD(
                self.parameters(), lr=hp.lr, momentum=0.9, weight_decay=hp.weight_decay, **fused
            )
        else:
            capturable = {"capturable": True} if hp.capturable else {}
            optimizer = torch.optim.AdamW(
                self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay, **fused, **capturable
            )
        if not hp.lr_step_size:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=hp.lr_step_size, gamma=hp.lr_gamma)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class MarkovTokens(Dataset):
    """Sequences of a fixed random Markov chain (four successors per token): a pattern the model can learn.

    Args:
        vocab_size: Tokens in the vocabulary.
        seq_len: Tokens per sequence (plus one: the last target).
        samples: Sequences.
        seed: Seed of the chain (its table of successors) and of the sampling.
        stream: Which samples of the chain: every stream follows the same table, each with sequences of its own
            (0 for training, 1 for validation).
    """

    def __init__(self, vocab_size: int, seq_len: int, samples: int, seed: int = 0, stream: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(vocab_size, (vocab_size, 4), generator=generator)
        if stream:  # stream 0 goes on drawing from the chain's generator (the training data stay as they were)
            generator = torch.Generator().manual_seed(seed + stream * 2**32)
        choices = torch.randint(4, (samples, seq_len), generator=generator)
        tokens = torch.empty(samples, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(vocab_size, (samples,), generator=generator)
        for t in range(seq_len):
            tokens[:, t + 1] = self.successors[tokens[:, t], choices[:, t]]
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.tokens[index]
        return row[:-1], row[1:]


class TokenDataModule(pl.LightningDataModule):
    """Train and validation splits of :class:`MarkovTokens`: one chain, different sequences.

    Args:
        vocab_size: Tokens in the vocabulary (match the model's).
        seq_len: Context length (match the model's).
        batch_size: Sequences per batch.
        train_samples: Training sequences; not a multiple of ``batch_size`` gives a ragged last batch.
        val_samples: Validation sequences.
        drop_last: Drop the ragged last training batch.
        seed: Seed of the chain and the sampling.
    """

    def __init__(
        self,
        vocab_size: int = 1024,
        seq_len: int = 128,
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
        self.train_set = MarkovTokens(hp.vocab_size, hp.seq_len, hp.train_samples, hp.seed)
        self.val_set = MarkovTokens(hp.vocab_size, hp.seq_len, hp.val_samples, hp.seed, stream=1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, batch_size=self.hparams.batch_size, shuffle=False, drop_last=self.hparams.drop_last
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)


class GPTCLI(LightningCLI):
    """LightningCLI with a shorter run without CUDA and a closing line that says what the graphs did."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--cpu_preset",
            type=bool,
            default=True,
            help="Without CUDA, cap the run so it ends in about a minute: "
            + ", ".join(f"{key}<={value}" for key, value in CPU_PRESET.items())
            + ". False runs the config as written.",
        )

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        if config.get("cpu_preset") and _runs_without_cuda(config.trainer.accelerator):
            changes = _cap(config, CPU_PRESET)
            if changes:
                print(f"gpt.py: no CUDA, so a shorter CPU run: {changes} (--cpu_preset=false runs the config as is)")

    def after_fit(self) -> None:
        if self.trainer.is_global_zero:
            print(closing_line(self.trainer), flush=True)


def _runs_without_cuda(accelerator: Any) -> bool:
    """Whether the Trainer will train on something other than a CUDA device."""
    return accelerator in ("cpu", "mps") or not torch.cuda.is_available()


def _cap(config: Any, caps: dict[str, int]) -> str:
    """Lower each ``config`` value above its cap (integers only: a float ``val_check_interval`` is a fraction)."""
    changes = []
    for key, cap in caps.items():
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and (value > cap or value == -1):
            config[key] = cap
            changes.append(f"{key} {value} -> {cap}")
    return ", ".join(changes)


def closing_line(trainer: pl.Trainer) -> str:
    """Whether graphs were on (if not, why), the speedup they measured, and where the logs are."""
    callbacks = [cb for cb in trainer.callbacks if isinstance(cb, CUDAGraphCallback)]
    graphs = callbacks[0].report.summary() if callbacks else "CUDA graphs not used (no cudagraph strategy or callback)"
    logs = f"logs in {os.path.normpath(trainer.loggers[0].log_dir)}" if trainer.loggers else "no logger"
    return f"{graphs}; {logs}"


def main() -> None:
    GPTCLI(GPTModule, TokenDataModule, seed_everything_default=0)


if __name__ == "__main__":
    main()
