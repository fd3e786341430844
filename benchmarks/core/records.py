"""JSON records: where and how a run was measured, strict JSON out, the command-line lists in."""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
from collections.abc import Sequence
from datetime import date
from importlib import metadata
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 2
#: Versions recorded beside torch and lightning where installed.
OPTIONAL = ("transformers", "lightning-thunder", "transformer_engine")


def environment() -> dict[str, str]:
    """GPU, versions, date and the exact command line of this process."""
    import torch

    env = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "lightning": metadata.version("lightning"),
        "python": platform.python_version(),
        "date": date.today().isoformat(),
        "command": shlex.join(sys.orig_argv),
    }
    for name in OPTIONAL:
        try:
            env[name.removeprefix("lightning-")] = metadata.version(name)
        except metadata.PackageNotFoundError:
            env[name.removeprefix("lightning-")] = "not installed"
    return env


def write(record: dict[str, Any], path: Path) -> Path:
    """Write ``record`` as strict JSON (a non-finite figure raises: the writers store them as ``null``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schema": SCHEMA_VERSION, **record}, indent=1, allow_nan=False) + "\n")
    return path


def timed_parser(doc: str | None, steps: int, timed: int, rounds: int) -> argparse.ArgumentParser:
    """The options of alternated fits: ``--out``, ``--steps``, ``--timed`` (the last steps) and ``--rounds``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="results directory (created if missing)")
    parser.add_argument("--steps", type=int, default=steps, help=f"training steps per fit (default: {steps})")
    parser.add_argument("--timed", type=int, default=timed, help=f"last steps of each fit timed (default: {timed})")
    parser.add_argument("--rounds", type=int, default=rounds, help=f"alternated fits per variant (default: {rounds})")
    return parser


def check_timed(parser: argparse.ArgumentParser, args: argparse.Namespace, untimed: int) -> None:
    """Exit with code 2 unless some steps are timed and at least ``untimed`` (warmup, capture) are not."""
    if not 0 < args.timed <= args.steps - untimed - 1:
        parser.error(f"--timed must be at least 1 and leave {untimed} steps untimed (got {args.timed}, {args.steps})")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1 (got {args.rounds})")


def names(parser: argparse.ArgumentParser, option: str, text: str, known: Sequence[str]) -> list[str]:
    """A comma-separated option as a list in the order given, without repeats; an unknown name exits with code 2."""
    given = list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [name for name in given if name not in known]
    if unknown or not given:
        parser.error(f"{option}: unknown {', '.join(unknown) or 'empty list'}; known: {', '.join(known)}")
    return given


def needs_cuda(script: str) -> bool:
    """Whether a GPU benchmark must exit (with code 2) for want of a CUDA GPU; it says so where it must."""
    import torch

    if not torch.cuda.is_available():
        print(f"benchmarks/{script} measures CUDA graphs and needs a CUDA GPU; none is visible here.")
    return not torch.cuda.is_available()
