"""The built-in scopes: what each one finds in the model layouts the package knows.

docs/scopes.md has the table of layouts. The rules read attribute names, class names by suffix (``MixtralTopKRouter``
matches without importing its library) and a module's place in the tree. An MoE block is never ``mlp``; the ``layer``
blocks of convolutional networks are never their stem, head, or the ``Sequential`` that holds them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch.nn as nn

__all__ = ["BUILTIN_RULES", "Site", "sites_of"]

_LAYER_CONTAINERS = frozenset({"layers", "layer", "h", "blocks", "block", "decoder_layers", "encoder_layers"})
_LAYER_CLASSES = frozenset({"TransformerLayer"})
# torchvision's residual blocks: ResNet/ResNeXt/Wide-ResNet, MobileNetV2/V3, EfficientNet V1/V2, ConvNeXt, RegNet.
_BLOCK_CLASSES = frozenset(
    {"BasicBlock", "Bottleneck", "InvertedResidual", "MBConv", "FusedMBConv", "CNBlock", "ResBottleneckBlock"}
)
# ResNet's stages: ``layer1``..``layer4``.
_RESNET_STAGE = re.compile(r"layer\d+")
_MOE_NAMES = frozenset({"moe", "block_sparse_moe", "sparse_moe", "moe_layer", "moe_block", "mlp_moe"})
# Lower-cased: Hugging Face spells the same block ``DeepseekV3MoE``, ``DeepseekV2Moe`` and ``ExaoneMoeSparseMoEBlock``.
_MOE_CLASS_SUFFIXES = ("moe", "sparsemoeblock", "moelayer")
_ROUTER_NAMES = frozenset({"gate", "router"})
_ATTN_NAMES = frozenset({"attn", "attention", "self_attn", "self_attention", "mha", "multihead_attn"})
_ATTN_CLASSES = frozenset({"MultiheadAttention", "DotProductAttention"})
_MLP_NAMES = frozenset({"mlp", "ffn", "feed_forward", "feedforward"})
# BERT-style layers split the feed-forward into two sibling modules, each called once per layer.
_SPLIT_FFN = frozenset({"intermediate", "output"})
_MAMBA_NAMES = frozenset({"mamba", "mamba_mixer"})
_MAMBA_CLASSES = frozenset({"Mamba", "Mamba2"})


@dataclass(frozen=True)
class Site:
    """A module as the built-in rules see it: its qualified name, the module, and the model's tree around it."""

    name: str
    module: nn.Module
    tree: Mapping[str, nn.Module] = field(repr=False, compare=False)

    @property
    def parent_name(self) -> str:
        """The qualified name of its parent (``""`` for the root)."""
        return self.name.rpartition(".")[0]

    @property
    def parent(self) -> nn.Module:
        """Its parent module."""
        return self.tree[self.parent_name]

    @property
    def attr(self) -> str:
        """Its attribute name in its parent."""
        return self.name.rpartition(".")[2]

    @property
    def cls(self) -> str:
        """Its class name."""
        return type(self.module).__name__

    @property
    def in_layer(self) -> bool:
        """Whether its parent is a layer."""
        return _is_layer(self.parent_name, self.tree)

    @property
    def in_moe(self) -> bool:
        """Whether its parent is an MoE block."""
        return _is_moe(self.parent_name, self.tree)


def sites_of(model: nn.Module) -> list[Site]:
    """Every module but the root, in model order."""
    tree = dict(model.named_modules())
    return [Site(name, module, tree) for name, module in tree.items() if name]


def _numbered(name: str) -> str | None:
    """The attribute of the parent of a numbered child (``blocks`` for ``x.blocks.3``), else ``None``."""
    parts = name.split(".")
    return parts[-2] if len(parts) > 1 and parts[-1].isdigit() else None


def _composite(module: nn.Module) -> bool:
    return next(module.children(), None) is not None


def _is_stage(name: str, tree: Mapping[str, nn.Module]) -> bool:
    """A numbered plain ``Sequential``/``ModuleList`` of a layer list that holds composite blocks of one class.

    timm's EfficientNet and MobileNetV3 keep their blocks at ``blocks.N.M``. A ``Sequential`` of leaf modules
    (``Linear``, ``GELU``) stays a layer.
    """
    module = tree.get(name)
    if module is None or type(module) not in (nn.Sequential, nn.ModuleList) or _numbered(name) not in _LAYER_CONTAINERS:
        return False
    blocks = list(module.children())
    classes = {type(block) for block in blocks}
    return len(classes) == 1 and not classes & {nn.Sequential, nn.ModuleList} and all(map(_composite, blocks))


def _is_layer(name: str, tree: Mapping[str, nn.Module]) -> bool:
    module = tree.get(name)
    if module is None or not name:
        return False
    parent, container = name.rpartition(".")[0], _numbered(name)
    if container in _LAYER_CONTAINERS:
        return not _is_stage(name, tree)
    if container is not None and container.isdigit() and _is_stage(parent, tree):
        return True
    if container is not None and _RESNET_STAGE.fullmatch(container) and isinstance(tree[parent], nn.Sequential):
        return _composite(module)
    return type(module).__name__ in _LAYER_CLASSES | _BLOCK_CLASSES or isinstance(
        module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
    )


def _is_moe(name: str, tree: Mapping[str, nn.Module]) -> bool:
    if _is_layer(name, tree):  # a decoder layer that holds an MoE block (``MoEBlock`` in examples/moe.py) is a layer
        return False
    module = tree[name]
    children = {child for child, _ in module.named_children()}
    return (
        name.rpartition(".")[2] in _MOE_NAMES
        or type(module).__name__.lower().endswith(_MOE_CLASS_SUFFIXES)
        or ("experts" in children and bool(children & _ROUTER_NAMES))
    )


def _attn(site: Site) -> bool:
    return (
        site.attr in _ATTN_NAMES
        or site.cls in _ATTN_CLASSES
        or isinstance(site.module, nn.MultiheadAttention)
        or (site.in_layer and site.cls.endswith("Attention"))
    )


def _mlp(site: Site) -> bool:
    if _is_moe(site.name, site.tree):
        return False
    if site.attr in _MLP_NAMES or site.cls == "LayerNormMLP":
        return True
    if site.in_layer and site.cls.lower().endswith("mlp"):
        return True
    return site.attr in _SPLIT_FFN and {child for child, _ in site.parent.named_children()} >= _SPLIT_FFN


def _moe_router(site: Site) -> bool:
    return site.attr == "moe_router" or (site.in_moe and (site.attr in _ROUTER_NAMES or site.cls.endswith("Router")))


def _moe_preprocess(site: Site) -> bool:
    return site.attr == "moe_preprocess" or (site.attr == "preprocess" and site.in_moe)


def _mamba(site: Site) -> bool:
    mixer = site.cls.endswith("Mixer") and "mamba" in site.cls.lower()
    return site.attr in _MAMBA_NAMES or site.cls in _MAMBA_CLASSES or mixer


#: The built-in scopes: a predicate over each module of the model (the root excluded).
BUILTIN_RULES: dict[str, Callable[[Site], bool]] = {
    "attn": _attn,
    "mlp": _mlp,
    "moe": lambda site: _is_moe(site.name, site.tree),
    "moe_router": _moe_router,
    "moe_preprocess": _moe_preprocess,
    "mamba": _mamba,
    "layer": lambda site: _is_layer(site.name, site.tree),
}
