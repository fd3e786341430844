"""The model zoo of ``zoo/run.py``: real third-party models and ordinary training patterns, small and offline.

Each :class:`Entry` builds a fresh :class:`ZooModule` and its training data from config classes (nothing is
downloaded: no hub, no pretrained weights, tokenizers made in code). Libraries are imported inside the builders, so
an entry whose library is missing is skipped (:func:`missing_libraries`) without touching the others.

Every module records what a user would check against eager training:

- ``step_losses``: the loss Lightning hands ``on_train_batch_end``, one per batch, kept on the device.
- ``batch_sums``: a position-weighted float64 checksum of every tensor in the batch ``training_step`` received,
  computed inside ``training_step`` and written into a device buffer at a slot set from the host at batch start.
  Under a whole-step graph the Python of ``training_step`` runs only at capture, but the checksum's kernels are in
  the graph: each replay writes the checksum of what the graph actually read (its static buffers) into that
  step's slot. A replay that trains on a stale or wrong batch shows as a checksum unlike eager's.
- ``zoo_metrics``: torchmetrics updated inside ``training_step``; their ``metric_state`` is compared after the fit.

:attr:`Built.dataset_tensors` names the tensors of a dataset that lives on the training device, so the runner can
checksum them before and after the fit (a package that writes into a user's batch overwrites the dataset).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, TensorDataset
from typing_extensions import override

#: Number of distinct position weights in a checksum (a prime, so a shifted or transposed batch sums differently).
_CHECKSUM_PERIOD = 251


# ---------------------------------------------------------------------------------------------------- checksums
def batch_tensors(batch: Any) -> list[Tensor]:
    """Every tensor in a batch, in a fixed order: mappings (``BatchEncoding`` too) by key, sequences, dataclasses,
    and objects with ``to_dict()`` (``torch_geometric`` ``Data``/``Batch``).

    Example:
        >>> batch = {"b": torch.ones(2), "a": [torch.zeros(1), (torch.ones(3),)]}
        >>> [t.numel() for t in batch_tensors(batch)]
        [1, 3, 2]
    """
    if isinstance(batch, Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for key in sorted(batch, key=str) for t in batch_tensors(batch[key])]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return [t for f in dataclasses.fields(batch) for t in batch_tensors(getattr(batch, f.name))]
    if isinstance(batch, (list, tuple)):
        return [t for item in batch for t in batch_tensors(item)]
    to_dict = getattr(batch, "to_dict", None)
    if callable(to_dict):
        return batch_tensors(to_dict())
    return []


def checksum(tensors: Sequence[Tensor]) -> Tensor:
    """A float64 device scalar that changes when any element of ``tensors`` changes or moves (no host sync).

    Example:
        >>> a = torch.arange(6.0)
        >>> bool(checksum([a]) != checksum([a.flip(0)]))
        True
    """
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    device = tensors[0].device
    with torch.autocast(device.type, enabled=False):  # autocast would run ``sum`` in float32
        total = torch.zeros((), dtype=torch.float64, device=device)
        for index, tensor in enumerate(tensors):
            flat = tensor.detach().reshape(-1).to(torch.float64)
            weights = torch.arange(flat.numel(), dtype=torch.float64, device=device)
            weights = weights.remainder(_CHECKSUM_PERIOD).add(1 + index)
            total = total + (flat * weights).sum()
    return total


# ---------------------------------------------------------------------------------------------------- the module
LossFn = Callable[["ZooModule", Any], Tensor]
OptimizerFn = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SchedulerFn = Callable[[torch.optim.Optimizer], Any]


class ZooModule(pl.LightningModule):
    """A LightningModule around a third-party ``net``, with the records the zoo compares against eager.

    Args:
        net: The model (a transformers, timm, torchvision, torchaudio, peft or torch_geometric module).
        loss: ``loss(module, batch) -> Tensor``; it may update ``module.zoo_metrics``.
        optimizer: Builds the optimizer from the trainable parameters.
        scheduler: Builds the LR scheduler config (``{"scheduler": ..., "interval": "step"}``) or ``None``.
        metrics: torchmetrics updated inside ``training_step`` (by ``loss``).
    """

    def __init__(
        self,
        net: nn.Module,
        loss: LossFn,
        optimizer: OptimizerFn,
        scheduler: SchedulerFn | None = None,
        metrics: Mapping[str, nn.Module] | None = None,
    ) -> None:
        super().__init__()
        self.net = net
        self.zoo_metrics = nn.ModuleDict(dict(metrics or {}))
        self._loss, self._optimizer, self._scheduler = loss, optimizer, scheduler
        self.step_losses: list[Tensor] = []
        self.batch_sums = torch.zeros(0, dtype=torch.float64)  # made on the device at fit start
        self._slot = torch.zeros(1, dtype=torch.long)
        self._batches_started = 0

    @override
    def on_fit_start(self) -> None:
        trainer = self.trainer
        capacity = int(trainer.max_steps) * int(trainer.accumulate_grad_batches) + 8
        self.batch_sums = torch.full((capacity,), math.nan, dtype=torch.float64, device=self.device)
        self._slot = torch.zeros(1, dtype=torch.long, device=self.device)
        self._batches_started, self.step_losses = 0, []

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Set on the host before the step (and before any replay): the step, eager or graphed, writes this slot.
        self._slot.fill_(min(self._batches_started, self.batch_sums.numel() - 1))
        self._batches_started += 1

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self.batch_sums.index_copy_(0, self._slot, checksum(batch_tensors(batch)).view(1))
        loss = self._loss(self, batch)
        self.log("train_loss", loss)
        return loss

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, Mapping) else outputs
        self.step_losses.append(loss.detach().clone())  # a replay overwrites the captured loss: keep a copy

    @override
    def configure_optimizers(self) -> Any:
        optimizer = self._optimizer([p for p in self.parameters() if p.requires_grad])
        if self._scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self._scheduler(optimizer)}

    def seen_batch_sums(self) -> list[float]:
        """The checksums of the batches ``training_step`` computed on, in order (one host sync)."""
        return self.batch_sums[: min(self._batches_started, self.batch_sums.numel())].tolist()

    def losses(self) -> list[float]:
        """The per-batch losses (one host sync)."""
        return torch.stack(self.step_losses).float().tolist() if self.step_losses else []


# ---------------------------------------------------------------------------------------------------- entries
@dataclass(frozen=True)
class BuildContext:
    """What a builder needs to know about the fit.

    Attributes:
        device: Where training runs (an on-device dataset is made there).
        steps: Optimizer steps of the fit (schedulers that need a total use it).
        batches: Training batches of the fit (``steps * accumulate_grad_batches``).
        seed: Seed of the data (the same for every fit of an entry).
    """

    device: torch.device
    steps: int
    batches: int
    seed: int = 0

    def generator(self, offset: int = 0) -> torch.Generator:
        """A CPU generator for data: the same numbers for every fit of the entry."""
        return torch.Generator().manual_seed(self.seed * 1000 + offset)


@dataclass
class Built:
    """A fresh module and its training loader; ``dataset_tensors`` live on the training device."""

    module: ZooModule
    loader: Any
    dataset_tensors: list[Tensor] = field(default_factory=list)
    #: The user's own callbacks, as they would pass them to the Trainer.
    callbacks: list[pl.Callback] = field(default_factory=list)


@dataclass(frozen=True)
class Entry:
    """A zoo entry.

    Attributes:
        name: Short name (``--only``).
        requires: Import names of the libraries it needs.
        patterns: What it exercises, for the table.
        build: Makes a fresh module and loader.
        precision: The Trainer's ``precision``.
        accumulate: ``accumulate_grad_batches``.
        clip: ``gradient_clip_val`` (``None``: no clipping).
        steps: Optimizer steps of a fit at ``--steps`` 64 (scaled with ``--steps``).
        layer_modules: ``modules={"layer": ...}`` (a glob or a class) for the ``layer`` variant where the built-in
            ``layer`` patterns find nothing (what the package's refusal tells a user to pass).
        moe: A mixture-of-experts model: the ``moe`` variant (Megatron's scopes: attention and the router) runs for
            it too.
    """

    name: str
    requires: tuple[str, ...]
    patterns: str
    build: Callable[[BuildContext], Built]
    precision: str = "32-true"
    accumulate: int = 1
    clip: float | None = None
    steps: int = 64
    layer_modules: str | type[nn.Module] | None = None
    moe: bool = False


def missing_libraries(entry: Entry) -> list[str]:
    """The libraries of ``entry`` that are not installed."""
    return [name for name in entry.requires if importlib.util.find_spec(name) is None]


def _adamw(lr: float = 1e-3) -> OptimizerFn:
    return lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


def _classification_loss(module: ZooModule, batch: Any) -> Tensor:
    images, labels = batch
    return F.cross_entropy(module.net(images), labels)


def _images(ctx: BuildContext, count: int, size: int, classes: int = 10) -> TensorDataset:
    generator = ctx.generator()
    return TensorDataset(
        torch.randn(count, 3, size, size, generator=generator), torch.randint(0, classes, (count,), generator=generator)
    )


def _loader(dataset: Dataset, batch_size: int, ctx: BuildContext, shuffle: bool = True, **kwargs: Any) -> DataLoader:
    """A single-process loader whose order is fixed by the entry's seed (not by the global RNG)."""
    generator = ctx.generator(offset=7) if shuffle else None
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=generator, drop_last=True, **kwargs)


# -- Hugging Face -----------------------------------------------------------------------------------------------
VOCAB = 512


def tiny_tokenizer(vocab_size: int = VOCAB) -> Any:
    """A real ``PreTrainedTokenizerFast`` over a word-level vocabulary made in code (``t0``, ``t1``, ...)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"t{i}": i + 2 for i in range(vocab_size - 2)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]")


def _texts(ctx: BuildContext, count: int, low: int, high: int) -> list[str]:
    """Random texts of ``low``..``high`` words of the tiny vocabulary."""
    generator = ctx.generator(offset=1)
    lengths = torch.randint(low, high + 1, (count,), generator=generator).tolist()
    return [" ".join(f"t{i}" for i in torch.randint(0, VOCAB - 2, (n,), generator=generator).tolist()) for n in lengths]


class _Rows(Dataset):
    """A list of examples (dicts), as a ``datasets`` dataset hands a collator."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.rows[index]


def _llama(**overrides: Any) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    # fmt: off
    config = {"vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 256, "use_cache": False}
    # fmt: on
    return LlamaForCausalLM(LlamaConfig(**{**config, **overrides}))


def _hf_loss(module: ZooModule, batch: Any) -> Tensor:
    """A Hugging Face model's own loss on a dict-like batch (labels inside)."""
    return module.net(**batch).loss


def _token_loss(module: ZooModule, batch: Any) -> Tensor:
    """Causal LM loss on a ``(input_ids,)`` batch of fixed length (labels are the inputs)."""
    (ids,) = batch
    return module.net(input_ids=ids, labels=ids).loss


def _token_loader(ctx: BuildContext, seq: int = 128, batch_size: int = 8) -> DataLoader:
    count = batch_size * 16
    ids = torch.randint(0, VOCAB, (count, seq), generator=ctx.generator())
    return _loader(TensorDataset(ids), batch_size, ctx)


def build_llama_collator(ctx: BuildContext) -> Built:
    """``LlamaForCausalLM`` fed by ``DataCollatorForLanguageModeling(mlm=False, pad_to_multiple_of=64)``."""
    from transformers import DataCollatorForLanguageModeling

    tokenizer = tiny_tokenizer()
    encoded = tokenizer(_texts(ctx, 8 * 16, 32, 256))["input_ids"]
    collator = DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm=False, pad_to_multiple_of=64)
    loader = _loader(_Rows([{"input_ids": ids} for ids in encoded]), 8, ctx, collate_fn=collator)
    return Built(ZooModule(_llama(), _hf_loss, _adamw()), loader)


def build_bert_padding(ctx: BuildContext) -> Built:
    """``BertForSequenceClassification`` fed by ``DataCollatorWithPadding(pad_to_multiple_of=32)``."""
    from transformers import BertConfig, BertForSequenceClassification, DataCollatorWithPadding

    tokenizer = tiny_tokenizer()
    texts = _texts(ctx, 16 * 8, 16, 128)
    labels = torch.randint(0, 4, (len(texts),), generator=ctx.generator(offset=2)).tolist()
    rows = [{**tokenizer(text), "labels": label} for text, label in zip(texts, labels, strict=True)]
    collator = DataCollatorWithPadding(tokenizer=tokenizer, pad_to_multiple_of=32)
    # fmt: off
    config = BertConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=256, max_position_embeddings=256, num_labels=4)
    # fmt: on
    net = BertForSequenceClassification(config)
    return Built(ZooModule(net, _hf_loss, _adamw()), _loader(_Rows(rows), 16, ctx, collate_fn=collator))


