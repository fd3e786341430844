"""How far the optimizer's capturable form trains from the optimizer as the user built it, without any graph.

    PYTHONPATH=. python benchmarks/optimizer_arithmetic.py
    PYTHONPATH=. python benchmarks/optimizer_arithmetic.py --device cuda --steps 200

The whole step and the optimizer graph run Adam, AdamW and SGD fused, with the learning rate in a device tensor.
Each form below trains the same MLP from the same weights on the same batches for ``--steps`` steps, eagerly; the
figure is the largest parameter difference from PyTorch's default (``foreach``) AdamW, relative to the largest
parameter. The default run twice is the noise floor (zero where kernels are deterministic).
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from lightning_cudagraph._backend.optimizers import CapturableOptimizer

Build = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
#: (label, how the user builds the optimizer, whether the package's capturable form is switched on).
FORMS: tuple[tuple[str, Build, bool], ...] = (
    ("default AdamW (foreach), again", lambda p: torch.optim.AdamW(p, lr=1e-3), False),
    ("AdamW(fused=True), float lr", lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True), False),
    ("the package's form of the default AdamW (fused, tensor lr)", lambda p: torch.optim.AdamW(p, lr=1e-3), True),
    ("the package's form of AdamW(fused=True)", lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True), True),
)


def train(
    net: torch.nn.Module, build: Build, switch: bool, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """Every parameter of a copy of ``net`` after training it on ``batches``, flattened."""
    model = copy.deepcopy(net)
    optimizer = build(model.parameters())
    device = next(model.parameters()).device
    if switch:
        CapturableOptimizer(optimizer, device)
    for inputs, targets in batches:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps (default: 100)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1 (got {args.steps})")
    torch.manual_seed(0)
    device = torch.device(args.device)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).to(device)
    batches = [(torch.randn(32, 64, device=device), torch.randn(32, 64, device=device)) for _ in range(args.steps)]
    reference = train(net, FORMS[0][1], False, batches)
    print(f"torch {torch.__version__} on {device}, {args.steps} steps of AdamW(lr=1e-3) on a 64-256-64 MLP")
    for label, build, switch in FORMS:
        got = train(net, build, switch, batches)
        print(f"  {label}: {((got - reference).abs().max() / reference.abs().max()).item():.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
