"""Convolutional networks shaped like torchvision's and timm's, with their module names and class names.

Neither library is a test dependency (torchvision does not install beside every torch), and scope discovery reads
names and classes, never the library: these lookalikes have the same trees at a few channels, and train on a CPU.
Each builder returns the model and the ``layer`` targets the package must find in it, in model order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


@functools.cache
def named(class_name: str, base: type[nn.Module] = nn.Module, **namespace: Any) -> type[nn.Module]:
    """One class per name, as a library has (timm's stages hold blocks of one class)."""
    return type(class_name, (base,), namespace)


def conv_norm_act(cin: int, cout: int, stride: int = 1, groups: int = 1, act: bool = True) -> nn.Sequential:
    """torchvision's ``Conv2dNormActivation``: a ``Sequential`` of a convolution, a BatchNorm and an activation."""
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, 3, stride, 1, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    cls = named("Conv2dNormActivation", nn.Sequential)
    return cls(*layers, nn.Hardswish()) if act else cls(*layers)


# ---------------------------------------------------------------------------------------------- torchvision ResNet
class BasicBlock(nn.Module):
    """torchvision's ResNet block: two 3x3 convolutions with BatchNorm, a shortcut, in-place ReLUs."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        shortcut = stride != 1 or cin != cout
        self.downsample = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)) if shortcut else None
        )

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision's ResNet: the stem (``conv1``, ``bn1``, ``relu``, ``maxpool``), ``layer1``..``layer4``, the head."""

    def __init__(self, blocks: tuple[int, ...] = (2, 2, 2, 2), width: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = width
        for index, count in enumerate(blocks, start=1):
            cout, stride = width * 2 ** (index - 1), 1 if index == 1 else 2
            stage = [BasicBlock(cin if i == 0 else cout, cout, stride if i == 0 else 1) for i in range(count)]
            self.add_module(f"layer{index}", nn.Sequential(*stage))
            cin = cout
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18() -> tuple[nn.Module, list[str]]:
    return ResNet(), [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]


# ---------------------------------------------------------------------------------------- torchvision MobileNetV3
class SqueezeExcitation(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, max(channels // 4, 1), 1)
        self.fc2 = nn.Conv2d(max(channels // 4, 1), channels, 1)
        self.activation = nn.ReLU()
        self.scale_activation = nn.Hardsigmoid()

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))


class InvertedResidual(nn.Module):
    """torchvision's MobileNetV3 block: ``block`` holds expand, depthwise, squeeze-excitation and project."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        hidden = cin * 2
        self.use_res_connect = stride == 1 and cin == cout
        self.block = nn.Sequential(
            conv_norm_act(cin, hidden),
            conv_norm_act(hidden, hidden, stride, groups=hidden),
            SqueezeExcitation(hidden),
            conv_norm_act(hidden, cout, act=False),
        )

    def forward(self, x: Tensor) -> Tensor:
        out = self.block(x)
        return out + x if self.use_res_connect else out


class MobileNetV3(nn.Module):
    """``features.0`` the stem, ``features.1..N`` ``InvertedResidual``, the last feature a 1x1 conv; a dropout head."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        plan = [(4, 4, 2), (4, 8, 2), (8, 8, 1)]
        blocks = [InvertedResidual(cin, cout, stride) for cin, cout, stride in plan]
        self.features = nn.Sequential(conv_norm_act(3, 4, 2), *blocks, conv_norm_act(8, 16))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(16, 16), nn.Hardswish(), nn.Dropout(0.2), nn.Linear(16, classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def mobilenet_v3_small() -> tuple[nn.Module, list[str]]:
    return MobileNetV3(), ["features.1", "features.2", "features.3"]


# ------------------------------------------------------------------- torchvision EfficientNet, ConvNeXt and RegNet
def _residual(self: nn.Module, x: Tensor) -> Tensor:
    return x + self.block(x)


def _block(class_name: str, channels: int) -> nn.Module:
    """A residual block of class ``class_name`` whose body is a ``block`` Sequential (MBConv, FusedMBConv, CNBlock)."""

    block = named(class_name, forward=_residual)()
    block.block = nn.Sequential(conv_norm_act(channels, channels), conv_norm_act(channels, channels, act=False))
    return block


def _classify(self: nn.Module, x: Tensor) -> Tensor:
    return self.classifier(self.avgpool(self.features(x)).flatten(1))


def _staged(class_name: str, stages: int = 2, per_stage: int = 2) -> nn.Module:
    """``features.0`` stem, ``features.1..`` Sequentials of blocks, a 1x1 conv last, ``avgpool`` and ``classifier``."""
    model = named(class_name, forward=_classify)()
    stage_list = [nn.Sequential(*[_block(c, 4) for c in _classes_of(class_name, per_stage)]) for _ in range(stages)]
    model.features = nn.Sequential(conv_norm_act(3, 4, 2), *stage_list, conv_norm_act(4, 8))
    model.avgpool = nn.AdaptiveAvgPool2d(1)
    model.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(8, 10))
    return model


def _classes_of(model: str, count: int) -> list[str]:
    return {"EfficientNet": ["MBConv"] * count, "EfficientNetV2": ["FusedMBConv"] * count}.get(
        model, ["CNBlock"] * count
    )


def efficientnet_b0() -> tuple[nn.Module, list[str]]:
    return _staged("EfficientNet"), [f"features.{i}.{j}" for i in (1, 2) for j in (0, 1)]


def efficientnet_v2_s() -> tuple[nn.Module, list[str]]:
    return _staged("EfficientNetV2"), [f"features.{i}.{j}" for i in (1, 2) for j in (0, 1)]


def convnext_tiny() -> tuple[nn.Module, list[str]]:
    """torchvision's ConvNeXt: stages of ``CNBlock`` at ``features.1`` and ``features.3``, a downsample between."""
    model = _staged("ConvNeXt")
    downsample = nn.Sequential(nn.GroupNorm(1, 4), nn.Conv2d(4, 4, 1))
    stages = list(model.features)
    model.features = nn.Sequential(stages[0], stages[1], downsample, stages[2], stages[3])
    return model, [f"features.{i}.{j}" for i in (1, 3) for j in (0, 1)]


def _regnet_forward(self: nn.Module, x: Tensor) -> Tensor:
    return self.fc(self.avgpool(self.trunk_output(self.stem(x))).flatten(1))


def regnet_y_400mf() -> tuple[nn.Module, list[str]]:
    """torchvision's RegNet: ``stem``, ``trunk_output.blockN`` (``AnyStage``) of ``ResBottleneckBlock`` blocks."""
    model = named("RegNet", forward=_regnet_forward)()
    model.stem = conv_norm_act(3, 4, 2)
    model.trunk_output = nn.Sequential()
    for stage in (1, 2):
        any_stage = named("AnyStage", nn.Sequential)()
        for index in range(2):
            block = _block("ResBottleneckBlock", 4)
            any_stage.add_module(f"block{stage}-{index}", block)
        model.trunk_output.add_module(f"block{stage}", any_stage)
    model.avgpool = nn.AdaptiveAvgPool2d(1)
    model.fc = nn.Linear(4, 10)
    return model, [f"trunk_output.block{s}.block{s}-{i}" for s in (1, 2) for i in (0, 1)]


# ------------------------------------------------------------------------------------------------------------ timm
def timm_efficientnet() -> tuple[nn.Module, list[str]]:
    """timm's EfficientNet: ``conv_stem``/``bn1``, ``blocks.N`` stages of ``blocks.N.M`` blocks, ``conv_head``."""
    model = named("EfficientNet")()
    model.conv_stem, model.bn1 = nn.Conv2d(3, 4, 3, 2, 1), nn.BatchNorm2d(4)
    first = nn.Sequential(_block("DepthwiseSeparableConv", 4))
    second = nn.Sequential(_block("InvertedResidual", 4), _block("InvertedResidual", 4))
    model.blocks = nn.Sequential(first, second)
    model.conv_head, model.bn2 = nn.Conv2d(4, 8, 1), nn.BatchNorm2d(8)
    model.global_pool, model.classifier = nn.AdaptiveAvgPool2d(1), nn.Linear(8, 10)
    return model, ["blocks.0.0", "blocks.1.0", "blocks.1.1"]


class Mlp(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(channels, channels * 2), nn.GELU(), nn.Linear(channels * 2, channels)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ConvNeXtBlock(nn.Module):
    """timm's ConvNeXt block: depthwise ``conv_dw``, ``norm``, an ``mlp`` (which the ``mlp`` scope finds), ``gamma``."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv_dw = nn.Conv2d(channels, channels, 7, padding=3, groups=channels)
        self.norm = nn.LayerNorm(channels)
        self.mlp = Mlp(channels)
        self.gamma = nn.Parameter(torch.full((channels,), 1e-6))

    def forward(self, x: Tensor) -> Tensor:
        y = self.mlp(self.norm(self.conv_dw(x).permute(0, 2, 3, 1)))
        return x + (y * self.gamma).permute(0, 3, 1, 2)


def timm_convnext() -> tuple[nn.Module, list[str]]:
    """timm's ConvNeXt: ``stem``, ``stages.N`` (``ConvNeXtStage``: ``downsample``, ``blocks.M``), ``head``."""
    model = named("ConvNeXt")()
    model.stem = nn.Sequential(nn.Conv2d(3, 4, 4, 4), nn.GroupNorm(1, 4))
    stages = []
    for _ in range(2):
        stage = named("ConvNeXtStage")()
        stage.downsample = nn.Identity()
        stage.blocks = nn.Sequential(*[ConvNeXtBlock(4) for _ in range(2)])
        stages.append(stage)
    model.stages = nn.Sequential(*stages)
    model.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))
    return model, [f"stages.{s}.blocks.{b}" for s in (0, 1) for b in (0, 1)]


#: Each layout: a builder of the model and the ``layer`` targets it must resolve to.
LAYOUTS: dict[str, Callable[[], tuple[nn.Module, list[str]]]] = {
    "torchvision-resnet18": resnet18,
    "torchvision-mobilenet_v3_small": mobilenet_v3_small,
    "torchvision-efficientnet_b0": efficientnet_b0,
    "torchvision-efficientnet_v2_s": efficientnet_v2_s,
    "torchvision-convnext_tiny": convnext_tiny,
    "torchvision-regnet_y_400mf": regnet_y_400mf,
    "timm-efficientnet_b0": timm_efficientnet,
    "timm-convnext_atto": timm_convnext,
}


def classification_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    images, labels = batch
    return F.cross_entropy(model(images), labels)