def build_llama_accumulate(ctx: BuildContext) -> Built:
    """``LlamaForCausalLM`` trained with ``accumulate_grad_batches=4``."""
    return Built(ZooModule(_llama(), _token_loss, _adamw()), _token_loader(ctx))


def build_llama_bf16(ctx: BuildContext) -> Built:
    """``LlamaForCausalLM`` under ``precision="bf16-mixed"``."""
    return Built(ZooModule(_llama(), _token_loss, _adamw()), _token_loader(ctx))


def build_lora_llama(ctx: BuildContext) -> Built:
    """peft LoRA (``q_proj``, ``v_proj``, r=8) on a tiny ``LlamaForCausalLM``: only the adapters train."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")
    net = get_peft_model(_llama(), lora)
    return Built(ZooModule(net, _token_loss, _adamw(3e-3)), _token_loader(ctx))


def build_moe(family: str, experts: str) -> Callable[[BuildContext], Built]:
    """A dropless Hugging Face MoE causal LM (``family``: ``qwen3_moe``, ``olmoe``, ``mixtral``) from its config class,
    4 layers of 8 experts, top-2, the router's auxiliary loss in the loss, experts run by ``experts``
    (``grouped_mm``, ``batched_mm`` or ``eager``, set with ``set_experts_implementation``); sequence 256, batch 8.
    """

    def build(ctx: BuildContext) -> Built:
        import transformers

        config_class, model_class = MOE_FAMILIES[family]
        # fmt: off
        config = {"vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
                  "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 256,
                  "use_cache": False, "output_router_logits": True, "router_aux_loss_coef": 0.01}
        # fmt: on
        if family == "mixtral":
            config.update(num_local_experts=8, num_experts_per_tok=2)
        else:
            config.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256)
        net = getattr(transformers, model_class)(getattr(transformers, config_class)(**config))
        net.set_experts_implementation(experts)
        return Built(ZooModule(net, _token_loss, _adamw()), _token_loader(ctx, seq=256))

    return build


#: Config and model classes of the MoE families the zoo builds.
MOE_FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}


def _gpt2(dropout: float, use_cache: bool | None = False) -> nn.Module:
    """A tiny GPT-2; ``use_cache=None`` keeps the config's default (``True``: a cache object in every forward)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cache = {} if use_cache is None else {"use_cache": use_cache}
    # fmt: off
    config = GPT2Config(**cache, vocab_size=VOCAB, n_positions=128, n_embd=128, n_layer=2, n_head=4,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    # fmt: on
    return GPT2LMHeadModel(config)


def build_gpt2_onecycle(ctx: BuildContext) -> Built:
    """``GPT2LMHeadModel`` with AdamW and ``OneCycleLR`` (interval ``step``, ``cycle_momentum=True`` cycles betas)."""

    def scheduler(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        onecycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=2e-3, total_steps=ctx.steps + 1)
        return {"scheduler": onecycle, "interval": "step"}

    module = ZooModule(_gpt2(0.0), _token_loss, _adamw(), scheduler=scheduler)
    return Built(module, _token_loader(ctx))


def build_gpt2_dropout(ctx: BuildContext) -> Built:
    """``GPT2LMHeadModel`` with dropout 0.1 (embeddings, attention, residuals): RNG inside the step."""
    return Built(ZooModule(_gpt2(0.1), _token_loss, _adamw()), _token_loader(ctx))


def build_gpt2_default_cache(ctx: BuildContext) -> Built:
    """``GPT2LMHeadModel`` from a config that keeps ``use_cache`` at its default, as a new user writes it."""
    return Built(ZooModule(_gpt2(0.0, use_cache=None), _token_loss, _adamw()), _token_loader(ctx))


def build_t5(ctx: BuildContext) -> Built:
    """``T5ForConditionalGeneration`` (tiny config, dropout 0.1): encoder-decoder, relative position buckets."""
    from transformers import T5Config, T5ForConditionalGeneration

    # fmt: off
    config = T5Config(vocab_size=VOCAB, d_model=128, d_kv=32, d_ff=256, num_layers=2, num_decoder_layers=2,
                      num_heads=4, dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0, use_cache=False)
    # fmt: on
    generator = ctx.generator()
    count = 8 * 16
    sources = torch.randint(1, VOCAB, (count, 64), generator=generator)
    targets = torch.randint(1, VOCAB, (count, 32), generator=generator)
    rows = [{"input_ids": s, "labels": t} for s, t in zip(sources, targets, strict=True)]
    return Built(ZooModule(T5ForConditionalGeneration(config), _hf_loss, _adamw()), _loader(_Rows(rows), 8, ctx))


def build_whisper(ctx: BuildContext) -> Built:
    """``WhisperForConditionalGeneration`` (tiny config): log-mel features in, token labels out."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    # fmt: off
    config = WhisperConfig(vocab_size=VOCAB, num_mel_bins=32, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=4, decoder_attention_heads=4, d_model=128, encoder_ffn_dim=256,
                           decoder_ffn_dim=256, max_source_positions=64, max_target_positions=64, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, use_cache=False)
    # fmt: on
    generator = ctx.generator()
    count = 8 * 16
    features = torch.randn(count, 32, 128, generator=generator)  # 2 * max_source_positions frames
    labels = torch.randint(3, VOCAB, (count, 24), generator=generator)
    rows = [{"input_features": f, "labels": y} for f, y in zip(features, labels, strict=True)]
    net = WhisperForConditionalGeneration(config)
    return Built(ZooModule(net, _hf_loss, _adamw()), _loader(_Rows(rows), 8, ctx))


# -- datasets on the device ----------------------------------------------------------------------------------------
def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(32, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 4)
    )


def _device_tensors(ctx: BuildContext, count: int) -> tuple[Tensor, Tensor]:
    generator = ctx.generator()
    inputs = torch.randn(count, 32, generator=generator).to(ctx.device)
    labels = torch.randint(0, 4, (count,), generator=generator).to(ctx.device)
    return inputs, labels


def build_device_tensordataset(ctx: BuildContext) -> Built:
    """A ``TensorDataset`` of tensors already on the training device, ``batch_size=16``, 8 batches an epoch."""
    inputs, labels = _device_tensors(ctx, 16 * 8)
    loader = DataLoader(TensorDataset(inputs, labels), batch_size=16, shuffle=False)
    return Built(ZooModule(_mlp(), _classification_loss, _adamw()), loader, [inputs, labels])


class DeviceBatches(Dataset):
    """Pre-batched data on the device: item ``i`` is a view of the ``i``-th slice of the user's tensors."""

    def __init__(self, inputs: Tensor, labels: Tensor, batch_size: int) -> None:
        self.inputs, self.labels, self.batch_size = inputs, labels, batch_size

    def __len__(self) -> int:
        return self.inputs.shape[0] // self.batch_size

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        window = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self.inputs[window], self.labels[window]


def build_device_views(ctx: BuildContext) -> Built:
    """Batches that are views of a device dataset (``batch_size=None``): a write into a batch lands in the dataset."""
    inputs, labels = _device_tensors(ctx, 16 * 8)
    loader = DataLoader(DeviceBatches(inputs, labels, 16), batch_size=None, shuffle=False)
    return Built(ZooModule(_mlp(), _classification_loss, _adamw()), loader, [inputs, labels])


class PythonStep(ZooModule):
    """The device MLP with per-step Python in ``training_step``, as users write it.

    ``kind``: ``"skip"`` (every fourth batch returns ``None``), ``"annealed"`` (a loss weight read from
    ``self.global_step``), ``"epoch_branch"`` (an L2 term from the second epoch on), ``"outputs_counter"`` (the
    losses appended to a list read in ``on_train_epoch_end``, and a call counter), ``"random"`` (an input flip drawn
    from Python's ``random``), ``"flag"`` (an L2 term while ``self.regularize`` is set, which :class:`FlagFlipper`
    turns on from the second epoch), ``"lr_warmup"`` (Lightning's documented warm-up: ``optimizer_step`` writes the
    param groups' ``lr`` as a number) or ``"temperature"`` (the loss divided by ``self.temperature``, which
    :class:`TemperatureAt` sets in the middle of the second epoch). The Python state a user would read
    after the fit (the counter, the epoch means) is copied into the buffer ``python_state``, which the zoo compares.
    """

    def __init__(self, kind: str) -> None:
        super().__init__(_mlp(), _classification_loss, _adamw())
        self.kind = kind
        self.calls = 0
        self.regularize = False
        self.temperature = 1.0
        self.epoch_outputs: list[Tensor] = []
        self.epoch_means: list[float] = []
        self.register_buffer("python_state", torch.zeros(16, dtype=torch.float64))

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor | None:
        self.batch_sums.index_copy_(0, self._slot, checksum(batch_tensors(batch)).view(1))
        if self.kind == "skip" and batch_idx % 4 == 3:
            return None
        if self.kind == "random" and random.random() < 0.5:
            inputs, labels = batch
            batch = (inputs.flip(-1), labels)
        loss = self._loss(self, batch)
        if self.kind == "annealed":
            loss = loss * (1.0 if self.global_step < 8 else 0.1)
        elif (self.kind == "epoch_branch" and self.current_epoch >= 1) or (self.kind == "flag" and self.regularize):
            loss = loss + 1e-2 * self.net[0].weight.pow(2).sum()
        elif self.kind == "outputs_counter":
            self.calls += 1
            self.epoch_outputs.append(loss.detach())
        elif self.kind == "temperature":
            loss = loss / self.temperature
        self.log("train_loss", loss)
        return loss

    @override
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        optimizer.step(closure=optimizer_closure)
        if self.kind == "lr_warmup" and self.trainer.global_step < WARMUP_STEPS:
            for group in optimizer.param_groups:
                group["lr"] = 1e-3 * (self.trainer.global_step + 1) / WARMUP_STEPS

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if outputs is None or (isinstance(outputs, Mapping) and "loss" not in outputs):
            self.step_losses.append(torch.zeros((), device=self.device))  # a skipped batch
            return
        super().on_train_batch_end(outputs, batch, batch_idx)

    @override
    def on_train_epoch_end(self) -> None:
        if self.epoch_outputs:
            self.epoch_means.append(float(torch.stack(self.epoch_outputs).mean()))
            self.epoch_outputs.clear()
        values = [float(self.calls), *self.epoch_means][: self.python_state.numel()]
        self.python_state[: len(values)] = torch.tensor(values, dtype=torch.float64)


#: Optimizer steps of :class:`PythonStep`'s ``"lr_warmup"``.
WARMUP_STEPS = 50


class TemperatureAt(pl.Callback):
    """A user's callback that sets the module's ``temperature`` to 2 in the middle of the second epoch (step 12)."""

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == 12:
            pl_module.temperature = 2.0


class FlagFlipper(pl.Callback):
    """A user's callback that turns the module's ``regularize`` flag on from the second epoch."""

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pl_module.regularize = trainer.current_epoch >= 1


def build_python_step(kind: str) -> Callable[[BuildContext], Built]:
    """A builder of :class:`PythonStep` of ``kind`` on the device ``TensorDataset`` (8 batches an epoch)."""

    def build(ctx: BuildContext) -> Built:
        inputs, labels = _device_tensors(ctx, 16 * 8)
        loader = DataLoader(TensorDataset(inputs, labels), batch_size=16, shuffle=False)
        callbacks: list[pl.Callback] = {"flag": [FlagFlipper()], "temperature": [TemperatureAt()]}.get(kind, [])
        return Built(PythonStep(kind), loader, [inputs, labels], callbacks)

    return build


class ManualGAN(ZooModule):
    """A GAN-style pair under manual optimization, as Lightning documents it: each turn toggles its optimizer.

    The classifier (``net``) is trained on the labels and to fool a critic that tells its class distributions from the
    labels' one-hot rows; the critic learns to tell them apart. Each turn clips its gradients by norm
    (``self.clip_gradients``) and steps its own AdamW, so Lightning counts two optimizer steps per batch.
    """

    def __init__(self) -> None:
        super().__init__(_mlp(), _classification_loss, _adamw())
        self.automatic_optimization = False
        self.critic = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))

    @override
    def configure_optimizers(self) -> Any:
        return _adamw()(self.net.parameters()), _adamw()(self.critic.parameters())

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self.batch_sums.index_copy_(0, self._slot, checksum(batch_tensors(batch)).view(1))
        classifier, critic = self.optimizers()
        inputs, labels = batch
        self.toggle_optimizer(classifier)
        logits = self.net(inputs)
        fake = logits.softmax(-1)
        loss = F.cross_entropy(logits, labels) + 0.1 * F.softplus(-self.critic(fake)).mean()
        classifier.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(classifier, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        classifier.step()
        self.untoggle_optimizer(classifier)
        self.toggle_optimizer(critic)
        real = torch.eye(4, device=labels.device)[labels]
        critic_loss = F.softplus(-self.critic(real)).mean() + F.softplus(self.critic(fake.detach())).mean()
        critic.zero_grad()
        self.manual_backward(critic_loss)
        self.clip_gradients(critic, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        critic.step()
        self.untoggle_optimizer(critic)
        self.log("train_loss", loss)
        return loss


def build_manual_gan(ctx: BuildContext) -> Built:
    """:class:`ManualGAN` on the device ``TensorDataset`` (8 batches an epoch)."""
    inputs, labels = _device_tensors(ctx, 16 * 8)
    loader = DataLoader(TensorDataset(inputs, labels), batch_size=16, shuffle=False)
    return Built(ManualGAN(), loader, [inputs, labels])


# -- vision ------------------------------------------------------------------------------------------------------
def build_resnet18_cyclic(ctx: BuildContext) -> Built:
    """torchvision ``resnet18`` at 64x64 (BatchNorm), SGD with ``CyclicLR`` cycling momentum (interval ``step``)."""
    import torchvision

    def optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=5e-4)

    def scheduler(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        cyclic = torch.optim.lr_scheduler.CyclicLR(
            optimizer, base_lr=0.005, max_lr=0.05, step_size_up=8, cycle_momentum=True, base_momentum=0.8
        )
        return {"scheduler": cyclic, "interval": "step"}

    net = torchvision.models.resnet18(num_classes=10)
    module = ZooModule(net, _classification_loss, optimizer, scheduler=scheduler)
    return Built(module, _loader(_images(ctx, 32 * 8, 64), 32, ctx))


def build_mobilenet(ctx: BuildContext) -> Built:
    """torchvision ``mobilenet_v3_small`` at 64x64: BatchNorm, squeeze-excitation, dropout 0.2 in the head."""
    import torchvision

    net = torchvision.models.mobilenet_v3_small(num_classes=10)
    return Built(ZooModule(net, _classification_loss, _adamw()), _loader(_images(ctx, 32 * 8, 64), 32, ctx))


def build_efficientnet(ctx: BuildContext) -> Built:
    """timm ``efficientnet_b0`` at 64x64 (BatchNorm, SiLU, squeeze-excitation)."""
    import timm

    net = timm.create_model("efficientnet_b0", pretrained=False, num_classes=10)
    return Built(ZooModule(net, _classification_loss, _adamw()), _loader(_images(ctx, 16 * 8, 64), 16, ctx))


def build_convnext(ctx: BuildContext) -> Built:
    """timm ``convnext_atto`` at 64x64 (LayerNorm, depthwise convolutions)."""
    import timm

    net = timm.create_model("convnext_atto", pretrained=False, num_classes=10)
    return Built(ZooModule(net, _classification_loss, _adamw()), _loader(_images(ctx, 32 * 8, 64), 32, ctx))


def build_vit_accuracy(ctx: BuildContext) -> Built:
    """timm ViT (depth 4, 32x32, patch 4) with a torchmetrics ``MulticlassAccuracy`` updated in ``training_step``."""
    import timm
    from torchmetrics.classification import MulticlassAccuracy

    def loss(module: ZooModule, batch: Any) -> Tensor:
        images, labels = batch
        logits = module.net(images)
        module.zoo_metrics["accuracy"].update(logits, labels)
        return F.cross_entropy(logits, labels)

    net = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4, depth=4, num_classes=10
    )
    module = ZooModule(net, loss, _adamw(), metrics={"accuracy": MulticlassAccuracy(num_classes=10)})
    return Built(module, _loader(_images(ctx, 32 * 8, 32), 32, ctx))


# -- graphs --------------------------------------------------------------------------------------------------------
class GCN(nn.Module):
    """Two ``GCNConv`` layers, mean pooling per graph, a linear head (graph classification)."""

    def __init__(self, features: int = 16, hidden: int = 64, classes: int = 4) -> None:
        super().__init__()
        from torch_geometric.nn import GCNConv

        self.conv1, self.conv2 = GCNConv(features, hidden), GCNConv(hidden, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, batch: Any) -> Tensor:
        from torch_geometric.nn import global_mean_pool

        x = F.relu(self.conv1(batch.x, batch.edge_index))
        x = F.relu(self.conv2(x, batch.edge_index))
        return self.head(global_mean_pool(x, batch.batch, size=batch.num_graphs))


def _graph_loss(module: ZooModule, batch: Any) -> Tensor:
    return F.cross_entropy(module.net(batch), batch.y)


def _random_graphs(ctx: BuildContext, count: int, nodes: Callable[[torch.Generator], int]) -> list[Any]:
    from torch_geometric.data import Data

    generator = ctx.generator()
    graphs = []
    for _ in range(count):
        n = nodes(generator)
        edges = torch.randint(0, n, (2, 3 * n), generator=generator)
        x = torch.randn(n, 16, generator=generator)
        graphs.append(Data(x=x, edge_index=edges, y=torch.randint(0, 4, (1,), generator=generator)))
    return graphs


def _graph_loader(graphs: list[Any], ctx: BuildContext) -> Any:
    from torch_geometric.loader import DataLoader as GraphLoader

    return GraphLoader(graphs, batch_size=16, shuffle=True, generator=ctx.generator(offset=7), drop_last=True)


def build_gcn_fixed(ctx: BuildContext) -> Built:
    """torch_geometric GCN on ``Batch`` objects of 16 random graphs of 24 nodes and 72 edges each (stable shapes)."""
    graphs = _random_graphs(ctx, 16 * 8, lambda generator: 24)
    return Built(ZooModule(GCN(), _graph_loss, _adamw()), _graph_loader(graphs, ctx))


def build_gcn_variable(ctx: BuildContext) -> Built:
    """torch_geometric GCN on ``Batch`` objects of random graphs of 12..36 nodes (a new shape every batch)."""
    graphs = _random_graphs(ctx, 16 * 8, lambda generator: int(torch.randint(12, 37, (1,), generator=generator)))
    return Built(ZooModule(GCN(), _graph_loss, _adamw()), _graph_loader(graphs, ctx))


# -- audio ---------------------------------------------------------------------------------------------------------
def build_wav2letter(ctx: BuildContext) -> Built:
    """torchaudio ``Wav2Letter`` on MFCC-like features with CTC loss (fixed lengths, given as Python ints)."""
    from torchaudio.models import Wav2Letter

    frames, target_len, classes = 200, 20, 30

    def loss(module: ZooModule, batch: Any) -> Tensor:
        features, targets = batch
        log_probs = module.net(features).permute(2, 0, 1)  # (time, batch, classes), log-softmaxed by the model
        batch_size = features.shape[0]
        return F.ctc_loss(log_probs, targets, (log_probs.shape[0],) * batch_size, (target_len,) * batch_size)

    generator = ctx.generator()
    count = 16 * 8
    features = torch.randn(count, 40, frames, generator=generator)
    targets = torch.randint(1, classes, (count, target_len), generator=generator)
    net = Wav2Letter(num_classes=classes, input_type="mfcc", num_features=40)
    return Built(ZooModule(net, loss, _adamw()), _loader(TensorDataset(features, targets), 16, ctx))


# ---------------------------------------------------------------------------------------------------- the zoo
HF = ("transformers", "tokenizers")
# fmt: off
ENTRIES: tuple[Entry, ...] = (
    Entry("llama_clm_collator", HF, "HF collator, BatchEncoding, lengths 32..256 padded to 64", build_llama_collator),
    Entry("bert_cls_padding", HF, "DataCollatorWithPadding, sequence classifier, dropout 0.1", build_bert_padding),
    Entry("device_tensordataset", (), "TensorDataset on the device, batch_size 16, 8 epochs",
          build_device_tensordataset, layer_modules="net.*"),
    Entry("python_skip", (), "training_step returns None on every fourth batch", build_python_step("skip"),
          layer_modules="net.*"),
    Entry("python_annealed", (), "a loss weight read from self.global_step", build_python_step("annealed"),
          layer_modules="net.*"),
    Entry("python_epoch_branch", (), "an L2 term from the second epoch on", build_python_step("epoch_branch"),
          layer_modules="net.*"),
    Entry("python_outputs_counter", (), "losses appended to a list read in on_train_epoch_end, a call counter",
          build_python_step("outputs_counter"), layer_modules="net.*"),
    Entry("python_random", (), "training_step flips its inputs when random.random() < 0.5", build_python_step("random"),
          layer_modules="net.*"),
    Entry("python_callback_flag", (), "a callback sets a flag the step reads, from the second epoch",
          build_python_step("flag"), layer_modules="net.*"),
    Entry("python_lr_warmup", (), "Lightning's documented warm-up: optimizer_step writes the param groups' lr",
          build_python_step("lr_warmup"), layer_modules="net.*"),
    Entry("python_temperature_mid_epoch", (), "a callback sets a loss temperature the step reads, mid-epoch",
          build_python_step("temperature"), layer_modules="net.*"),
    Entry("manual_gan", (), "manual optimization, a GAN: two optimizers, toggle_optimizer, clip_gradients",
          build_manual_gan, layer_modules="net.*"),
    Entry("device_batch_views", (), "batches are views of a device dataset, 8 epochs", build_device_views,
          layer_modules="net.*"),
    Entry("gpt2_onecycle_clip", HF, "OneCycleLR (betas cycle) + gradient_clip_val=1.0", build_gpt2_onecycle, clip=1.0),
    Entry("resnet18_cycliclr_sgd", ("torchvision",), "torchvision resnet18 64x64, BatchNorm, SGD + CyclicLR momentum"
          " cycling", build_resnet18_cyclic),
    Entry("vit_accuracy_metric", ("timm", "torchmetrics"), "timm ViT, torchmetrics Accuracy updated in training_step",
          build_vit_accuracy),
    Entry("llama_accumulate4", HF, "accumulate_grad_batches=4 on LlamaForCausalLM", build_llama_accumulate,
          accumulate=4, steps=32),
    Entry("lora_llama", (*HF, "peft"), "peft LoRA (q_proj, v_proj) on Llama", build_lora_llama),
    Entry("mobilenet_v3_small", ("torchvision",), "torchvision mobilenet_v3_small 64x64, BatchNorm, dropout 0.2",
          build_mobilenet),
    Entry("efficientnet_b0", ("timm",), "timm efficientnet_b0 64x64, BatchNorm", build_efficientnet),
    Entry("convnext_atto", ("timm",), "timm convnext_atto 64x64", build_convnext),
    Entry("gcn_fixed_graphs", ("torch_geometric",), "torch_geometric GCN, Batch of fixed-size random graphs",
          build_gcn_fixed, layer_modules="net.conv*"),
    Entry("gcn_variable_graphs", ("torch_geometric",), "torch_geometric GCN, Batch of random graphs of 12..36 nodes",
          build_gcn_variable, layer_modules="net.conv*"),
    Entry("gpt2_dropout", HF, "GPT-2 with dropout 0.1 (RNG in the step)", build_gpt2_dropout),
    Entry("llama_bf16", HF, 'LlamaForCausalLM, precision="bf16-mixed"', build_llama_bf16, precision="bf16-mixed"),
    Entry("gpt2_default_cache", HF, "GPT-2 config left at its defaults (use_cache=True)", build_gpt2_default_cache),
    Entry("t5_tiny", HF, "T5 encoder-decoder, dropout 0.1", build_t5),
    Entry("qwen3_moe_grouped_mm", HF, "Qwen3-MoE 4x8 experts top-2, grouped_mm experts, router aux loss, bf16-mixed",
          build_moe("qwen3_moe", "grouped_mm"), precision="bf16-mixed", steps=100, moe=True),
    Entry("qwen3_moe_batched_mm", HF, "Qwen3-MoE 4x8 experts top-2, batched_mm experts, router aux loss",
          build_moe("qwen3_moe", "batched_mm"), steps=100, moe=True),
    Entry("qwen3_moe_eager_experts", HF, "Qwen3-MoE 4x8 experts top-2, eager experts (a host sync), bf16-mixed",
          build_moe("qwen3_moe", "eager"), precision="bf16-mixed", steps=100, moe=True),
    Entry("olmoe_grouped_mm", HF, "OLMoE 4x8 experts top-2, grouped_mm experts, router aux loss",
          build_moe("olmoe", "grouped_mm"), steps=100, moe=True),
    Entry("mixtral_grouped_mm", HF, "Mixtral 4x8 experts top-2, grouped_mm experts, router aux loss, bf16-mixed",
          build_moe("mixtral", "grouped_mm"), precision="bf16-mixed", steps=100, moe=True),
    Entry("whisper_tiny", HF, "Whisper encoder-decoder on log-mel features", build_whisper),
    # Wav2Letter's Sequential also holds ReLU(inplace=True), which is no region of its own: select the convolutions.
    Entry("wav2letter_ctc", ("torchaudio",), "torchaudio Wav2Letter, CTC loss", build_wav2letter,
          layer_modules=nn.Conv1d),
)
# fmt: on


def entries_named(names: Sequence[str] | None) -> list[Entry]:
    """The entries to run, in zoo order; unknown names raise ``ValueError`` naming the known ones."""
    if not names:
        return list(ENTRIES)
    known = {entry.name: entry for entry in ENTRIES}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(
            f"zoo/run.py: --only got unknown entries {unknown}; the zoo has {sorted(known)}."
            " Pass names from that list, separated by commas."
        )
    return [entry for entry in ENTRIES if entry.name in names]
